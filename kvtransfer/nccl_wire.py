"""NCCL transport: GPU workers, the stream protocol of stream_channel over a pairwise communicator.

No receive is posted for an idle peer: each request's header rides the pair's doorbell
(kvtransfer.doorbell, a key in the receiver's TCP store), and the receiver posts that request's
receives only once it has read the header, as the sender posts its sends only after ringing.
A posted NCCL receive is a kernel waiting on the GPU: kept posted while idle, any device-wide
synchronisation in the process (an allocator retry, `empty_cache`) would wait for the next
hand-off.

Each pair has its own two-rank communicator (receiver rank 0, sender rank 1) and its own
CUDA streams on each side (one for NCCL, one for packing/scattering), so transfers never
queue behind compute. Ordering against
compute is by events: a sender packs layer i only after the event recorded at
layer_done(i); a receiver scatters only after the event recorded at expect() (the last
use of the reserved blocks and slot by their previous owner), and reports DONE only after
its stream has run every scatter.
"""

from __future__ import annotations

import threading
import time

import torch

from kvtransfer.doorbell import Doorbell, StoreHost, store_client
from kvtransfer.errors import WireError, WireTimeoutError
from kvtransfer.messages import NcclOffer
from kvtransfer.nccl import IN_PROGRESS, NcclCommunicator, load_library
from kvtransfer.receiver import HandoffReceiver
from kvtransfer.sender import HandoffSender
from kvtransfer.stream_channel import StreamSenderChannel, join_as_receiver, join_as_sender

RECEIVER_RANK, SENDER_RANK = 0, 1
_FIRST_NAP_S, _LAST_NAP_S = 10e-6, 1e-3


class NcclPending:
    def __init__(self, wire: NcclWire, event: torch.cuda.Event, tensors: list[torch.Tensor]):
        self._wire, self._event = wire, event
        self._tensors = tensors  # NCCL may still read or write them until the event fires

    def wait(self, timeout_s: float | None) -> None:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        nap = _FIRST_NAP_S
        while not self._event.query():
            self._wire.raise_if_failed()
            if deadline is not None and time.monotonic() > deadline:
                raise WireTimeoutError(f"nccl: not done within {timeout_s:.3f}s")
            time.sleep(nap)
            nap = min(nap * 2, _LAST_NAP_S)
        self._tensors = []


class NcclWire:
    def __init__(self, comm: NcclCommunicator, rank: int, doorbell: Doorbell):
        self.device = comm.device
        self._doorbell = doorbell
        self.comm, self._peer = comm, 1 - rank
        self.stream = torch.cuda.Stream(self.device)  # NCCL kernels only
        # Packing and scattering run here, so a scatter never queues behind a posted receive
        # of a later segment and its completion can be awaited on its own (release()).
        self.copy_stream = torch.cuda.Stream(self.device)
        self.aborted = False
        self._comm_lock = threading.Lock()  # abort() frees the communicator other threads query

    def raise_if_failed(self) -> None:
        with self._comm_lock:
            if self.aborted:
                raise WireError("nccl: the wire was closed")
            code = self.comm.async_error()
        if code not in (0, IN_PROGRESS):
            raise WireError(f"nccl: {self.comm.lib.error_string(code)}")

    def announce(self, header: torch.Tensor) -> None:
        self._doorbell.ring(header)

    def await_announcement(self) -> torch.Tensor | None:
        """The next request's header (on the host), or None once the wire is closed; no NCCL
        call while waiting."""
        return None if self.aborted else self._doorbell.wait()

    def _issue(self, outgoing: list[torch.Tensor], incoming: list[torch.Tensor]) -> NcclPending:
        with self._comm_lock, torch.cuda.device(self.device):
            if self.aborted:
                raise WireError("nccl: the wire was closed")
            self.stream.wait_stream(torch.cuda.current_stream(self.device))  # tensors made on the caller's stream
            self.stream.wait_stream(self.copy_stream)  # packed rows are in place
            with self.comm.group():
                for t in outgoing:
                    self.comm.send(t, self._peer, self.stream)
                for t in incoming:
                    self.comm.recv(t, self._peer, self.stream)
            event = torch.cuda.Event()
            event.record(self.stream)
        return NcclPending(self, event, outgoing + incoming)

    def send(self, tensors: list[torch.Tensor]) -> NcclPending:
        return self._issue(tensors, [])

    def recv(self, tensors: list[torch.Tensor]) -> NcclPending:
        return self._issue([], tensors)

    def exchange(self, outgoing: list[torch.Tensor], incoming: list[torch.Tensor]) -> NcclPending:
        return self._issue(outgoing, incoming)

    def on_stream(self):
        return torch.cuda.stream(self.copy_stream)

    def wait_event(self, event) -> None:
        self.copy_stream.wait_event(event)

    def fence(self) -> None:
        self.copy_stream.synchronize()

    def abort(self) -> None:
        with self._comm_lock:
            if self.aborted:
                return
            self.aborted = True
            self._doorbell.close()
            try:
                self.comm.abort()
            except Exception:  # the communicator is being discarded either way
                pass


def device_uuid(device: torch.device) -> str:
    return str(torch.cuda.get_device_properties(device).uuid)


def check_distinct_devices(sender: str, sender_uuid: str, receiver: str, receiver_uuid: str) -> None:
    """NCCL refuses two ranks of one communicator on one GPU, and would say so only as an
    opaque error at the first hand-off: refuse the pairing, naming both workers."""
    if sender_uuid and sender_uuid == receiver_uuid:
        raise ValueError(f"nccl: sender {sender} and receiver {receiver} share GPU {sender_uuid}, which NCCL "
                         "refuses; give each worker whole GPUs of its own, or use shm or gloo (staged "
                         "through host memory)")


class NcclReceiver(HandoffReceiver):
    transport, devices = "nccl", ("cuda",)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._stores = StoreHost(self.config.advertise_host, self.config.connect_timeout_s)

    def accept(self, peer: str) -> NcclOffer:
        unique_id = load_library().unique_id()
        prefix, port = self._stores.new_prefix(self.name, peer), self._stores.port
        threading.Thread(target=self._join, args=(peer, unique_id, prefix), name=f"kvtransfer-nccl-accept-{peer}",
                         daemon=True).start()
        return NcclOffer(self.name, unique_id, device_uuid(self.cache.device), self.config.advertise_host, port, prefix)

    def _join(self, peer: str, unique_id: bytes, prefix: str) -> None:
        def make_wire():
            return NcclWire(NcclCommunicator(unique_id, RECEIVER_RANK, 2, self.cache.device), RECEIVER_RANK,
                            self._stores.doorbell(prefix))

        join_as_receiver(self, peer, make_wire)


class NcclSender(HandoffSender):
    transport, devices = "nccl", ("cuda",)

    def _open_channel(self, peer: str, offer: NcclOffer) -> StreamSenderChannel:
        if not isinstance(offer, NcclOffer) or offer.receiver != peer:
            raise ValueError(f"expected an NcclOffer from receiver {peer!r}, got {offer!r}")
        check_distinct_devices(self.name, device_uuid(self.cache.device), peer, offer.device_uuid)
        doorbell = Doorbell(store_client(offer.host, offer.port, offer.prefix, self.config.connect_timeout_s))
        wire = NcclWire(NcclCommunicator(offer.unique_id, SENDER_RANK, 2, self.cache.device), SENDER_RANK, doorbell)
        return join_as_sender(self, peer, wire)
