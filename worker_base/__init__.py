"""What both worker actors are built from: an engine (its tensor-parallel ranks placed by Ray),
the wire to the other kind of worker, the rows that wire moves (the engine's cache, or host
staging rows for a GPU cache on a host-side wire), rank-to-rank hand-offs for a sharded engine,
and the fault injection and node facts the router and the drills use. kvtransfer only moves
bytes; this is where a worker meets it."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import sys
import uuid

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.staging import HandoffStaging, staging_device
from engine.tp.rank_handoffs import RankHandoffs
from engine.tp.ray_ranks import RayRanks
from kvtransfer import make_transport
from kvtransfer.config import TransferConfig
from kvtransfer.layout import CacheTensors
from kvtransfer.nccl import check_launch_order
from worker_base.prefix_wire import PrefixWire, StagedRows

log = logging.getLogger(__name__)
WORKER_SWITCH_INTERVAL_S = 0.0005


class WorkerBase:
    """One construction path for both workers. `role` is the worker's end of the wire:
    "sender" (prefill) or "receiver" (decode); the subclass opens that end on `self.wire`."""

    def __init__(self, name: str, model: str, engine_options: dict, transport: str, mode: str,
                 role: str, transfer_timeout_s: float = 30.0, tp_ranks: tuple | None = None,
                 **engine_config):
        self.name = name
        # Changes when Ray restarts the actor: the router then reconnects it and knows that
        # whatever the previous incarnation held is gone.
        self.incarnation = uuid.uuid4().hex[:12]
        self._crash_plan: tuple[str, int] | None = None
        # A hand-off is a few control messages, each answered by a transport thread that must
        # take the GIL from the busy engine thread: at Python's default switch interval each
        # such wait is long against the hand-off itself (docs/kvtransfer.md).
        sys.setswitchinterval(WORKER_SWITCH_INTERVAL_S)
        # tp_ranks: (placement group, bundle indices, cpus, gpus) for tensor-parallel ranks 1..N-1
        launcher = RayRanks(*tp_ranks) if tp_ranks is not None else None
        if transport == "nccl":  # refused before the engine loads anything
            check_launch_order({**engine_config, **engine_options}.get("tensor_parallel_size", 1))
        self.engine = engine = LLMEngine(EngineConfig(model=model, mode=mode, **engine_config,
                                                      **engine_options), launcher)
        engine.trace_name = name  # its spans say which worker measured them (engine.trace)
        if engine.tp is not None:
            engine.tp.on_rank_lost = self._rank_lost
        self.wire = make_transport(transport)
        # What the wire reads and writes: the engine's cache, or staging rows (engine.staging:
        # a GPU cache over a host-side wire, a tensor-parallel worker's un-sharded rows).
        where = staging_device(engine, self.wire.devices)  # None: the wire moves the engine's own rows
        self.staging = HandoffStaging(engine, where) if where is not None else None
        cache = self.staging.cache if self.staging is not None else engine.cache
        speculative = engine.config.speculative_config
        self.cache_tensors = CacheTensors.from_named(engine.config.block_size, cache.handoff_tensors(),
                                                     speculative=speculative.canonical() if speculative else "")
        self.transfer_config = TransferConfig(timeout_s=transfer_timeout_s, advertise_host=node_ip())
        self.ranks = engine.tp.group.size if engine.tp is not None else 1
        # Equal TP sizes on both sides hand off rank to rank (engine.tp.rank_handoffs)
        self.rank_handoffs = (RankHandoffs(engine, transport, role, name, self.transfer_config)
                              if self.ranks > 1 else None)
        self._rank_peers: set[str] = set()  # peers of this TP size: hand-offs go rank to rank
        self._open_prefix_wire()

    def layout(self) -> dict:
        return self.cache_tensors.layout.to_dict()

    async def on_engine(self, fn):
        """fn(engine) on the engine's thread, between steps; its result."""
        return await asyncio.wrap_future(self.thread.call(fn))

    # ---- a source of prefix fetches (worker_base.prefix_wire) ----

    async def stage_prefix(self, hashes: list[bytes], fetch_id: str):
        """(this worker's fetch endpoints' name, the longest usable prefix of the block chain
        `hashes` it holds, staged in rows of its host tier for another worker to fetch:
        engine.prefix_exchange.StagedPrefix, or None where it holds none or has no host tier)."""
        staged = await self.staged_rows.stage(hashes, fetch_id)
        return (self.prefix_wire.name if self.prefix_wire is not None else None), staged

    async def unstage_prefix(self, fetch_id: str) -> None:
        await self.staged_rows.release(fetch_id)

    async def connect_prefix_wire(self, peer: str, kind: str, offer) -> None:
        await asyncio.to_thread(self.prefix_wire.sender(kind).connect, peer, offer)

    async def send_prefix(self, fetch_id: str, peer: str, kind: str, dst_rows: list[int]) -> str:
        """Send what `stage_prefix` staged for `fetch_id` to `peer`'s `dst_rows`: "sent", "not
        connected", or why not."""
        return await self.staged_rows.send(fetch_id, peer, kind, dst_rows)

    def _open_prefix_wire(self) -> None:
        tiers = self.engine.tiers
        host = tiers.host if tiers is not None else None
        self.prefix_wire = None if host is None or self.engine.exchange is None else PrefixWire(
            f"{self.name}/prefix-{self.incarnation}", host.rows(), self.transfer_config, on_sent=self._prefix_sent)
        self.staged_rows = StagedRows(self, self.transfer_config.timeout_s)

    def _prefix_sent(self, fetch_id: str) -> None:  # on a transport thread
        self.staged_rows.sent(fetch_id)
        self.thread.call(lambda engine: engine.exchange.unstage(fetch_id))

    def _close_prefix_wire(self) -> None:
        if self.prefix_wire is not None:
            self.prefix_wire.close()

    def _rank_lost(self, rank: int | None, why) -> None:
        """A tensor-parallel rank died (None: a collective failed, which one is unknown): the
        whole worker goes, as in a crash; Ray restarts it with all its ranks, and the router
        resumes its requests from the tokens delivered."""
        log.error("%s: tensor-parallel rank %s lost (%s); exiting", self.name, rank, why)
        os._exit(18)

    def tp_rank_pids(self) -> list[int]:
        """Processes of the other tensor-parallel ranks (drills and tests kill them)."""
        return self.engine.tp.pids if getattr(self.engine, "tp", None) is not None else []

    def inject_slow_steps(self, seconds: float) -> None:
        """Fault injection for tests and drills: every engine step takes `seconds` longer
        (0 to stop), as on a loaded machine; outlasts redeploys however fast the engine is."""
        self.thread.step_delay_s = max(0.0, float(seconds))

    def inject_crash(self, request_id: str, after: int = 0) -> None:
        """Fault injection for tests and drills: the process dies, as in a crash, at the
        (after+1)-th crash point that involves `request_id` (prefill: an engine step while it
        is in the engine; decode: a delivery of its output)."""
        self._crash_plan = (request_id, after)

    def _crash_point(self, request_ids) -> None:
        if self._crash_plan is None or self._crash_plan[0] not in request_ids:
            return
        request_id, after = self._crash_plan
        if after == 0:
            log.error("%s: injected crash while serving %s", self.name, request_id)
            os._exit(17)
        self._crash_plan = (request_id, after - 1)

    def model_facts(self) -> dict:
        """What the router needs to know of the model this worker serves."""
        spec = self.engine.spec
        return {"model_type": spec.model_type, "vocab_size": spec.vocab_size,
                "max_model_len": self.engine.max_model_len, "layer_kinds": list(spec.layer_kinds),
                "eos_token_ids": list(self.engine.eos_token_ids)}

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()


def node_ip() -> str:
    """The address peers on other nodes reach this process at."""
    try:
        import ray

        return ray.util.get_node_ip_address()
    except Exception:
        return socket.gethostbyname(socket.gethostname())
