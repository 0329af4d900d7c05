"""Gloo transport: CPU workers on any nodes, over a stateless two-rank Gloo group per pair.

Each pair gets its own ProcessGroupGloo on its own store prefix; nothing touches
torch.distributed's global process group, so a worker may pair with any number of peers
and re-pair after a failure. The receiver hosts one TCPStore (ephemeral port) for all its
pairs; the offer carries its address to the sender.
"""

from __future__ import annotations

import contextlib
import datetime
import threading
import time

import torch
import torch.distributed as dist

from kvtransfer.doorbell import Doorbell, StoreHost, store_client
from kvtransfer.errors import WireError, WireTimeoutError
from kvtransfer.messages import GlooOffer
from kvtransfer.receiver import HandoffReceiver
from kvtransfer.sender import HandoffSender
from kvtransfer.stream_channel import StreamSenderChannel, join_as_receiver, join_as_sender

# Gloo closes a pair when any wait times out, so every wait here has a real deadline.
_IDLE_FOREVER = datetime.timedelta(days=365)
_TAG_SPACE = 1 << 30
RECEIVER_RANK, SENDER_RANK = 0, 1


class GlooPending:
    def __init__(self, works: list):
        self._works = works

    def wait(self, timeout_s: float | None) -> None:
        deadline = time.monotonic() + (timeout_s if timeout_s is not None else _IDLE_FOREVER.total_seconds())
        for work in self._works:
            try:
                work.wait(datetime.timedelta(seconds=max(deadline - time.monotonic(), 0.001)))
            except RuntimeError as error:
                kind = WireTimeoutError if "Timed out" in str(error) else WireError
                raise kind(f"gloo: {error}") from None


class GlooWire:
    """A two-rank Gloo group plus the pair's doorbell (kvtransfer.doorbell): an idle receiver
    sleeps on the doorbell, never in a Gloo wait (which abort() could not end)."""

    def __init__(self, group: dist.ProcessGroupGloo, doorbell: Doorbell, rank: int):
        self.device = torch.device("cpu")
        self._group, self._peer = group, 1 - rank
        self._doorbell = doorbell
        self._send_seq = self._recv_seq = 0
        self.aborted = False

    def announce(self, header: torch.Tensor) -> None:
        self._doorbell.ring(header)

    def await_announcement(self) -> torch.Tensor | None:
        """Sleep until the peer announces the next request (its header) or the wire is closed (None)."""
        return None if self.aborted else self._doorbell.wait()

    def send(self, tensors: list[torch.Tensor]) -> GlooPending:
        return GlooPending([self._send_one(t) for t in tensors])

    def recv(self, tensors: list[torch.Tensor]) -> GlooPending:
        return GlooPending([self._recv_one(t) for t in tensors])

    def exchange(self, outgoing: list[torch.Tensor], incoming: list[torch.Tensor]) -> GlooPending:
        return GlooPending([self._send_one(t) for t in outgoing] + [self._recv_one(t) for t in incoming])

    def _send_one(self, tensor: torch.Tensor):
        self._send_seq += 1
        return self._live_group().send([tensor], self._peer, self._send_seq % _TAG_SPACE)

    def _recv_one(self, tensor: torch.Tensor):
        self._recv_seq += 1
        return self._live_group().recv([tensor], self._peer, self._recv_seq % _TAG_SPACE)

    def _live_group(self) -> dist.ProcessGroupGloo:
        group = self._group
        if group is None:
            raise WireError("gloo: the wire was closed")
        return group

    def on_stream(self):
        return contextlib.nullcontext()

    def wait_event(self, event) -> None:
        pass

    def fence(self) -> None:
        pass  # CPU copies are synchronous

    def abort(self) -> None:
        if self.aborted:
            return
        self.aborted = True
        self._doorbell.close()  # wakes whichever side waits
        with contextlib.suppress(Exception):
            self._group.abort()
        # Destroy the group now, while the interpreter is alive: destroyed during interpreter
        # shutdown, its threads can hit a finalizing interpreter and abort the process.
        self._group = None


def _pair_group(store: dist.Store, rank: int, host: str) -> dist.ProcessGroupGloo:
    options = dist.ProcessGroupGloo._Options()
    options._timeout = _IDLE_FOREVER
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    return dist.ProcessGroupGloo(dist.PrefixStore("group/", store), rank, 2, options)


class GlooReceiver(HandoffReceiver):
    transport = "gloo"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._stores = StoreHost(self.config.advertise_host, self.config.connect_timeout_s)

    def accept(self, peer: str) -> GlooOffer:
        prefix = self._stores.new_prefix(self.name, peer)
        port = self._stores.port
        joiner = threading.Thread(target=self._join, args=(peer, prefix), name=f"kvtransfer-accept-{peer}", daemon=True)
        joiner.start()
        return GlooOffer(self.name, self.config.advertise_host, port, prefix)

    def _join(self, peer: str, prefix: str) -> None:
        def make_wire():
            # Rendezvous, then doorbell waits, on a connection of this pair's own; rings (only
            # close() rings here) go through the master's, which no one blocks on.
            waiting_store = self._stores.client(prefix)
            group = _pair_group(waiting_store, RECEIVER_RANK, self.config.advertise_host)
            return GlooWire(group, self._stores.doorbell(prefix, waiting_store), RECEIVER_RANK)

        join_as_receiver(self, peer, make_wire)


class GlooSender(HandoffSender):
    transport = "gloo"

    def _open_channel(self, peer: str, offer: GlooOffer) -> StreamSenderChannel:
        if not isinstance(offer, GlooOffer) or offer.receiver != peer:
            raise ValueError(f"expected a GlooOffer from receiver {peer!r}, got {offer!r}")
        store = store_client(offer.host, offer.port, offer.prefix, self.config.connect_timeout_s)
        wire = GlooWire(_pair_group(store, SENDER_RANK, self.config.advertise_host), Doorbell(store), SENDER_RANK)
        return join_as_sender(self, peer, wire)
