"""Hand-offs between caches whose block sizes differ.

A block tensor is [num_blocks, block_size, ...]: one block row holds block_size tokens,
contiguous. Between a side with blocks of P tokens and one with blocks of D tokens, both
view their block tensors in rows of g = gcd(P, D) tokens (a reshape: no copy), and the wire
carries ceil(num_tokens / g) such rows in order. Token t lands in the receiver's block
t // D at offset t % D whatever P is, so re-blocking costs nothing beyond shorter runs of
consecutive rows. With equal sizes g is the block size and every row is a block, as before.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from math import gcd

import numpy as np

from kvtransfer.layout import BLOCK, CacheLayout


@dataclass(frozen=True)
class Grid:
    """The rows one channel moves block tensors in; `mine` and `peer` are the two block sizes."""

    mine: int
    peer: int

    def __post_init__(self) -> None:
        if self.mine < 1 or self.peer < 1:
            raise ValueError(f"block sizes must be >= 1, got {self.mine} and {self.peer}")

    @classmethod
    def between(cls, mine: CacheLayout, peer: CacheLayout) -> Grid:
        return cls(mine.block_size, peer.block_size)

    @property
    def row_tokens(self) -> int:
        return gcd(self.mine, self.peer)

    def wire_layout(self, layout: CacheLayout) -> CacheLayout:
        """`layout` as the wire sees it: block rows of row_tokens tokens. Identical on both sides."""
        g = self.row_tokens
        specs = tuple(replace(s, row_shape=(g, *s.row_shape[1:])) if s.role == BLOCK else s for s in layout.specs)
        return CacheLayout(g, specs, layout.shard, layout.speculative)

    def wire_rows(self, layout: CacheLayout, num_tokens: int) -> int:
        """Block rows on the wire for a prompt of num_tokens (0 for a cache without blocks)."""
        return -(-num_tokens // self.row_tokens) if layout.has_blocks else 0

    def my_rows(self, block_ids: list[int], num_tokens: int) -> list[int]:
        return _sub_rows(block_ids, self.mine // self.row_tokens, -(-num_tokens // self.row_tokens))

    def peer_rows(self, block_ids: list[int], num_tokens: int) -> list[int]:
        return _sub_rows(block_ids, self.peer // self.row_tokens, -(-num_tokens // self.row_tokens))

    def peer_blocks_for(self, layout: CacheLayout, num_tokens: int) -> int:
        """How many of the peer's blocks a prompt of num_tokens fills."""
        return -(-num_tokens // self.peer) if layout.has_blocks else 0

    def split(self, rows, block_size: int, role: str):
        """A [blocks, row_bytes] byte matrix (numpy or torch) of a cache with `block_size`-token
        blocks, as [blocks * k, row_bytes / k] rows of row_tokens tokens (a view)."""
        k = block_size // self.row_tokens
        if role != BLOCK or k == 1:
            return rows
        return rows.reshape(rows.shape[0] * k, rows.shape[1] // k)

    def split_all(self, rows: dict, layout: CacheLayout) -> dict:
        """split() for every tensor of `layout` (either side's) from {name: byte matrix}."""
        return {s.name: self.split(rows[s.name], layout.block_size, s.role) for s in layout.specs}


def _sub_rows(block_ids: list[int], per_block: int, count: int) -> list[int]:
    """The first `count` rows of `block_ids` in order, each block split into `per_block` rows."""
    if per_block == 1:
        return list(block_ids[:count])
    ids = np.asarray(block_ids[: -(-count // per_block)], dtype=np.int64)
    return (ids[:, None] * per_block + np.arange(per_block)).reshape(-1)[:count].tolist()
