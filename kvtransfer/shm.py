"""Shared-memory transport: CPU workers on one node, one copy per byte, no message per hand-off.

The receiver moves its cache storage into shared memory once (in place: the engine's
tensor objects stay valid; do it before anything caches raw data pointers) and passes
the descriptors, with those of its grant table, to each sender over a Unix socket at the
handshake. Per request (kvtransfer/grant_table.py has the table's rules):

    receiver, expect():   grant a table row to the request (its destination rows' checksum)
    sender, begin():      find the grant, lock the row, claim it (or mark it refused)
    sender, layer_done(): copy that layer's rows into the receiver's blocks and slot, on the caller's thread
    sender, finish():     first token, status and DONE into the row; unlock; the sender's rows are free
    receiver, poll():     DONE seen and the row's lock free: the request landed

Nothing on that path waits for the other process or wakes a thread. A failure on the
receiver (timeout, abort) revokes the grant and is reported once the row's lock is free,
that is once no write of it can still run; the sender sees the revocation before its next
layer or at its watchdog's next look, whichever comes first. The socket stays open only
so that each side notices the other going away.
"""

from __future__ import annotations

import mmap
import os
import socket

import numpy as np

from kvtransfer.control import ControlSocket
from kvtransfer.errors import ChannelClosedError
from kvtransfer.grid import Grid
from kvtransfer.layout import CacheLayout, CacheTensors
from kvtransfer.messages import ShmOffer
from kvtransfer.grant_table import GrantTable
from kvtransfer.sender import ABORTING, HandoffSender
from kvtransfer.shm_receiver import ShmReceiver
from kvtransfer.shm_sender import ShmSenderChannel

__all__ = ["ShmReceiver", "ShmSender", "SHM_SENDER_ENV", "share_cache_storage", "map_peer_cache"]
PROTOCOL_VERSION = 2

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


class ShmSender(HandoffSender):
    """Writes on the caller's thread (kvtransfer/shm_sender.py); the watchdog also looks for revoked grants."""

    transport = "shm"

    def __init__(self, *args, **kwargs):
        self._retired: list[GrantTable] = []
        super().__init__(*args, **kwargs)

    def _fail(self, request_id, error, only_if=None) -> None:
        with self._lock:
            job = self._outgoing.get(request_id)
        super()._fail(request_id, error, only_if)
        if job is not None and job.state == ABORTING:
            job.channel.release(job)

    def _expire(self, now: float) -> None:
        super()._expire(now)
        with self._lock:
            channels = list(self._channels.values())
        for channel in channels:
            channel.check_revoked()

    def _retire(self, table: GrantTable) -> None:
        # Closing a descriptor of the table would drop every record lock this process holds
        # on it, a newer channel's included: tables close with the sender.
        with self._lock:
            self._retired.append(table)

    def _close_channels(self) -> None:
        super()._close_channels()
        with self._lock:
            retired, self._retired = self._retired, []
        for table in retired:
            table.close()

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
            if len(fds) != len(reply["sizes"]) + 1:
                raise ChannelClosedError(f"receiver {peer} sent {len(fds)} descriptors, expected {len(reply['sizes']) + 1}")
            table = GrantTable(fds.pop(), reply["grant_rows"])
            maps, views = map_peer_cache(theirs, fds, reply["sizes"], reply["places"], reply["rows"])
        except Exception:
            control.close()
            raise
        control.settimeout(None)
        grid = Grid.between(self.layout, theirs)
        return ShmSenderChannel(self, peer, control, maps, grid.split_all(views, theirs), table, reply["peer_index"], grid)
