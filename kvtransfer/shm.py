"""Shared-memory transport: CPU workers on one node, one copy per byte.

The receiver moves its cache storage into shared memory once (in place: the engine's
tensor objects stay valid; do it before anything caches raw data pointers) and passes
the descriptors to each sender over a Unix socket. The sender maps them and copies its
rows straight into the reserved blocks and slot; the socket carries only the control
messages, per request:

    sender  -> BEGIN(request, counts, checksum of destination rows)
    receiver-> GRANT | REFUSE(why)          (GRANT: the rows are reserved for this request)
    sender  -> DONE(first token) | ABORTED(why)   after the last layer is written
    receiver-> REVOKE                        (timeout/abort while the sender may write)

The sender writes only between GRANT and DONE/ABORTED and checks for REVOKE before
each layer, so a revoked request is reported failed (and its rows freed) only after the
sender's ABORTED (or its disconnect) says no write of it is still running.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import socket
import threading
import uuid

import numpy as np

from kvtransfer.control import ControlSocket
from kvtransfer.errors import ChannelClosedError, LayoutMismatchError
from kvtransfer.layout import CacheLayout, CacheTensors
from kvtransfer.messages import ShmOffer
from kvtransfer.receiver import HandoffReceiver
from kvtransfer.shm_sender import ShmSenderChannel
from kvtransfer.sender import HandoffSender

PROTOCOL_VERSION = 1

# Environment for a process that sends over shm (set at its start, e.g. in the Ray actor's
# runtime_env): glibc then copies a block row (tens of KiB) with non-temporal stores, as it
# already does for one huge memcpy, instead of pulling rows only the receiver will read
# into this core's cache. x86-64 glibc only; ignored elsewhere. Measured in docs/kvtransfer.md.
SHM_SENDER_ENV = {
    "GLIBC_TUNABLES": "glibc.cpu.x86_non_temporal_threshold=0x5000:glibc.cpu.x86_rep_movsb_threshold=0x10000000",
}


def share_cache_storage(cache: CacheTensors) -> tuple[list[int], list[int], dict[str, dict]]:
    """Move the cache's storages into shared memory; returns (fds, sizes, where each tensor sits)."""
    fds, sizes, index_of, places = [], [], {}, {}
    for name, tensor in cache.tensors.items():
        storage = tensor.untyped_storage()
        fd, size = storage._share_fd_cpu_()  # first call moves the bytes into shared memory, in place
        if fd not in index_of:
            index_of[fd] = len(fds)
            fds.append(fd)
            sizes.append(size)
        places[name] = {"storage": index_of[fd], "offset": tensor.storage_offset() * tensor.element_size()}
    return fds, sizes, places


def map_peer_cache(layout: CacheLayout, fds: list[int], sizes: list[int], places: dict[str, dict], rows: dict[str, int]):
    """The peer's cache as {name: [rows, row_bytes] uint8 array} over shared mappings."""
    if len(fds) != len(sizes):
        raise ChannelClosedError(f"expected {len(sizes)} shared-memory descriptors, received {len(fds)}")
    maps = []
    try:
        for fd, size in zip(fds, sizes):
            maps.append(mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)))
    finally:
        for fd in fds:
            os.close(fd)
    views = {}
    for spec in layout.specs:
        place, count = places[spec.name], rows[spec.role]
        flat = np.frombuffer(maps[place["storage"]], dtype=np.uint8, count=count * spec.row_bytes, offset=place["offset"])
        views[spec.name] = flat.reshape(count, spec.row_bytes)
    return maps, views


class ShmReceiver(HandoffReceiver):
    """Moves the cache's storage into shared memory at construction (see the module doc)."""

    transport = "shm"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._shared = share_cache_storage(self.cache)
        self._tokens: dict[str, str] = {}
        self._socket_name = f"\0kvtransfer-{self.name}-{uuid.uuid4().hex}"
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(self._socket_name)
        self._listener.listen(64)
        self._listener.settimeout(0.2)
        self._accepter = threading.Thread(target=self._accept_loop, name=f"kvtransfer-shm-listen-{self.name}", daemon=True)
        self._accepter.start()

    def accept(self, peer: str) -> ShmOffer:
        token = uuid.uuid4().hex
        with self._lock:
            self._tokens[token] = peer
        return ShmOffer(self.name, self._socket_name, token)

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            threading.Thread(target=self._welcome, args=(conn,), daemon=True).start()

    def _welcome(self, conn: socket.socket) -> None:
        control = ControlSocket(conn)
        control.settimeout(self.config.connect_timeout_s)
        peer = None
        try:
            hello, _ = control.recv()
            with self._lock:
                peer = self._tokens.pop(hello.get("token", ""), None)
            if hello.get("kind") != "hello" or peer is None:
                raise ChannelClosedError("unknown or reused offer token")
            if hello.get("version") != PROTOCOL_VERSION:
                raise ChannelClosedError(f"peer speaks shm protocol {hello.get('version')}, this is {PROTOCOL_VERSION}")
            try:
                self.layout.check_compatible(CacheLayout.from_dict(hello["layout"]), f"receiver {self.name}", f"sender {peer}")
            except LayoutMismatchError as error:
                control.send("refused", error=str(error), layout=self.layout.to_dict())
                self._channel_failed_to_open(peer, error)
                control.close()
                return
            fds, sizes, places = self._shared
            rows = {"block": self.cache.num_blocks, "slot": self.cache.num_slots}
            control.send("welcome", fds=fds, layout=self.layout.to_dict(), sizes=sizes, places=places, rows=rows)
            control.settimeout(None)
        except Exception as error:  # a peer that cannot pair gets disconnected, nothing else
            if peer is not None:
                self._channel_failed_to_open(peer, error)
            control.close()
            return
        self._install_channel(peer, ShmReceiverChannel(self, peer, control))

    def _close_channels(self) -> None:
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accept loop now
        with contextlib.suppress(OSError):
            self._listener.close()
        self._accepter.join(timeout=2)
        super()._close_channels()


class ShmReceiverChannel:
    def __init__(self, receiver: ShmReceiver, peer: str, control: ControlSocket):
        self.receiver, self.peer, self.control = receiver, peer, control
        self._landing: dict[str, object] = {}
        self._thread = threading.Thread(target=self._run, name=f"kvtransfer-shm-recv-{receiver.name}-{peer}", daemon=True)
        self._thread.start()

    def release(self, incoming) -> bool:
        with contextlib.suppress(ChannelClosedError):
            self.control.send("revoke", request_id=incoming.target.request_id)
        return False  # the failure is reported when the sender answers ABORTED or goes away

    def close(self) -> None:
        self.control.close()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        try:
            while True:
                message, _ = self.control.recv()
                self._handle(message)
        except Exception as error:
            self.control.close()
            self.receiver._channel_broken(self, self.peer, error)

    def _handle(self, message: dict) -> None:
        kind, rid = message["kind"], message["request_id"]
        if kind == "begin":
            incoming, why = self.receiver._claim(rid, message["num_tokens"], message["num_blocks"], message["digest"], message["slot"], self)
            if incoming is None:
                self.control.send("refuse", request_id=rid, error=why)
            else:
                self._landing[rid] = incoming
                self.control.send("grant", request_id=rid)
        elif kind in ("done", "aborted"):
            incoming = self._landing.pop(rid, None)
            if incoming is not None:
                self.receiver._landed(incoming, kind == "done", message.get("first_token"), message.get("error", ""))
        else:
            raise ChannelClosedError(f"unexpected control message {kind!r} from sender {self.peer}")


class ShmSender(HandoffSender):
    transport = "shm"

    def _open_channel(self, peer: str, offer: ShmOffer) -> ShmSenderChannel:
        if not isinstance(offer, ShmOffer) or offer.receiver != peer:
            raise ValueError(f"expected a ShmOffer from receiver {peer!r}, got {offer!r}")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.config.connect_timeout_s)
        try:
            sock.connect(offer.socket_name)
        except OSError as error:
            sock.close()
            raise ChannelClosedError(f"cannot reach receiver {peer} over shared memory (same node?): {error}") from None
        control = ControlSocket(sock)
        try:
            control.send("hello", token=offer.token, name=self.name, version=PROTOCOL_VERSION, layout=self.layout.to_dict())
            reply, fds = control.recv()
            theirs = CacheLayout.from_dict(reply["layout"])
            self.layout.check_compatible(theirs, f"sender {self.name}", f"receiver {peer}")
            if reply["kind"] != "welcome":
                raise ChannelClosedError(f"receiver {peer} refused: {reply.get('error')}")
            maps, views = map_peer_cache(theirs, fds, reply["sizes"], reply["places"], reply["rows"])
        except Exception:
            control.close()
            raise
        control.settimeout(None)
        return ShmSenderChannel(self, peer, control, maps, views)
