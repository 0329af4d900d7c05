"""The doorbell of a stream wire (Gloo, NCCL): how a receiver learns that a hand-off follows.

An idle receiver must not sit in a receive on the wire itself. A Gloo wait can be neither
cancelled nor timed out without closing the pair; a posted NCCL receive keeps a kernel
waiting on the GPU, so any device-wide synchronisation in that process (an allocator retry,
`empty_cache`) would wait for the next hand-off. So the receiver sleeps on a key of a TCP
store instead: the sender rings with each request's header as the key's value and only then
posts the request's messages, which the receiver posts too once it has read the header.
Either side's abort() rings a value no header can be, which wakes the waiting side.

The receiver hosts one TCPStore (ephemeral port) for all its pairs, each pair under its own
prefix; the offer carries host, port and prefix to the sender.
"""

from __future__ import annotations

import contextlib
import datetime
import threading
import uuid

import torch
import torch.distributed as dist

CLOSED = b"closed"  # a doorbell value no header can be (headers are HEADER_BYTES long)


def store_client(host: str, port: int, prefix: str, timeout_s: float) -> dist.Store:
    """A connection of one's own to a receiver's store, under a pair's prefix."""
    timeout = datetime.timedelta(seconds=timeout_s)
    return dist.PrefixStore(prefix, dist.TCPStore(host, port, None, False, timeout=timeout))


class StoreHost:
    """A receiver's one TCPStore, made at its first accept(); a fresh prefix per pair."""

    def __init__(self, host: str, timeout_s: float):
        self.host, self.timeout_s = host, timeout_s
        self._store: dist.TCPStore | None = None
        self._lock = threading.Lock()

    @property
    def port(self) -> int:
        return self.master().port

    def master(self) -> dist.TCPStore:
        with self._lock:
            if self._store is None:
                timeout = datetime.timedelta(seconds=self.timeout_s)
                self._store = dist.TCPStore(self.host, 0, None, True, timeout=timeout, wait_for_workers=False)
            return self._store

    @staticmethod
    def new_prefix(receiver: str, peer: str) -> str:
        return f"kvtransfer/{receiver}/{peer}/{uuid.uuid4().hex}/"

    def client(self, prefix: str) -> dist.Store:
        return store_client(self.host, self.port, prefix, self.timeout_s)

    def doorbell(self, prefix: str, waiting_store: dist.Store | None = None) -> Doorbell:
        """The receiver's side of a pair's doorbell: it waits on a connection of the pair's own
        (`waiting_store`, else a new one); close() rings through the master's, never blocked on."""
        return Doorbell(dist.PrefixStore(prefix, self.master()),
                        waiting_store if waiting_store is not None else self.client(prefix))


class Doorbell:
    """Rings (sender) and waits (receiver) on numbered keys under one pair's prefix.

    A TCPStore client holds its lock through a wait, so the waiting side passes a connection of
    its own (`waiting_store`) and rings, close() included, go through `store`."""

    def __init__(self, store: dist.Store, waiting_store: dist.Store | None = None):
        self._ring_store = dist.PrefixStore("doorbell/", store)
        self._wait_store = dist.PrefixStore("doorbell/", waiting_store if waiting_store is not None else store)
        self._rung = self._answered = 0
        self.closed = False

    def ring(self, header: torch.Tensor) -> None:
        """Announce the next request: its header (a CPU uint8 tensor) becomes the next key's value."""
        self._rung += 1
        self._ring_store.set(str(self._rung), header.numpy().tobytes())

    def wait(self) -> torch.Tensor | None:
        """Sleep until the next ring: its header, or None once either side closed the pair."""
        if self._answered:  # the previous ring, deleted now rather than on that request's path
            with contextlib.suppress(Exception):
                self._wait_store.delete_key(str(self._answered))
        key = str(self._answered + 1)
        while not self.closed:
            try:
                value = self._wait_store.get(key)  # one call: blocks until rung (or the store's timeout)
            except RuntimeError:  # nap over: look at the closed flag again
                continue
            self._answered += 1
            if value == CLOSED or self.closed:
                return None
            return torch.frombuffer(bytearray(value), dtype=torch.uint8)
        return None

    def close(self) -> None:
        """Wake whichever side waits; no ring after this is read."""
        if self.closed:
            return
        self.closed = True
        with contextlib.suppress(Exception):
            self._ring_store.set(str(max(self._rung, self._answered) + 1), CLOSED)
