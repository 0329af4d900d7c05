"""What both worker actors share: an engine, its cache seen as hand-off rows, this node's
transfer settings. The engine is passed in (duck-typed), so kvtransfer imports no engine code."""

from __future__ import annotations

import socket

from kvtransfer.config import TransferConfig
from kvtransfer.layout import CacheTensors


class EngineEndpoint:
    def __init__(self, name: str, engine, transfer_timeout_s: float):
        self.name = name
        self.engine = engine
        cache = engine.cache
        self.cache_tensors = CacheTensors.from_named(engine.config.block_size, cache.block_tensors(),
                                                     cache.slot_tensors())
        self.transfer_config = TransferConfig(timeout_s=transfer_timeout_s, advertise_host=node_ip())

    def layout(self) -> dict:
        return self.cache_tensors.layout.to_dict()

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
