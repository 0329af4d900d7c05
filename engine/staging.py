"""Staging rows: a small cache the wire reads and writes when it cannot use the engine's own.

Two things put a worker's hand-offs through staging rows, which have the engine cache's
layout and room for a few requests:
- the wire cannot reach the cache where it lives: a GPU cache and a host-side transport (shm,
  gloo). The staging rows then live in host memory; the prefill side copies a finished
  request's rows device -> host before the send, the decode side host -> device once they
  landed. One GPU per node, fractional GPUs and nodes without NCCL-capable links work so;
- a tensor-parallel worker: rank 0's staging rows hold the un-sharded layout, gathered from
  and scattered to every rank (engine.tp.staging), on the device the wire reads.
The same code moves CPU caches when staging is forced (`SPLITSERVE_STAGE_HANDOFFS=1`), which
is how CI runs the GPU path's bookkeeping.

A prefill worker holds a request's staging rows from its send to the transport's result; a
decode worker from the reservation to the landing. When all are taken, the prefill side
defers the send and the decode side refuses the reservation (the router waits for room).
Engine thread only.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from engine.cache import CacheSizes, ModelCache
from engine.tp.staging import gather_rows, local_rows, scatter_rows, shard_indices, write_local

TP_STAGING_REQUESTS = 4  # un-sharded hand-offs in flight per tensor-parallel worker
HOST_STAGING_REQUESTS = 8  # hand-offs in flight per GPU worker over a host-side wire
FORCE_ENV = "SPLITSERVE_STAGE_HANDOFFS"


@dataclass
class Staged:
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
        spec = engine.model.full_spec if self.group is not None else engine.model.spec
        device = torch.device(device) if device is not None else engine.cache.device
        if requests is None:
            requests = TP_STAGING_REQUESTS if self.group is not None else HOST_STAGING_REQUESTS
        self.index = shard_indices(spec, self.group.size, engine.cache.device) if self.group is not None else None
        blocks_each = -(-engine.max_model_len // config.block_size) if spec.attention_layers else 0
        slots = requests if spec.state_layers else 0
        self.cache = ModelCache(spec, CacheSizes(requests * blocks_each, slots, 0, 0), config.block_size,
                                config.torch_dtype, device)
        self.free_blocks = list(range(requests * blocks_each))
        self.free_slots = list(range(slots))
        self.held: dict[str, Staged] = {}

    def take(self, request_id: str, num_blocks: int) -> Staged | None:
        """Staging rows for a request, or None when they are all in use."""
        if not self.cache.spec.attention_layers:
            num_blocks = 0  # block tables are bookkeeping only: nothing to move
        has_state = bool(self.cache.spec.state_layers)
        if len(self.free_blocks) < num_blocks or (has_state and not self.free_slots):
            return None
        blocks = [self.free_blocks.pop() for _ in range(num_blocks)]
        slot = self.free_slots.pop() if has_state else None
        self.held[request_id] = Staged(blocks, slot)
        return self.held[request_id]

    def give_back(self, request_id: str) -> None:
        staged = self.held.pop(request_id, None)
        if staged is not None:
            self.free_blocks += staged.blocks
            if staged.slot is not None:
                self.free_slots.append(staged.slot)

    def gather(self, staged: Staged, blocks: list[int], slot: int | None) -> None:
        """Prefill side: the request's rows (from every rank) into its staging rows."""
        if self.group is None:
            rows = local_rows(self.engine.cache, blocks, slot)
            write_local(self.cache, [r.to(self.cache.device) for r in rows], staged.blocks, staged.slot)
            return
        self.engine.tp.send("gather", blocks, slot)
        parts = gather_rows(self.group, self.engine.cache, blocks, slot)
        full = local_rows(self.cache, staged.blocks, staged.slot)  # shaped like the request's rows
        for (name, *_), by_rank, rows in zip(self.cache.handoff_tensors(), parts, full):
            for rank, (axis, idx) in enumerate(self.index[name]):
                rows.index_copy_(axis, idx.to(rows.device), by_rank[rank].to(rows.device))
        write_local(self.cache, full, staged.blocks, staged.slot)

    def scatter(self, staged: Staged, num_blocks: int, blocks: list[int], slot: int | None) -> None:
        """Decode side: landed staging rows into the request's own rows (on every rank)."""
        device = self.engine.cache.device
        full = [r.to(device) for r in local_rows(self.cache, staged.blocks[:num_blocks], staged.slot)]
        if self.group is None:
            write_local(self.engine.cache, full, blocks[:num_blocks], slot)
            return
        shapes = [r.shape for r in full]
        self.engine.tp.send("scatter", shapes, blocks[:num_blocks], slot)
        scatter_rows(self.group, self.engine.cache, self.index, full, shapes, blocks[:num_blocks], slot)
