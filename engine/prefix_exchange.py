"""Prefix-cache entries moved between workers.

A worker exports the longest usable prefix of a prompt it holds, from its pool or a tier, as a
tier entry (engine.host_tier.Entry: every block's KV and the checkpoint that makes it usable,
whole). Another imports it into its host tier, where the request's admission finds it as it
finds any tier entry (engine.tiered_cache), and computes only what lies past it. The router
decides who fetches from whom (router.prefix_fetch); the entry travels in Ray's object store,
from the source's node to the importer's.

An importer takes only what a cache like its own exported: the same fingerprint
(engine.disk_tier.cache_fingerprint: the model's files, dtype, block size, every cache tensor's
name, kind and per-token shape), each tensor's rows shaped and typed as its own, and a chain
as long as the tokens it claims. Anything else is refused, and the request recomputes.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from engine.host_tier import Entry, unfit_tensors

log = logging.getLogger(__name__)


@dataclass
class ExportedPrefix:
    fingerprint: str  # the exporting cache's (engine.disk_tier.cache_fingerprint)
    entry: Entry
    tier: str  # where the exporter held it: "pool", "host" or "disk"


class PrefixExchange:
    """An engine's side of the exchange; runs on the engine's thread (between steps)."""

    def __init__(self, engine):
        self.engine = engine
        self.prefix_cache, self.rows = engine.prefix_cache, engine.entry_rows
        self.block_size = engine.config.block_size
        self.row_shapes = self.rows.row_shapes
        self.exported = self.imported = self.imported_tokens = self.refused = 0

    @property
    def fingerprint(self) -> str:
        return self.engine.cache_fingerprint

    @torch.inference_mode()
    def export(self, hashes: list[bytes]) -> ExportedPrefix | None:
        """The longest usable prefix of the block chain `hashes` held here (pool or tiers),
        copied out; None where none is."""
        hit = self.prefix_cache.lookup(hashes, (len(hashes) + 1) * self.block_size)
        tiers = self.engine.tiers
        for i in range(len(hashes) - 1, -1, -1):
            end = (i + 1) * self.block_size
            if end <= hit.num_tokens:
                break
            entry = tiers.find(hashes[: i + 1], end) if tiers is not None else None
            if entry is not None:
                tier = "host" if tiers.host is not None and hashes[i] in tiers.host.entries else "disk"
                if tier == "host":  # its tensors are views of the tier's arena, which Ray would ship whole
                    entry = tiers.host.copy(entry)
                self.exported += 1
                return ExportedPrefix(self.fingerprint, entry, tier)
        if not hit.num_tokens:
            return None
        keys = hashes[: hit.num_tokens // self.block_size]
        entry = self.rows.copy_out(keys, hit.blocks, hit.checkpoint, hit.num_tokens)
        self.exported += 1
        return ExportedPrefix(self.fingerprint, entry, "pool")

    def accept(self, exported: ExportedPrefix) -> int:
        """`exported` into the host tier; the tokens it covers, or 0 where it is refused (logged)
        or held here already."""
        entry = exported.entry
        why = self._unfit(exported)
        if why is not None:
            self.refused += 1
            log.warning("prefix of %d tokens from another worker refused: %s", entry.end, why)
            return 0
        tiers = self.engine.tiers
        held = self.prefix_cache.lookup(entry.keys, entry.end + 1).num_tokens >= entry.end
        if held or entry.keys[-1] in tiers.host.entries:
            return 0
        # a new Entry: its recency is this process's clock, not the exporter's
        tiers.keep(Entry(list(entry.keys), entry.end, entry.tensors))
        self.imported += 1
        self.imported_tokens += entry.end
        return entry.end

    def _unfit(self, exported: ExportedPrefix) -> str | None:
        tiers, entry = self.engine.tiers, exported.entry
        if tiers is None or tiers.host is None:
            return "this worker has no host tier to take it (--host-cache-bytes)"
        if exported.fingerprint != self.fingerprint:
            return f"exported by a cache unlike this one (fingerprint {exported.fingerprint} != {self.fingerprint})"
        if not entry.keys or len(entry.keys) * self.block_size != entry.end:
            return f"{len(entry.keys)} blocks of {self.block_size} tokens do not cover {entry.end} tokens"
        return unfit_tensors(entry.tensors, len(entry.keys), self.row_shapes)

    def stats(self) -> dict:
        return {"prefix_fetch_exported": self.exported, "prefix_fetch_imported": self.imported,
                "prefix_fetch_imported_tokens": self.imported_tokens, "prefix_fetch_refused": self.refused,
                # what an entry of n blocks weighs (n * block + state bytes), for the router's fetch cost
                "prefix_entry_block_bytes": self.rows.block_bytes, "prefix_entry_state_bytes": self.rows.state_bytes}
