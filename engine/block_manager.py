"""Paged KV block allocator. Pure bookkeeping: no torch here, the tensors live in engine.cache.

Invariants (checked by `check_integrity`):
- a block is either on the free list (ref count 0) or referenced by >= 1 holder;
- the free list holds no duplicates.
- a block's ref count equals the number of block tables that hold it, plus one while the
  prefix cache holds it (`hold`); a block only the cache holds is "evictable": the
  `evictor` (engine.prefix_cache) gives such blocks back when the free list runs short.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable


class OutOfBlocks(RuntimeError):
    pass


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be > 0, got {num_blocks}")
        if block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._ref_counts = [0] * num_blocks
        self.block_tables: dict[str, list[int]] = {}
        self.held: set[int] = set()  # blocks the prefix cache holds a reference to
        self.evictable: set[int] = set()  # held blocks no table holds
        self.evictor: Callable[[int], None] | None = None  # frees >= n evictable blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def extra_blocks_needed(self, request_id: str, num_tokens: int) -> int:
        """Blocks to add so that `request_id` can hold `num_tokens` tokens in total."""
        have = len(self.block_tables.get(request_id, ()))
        return max(0, self.blocks_needed(num_tokens) - have)

    @property
    def num_available_blocks(self) -> int:
        """Free blocks plus the cached ones nothing but the cache holds."""
        return len(self._free) + len(self.evictable)

    def can_allocate(self, request_id: str, num_tokens: int) -> bool:
        return self.extra_blocks_needed(request_id, num_tokens) <= self.num_available_blocks

    def allocate(self, request_id: str, num_tokens: int) -> list[int]:
        """Grow `request_id`'s table to hold `num_tokens` tokens; returns the whole table."""
        extra = self.extra_blocks_needed(request_id, num_tokens)
        if extra > len(self._free) and self.evictor is not None and self.evictable:
            self.evictor(extra - len(self._free))
        if extra > len(self._free):
            raise OutOfBlocks(
                f"request {request_id!r} needs {extra} more KV blocks, {len(self._free)} free"
            )
        table = self.block_tables.setdefault(request_id, [])
        for _ in range(extra):
            block = self._free.popleft()
            self._ref_counts[block] = 1
            table.append(block)
        return table

    def hold(self, block: int) -> None:
        """The prefix cache keeps `block` (which a table holds now) after its tables let go."""
        if block in self.held or self._ref_counts[block] <= 0:
            raise ValueError(f"block {block} cannot be held: ref count {self._ref_counts[block]}, "
                             f"held {block in self.held}")
        self.held.add(block)
        self._ref_counts[block] += 1

    def unhold(self, block: int) -> None:
        """The prefix cache lets go of `block`; it is free once no table holds it either."""
        self.held.remove(block)
        self.evictable.discard(block)
        self._unref(block)

    def share(self, request_id: str, blocks: list[int]) -> None:
        """Start `request_id`'s table with blocks another table already holds (prefix sharing)."""
        if request_id in self.block_tables:
            raise ValueError(f"request {request_id!r} already has a block table")
        for block in blocks:
            if self._ref_counts[block] <= 0:
                raise ValueError(f"block {block} is free and cannot be shared")
        for block in blocks:
            self._ref_counts[block] += 1
            self.evictable.discard(block)
        self.block_tables[request_id] = list(blocks)

    def free(self, request_id: str) -> int:
        """Release `request_id`'s blocks; unknown ids are a no-op so aborts can call it freely."""
        table = self.block_tables.pop(request_id, None)
        if table is None:
            return 0
        # In table order: a later request gets these back as ascending runs, which a hand-off
        # copies (or sends) as one piece per run instead of one per block.
        return sum(self._unref(block) for block in table)

    def _unref(self, block: int) -> bool:
        self._ref_counts[block] -= 1
        if self._ref_counts[block] == 0:
            self._free.append(block)
            return True
        if self._ref_counts[block] == 1 and block in self.held:
            self.evictable.add(block)
        return False

    def table(self, request_id: str) -> list[int]:
        return self.block_tables[request_id]

    def check_integrity(self) -> None:
        free = set(self._free)
        if len(free) != len(self._free):
            raise AssertionError("free list holds duplicate blocks")
        expected = [0] * self.num_blocks
        for request_id, table in self.block_tables.items():
            for block in table:
                if not 0 <= block < self.num_blocks:
                    raise AssertionError(f"request {request_id!r} holds invalid block {block}")
                expected[block] += 1
        for block in self.held:
            expected[block] += 1
        if self.evictable != {b for b in self.held if expected[b] == 1}:
            raise AssertionError("evictable set differs from the held blocks no table holds")
        for block, count in enumerate(expected):
            if count != self._ref_counts[block]:
                raise AssertionError(
                    f"block {block}: ref count {self._ref_counts[block]}, held {count} times"
                )
            if (count == 0) != (block in free):
                raise AssertionError(f"block {block}: ref count {count} but free={block in free}")
