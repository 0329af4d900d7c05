"""Tiers below the prefix cache's pool (engine.prefix_cache): host memory (engine.host_tier),
then a directory (engine.disk_tier).

An entry (engine.host_tier.Entry: a usable prefix's KV and checkpoint) moves whole: spilled from
the pool when the pool evicts it under pressure, pushed from host memory to disk when host
memory is full, dropped from disk when the disk budget is. A request about to be admitted whose
longest tier entry goes past its pool hit gets that entry loaded back into the pool (its blocks
indexed, its checkpoint in a checkpoint row), where the scheduler then finds it as any pool hit.
A request that waits longer (behind the ones the free slots admit) has its disk entry read on
the disk tier's reader thread meanwhile, so its load at admission copies from memory.
"""

from __future__ import annotations

import contextlib
import itertools
import time

import torch

from engine.disk_tier import DiskTier, cache_fingerprint
from engine.entry_rows import CacheRows
from engine.host_tier import Entry, HostTier, TierConfig, entry_specs
from engine.prefix_cache import PrefixCache, block_hashes

LOAD_OWNER = "#tier-load"  # holds an entry's blocks while they are filled
__all__ = ["TierConfig", "TieredCache", "cache_fingerprint"]


class TieredCache:
    """The engine's tiers: spill from the pool, promote back into it."""

    def __init__(self, config: TierConfig, rows: CacheRows, blocks, prefix_cache: PrefixCache, fingerprint: str):
        self.config = config
        self.rows, self.blocks, self.prefix_cache = rows, blocks, prefix_cache
        self.host = HostTier(config.host_bytes, rows.cache.device, below=config.disk_dir is not None) \
            if config.host_bytes else None
        self.disk = DiskTier(config.disk_dir, config.disk_bytes, fingerprint) if config.disk_dir else None
        self.block_size = blocks.block_size
        self.row_shapes = rows.row_shapes
        self.spills = self.host_hits = self.disk_hits = self.loaded_tokens = 0
        prefix_cache.on_evict = self.spill

    def attach_events(self, events) -> None:
        for tier in (self.host, self.disk):
            if tier is not None:
                tier.events = events

    def held(self) -> list[tuple[str, bytes, int]]:
        """(tier, key, tokens) of every entry the tiers hold."""
        host = [("host", key, e.end) for key, e in list(self.host.entries.items())] if self.host is not None else []
        return host + ([("disk", key, end) for key, end in self.disk.held()] if self.disk is not None else [])

    # ------------------------------------------------------------------ down

    @torch.inference_mode()
    def spill(self, keys: list[bytes], blocks: list[int], checkpoint: int | None, end: int) -> None:
        """A prefix the pool evicts: copied out whole, into the highest tier with room."""
        if self.host is not None and keys[-1] in self.host.entries:
            self.host.entries[keys[-1]].last_used = time.monotonic()
            return
        self.spills += 1
        views, below = None, []
        if self.host is not None:
            specs = entry_specs(self.row_shapes, len(blocks), checkpoint is not None)
            views, below = self.host.reserve(keys, end, specs, time.monotonic())
        if views is None:  # no host tier, or the least useful of all: straight down
            below.append(self.rows.copy_out(keys, blocks, checkpoint, end))
        else:
            self.rows.gather_into(views, blocks, checkpoint)
            self.host.fence()
        self.keep_below(below)

    def keep(self, entry: Entry) -> None:
        """`entry` into the highest tier with room (what host memory pushes out goes to disk)."""
        self.keep_below(self.host.put(entry) if self.host is not None else [entry])

    def keep_below(self, entries: list[Entry]) -> None:
        """What goes below host memory: to disk, where there is one."""
        if self.disk is not None:
            for entry in entries:
                self.disk.put(entry)

    # ------------------------------------------------------------------ up

    def promote(self, request) -> int:
        """Before `request` is admitted: load its longest tier entry that goes past its pool hit
        into the pool. Tokens loaded (0: none)."""
        if request.tier_checked:
            return 0
        missing = None  # missing[i]: blocks of the first i + 1 the pool lacks (the longest prefix comes first)
        for i, end in self._past_the_pool(request):
            hashes = request.block_hashes
            if not self._may_hold(hashes[i], end):
                continue  # looked up by the last key before anything is built or read
            if missing is None:
                missing = list(itertools.accumulate(key not in self.prefix_cache.nodes for key in hashes))
            if missing[i] > self.blocks.num_available_blocks:
                return 0  # no room in the pool now (nothing read): looked up again in a later step
            entry = self.find(hashes[: i + 1], end)
            if entry is None:
                continue
            in_host = self.host is not None and entry.keys[-1] in self.host.entries
            with self.host.loading(entry.keys[-1]) if in_host else contextlib.nullcontext():
                if not self._load(entry):
                    return 0  # no room in the pool now: looked up again in a later step
            if in_host:
                self.host.take(entry.keys[-1])  # in the pool now; evicted again, it is spilled again
                self.host_hits += 1
            else:
                self.disk_hits += 1
            self.loaded_tokens += end
            request.tier_checked = True
            return end
        request.tier_checked = True
        return 0

    def prefetch(self, request) -> None:
        """While `request` queues: start reading its longest entry past its pool hit from disk
        (engine.disk_tier.DiskTier.prefetch), unless host memory holds a longer one."""
        if self.disk is None or request.tier_checked or request.tier_prefetched:
            return
        request.tier_prefetched = True
        for i, end in self._past_the_pool(request):
            key = request.block_hashes[i]
            if self.host is not None and key in self.host.entries:
                return
            if self.disk.may_hold(key, end) and \
                    self.disk.prefetch(key, end, request.block_hashes[: i + 1], self.row_shapes):
                return

    def _past_the_pool(self, request):
        """(i, tokens) of each block-aligned prefix of `request` (its first i + 1 blocks of
        `request.block_hashes`) longer than its pool hit, longest first, leaving at least one
        token to compute."""
        size = self.block_size
        request.block_hashes = block_hashes(request.all_token_ids, size, request.block_hashes)
        hit = self.prefix_cache.lookup(request.block_hashes, request.num_tokens).num_tokens
        for i in range(len(request.block_hashes) - 1, -1, -1):
            end = (i + 1) * size
            if end >= request.num_tokens:
                continue  # one token is always computed
            if end <= hit:
                return
            yield i, end

    def _may_hold(self, key: bytes, end: int) -> bool:
        return (self.host is not None and key in self.host.entries) or \
            (self.disk is not None and self.disk.may_hold(key, end))

    def find(self, keys: list[bytes], end: int) -> Entry | None:
        """The entry for the prefix `keys` (of `end` tokens) in host memory or on disk; None."""
        if self.host is not None and (entry := self.host.entries.get(keys[-1])) is not None:
            return entry
        if self.disk is not None:
            return self.disk.get(keys[-1], end, keys, self.row_shapes)
        return None

    @torch.inference_mode()
    def _load(self, entry: Entry) -> bool:
        """The entry's missing blocks filled and indexed, its checkpoint in a row; False (and
        nothing taken) where the pool has no room for it now."""
        nodes, size = self.prefix_cache.nodes, self.block_size
        present = [nodes[key].block for key in entry.keys if key in nodes]
        if present:
            self.blocks.share(LOAD_OWNER, present)  # kept while the rest is allocated
        try:
            if not self.blocks.can_allocate(LOAD_OWNER, len(entry.keys) * size):
                return False
            new = iter(self.blocks.allocate(LOAD_OWNER, len(entry.keys) * size)[len(present):])
            missing = [i for i, key in enumerate(entry.keys) if key not in nodes]
            table = [nodes[key].block if key in nodes else next(new) for key in entry.keys]
            self.prefix_cache.insert(entry.keys, table)
            checkpoint = self.prefix_cache.take_checkpoint_row(entry.keys[-1]) if self.rows.state_tensors else None
            rows = torch.tensor(missing) if len(missing) < len(entry.keys) else slice(None)
            # The blocks are filled even where no checkpoint row is free: the index holds them now.
            self.rows.fill(entry, rows, [table[i] for i in missing], checkpoint)
            if self.host is not None:
                self.host.fence()  # the entry's range may be given back next: later writes wait for these reads
            return checkpoint is not None or not self.rows.state_tensors
        finally:
            self.blocks.free(LOAD_OWNER)

    def flush(self) -> None:
        """Wait for the disk tier's queued writes."""
        if self.disk is not None:
            self.disk.flush()

    def stats(self) -> dict:
        out = {"tier_spills": self.spills, "tier_host_hits": self.host_hits, "tier_disk_hits": self.disk_hits,
               "tier_loaded_tokens": self.loaded_tokens}
        if self.host is not None:
            out.update(tier_host_bytes=self.host.nbytes, tier_host_entries=len(self.host.entries))
        if self.disk is not None:
            disk_bytes, disk_entries = self.disk.usage()
            out.update(tier_disk_bytes=disk_bytes, tier_disk_entries=disk_entries,
                       tier_disk_write_errors=self.disk.write_errors, tier_disk_removed_bad=self.disk.removed_bad,
                       tier_disk_read_ahead=self.disk.prefetch_hits)
        return out
