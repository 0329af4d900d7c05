"""Staging rows: a small cache the wire reads and writes when it cannot use the engine's own.

Two things put a worker's hand-offs through staging rows, which have the engine cache's
layout and room for a few requests:
- the wire cannot reach the cache where it lives: a GPU cache and a host-side transport (shm,
  gloo). The staging rows then live in host memory, page-locked once the transport has put
  them where it wants them (shm moves them into shared memory), so the copies are DMA. The
  prefill side copies a finished request's rows device -> host on a copy stream of its own, an
  event per layer, and hands the wire each layer as its copy completes (StagedSendPump), so
  layer i crosses the wire while layer i+1 is still copying and the engine thread waits for
  neither; the decode side copies landed rows host -> device on that stream, and the compute
  stream waits for them on the device. One GPU per node, fractional GPUs and nodes without
  NCCL-capable links work so;
- a tensor-parallel worker: rank 0's staging rows hold the un-sharded layout, gathered from
  and scattered to every rank (engine.tp.staging), on the device the wire reads.
The same code moves CPU caches when staging is forced (`SPLITSERVE_STAGE_HANDOFFS=1`), which
is how CI runs the GPU path's bookkeeping; CPU copies are done when they return.

Each request in flight has a region of its own: a contiguous run of blocks (one device ->
host copy per tensor, straight into place) and one state slot. A prefill worker holds a
region from its send to the transport's result, a decode worker from the reservation to the
landing; a region comes back to the pool only once its last copy has run, so an asynchronous
copy of a failed hand-off can never write rows a later request was given. When all are
taken, the prefill side defers the send and the decode side refuses the reservation (the
router waits for room). Engine thread only, but for the pump's own thread.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
from dataclasses import dataclass

import torch

from engine.cache import BLOCK_ROLE, CacheSizes, ModelCache, index_copy
from engine.host_arena import page_lock
from engine.tp.staging import assemble, gather_rows, local_rows, scatter_rows, shard_indices, write_local

log = logging.getLogger(__name__)
TP_STAGING_REQUESTS = 4  # un-sharded hand-offs in flight per tensor-parallel worker
HOST_STAGING_REQUESTS = 8  # hand-offs in flight per GPU worker over a host-side wire
FORCE_ENV = "SPLITSERVE_STAGE_HANDOFFS"


@dataclass
class Staged:
    request_id: str
    region: int
    blocks: list[int]
    slot: int | None


def staging_device(engine, wire_devices: tuple[str, ...]) -> torch.device | None:
    """Where a worker's staging rows live for a wire that moves `wire_devices` caches; None:
    the wire moves the engine's own cache (one rank, a device it reaches, staging not forced)."""
    device = engine.cache.device
    reachable = device.type in wire_devices
    if getattr(engine, "tp", None) is None and reachable and os.environ.get(FORCE_ENV, "") in ("", "0"):
        return None
    return device if reachable else torch.device(wire_devices[0])


class HandoffStaging:
    def __init__(self, engine, device: torch.device | str | None = None, requests: int | None = None):
        config = engine.config
        self.engine = engine
        self.group = engine.tp.group if getattr(engine, "tp", None) is not None else None
        # The engine's own cache layout (an MTP head's layer, narrow state formats included), or
        # under tensor parallelism the un-sharded one in the same formats.
        spec = engine.full_cache_spec
        device = torch.device(device) if device is not None else engine.cache.device
        if requests is None:
            requests = TP_STAGING_REQUESTS if self.group is not None else HOST_STAGING_REQUESTS
        self.index = shard_indices(spec, self.group.size, engine.cache.device) if self.group is not None else None
        self.blocks_each = -(-engine.max_model_len // config.block_size) if spec.attention_layers else 0
        slots = requests if spec.state_layers else 0
        self.cache = ModelCache(spec, CacheSizes(requests * self.blocks_each, slots, 0, 0), config.block_size,
                                config.torch_dtype, device, runs_layers=False)
        # A GPU cache copied to and from host rows: asynchronously, on a stream of its own.
        host_side = engine.cache.device.type == "cuda" and device.type == "cpu" and self.group is None
        self.copy_stream = torch.cuda.Stream(engine.cache.device) if host_side else None
        self._pinned: bool | None = None  # host rows page-locked: at the first copy (_pin)
        self.free_regions = list(range(requests))
        self.held: dict[str, Staged] = {}
        self._last_copy: dict[str, torch.cuda.Event] = {}  # a held region's latest asynchronous copy
        self._draining: list[tuple[int, torch.cuda.Event]] = []  # given back, a copy still running

    def take(self, request_id: str, num_blocks: int) -> Staged | None:
        """A region for a request, or None when they are all in use."""
        self._reclaim()
        if not self.free_regions:
            return None
        if not self.cache.spec.attention_layers:
            num_blocks = 0  # block tables are bookkeeping only: nothing to move
        if num_blocks > self.blocks_each:
            raise ValueError(f"request {request_id}: {num_blocks} blocks, a staging region holds {self.blocks_each}")
        region = self.free_regions.pop()
        first = region * self.blocks_each
        slot = region if self.cache.spec.state_layers else None
        self.held[request_id] = Staged(request_id, region, list(range(first, first + num_blocks)), slot)
        return self.held[request_id]

    def give_back(self, request_id: str) -> None:
        """The request is done with its region; it returns to the pool once its last copy ran."""
        staged = self.held.pop(request_id, None)
        copy = self._last_copy.pop(request_id, None)
        if staged is None:
            return
        if copy is not None and not copy.query():
            self._draining.append((staged.region, copy))
        else:
            self.free_regions.append(staged.region)

    def _reclaim(self) -> None:
        still = []
        for region, copy in self._draining:
            if copy.query():
                self.free_regions.append(region)
            else:
                still.append((region, copy))
        self._draining = still

    def gather(self, staged: Staged, blocks: list[int], slot: int | None) -> list[tuple[int, torch.cuda.Event]]:
        """Prefill side: the request's rows (from every rank) into its staging rows. Returns
        (layer, event) per layer, in order, while the copies still run: a layer's rows are in
        place once its event has fired. Empty: every row is in place already."""
        if self.group is not None:
            self._gather_ranks(staged, blocks, slot)
            return []
        source = self.engine.cache.handoff_tensors()
        marks = []
        with self._copying():  # every temporary below is the copy stream's: freed in its order
            block_index = self._ids(blocks)
            for i, ((_, layer, _, role, src), (*_, dst)) in enumerate(zip(source, self.cache.handoff_tensors())):
                if role == BLOCK_ROLE:
                    rows = dst[staged.blocks[0]: staged.blocks[0] + len(blocks)] if blocks else dst[:0]
                    rows.copy_(src.index_select(0, block_index), non_blocking=True)
                else:
                    dst[staged.slot: staged.slot + 1].copy_(src[slot: slot + 1], non_blocking=True)
                if (i + 1 == len(source) or source[i + 1][1] != layer) and (copied := self._mark(staged)) is not None:
                    marks.append((layer, copied))
        return marks

    def _gather_ranks(self, staged: Staged, blocks: list[int], slot: int | None) -> None:
        self.engine.tp.send("gather", blocks, slot)
        parts = gather_rows(self.group, self.engine.cache, blocks, slot)
        full = local_rows(self.cache, staged.blocks, staged.slot)  # shaped like the request's rows
        assemble(self.index, [name for name, *_ in self.cache.handoff_tensors()], parts, full)
        write_local(self.cache, full, staged.blocks, staged.slot)

    def scatter(self, staged: Staged, num_blocks: int, blocks: list[int], slot: int | None) -> None:
        """Decode side: landed staging rows into the request's own rows (on every rank). Every
        later step of the engine's stream sees them; the region is not reused before they are read."""
        device = self.engine.cache.device
        if self.group is not None:
            full = [r.to(device) for r in local_rows(self.cache, staged.blocks[:num_blocks], staged.slot)]
            shapes = [r.shape for r in full]
            self.engine.tp.send("scatter", shapes, blocks[:num_blocks], slot)
            scatter_rows(self.group, self.engine.cache, self.index, full, shapes, blocks[:num_blocks], slot)
            return
        first = staged.blocks[0] if staged.blocks else 0
        with self._copying():
            block_index = self._ids(blocks[:num_blocks])
            for (*_, role, src), (*_, dst) in zip(self.cache.handoff_tensors(), self.engine.cache.handoff_tensors()):
                if role == BLOCK_ROLE:
                    index_copy(dst, 0, block_index, src[first: first + num_blocks].to(device, non_blocking=True))
                else:
                    dst[slot: slot + 1].copy_(src[staged.slot: staged.slot + 1], non_blocking=True)
            landed = self._mark(staged)
        if landed is not None:
            torch.cuda.current_stream(device).wait_event(landed)  # the next step reads them after the copy

    @contextlib.contextmanager
    def _copying(self):
        """Where the copies run: the copy stream, after everything the engine's stream has queued
        (the rows' last writer, or their previous owner's last reader); on CPU, right here."""
        if self.copy_stream is None:
            yield
            return
        self._pin()
        self.copy_stream.wait_stream(torch.cuda.current_stream(self.copy_stream.device))
        with torch.cuda.stream(self.copy_stream):
            yield

    def _ids(self, ids: list[int]) -> torch.Tensor:
        """Block ids on the engine's device without a host wait: a blocking copy would wait for
        the copy stream, which waits for the engine's stream."""
        index = torch.tensor(ids, dtype=torch.long)
        if self.copy_stream is None:
            return index.to(self.engine.cache.device)
        return index.pin_memory().to(self.engine.cache.device, non_blocking=True)

    def _mark(self, staged: Staged) -> torch.cuda.Event | None:
        if self.copy_stream is None:
            return None
        event = torch.cuda.Event()
        event.record(self.copy_stream)
        self._last_copy[staged.request_id] = event
        return event

    def _pin(self) -> None:
        """Page-lock the host rows where they now live (after shm moved them into shared memory,
        which happens when the transport starts), so the copies are DMA and asynchronous. Where
        registering fails the copies still run, from pageable memory, and it is logged once."""
        if self._pinned is not None:
            return
        storages = {}
        for *_, t in self.cache.handoff_tensors():
            storage = t.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
        try:
            for ptr, nbytes in storages.items():
                if nbytes and (code := page_lock(ptr, nbytes)) != 0:
                    raise RuntimeError(f"cudaHostRegister: error {code}")
            self._pinned = True
        except Exception as error:  # noqa: BLE001 - correctness does not depend on it
            self._pinned = False
            log.warning("staging rows stay pageable (%s): host copies are slower and synchronous", error)


class StagedSendPump:
    """Prefill side on a GPU: a thread that tells a hand-off each layer is ready as its
    device -> host copy completes (its event), then finishes it. The engine thread never waits
    for a copy, and the wire moves a layer while the next is still copying."""

    def __init__(self, name: str):
        self._jobs: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name=f"{name}-staged-sends", daemon=True)
        self._thread.start()

    def submit(self, handoff, marks: list[tuple[int, torch.cuda.Event]], first_token: int) -> None:
        """marks: (layer, event) as HandoffStaging.gather returns them."""
        self._jobs.put((handoff, marks, first_token))

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            handoff, marks, first_token = job
            try:
                for layer, copied in marks:
                    copied.synchronize()  # releases the GIL while the copy runs
                    handoff.layer_done(layer)
                handoff.finish(first_token)
            except Exception as error:  # noqa: BLE001 - the hand-off fails; its result reports it
                log.warning("staged hand-off %s: %s", handoff.request_id, error)
                handoff.abort(f"staging copy failed: {error}")
