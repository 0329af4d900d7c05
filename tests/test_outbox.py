"""decode_worker.outbox: a decode worker's outputs reach the router over its direct connection
(or a Ray stream), in order, only for a router that holds the worker's token, one consumer at
a time; and the router falls back to the Ray stream where it cannot connect."""

import asyncio
import socket
import threading
import time

import pytest

from decode_worker.outbox import Outbox, _proof, connect_outputs
from router.workers import WorkerRef, WorkerSet


@pytest.fixture
def outbox():
    box = Outbox("127.0.0.1", "test")
    yield box
    box.close()


def read(box: Outbox, count: int, token: bytes | None = None, timeout_s: float = 10.0) -> list:
    async def go():
        batches = await connect_outputs(*box.address, token or box.token)
        out = []
        async for batch in batches:
            out.append(batch)
            if len(out) == count:
                await batches.aclose()
                return out

    return asyncio.run(asyncio.wait_for(go(), timeout_s))


def test_batches_arrive_in_order_and_those_put_before_the_router_connects_wait_for_it(outbox):
    outbox.put(["a", "b"])  # no consumer yet: kept

    def later():
        time.sleep(0.2)
        for i in range(50):
            outbox.put([i])

    threading.Thread(target=later).start()
    got = []

    async def go():
        batches = await connect_outputs(*outbox.address, outbox.token)
        async for batch in batches:
            got.extend(batch)
            if len(got) == 52:
                await batches.aclose()
                return

    asyncio.run(asyncio.wait_for(go(), 10))
    assert got == ["a", "b", *range(50)]


def test_a_router_without_the_token_gets_nothing_and_the_outputs_wait(outbox):
    outbox.put(["secret"])
    with pytest.raises(ConnectionError):
        read(outbox, 1, token=b"x" * 32)
    # raw: the hello is refused and nothing but the worker's nonce is written back
    with socket.create_connection(outbox.address, timeout=5) as raw:
        raw.sendall(b"\0" * 48)
        received = b""
        while chunk := raw.recv(100):
            received += chunk
        assert len(received) == 16
    assert read(outbox, 1) == [["secret"]]


def test_a_hello_seen_on_the_wire_cannot_be_replayed(outbox):
    """A router's hello answers the worker's nonce of that connection, which the next differs from."""
    outbox.put(["secret"])
    with socket.create_connection(outbox.address, timeout=5) as first:
        nonce = first.recv(16)
        ours = b"r" * 16
        hello = ours + _proof(outbox.token, nonce + ours, b"router")
        first.sendall(hello)
        assert len(first.recv(32)) == 32  # accepted, as the real router would be
    with socket.create_connection(outbox.address, timeout=5) as replay:
        replay.recv(16)
        replay.sendall(hello)
        received = b""
        while chunk := replay.recv(100):
            received += chunk
        assert received == b""  # refused: no proof, no outputs


def test_an_impostor_at_the_port_is_refused_before_anything_is_unpickled():
    server = socket.create_server(("127.0.0.1", 0))
    token = b"t" * 32

    def impostor():
        conn, _ = server.accept()
        with conn:
            conn.sendall(b"n" * 16)
            conn.recv(48)
            conn.sendall(b"\1" * 32 + b"\x05\0\0\0" + b"junk!")

    threading.Thread(target=impostor, daemon=True).start()
    with pytest.raises(ConnectionError, match="not the worker"):
        asyncio.run(connect_outputs(*server.getsockname(), token))
    server.close()


def test_a_newer_consumer_ends_the_older_and_takes_what_follows(outbox):
    async def go():
        first = await connect_outputs(*outbox.address, outbox.token)
        outbox.put([1])
        assert await anext(first) == [1]
        second = await connect_outputs(*outbox.address, outbox.token)
        with pytest.raises((asyncio.IncompleteReadError, ConnectionError)):
            await asyncio.wait_for(anext(first), 5)  # replaced: its connection ends
        outbox.put([2])
        assert await asyncio.wait_for(anext(second), 5) == [2]
        # A Ray `outputs` stream replaces the connection in turn, once its body runs (an output
        # put before that is the connection's to send).
        ray_like = outbox.stream()
        first_batch = asyncio.ensure_future(anext(ray_like))
        with pytest.raises((asyncio.IncompleteReadError, ConnectionError)):
            await asyncio.wait_for(anext(second), 5)
        outbox.put([3])
        assert await asyncio.wait_for(first_batch, 5) == [3]
        third = await connect_outputs(*outbox.address, outbox.token)
        with pytest.raises(StopAsyncIteration):  # and ends when a connection replaces it
            await asyncio.wait_for(anext(ray_like), 5)
        outbox.put([4])
        assert await asyncio.wait_for(anext(third), 5) == [4]
        await third.aclose()

    asyncio.run(go())


def test_put_never_waits_for_a_router_that_does_not_read(outbox):
    async def go():
        batches = await connect_outputs(*outbox.address, outbox.token)  # connected, never read
        started = time.perf_counter()
        for _ in range(200):  # 200 MB: far past what the sockets buffer
            outbox.put([b"x" * (1 << 20)])
        elapsed = time.perf_counter() - started
        await batches.aclose()
        return elapsed

    assert asyncio.run(go()) < 5.0  # a put that sent on the caller's thread would block for good


def test_closing_ends_the_routers_stream(outbox):
    async def go():
        batches = await connect_outputs(*outbox.address, outbox.token)
        outbox.put([1])
        assert await anext(batches) == [1]
        outbox.close()
        with pytest.raises((asyncio.IncompleteReadError, ConnectionError)):
            await asyncio.wait_for(anext(batches), 5)
        with pytest.raises(OSError):
            await connect_outputs(*outbox.address, outbox.token, timeout_s=2)

    asyncio.run(go())


class _Remote:
    def __init__(self, fn):
        self.fn = fn

    def remote(self, *args):
        return self.fn(*args)


def test_the_router_falls_back_to_the_ray_stream_where_it_cannot_connect():
    closed = socket.create_server(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()  # nothing listens there

    asked = []

    async def address():
        asked.append(1)
        return ("127.0.0.1", port, b"t" * 32)

    async def value(v):
        return v

    async def ray_stream():
        for batch in ([1], [2]):
            yield value(batch)

    handle = type("Handle", (), {})()
    handle.output_address = _Remote(address)
    handle.outputs = _Remote(ray_stream)
    worker = WorkerRef("decode-0", "decode", handle)

    async def go():
        return [batch async for batch in await WorkerSet._outputs_of(worker)]

    assert asyncio.run(go()) == [[1], [2]]
    assert worker.outputs_over_ray
    assert asyncio.run(go()) == [[1], [2]]  # and stays there, without trying again
    assert len(asked) == 1
