"""Where a prompt's prefix is likely cached: the router's view, per worker.

The router does not ask workers what they hold; it remembers the block hashes
(engine.prefix_cache.block_hashes, the engine's own keys) of what it sent each worker, in a
bounded LRU about the size of the worker's cache (SGLang's cache-aware router keeps such an
approximate tree per worker). A wrong guess costs only speed: the engine looks its cache up
again, and outputs never depend on this.
"""

from __future__ import annotations

from collections import OrderedDict


class PrefixIndex:
    def __init__(self, capacity: int):
        if capacity <= 0:
            raise ValueError(f"capacity must be > 0, got {capacity}")
        self.capacity = capacity
        self._keys: OrderedDict[bytes, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._keys)

    def add(self, hashes: list[bytes]) -> None:
        for key in hashes:
            self._keys[key] = None
            self._keys.move_to_end(key)
        while len(self._keys) > self.capacity:
            self._keys.popitem(last=False)

    def matched_blocks(self, hashes: list[bytes]) -> int:
        """Leading blocks of `hashes` this worker was sent (a chain: the first miss ends it)."""
        count = 0
        for key in hashes:
            if key not in self._keys:
                break
            count += 1
        return count

    def clear(self) -> None:
        self._keys.clear()
