"""What both worker actors share: an engine, its cache seen as hand-off rows, this node's
transfer settings. The engine is passed in (duck-typed), so kvtransfer imports no engine code."""

from __future__ import annotations

import logging
import os
import socket
import sys
import uuid

from kvtransfer.config import TransferConfig
from kvtransfer.layout import CacheTensors


log = logging.getLogger(__name__)
WORKER_SWITCH_INTERVAL_S = 0.0005


class EngineEndpoint:
    def __init__(self, name: str, engine, transfer_timeout_s: float, handoff_cache=None):
        self.name = name
        # Changes when Ray restarts the actor: the router then reconnects it and knows that
        # whatever the previous incarnation held is gone.
        self.incarnation = uuid.uuid4().hex[:12]
        self._crash_plan: tuple[str, int] | None = None
        # A hand-off is a few control messages, each answered by a transport thread that must
        # take the GIL from the busy engine thread: at Python's default switch interval each
        # such wait is long against the hand-off itself (docs/kvtransfer.md).
        sys.setswitchinterval(WORKER_SWITCH_INTERVAL_S)
        self.engine = engine
        if getattr(engine, "tp", None) is not None:
            engine.tp.on_rank_lost = self._rank_lost
        # What the wire reads and writes: the engine's cache, or staging rows (engine.staging:
        # a GPU cache over a host-side wire, a tensor-parallel worker's un-sharded rows).
        cache = handoff_cache if handoff_cache is not None else engine.cache
        self.cache_tensors = CacheTensors.from_named(engine.config.block_size, cache.handoff_tensors())
        self.transfer_config = TransferConfig(timeout_s=transfer_timeout_s, advertise_host=node_ip())

    def layout(self) -> dict:
        return self.cache_tensors.layout.to_dict()

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
