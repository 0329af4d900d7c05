"""What a worker's prefix cache stores and drops, as events for the router's index. No torch.

An event is (op, tier, key, tokens): op "+" stored or "-" dropped; tier "pool", "host" or
"disk"; key the hash-chain key of the last block of a usable prefix (engine.prefix_cache:
a key names the whole prefix up to it); tokens its length. Usable means a hit can start
there: for a model with recurrent layers, a key with a checkpoint; otherwise any indexed
block.

Events wait here until the worker's next stats report drains them, so a busy worker sends
them batched, at the router's pace. The buffer is bounded: past `limit` events it drops them
all and the next drain is a reset with a snapshot of everything held (`snapshot()`), which
is what the router needs anyway to be exact again. Appends come from the engine's thread and
the disk tier's writer, drains from the worker's: one lock.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

Event = tuple[str, str, bytes, int]


class CacheEvents:
    def __init__(self, snapshot: Callable[[], list[Event]], limit: int = 16384):
        """`snapshot()`: a "+" event for every usable prefix held now, in every tier."""
        self.snapshot = snapshot
        self.limit = limit
        self._events: list[Event] = []
        self._reset = True  # the first report is a snapshot: whatever a disk tier held at start
        self._lock = threading.Lock()

    def stored(self, tier: str, key: bytes, tokens: int) -> None:
        self._add(("+", tier, key, tokens))

    def dropped(self, tier: str, key: bytes, tokens: int) -> None:
        self._add(("-", tier, key, tokens))

    def _add(self, event: Event) -> None:
        with self._lock:
            if self._reset:
                return  # the snapshot will say it
            if len(self._events) >= self.limit:
                self._events.clear()
                self._reset = True
                return
            self._events.append(event)

    def drain(self) -> dict:
        """{"reset": whether the index must start over, "events": [...]}, since the last drain."""
        with self._lock:
            if self._reset:
                self._reset = False
                self._events.clear()
                return {"reset": True, "events": self.snapshot()}
            events, self._events = self._events, []
            return {"reset": False, "events": events}
