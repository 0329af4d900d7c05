"""Choosing a transport: make_transport(kind) and what the cluster picks for CPU workers."""

from __future__ import annotations

from dataclasses import dataclass

from kvtransfer.config import TransferConfig
from kvtransfer.endpoint import OnDone
from kvtransfer.layout import CacheTensors
from kvtransfer.receiver import HandoffReceiver
from kvtransfer.sender import HandoffSender

TRANSPORTS = ("shm", "gloo", "nccl")


@dataclass(frozen=True)
class Transport:
    name: str
    sender_class: type
    receiver_class: type

    def sender(self, name: str, cache: CacheTensors, config: TransferConfig | None = None, on_done: OnDone | None = None) -> HandoffSender:
        return self.sender_class(name, cache, config, on_done)

    def receiver(self, name: str, cache: CacheTensors, config: TransferConfig | None = None, on_done: OnDone | None = None) -> HandoffReceiver:
        return self.receiver_class(name, cache, config, on_done)


def make_transport(kind: str) -> Transport:
    if kind == "gloo":
        from kvtransfer.gloo import GlooReceiver, GlooSender

        return Transport(kind, GlooSender, GlooReceiver)
    if kind == "shm":
        from kvtransfer.shm import ShmReceiver, ShmSender

        return Transport(kind, ShmSender, ShmReceiver)
    if kind == "nccl":
        from kvtransfer.nccl_wire import NcclReceiver, NcclSender

        return Transport(kind, NcclSender, NcclReceiver)
    raise ValueError(f"unknown transport {kind!r}; choose one of {', '.join(TRANSPORTS)}")


def default_cpu_transport(same_node: bool) -> str:
    """What the cluster uses between two CPU workers.

    shm on one node: it copies each byte once, straight into the reserved blocks, and
    measured well above Gloo over loopback (docs/kvtransfer.md); gloo across nodes.
    """
    return "shm" if same_node else "gloo"
