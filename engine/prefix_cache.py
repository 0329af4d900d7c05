"""Prefix caching for hybrid models. No torch: the engine copies the state rows it names.

KV blocks are found again by a hash chain over full blocks (a block's key covers every token
before it). A recurrent layer has no per-token cache, so a hit also needs the state at the end
of the prefix, and that exists only where it was saved: checkpoints, one state-slot's worth of
rows each, in a bounded pool of their own beside the request slots (engine.cache).

Where checkpoints are saved (each at a block boundary, so the KV of the same prefix is whole;
a prefill chunk runs in passes that end at each point; the engine copies the state after it):
- the last boundary of every prompt short of its end (an identical prompt hits it);
- where a prompt leaves a cached chain that has no checkpoint there (Marconi's speculative
  insertion): a branch point, such as the end of a shared system prompt, is likely to be hit
  again;
- the latest boundary a decode crosses, replacing the request's previous one, so a finished
  answer leaves one checkpoint where the next chat turn's prompt goes past it.
A hit is the longest cached chain that ends in a checkpoint (any block boundary, for models
without recurrent layers), short of the whole sequence: one token is always computed.

Eviction: KV blocks only the cache holds are taken back leaf first, least recently used first,
and for hybrids blocks past the last checkpoint of their chain (useless for a hit) before any
other. Checkpoints are evicted by Marconi's (MLSys'25) utility: recency plus the compute a hit
saves per byte; every checkpoint costs the same bytes, so that is its prefix length.
"""

from __future__ import annotations

import hashlib
import heapq
from array import array
from dataclasses import dataclass, field
from collections.abc import Callable, Sequence

from engine.block_manager import BlockManager

# Marconi's alpha: how much the compute a checkpoint saves counts against its recency. Above 1,
# a long prefix outlives a short one used more recently (recomputing it costs more).
CHECKPOINT_COMPUTE_WEIGHT = 2.0
EVICT_AHEAD = 64  # blocks an eviction frees at least, pools of 4096 blocks and more (evict_blocks)


def block_hashes(token_ids: Sequence[int], block_size: int, known: list[bytes]) -> list[bytes]:
    """Extend `known` (the hashes of the first len(known) full blocks) to every full block."""
    hashes = list(known)
    for begin in range(len(hashes) * block_size, len(token_ids) - block_size + 1, block_size):
        digest = hashlib.blake2b(hashes[-1] if hashes else b"", digest_size=16)
        digest.update(array("q", token_ids[begin:begin + block_size]).tobytes())
        hashes.append(digest.digest())
    return hashes


@dataclass
class CachedBlock:
    key: bytes
    block: int
    parent: bytes | None
    end: int  # tokens up to the end of this block
    last_used: int
    children: set[bytes] = field(default_factory=set)
    checkpoint: int | None = None  # checkpoint row holding the state after `end` tokens


@dataclass
class PrefixHit:
    num_tokens: int
    blocks: list[int]
    checkpoint: int | None  # row to copy into the request's slot (None: no recurrent layers)
    num_matched_tokens: int = 0  # how far the cached KV chain goes, checkpoint or not


class PrefixCache:
    def __init__(self, blocks: BlockManager, num_checkpoints: int, needs_state: bool):
        if num_checkpoints < 0 or (needs_state and num_checkpoints == 0):
            raise ValueError(f"prefix caching a model with recurrent layers needs checkpoint rows, "
                             f"got {num_checkpoints}")
        self.blocks = blocks
        self.block_size = blocks.block_size
        self.needs_state = needs_state
        self.num_checkpoints = num_checkpoints
        self.nodes: dict[bytes, CachedBlock] = {}
        self._free_rows = list(range(num_checkpoints - 1, -1, -1))
        self._row_owner: dict[int, bytes] = {}  # checkpoint row -> node key
        self._clock = 0
        self.queried_tokens = 0
        self.hit_tokens = 0
        # Called with (chain keys root first, their blocks, checkpoint row or None, tokens) for
        # each usable prefix about to leave the pool under pressure, while its blocks and row
        # still hold it: a lower tier keeps it (engine.tiered_cache). None: it is dropped.
        self.on_evict: Callable[[list[bytes], list[int], int | None, int], None] | None = None
        self.events = None  # engine.cache_events.CacheEvents: usable prefixes stored and dropped
        blocks.evictor = self.evict_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self.nodes)

    @property
    def num_checkpoints_used(self) -> int:
        return len(self._row_owner)

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    # ------------------------------------------------------------------ lookups

    def lookup(self, hashes: list[bytes], num_tokens: int) -> PrefixHit:
        """Longest usable prefix of a sequence of `num_tokens` tokens whose full blocks hash to
        `hashes`; nothing is taken yet (the scheduler shares the blocks when it admits)."""
        best = PrefixHit(0, [], None)
        chain: list[int] = []
        now = self._tick()
        for key in hashes:
            node = self.nodes.get(key)
            if node is None or node.end >= num_tokens:
                break
            chain.append(node.block)
            node.last_used = now
            if not self.needs_state or node.checkpoint is not None:
                best = PrefixHit(node.end, list(chain), node.checkpoint)
            best.num_matched_tokens = node.end
        return best

    def record(self, num_tokens: int, num_hit_tokens: int) -> None:
        """An admitted request looked up `num_tokens` tokens and found `num_hit_tokens`."""
        self.queried_tokens += num_tokens
        self.hit_tokens += num_hit_tokens

    def has_checkpoint(self, key: bytes) -> bool:
        node = self.nodes.get(key)
        return node is not None and node.checkpoint is not None

    # ------------------------------------------------------------------ filling

    def insert(self, hashes: list[bytes], table: list[int], start: int = 0) -> None:
        """Index a request's full blocks (`table[i]` holds the tokens hashed by `hashes[i]`),
        from `start` when the blocks before it are indexed already. A block whose key is
        indexed under another block stays the request's own."""
        now = self._tick()
        if start > 0 and hashes[start - 1] not in self.nodes:
            start = 0  # evicted since: index the request's own copies again
        parent = hashes[start - 1] if start > 0 else None
        for i in range(start, len(hashes)):
            key = hashes[i]
            node = self.nodes.get(key)
            if node is None:
                self.blocks.hold(table[i])
                node = self.nodes[key] = CachedBlock(key, table[i], parent, (i + 1) * self.block_size, now)
                if parent is not None:
                    self.nodes[parent].children.add(key)
                if self.events is not None and self._usable(node):
                    self.events.stored("pool", key, node.end)
            node.last_used = now
            parent = key

    def take_checkpoint_row(self, key: bytes) -> int | None:
        """A row to save the state after the block `key` into, attached to that block; None when
        the block is not indexed, or every row is in use and none can be evicted."""
        node = self.nodes.get(key)
        if node is None:
            return None
        if node.checkpoint is not None:
            return node.checkpoint
        row = self.reserve_checkpoint_row()
        if row is not None:
            self.attach_checkpoint(key, row)
        return row

    def reserve_checkpoint_row(self) -> int | None:
        """A row no block owns yet (a checkpoint evicted where none is free), for a pass to
        write a state into before that state's block is indexed; the caller attaches it
        (attach_checkpoint) or gives it back (release_checkpoint_row). None: no row."""
        if not self._free_rows and not self._evict_checkpoint():
            return None
        return self._free_rows.pop()

    def attach_checkpoint(self, key: bytes, row: int) -> bool:
        """Reserved `row` becomes the checkpoint of block `key`; False, and the row given back,
        where that block is not indexed or already has one."""
        node = self.nodes.get(key)
        if node is None or node.checkpoint is not None:
            self.release_checkpoint_row(row)
            return False
        node.checkpoint, self._row_owner[row] = row, key
        node.last_used = self._tick()
        if self.events is not None:
            self.events.stored("pool", key, node.end)
        return True

    def release_checkpoint_row(self, row: int) -> None:
        self._free_rows.append(row)

    def drop_checkpoint(self, key: bytes) -> None:
        node = self.nodes.get(key)
        if node is not None and node.checkpoint is not None:
            del self._row_owner[node.checkpoint]
            self._free_rows.append(node.checkpoint)
            node.checkpoint = None
            if self.events is not None:
                self.events.dropped("pool", key, node.end)

    # ------------------------------------------------------------------ eviction

    def _evict_checkpoint(self) -> bool:
        if not self._row_owner:
            return False
        nodes = [self.nodes[key] for key in self._row_owner.values()]
        oldest, newest = min(n.last_used for n in nodes), max(n.last_used for n in nodes)
        shortest, longest = min(n.end for n in nodes), max(n.end for n in nodes)

        def utility(node: CachedBlock) -> float:  # both terms scaled to [0, 1] over the candidates
            recency = (node.last_used - oldest) / max(1, newest - oldest)
            saved = (node.end - shortest) / max(1, longest - shortest)
            return recency + CHECKPOINT_COMPUTE_WEIGHT * saved

        victim = min(nodes, key=utility)
        self._spill(victim)
        self.drop_checkpoint(victim.key)
        return True

    def _spill(self, node: CachedBlock) -> None:
        """Hand the prefix ending at `node` to on_evict, where it is usable for a hit (it has a
        checkpoint, or the model has no state)."""
        if self.on_evict is None or not self._usable(node):
            return
        keys, blocks, at = [], [], node
        while at is not None:
            keys.append(at.key)
            blocks.append(at.block)
            at = self.nodes.get(at.parent) if at.parent is not None else None
        self.on_evict(keys[::-1], blocks[::-1], node.checkpoint, node.end)

    def evict_blocks(self, count: int) -> None:
        """Free at least `count` blocks the cache alone holds (fewer if there are not as many),
        and up to EVICT_AHEAD (a 64th of a small pool) when fewer are asked for: each call scans
        the index, and a decode step's one-block allocations would otherwise pay that each."""
        count = max(count, min(EVICT_AHEAD, self.blocks.num_blocks // 64))
        def entry(node: CachedBlock):
            return (bool(node.children), node.checkpoint is not None, node.last_used, -node.end, node.key)

        evictable = self.blocks.evictable
        # Leaves go first (the entry's order), and a parent is queued as its last child goes,
        # so the heap starts with the evictable leaves alone; the nodes that still have
        # children join only if the leaves do not free enough.
        heap = [entry(node) for node in self.nodes.values() if not node.children and node.block in evictable]
        heapq.heapify(heap)
        freed, inner_queued = 0, False
        while freed < count and (heap or not inner_queued):
            if not heap:
                heap = [entry(node) for node in self.nodes.values() if node.children and node.block in evictable]
                heapq.heapify(heap)
                inner_queued = True
                continue
            item = heapq.heappop(heap)
            node = self.nodes.get(item[-1])
            if node is None or node.block not in self.blocks.evictable:
                continue
            if entry(node) != item:  # changed since it was queued (e.g. lost its last child)
                heapq.heappush(heap, entry(node))
                continue
            parent = self.nodes.get(node.parent) if node.parent is not None else None
            freed += self._remove(node.key)
            if parent is not None and not parent.children and parent.block in self.blocks.evictable:
                heapq.heappush(heap, entry(parent))

    def _remove(self, key: bytes, spill: bool = True) -> int:
        """Drop `key` and everything chained after it from the index (their usable prefixes
        spilled first, unless told not to); blocks freed."""
        if spill and self.on_evict is not None:
            stack = [key]
            while stack:
                node = self.nodes[stack.pop()]
                stack.extend(node.children)
                if node.checkpoint is not None or not node.children:  # each usable prefix once
                    self._spill(node)
        freed, stack = 0, [key]
        node = self.nodes[key]
        if node.parent is not None and node.parent in self.nodes:
            self.nodes[node.parent].children.discard(key)
        while stack:
            node = self.nodes.pop(stack.pop())
            stack.extend(node.children)
            if self.events is not None and self._usable(node):
                self.events.dropped("pool", node.key, node.end)
            if node.checkpoint is not None:
                del self._row_owner[node.checkpoint]
                self._free_rows.append(node.checkpoint)
            freed += node.block in self.blocks.evictable
            self.blocks.unhold(node.block)
        return freed

    def clear(self) -> None:
        for key in [k for k, n in self.nodes.items() if n.parent is None]:
            self._remove(key, spill=False)

    def _usable(self, node: CachedBlock) -> bool:
        """Whether a hit can start after `node`: it has a checkpoint, or the model has no state."""
        return node.checkpoint is not None or not self.needs_state

    def usable(self) -> list[tuple[bytes, int]]:
        """(key, tokens) of every prefix a hit can start from now."""
        for _ in range(8):  # another thread (a stats report) may read while the engine's inserts
            try:
                return [(key, node.end) for key, node in list(self.nodes.items()) if self._usable(node)]
            except RuntimeError:
                continue
        return []

    def check_integrity(self) -> None:
        held = {node.block for node in self.nodes.values()}
        if held != self.blocks.held:
            raise AssertionError("the prefix index and the block manager disagree on held blocks")
        rows = {node.checkpoint: key for key, node in self.nodes.items() if node.checkpoint is not None}
        if rows != self._row_owner or set(rows) & set(self._free_rows) \
                or len(rows) + len(self._free_rows) != self.num_checkpoints:
            raise AssertionError("checkpoint rows are neither free nor owned by one cached block")
        for key, node in self.nodes.items():
            if node.parent is not None and key not in self.nodes[node.parent].children:
                raise AssertionError(f"cached block {node.block} is not among its parent's children")

    def stats(self) -> dict:
        return {"prefix_cache_blocks": self.num_cached_blocks,
                "prefix_cache_checkpoints_used": self.num_checkpoints_used,
                "prefix_cache_checkpoints_total": self.num_checkpoints,
                "prefix_cache_queried_tokens": self.queried_tokens,
                "prefix_cache_hit_tokens": self.hit_tokens}
