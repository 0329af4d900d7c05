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

    @property
    def devices(self) -> tuple[str, ...]:
        """Cache device types this transport moves in place (others go through staging rows)."""
        return self.sender_class.devices

    def sender(self, name: str, cache: CacheTensors, config: TransferConfig | None = None, on_done: OnDone | None = None) -> HandoffSender:
        return self.sender_class(name, cache, config, on_done)

    def receiver(
        self, name: str, cache: CacheTensors, config: TransferConfig | None = None, on_done: OnDone | None = None
    ) -> HandoffReceiver:
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
    """What the cluster uses between two CPU workers (or GPU workers that share GPUs).

    shm on one node: it copies each byte once, straight into the reserved blocks, where Gloo
    over loopback copies through sockets (docs/kvtransfer.md); gloo across nodes.
    """
    return "shm" if same_node else "gloo"


def whole_gpus(gpus_per_worker: float) -> bool:
    """Each worker holds whole GPUs of its own: Ray never gives two of them the same device."""
    return gpus_per_worker >= 1 and float(gpus_per_worker).is_integer()


def check_transport(requested: str, gpus_per_worker: float) -> None:
    """Refuse at start a transport that cannot move these workers' caches."""
    if requested not in ("auto", *TRANSPORTS):
        raise ValueError(f"transport: {requested!r} not in auto, {', '.join(TRANSPORTS)}")
    if requested != "nccl" or whole_gpus(gpus_per_worker):
        return
    if not gpus_per_worker:
        raise ValueError("transport nccl moves GPU caches, and these workers run on CPU (gpus_per_worker=0): "
                         "use shm or gloo")
    raise ValueError(f"transport nccl with gpus_per_worker={gpus_per_worker}: two workers may share one GPU, "
                     "and NCCL refuses two ranks on one device; give each worker whole GPUs "
                     "(gpus_per_worker=1) or use shm or gloo, which stage GPU caches through host memory")


def choose_transport(requested: str, gpus_per_worker: float, same_node: bool) -> str:
    """"auto": nccl between workers that hold whole GPUs of their own; otherwise shm on one
    node and gloo across nodes (GPU caches then go through host staging rows, engine.staging)."""
    check_transport(requested, gpus_per_worker)
    if requested != "auto":
        return requested
    return "nccl" if whole_gpus(gpus_per_worker) else default_cpu_transport(same_node)
