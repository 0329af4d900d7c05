"""A decode worker's outputs on their way to the router.

The engine thread puts each step's outputs here (`put`); one consumer at a time takes them,
and a newer consumer ends the one before it:
- the router's direct connection, which the cluster uses: the router connects over TCP to
  `address` (this node's address, a port of the worker's own), both ends prove they hold
  `token` (which the router got from the worker over Ray) without sending it, each over a
  nonce of its own and one of the other's (so a hello seen on the wire cannot be replayed),
  and from then on
  each batch goes as one length-prefixed pickle, written by the connection's own thread as soon
  as the engine puts it. Between a step and the router there is one thread wake and one socket
  write; a Ray streaming generator adds the actor's event loop and Ray's object path, each a
  wake on a busy CPU, on every step of the token loop.
- a Ray `outputs` stream (`stream`), which the router falls back to where it cannot reach the
  worker's port (a network policy that opens only Ray's own ports);
- `take`, for in-process callers (tests, scripts).
Outputs put while no consumer reads wait here for the next one.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import pickle
import secrets
import socket
import struct
import threading

log = logging.getLogger(__name__)
FRAME = struct.Struct("<I")  # the pickled batch's length
NONCE_BYTES = 16
HELLO_TIMEOUT_S = 5.0


def _proof(token: bytes, nonce: bytes, side: bytes) -> bytes:
    return hmac.new(token, nonce + side, hashlib.sha256).digest()


class Outbox:
    def __init__(self, host: str, name: str):
        self.name = name
        self.token = secrets.token_bytes(32)
        self._items: list = []
        self._ready = threading.Condition()
        self._consumer: _Consumer | None = None
        self._closed = False
        try:
            self._listener = socket.create_server((host, 0))
        except OSError:  # an advertised address that is not this host's own (NAT): listen on all
            self._listener = socket.create_server(("", 0))
        self.address = (host, self._listener.getsockname()[1])
        threading.Thread(target=self._accept, name=f"{name}-outbox", daemon=True).start()

    def put(self, outputs: list) -> None:
        with self._ready:
            if not self._items and self._consumer is not None:  # else it was woken already
                self._consumer.wake()
            self._items.extend(outputs)
            self._ready.notify_all()

    def take(self, timeout_s: float) -> list:
        """Everything put so far, waiting up to timeout_s for something (in-process callers)."""
        with self._ready:
            if not self._items:
                self._ready.wait(timeout_s)
            out, self._items = self._items, []
        return out

    async def stream(self):
        """The body of the worker's Ray `outputs` generator: what was put since its last item."""
        me = _RayStream(asyncio.get_running_loop())
        self._replace(me)
        while True:
            await me.ready.wait()
            me.ready.clear()
            batch = self._take_for(me)
            if batch is None:
                return
            if batch:
                yield batch

    def close(self) -> None:
        self._closed = True
        try:
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accept (Linux)
        except OSError:
            pass
        self._listener.close()
        self._replace(None)

    # ---- consumers ----

    def _replace(self, consumer: _Consumer | None) -> None:
        with self._ready:
            old, self._consumer = self._consumer, consumer
            if consumer is not None and self._items:
                consumer.wake()
            self._ready.notify_all()
        if old is not None:
            old.close()

    def _take_for(self, consumer: _Consumer, wait: bool = False) -> list | None:
        """What was put, for `consumer` (waiting for something if `wait`); None once it has been
        replaced, so a consumer that lost its place never takes another's outputs."""
        with self._ready:
            while wait and not self._items and self._consumer is consumer:
                self._ready.wait()
            if self._consumer is not consumer:
                return None
            out, self._items = self._items, []
        return out

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), name=f"{self.name}-outputs", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            try:
                conn.settimeout(HELLO_TIMEOUT_S)
                ours = secrets.token_bytes(NONCE_BYTES)  # so a hello seen on the wire cannot be replayed
                conn.sendall(ours)
                theirs = _recv_exactly(conn, NONCE_BYTES)
                if not hmac.compare_digest(_recv_exactly(conn, 32), _proof(self.token, ours + theirs, b"router")):
                    log.warning("%s: an outputs connection without the token; closed", self.name)
                    return
                conn.sendall(_proof(self.token, theirs + ours, b"worker"))
                conn.settimeout(None)
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                return
            me = _Connection(conn)
            self._replace(me)
            while (batch := self._take_for(me, wait=True)) is not None:
                body = pickle.dumps(batch, pickle.HIGHEST_PROTOCOL)
                try:
                    conn.sendall(FRAME.pack(len(body)) + body)
                except OSError:  # the router went: it fails over what this worker held
                    with self._ready:
                        if self._consumer is me:
                            self._consumer = None
                    return


class _Consumer:
    def wake(self) -> None:
        pass

    def close(self) -> None:
        pass


class _Connection(_Consumer):
    """The router's direct connection; its thread waits on the outbox's condition."""

    def __init__(self, conn: socket.socket):
        self.conn = conn

    def close(self) -> None:
        try:  # a send in progress fails and the router reads the end of the stream
            self.conn.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


class _RayStream(_Consumer):
    """The actor loop's side of one Ray `outputs` stream: the engine thread wakes it."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.ready = asyncio.Event()

    def wake(self) -> None:
        try:
            self.loop.call_soon_threadsafe(self.ready.set)
        except RuntimeError:  # the actor's loop closed: the worker is shutting down
            pass

    close = wake  # it finds itself replaced when it wakes


def _recv_exactly(conn: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            raise ConnectionError("closed before the hello")
        data += chunk
    return data


async def connect_outputs(host: str, port: int, token: bytes, timeout_s: float = HELLO_TIMEOUT_S):
    """The router's end of a direct connection, once both ends have proved they hold `token`:
    an async iterator of each batch the worker sends, as it comes, which raises once the
    connection ends (the worker died or shut down). Raises OSError when it cannot connect, or
    when whatever answers at that port does not hold the token."""
    reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout_s)
    try:
        try:
            theirs = await asyncio.wait_for(reader.readexactly(NONCE_BYTES), timeout_s)
            ours = secrets.token_bytes(NONCE_BYTES)
            writer.write(ours + _proof(token, theirs + ours, b"router"))
            await writer.drain()
            answer = await asyncio.wait_for(reader.readexactly(32), timeout_s)
        except asyncio.IncompleteReadError:
            answer = b""
            ours = theirs = b""
        if not hmac.compare_digest(answer, _proof(token, ours + theirs, b"worker")):
            raise ConnectionError(f"{host}:{port} is not the worker that gave this address")
    except BaseException:
        writer.close()
        raise
    return _batches(reader, writer)


async def _batches(reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
    try:
        while True:
            (size,) = FRAME.unpack(await reader.readexactly(FRAME.size))
            yield pickle.loads(await reader.readexactly(size))
    finally:
        writer.close()
