"""Moving a staged prefix-cache entry from one worker's host tier to another's
(engine.prefix_exchange says what is staged and adopted; router.prefix_fetch who fetches).

The bytes go over kvtransfer, as hand-offs do, with a cache of its own: the host tier's arena
as rows of engine.host_tier.ROW_BYTES. The source stages the entry in whole rows; the importer
reserves as many rows and expects them like a hand-off (request id the fetch's, destination
blocks the rows, no state slot); the source sends its rows there. Shared memory between workers
on one node (the importer's arena moves into shared memory once, in place, when its receiver
opens, as a decode worker's cache does), Gloo across nodes and for an arena page-locked for a
GPU (moving it would undo the page-locking).

Pairs connect when first needed: the importer asks the source to send, and where the source
has no channel to it (the first fetch, or either side restarted since: endpoints are named
after the worker's incarnation), the importer opens one with an offer and asks again. Every
failure on the way, and every refusal, costs the importer the recompute it hoped to save,
never the request; each side's rows go back when the move is over either way, and a source
releases what no importer came to fetch.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time

from engine.host_tier import ROW_BYTES
from kvtransfer import BLOCK, CacheTensors, HandoffSender, make_transport
from kvtransfer.config import TransferConfig
from kvtransfer.messages import HandoffResult, HandoffTarget

log = logging.getLogger(__name__)


def fetch_transport(same_node: bool, pinned: bool) -> str:
    """The importer's choice: shared memory on one node, unless its arena is page-locked."""
    return "shm" if same_node and not pinned else "gloo"


class PrefixWire:
    """A worker's fetch endpoints over its host tier's rows: a sender and a receiver per
    transport kind, each opened when first used. `on_sent(fetch id)` runs (on a transport
    thread) when a send is over, either way."""

    def __init__(self, name: str, rows, config: TransferConfig, on_sent=None):
        self.name = name  # a worker's: its name and incarnation, so a restarted peer is a new one
        self.cache = CacheTensors.from_named(1, [("layer0.rows", 0, "attention", BLOCK, rows)])
        self.config, self.on_sent = config, on_sent
        self._senders: dict[str, HandoffSender] = {}
        self._receivers: dict = {}
        self.shm_refused: str | None = None  # why this worker's arena could not go into shared memory
        self._opening = threading.Lock()

    def sender(self, kind: str) -> HandoffSender:
        with self._opening:  # connect and send run on worker threads
            if kind not in self._senders:
                self._senders[kind] = make_transport(kind).sender(self.name, self.cache, self.config, self._sent)
            return self._senders[kind]

    def receiver(self, kind: str):
        """(the kind opened, its receiver); on the engine's thread, where shm moves the arena
        into shared memory. Where that fails (a /dev/shm too small for it), Gloo from then on."""
        if kind == "shm" and self.shm_refused is not None:
            kind = "gloo"
        if kind not in self._receivers:
            try:
                self._receivers[kind] = make_transport(kind).receiver(self.name, self.cache, self.config)
            except (OSError, RuntimeError) as error:
                if kind != "shm":
                    raise
                self.shm_refused = f"{type(error).__name__}: {error}"
                log.warning("%s: no shared-memory receiver for prefix fetches (%s); Gloo instead", self.name,
                            self.shm_refused)
                return self.receiver("gloo")
        return kind, self._receivers[kind]

    def send(self, fetch_id: str, peer: str, kind: str, rows: list[int], dst_rows: list[int]):
        """The staged `rows` to `peer`'s `dst_rows`; raises where there is no channel to it."""
        target = HandoffTarget(fetch_id, peer, tuple(dst_rows), None)
        return self.sender(kind).send(target, len(rows), rows, None, first_token=0)

    def sending(self) -> set[str]:
        """Fetch ids whose rows a sender still reads."""
        with self._opening:
            senders = list(self._senders.values())
        return {fetch_id for sender in senders for fetch_id in sender.pending()}

    def _sent(self, result: HandoffResult) -> None:
        if self.on_sent is not None:
            self.on_sent(result.request_id)

    def close(self) -> None:
        for endpoint in (*self._senders.values(), *self._receivers.values()):
            endpoint.close()


class PendingPrefix:
    """What the router tells a prefill worker to fetch for one request: the source (an actor
    handle, and its name for the logs), the block chain, and whether the two share a node."""

    def __init__(self, source, source_name: str, hashes: list[bytes], same_node: bool):
        self.source, self.source_name, self.hashes, self.same_node = source, source_name, hashes, same_node


async def fetch(worker, request_id: str, pending: PendingPrefix, timeout_s: float) -> int:
    """The prefix `pending` names, moved from its source into `worker`'s host tier: the tokens
    it covers (0: nothing came, or it was refused or held already). Each wait, on the source
    or on the rows, takes at most `timeout_s`."""
    exchange, wire = worker.engine.exchange, worker.prefix_wire
    fetch_id = f"{request_id}#prefix"

    def ask(method, *args):
        return asyncio.wait_for(getattr(pending.source, method).remote(*args), timeout_s)

    source_wire, staged = await ask("stage_prefix", pending.hashes, fetch_id)
    if staged is None:
        return 0
    offset = await worker.on_engine(lambda engine: exchange.make_room(staged))
    if offset is None:
        pending.source.unstage_prefix.remote(fetch_id)
        return 0
    first = offset // ROW_BYTES
    dst_rows = list(range(first, first + len(staged.rows)))
    receiver, landed = None, False
    try:
        kind = fetch_transport(pending.same_node, exchange.host.arena.pinned)
        kind, receiver = await worker.on_engine(lambda engine: wire.receiver(kind))
        receiver.expect(HandoffTarget(fetch_id, wire.name, tuple(dst_rows), None), timeout_s)
        sent = await ask("send_prefix", fetch_id, wire.name, kind, dst_rows)
        if sent == "not connected":  # the pair's first fetch, or a side restarted: pair, then again
            await ask("connect_prefix_wire", wire.name, kind, receiver.accept(source_wire))
            sent = await ask("send_prefix", fetch_id, wire.name, kind, dst_rows)
        if sent != "sent":
            raise RuntimeError(f"the source did not send: {sent}")
        # the receiver fails the rows itself once `timeout_s` has passed: this wait ends
        result = (await asyncio.to_thread(receiver.wait_for, [fetch_id], 2 * timeout_s))[fetch_id]
        if not result.ok:
            raise RuntimeError(result.error)
        landed = True
    finally:
        if not landed:
            # a failure is reported only once the transport no longer writes the rows (kvtransfer.endpoint)
            if receiver is not None and receiver.abort(fetch_id, "the fetch failed"):
                await asyncio.to_thread(receiver.wait_for, [fetch_id], 2 * timeout_s)
            await worker.on_engine(lambda engine: exchange.drop(offset, staged.nbytes))
            pending.source.unstage_prefix.remote(fetch_id)
    return await worker.on_engine(lambda engine: exchange.adopt(staged, offset))


class StagedRows:
    """A source's staged fetches, released when sent or when no importer came for them."""

    def __init__(self, worker, timeout_s: float):
        self.worker, self.timeout_s = worker, timeout_s
        self._at: dict[str, float] = {}  # fetch id -> when staged

    async def stage(self, hashes: list[bytes], fetch_id: str):
        exchange = self.worker.engine.exchange
        if exchange is None or self.worker.prefix_wire is None:
            return None
        await self._expire(exchange)
        staged = await self.worker.on_engine(lambda engine: exchange.stage(hashes, fetch_id))
        if staged is not None:
            self._at[fetch_id] = time.monotonic()
        return staged

    async def send(self, fetch_id: str, peer: str, kind: str, dst_rows: list[int]) -> str:
        wire, exchange = self.worker.prefix_wire, self.worker.engine.exchange
        rows = exchange.staged_rows(fetch_id) if exchange is not None else None
        if rows is None:
            return "nothing staged for it"
        if not wire.sender(kind).connected(peer):
            return "not connected"
        try:  # shared memory copies on the calling thread: not the event loop's
            await asyncio.to_thread(wire.send, fetch_id, peer, kind, rows, dst_rows)
        except Exception as error:
            await self.release(fetch_id)
            return f"{type(error).__name__}: {error}"
        return "sent"

    def sent(self, fetch_id: str) -> None:
        self._at.pop(fetch_id, None)

    async def release(self, fetch_id: str) -> None:
        self._at.pop(fetch_id, None)
        exchange = self.worker.engine.exchange
        await self.worker.on_engine(lambda engine: exchange.unstage(fetch_id))

    async def _expire(self, exchange) -> None:
        now = time.monotonic()
        sending = self.worker.prefix_wire.sending()
        for fetch_id, at in list(self._at.items()):
            if now - at > self.timeout_s and fetch_id not in sending:
                log.info("%s: staged prefix %s not fetched within %.0f s; released", self.worker.name, fetch_id,
                         self.timeout_s)
                await self.release(fetch_id)
