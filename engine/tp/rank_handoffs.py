"""Rank-to-rank hand-offs between tensor-parallel workers of equal size.

When a prefill and a decode worker have the same TP size, rank r of one holds exactly the heads
and channels rank r of the other owns (engine.tp.plan: the shard map depends only on the
un-sharded cache spec and the size), so each rank moves its own shard to its peer rank over its
own channel: no gather, no staging rows, no scatter, and the bytes on the wire are one
un-sharded copy (plus the copies of KV heads or Mamba2 groups that several ranks keep). Other
size pairs go through rank 0's staging rows (engine.tp.staging).

Every rank has an endpoint of the worker's transport over its own shard of the cache (receivers
on decode, senders on prefill), all with the worker's name, so one HandoffTarget (the request's
own blocks and slot: every rank's block table is rank 0's) addresses all of them; its `ranks`
says how many shards will arrive. Rank 0 drives the followers' endpoints through their command
sockets (TPLeader.ask, on the engine thread) and merges their results: a request has landed, or
its rows are free, once every rank that holds it says so; the first rank that fails aborts it
on the others, and the failure is reported only when all of them have let go of the rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from kvtransfer import CacheTensors, HandoffResult, TransferConfig, make_transport

# The endpoint calls a follower runs for rank 0; only these return a value worth sending back.
FOLLOWER_CALLS = {"accept", "connect", "disconnect", "connected", "expect", "send", "abort",
                  "keep_waiting", "poll"}
ANSWERING_CALLS = {"accept", "connected", "keep_waiting", "poll"}


def shard_name(rank: int, size: int) -> str:
    """What each rank's layout says at the handshake, so that only rank r meets rank r."""
    return f"rank {rank} of {size}"


@dataclass(frozen=True)
class RankOffers:
    """A TP decode worker's answer to accept() for a prefill worker of its size: rank r's offer
    at index r."""

    offers: tuple


class RankEndpoint:
    """A follower rank's endpoint over its shard of the cache, made by rank 0's first call."""

    def __init__(self, rank: int, size: int, block_size: int):
        self.rank, self.size, self.block_size, self.endpoint = rank, size, block_size, None

    def handle(self, cache, op: str, *args) -> tuple[bool, object]:
        try:
            if op == "open":
                transport, side, name, config = args
                if self.endpoint is not None:
                    raise RuntimeError("this rank's hand-off endpoint is already open")
                tensors = CacheTensors.from_named(self.block_size, cache.handoff_tensors(), shard_name(self.rank, self.size))
                self.endpoint = getattr(make_transport(transport), side)(name, tensors, config)
                return True, None
            if op not in FOLLOWER_CALLS or self.endpoint is None:
                raise RuntimeError(f"no hand-off call {op!r} on a rank whose endpoint is "
                                   f"{'open' if self.endpoint else 'not open'}")
            value = getattr(self.endpoint, op)(*args)
            return True, value if op in ANSWERING_CALLS else None
        except Exception as e:  # answered, not raised: rank 0 decides what it means
            return False, f"{type(e).__name__}: {e}"

    def close(self) -> None:
        if self.endpoint is not None:
            self.endpoint.close()


@dataclass
class _Open:
    """One request on every rank (a rank that could not take it counts as failed at once)."""

    results: dict[int, HandoffResult] = field(default_factory=dict)
    silent: bool = False  # the caller already knows it failed: swallow the merged result
    abort_reason: str | None = None  # aborted (a rank failed, or the caller): fails even if every rank landed


class RankHandoffs:
    """Rank 0's side: its own endpoint plus every follower's, as one (engine thread only, except
    `pending_ids`). `side` is "sender" (prefill) or "receiver" (decode)."""

    def __init__(self, engine, transport: str, side: str, name: str, config: TransferConfig):
        self.tp, self.size, self.side = engine.tp, engine.tp.group.size, side
        tensors = CacheTensors.from_named(engine.config.block_size, engine.cache.handoff_tensors(),
                                          shard_name(0, self.size))
        self.local = getattr(make_transport(transport), side)(name, tensors, config)
        self._ask("open", transport, side, name, config)
        self._open: dict[str, _Open] = {}
        self.pending_ids: frozenset[str] = frozenset()  # replaced, never mutated: any thread may read it

    # ---- both sides ----

    def abort(self, request_id: str, reason: str) -> None:
        opened = self._open.get(request_id)
        if opened is not None and opened.abort_reason is None:
            opened.abort_reason = reason
        self.local.abort(request_id, reason)
        self.tp.ask("xfer", "abort", request_id, reason)

    def poll(self) -> list[HandoffResult]:
        """Merged results of the requests every rank has reported. While any is open this asks
        every follower (a round trip on its command socket, each step of the engine loop)."""
        found = [(0, r) for r in self.local.poll()]
        if self._open:
            for rank, (ok, value) in enumerate(self.tp.ask("xfer", "poll"), start=1):
                if not ok:
                    raise RuntimeError(f"tensor-parallel rank {rank}: {value}")
                found += [(rank, r) for r in value]
        for rank, result in found:
            if result.request_id in self._open:
                self._record(result.request_id, rank, result)
        return self._take_finished()

    def close(self) -> None:
        self.local.close()  # the followers' endpoints close when their rank stops

    # ---- receiver (decode) ----

    def accept(self, peer: str) -> RankOffers:
        return RankOffers((self.local.accept(peer), *self._ask("accept", peer)))

    def expect(self, target) -> None:
        """Every rank expects the request, or none does (then this raises)."""
        self.local.expect(target)
        self._start(target.request_id, self.tp.ask("xfer", "expect", target), silent=True)

    def keep_waiting(self, request_id: str) -> bool:
        kept = self.local.keep_waiting(request_id)
        self.tp.ask("xfer", "keep_waiting", request_id)
        return kept

    # ---- sender (prefill) ----

    def connect(self, peer: str, offers: RankOffers) -> None:
        if len(offers.offers) != self.size:
            raise ValueError(f"receiver {peer!r} offers {len(offers.offers)} ranks; this worker has {self.size}")
        self.local.connect(peer, offers.offers[0])
        self._ask("connect", peer, each=list(offers.offers[1:]))

    def disconnect(self, peer: str) -> None:
        self.local.disconnect(peer)
        self._ask("disconnect", peer)

    def connected(self, peer: str) -> bool:
        return self.local.connected(peer) and all(self._ask("connected", peer))

    def send(self, target, num_tokens: int, block_ids: list[int], slot: int | None, first_token: int) -> None:
        """Every rank sends its shard; a rank that cannot start fails the request (the result
        follows once the others have let go)."""
        self.local.send(target, num_tokens, block_ids, slot, first_token)
        self._start(target.request_id, self.tp.ask("xfer", "send", target, num_tokens, block_ids, slot, first_token),
                    silent=False)

    # ---- internals ----

    def _ask(self, op: str, *args, each: list | None = None) -> list:
        answers = self.tp.ask("xfer", op, *args, each=each)
        errors = [f"rank {rank}: {value}" for rank, (ok, value) in enumerate(answers, start=1) if not ok]
        if errors:
            raise RuntimeError(f"hand-off {op} on the tensor-parallel ranks failed: {'; '.join(errors)}")
        return [value for _, value in answers]

    def _start(self, request_id: str, answers: list, silent: bool) -> None:
        """Rank 0 holds the request; `answers` say which followers do too (the others failed)."""
        opened = self._open[request_id] = _Open()
        self.pending_ids = frozenset(self._open)
        errors = {rank: value for rank, (ok, value) in enumerate(answers, start=1) if not ok}
        if not errors:
            return
        opened.silent = silent
        for rank, error in errors.items():
            self._record(request_id, rank, HandoffResult(request_id, False, self.side, error=error))
        if silent:
            raise RuntimeError(f"request {request_id}: the tensor-parallel ranks could not all take it: "
                               + "; ".join(f"rank {rank}: {e}" for rank, e in errors.items()))

    def _record(self, request_id: str, rank: int, result: HandoffResult) -> None:
        opened = self._open[request_id]
        opened.results[rank] = result
        if not result.ok and opened.abort_reason is None:
            self.abort(request_id, f"rank {rank} failed: {result.error}")

    def _take_finished(self) -> list[HandoffResult]:
        out = []
        for request_id, opened in list(self._open.items()):
            if len(opened.results) < self.size:
                continue
            del self._open[request_id]
            if not opened.silent:
                result = merged(request_id, opened.results, self.side)
                if result.ok and opened.abort_reason is not None:
                    result = replace(result, ok=False, error=f"request {request_id}: {opened.abort_reason}")
                out.append(result)
        self.pending_ids = frozenset(self._open)
        return out


def merged(request_id: str, by_rank: dict[int, HandoffResult], side: str) -> HandoffResult:
    """One result for a request every rank reported: ok only if all are."""
    failures = [f"rank {rank}: {r.error}" for rank, r in sorted(by_rank.items()) if not r.ok]
    first = by_rank.get(0)
    return HandoffResult(request_id, not failures, side,
                         first_token=first.first_token if first is not None else None,
                         num_tokens=max(r.num_tokens for r in by_rank.values()),
                         error="; ".join(failures) or None,
                         elapsed_s=max(r.elapsed_s for r in by_rank.values()))
