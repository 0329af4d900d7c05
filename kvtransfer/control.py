"""Length-prefixed JSON messages over a Unix socket, optionally carrying file descriptors."""

from __future__ import annotations

import array
import contextlib
import json
import socket
import struct
import threading

from kvtransfer.errors import ChannelClosedError

_LENGTH = struct.Struct("<I")
# Linux's SCM_MAX_FD: the most descriptors one message may carry (a cache of many layers sends
# one per tensor storage, plus the grant table's).
MAX_FDS = 253


class ControlSocket:
    def __init__(self, sock: socket.socket):
        self._sock = sock
        self._send_lock = threading.Lock()
        self._inbox = bytearray()
        self._fds: list[int] = []

    def settimeout(self, seconds: float | None) -> None:
        self._sock.settimeout(seconds)

    def send(self, kind: str, fds: list[int] = (), **fields) -> None:
        if len(fds) > MAX_FDS:
            raise ValueError(f"{len(fds)} file descriptors in one message; at most {MAX_FDS} can travel")
        data = json.dumps({"kind": kind, **fields}).encode()
        frame = _LENGTH.pack(len(data)) + data
        with self._send_lock:
            try:
                if fds:
                    sent = self._sock.sendmsg([frame], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
                    self._sock.sendall(frame[sent:])
                else:
                    self._sock.sendall(frame)
            except OSError as error:
                raise ChannelClosedError(f"control socket: {error}") from None

    def recv(self) -> tuple[dict, list[int]]:
        """The next message and any descriptors that arrived with it; ChannelClosedError on EOF."""
        while True:
            if len(self._inbox) >= _LENGTH.size:
                (size,) = _LENGTH.unpack_from(self._inbox)
                if len(self._inbox) >= _LENGTH.size + size:
                    body = bytes(self._inbox[_LENGTH.size : _LENGTH.size + size])
                    del self._inbox[: _LENGTH.size + size]
                    fds, self._fds = self._fds, []
                    return json.loads(body), fds
            try:
                data, ancillary, _flags, _addr = self._sock.recvmsg(1 << 16, socket.CMSG_SPACE(MAX_FDS * 4))
            except TimeoutError:
                raise ChannelClosedError("control socket: peer did not answer in time") from None
            except OSError as error:
                raise ChannelClosedError(f"control socket: {error}") from None
            for level, kind, payload in ancillary:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    fds = array.array("i")
                    fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
                    self._fds.extend(fds)
            if not data:
                raise ChannelClosedError("control socket: peer closed the connection")
            self._inbox += data

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            self._sock.close()
