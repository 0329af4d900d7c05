"""What both worker actors share: an engine, its cache seen as hand-off rows, this node's
transfer settings. The engine is passed in (duck-typed), so kvtransfer imports no engine code."""

from __future__ import annotations

import logging
import os
import socket
import uuid

from kvtransfer.config import TransferConfig
from kvtransfer.layout import CacheTensors


log = logging.getLogger(__name__)


class EngineEndpoint:
    def __init__(self, name: str, engine, transfer_timeout_s: float):
        self.name = name
        # Changes when Ray restarts the actor: the router then reconnects it and knows that
        # whatever the previous incarnation held is gone.
        self.incarnation = uuid.uuid4().hex[:12]
        self._crash_countdown: int | None = None
        self.engine = engine
        cache = engine.cache
        self.cache_tensors = CacheTensors.from_named(engine.config.block_size, cache.block_tensors(),
                                                     cache.slot_tensors())
        self.transfer_config = TransferConfig(timeout_s=transfer_timeout_s, advertise_host=node_ip())

    def layout(self) -> dict:
        return self.cache_tensors.layout.to_dict()

    def inject_crash(self, after: int = 0) -> None:
        """Fault injection for tests and drills: the process dies, as in a crash, at the
        (after+1)-th crash point from now (prefill: each engine step; decode: each delivery)."""
        self._crash_countdown = after

    def _crash_point(self) -> None:
        if self._crash_countdown is None:
            return
        if self._crash_countdown == 0:
            log.error("%s: injected crash", self.name)
            os._exit(17)
        self._crash_countdown -= 1

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
