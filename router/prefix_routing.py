"""Where a prompt's prefix is cached: the router's index, per worker.

Two parts. What the worker reports it holds: its cache events (engine.cache_events), drained
by each stats report, exact as of that report, per tier (pool, host, disk): the key of the
last block of each usable prefix (engine.prefix_cache.block_hashes, the engine's own keys;
a key names the whole prefix before it). And what the router sent the worker since its
previous report, which the worker may not have reported yet: a guess for that gap only,
dropped once a later report has covered it. A wrong guess costs only speed: the engine looks
its cache up again, and outputs never depend on this.
"""

from __future__ import annotations

from collections import OrderedDict


class PrefixIndex:
    def __init__(self, capacity: int):
        """`capacity`: how many sent block keys the guess keeps at most."""
        if capacity <= 0:
            raise ValueError(f"capacity must be > 0, got {capacity}")
        self.capacity = capacity
        self.held: dict[bytes, set[str]] = {}  # usable prefix key -> the tiers holding it
        self._sent: OrderedDict[bytes, int] = OrderedDict()  # key -> the report count when sent
        self._reports = 0

    def __len__(self) -> int:
        return len(self.held) + len(self._sent)

    def add(self, hashes: list[bytes]) -> None:
        """The router sent a prompt of these block keys."""
        for key in hashes:
            self._sent[key] = self._reports
            self._sent.move_to_end(key)
        while len(self._sent) > self.capacity:
            self._sent.popitem(last=False)

    def apply(self, report: dict) -> None:
        """A worker's drained cache events ({"reset", "events"}). Keys sent before the previous
        report are the worker's to report by now: the guess forgets them."""
        if report.get("reset"):
            self.held.clear()
        for op, tier, key, _ in report.get("events", ()):
            if op == "+":
                self.held.setdefault(key, set()).add(tier)
            elif (tiers := self.held.get(key)) is not None:
                tiers.discard(tier)
                if not tiers:
                    del self.held[key]
        self._reports += 1
        while self._sent and next(iter(self._sent.values())) < self._reports - 1:
            self._sent.popitem(last=False)

    def tiers_of(self, key: bytes) -> set[str]:
        return set(self.held.get(key, ()))

    def reported_blocks(self, hashes: list[bytes]) -> int:
        """Leading blocks of `hashes` through the longest usable prefix the worker reported."""
        return next((i + 1 for i in range(len(hashes) - 1, -1, -1) if hashes[i] in self.held), 0)

    def matched_blocks(self, hashes: list[bytes]) -> int:
        """Leading blocks of `hashes` cached there: through the longest usable prefix the
        worker reported, or the longest run of blocks sent to it since."""
        reported = self.reported_blocks(hashes)
        sent = 0
        for key in hashes:
            if key not in self._sent:
                break
            sent += 1
        return max(reported, sent)

    def clear(self) -> None:
        self.held.clear()
        self._sent.clear()
