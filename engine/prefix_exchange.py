"""Prefix-cache entries moved between workers: an engine's side (worker_base.prefix_wire moves
the bytes).

A source stages the longest usable prefix of a prompt it holds, from its pool or a tier, as a
tier entry (engine.host_tier.Entry: every block's KV and the checkpoint that makes it usable,
whole) packed into whole rows of its host tier (`stage`). The importer reserves as many rows
of its own host tier (`make_room`), a kvtransfer transport copies the rows across, and the
importer holds them as an entry of its host tier (`adopt`), where the request's admission finds
it as it finds any tier entry (engine.tiered_cache) and computes only what lies past it. Both
ends release their rows when a move fails (`unstage`, `drop`). The router decides who fetches
from whom (router.prefix_fetch).

An importer takes only what a cache like its own staged: the same fingerprint
(engine.disk_tier.cache_fingerprint: the model's files, dtype, block size, every cache tensor's
name, kind and per-token shape), each tensor's rows shaped and typed as its own, and a chain as
long as the tokens it claims. Anything else is refused before a byte moves, and the request
recomputes.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from engine.host_arena import Specs, footprint, specs_of
from engine.host_tier import ROW_BYTES, entry_specs, rows_of, unfit_specs

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StagedPrefix:
    fetch_id: str
    fingerprint: str  # the source cache's (engine.disk_tier.cache_fingerprint)
    keys: list[bytes]  # the chain's block hashes, root first
    end: int  # tokens the prefix covers
    specs: Specs  # the entry's tensors, packed in this order from its first row
    rows: list[int]  # the source's host-tier rows (engine.host_tier.HostTier.rows) that hold it
    tier: str  # where the source held it: "pool", "host" or "disk"

    @property
    def nbytes(self) -> int:
        return footprint(self.specs)


class PrefixExchange:
    """An engine's side of the exchange; runs on the engine's thread (between steps)."""

    def __init__(self, engine):
        self.engine = engine
        self.prefix_cache, self.rows = engine.prefix_cache, engine.entry_rows
        self.block_size = engine.config.block_size
        self.row_shapes = self.rows.row_shapes
        self.staged: dict[str, tuple[int, int]] = {}  # fetch id -> (offset, bytes) of its rows
        self.exported = self.imported = self.imported_tokens = self.refused = 0

    @property
    def fingerprint(self) -> str:
        return self.engine.cache_fingerprint

    @property
    def host(self):
        tiers = self.engine.tiers
        return tiers.host if tiers is not None else None

    # ------------------------------------------------------------------ the source's side

    @torch.inference_mode()
    def stage(self, hashes: list[bytes], fetch_id: str) -> StagedPrefix | None:
        """The longest usable prefix of the block chain `hashes` held here (pool or tiers),
        copied into rows of the host tier, held there for `fetch_id` until `unstage`; None
        where none is held, or there is no host tier, or no room in it."""
        if self.host is None or fetch_id in self.staged:
            return None
        found = self._find(hashes)
        if found is None:
            return None
        keys, end, specs, tier, fill = found
        offset, below = self.host.reserve_rows(footprint(specs))
        self.engine.tiers.keep_below(below)
        if offset is None:
            return None
        fill(self.host.arena.views(offset, specs))
        self.host.fence()
        self.host.wait()  # the transport reads the rows from another thread
        self.staged[fetch_id] = offset, footprint(specs)
        self.exported += 1
        return StagedPrefix(fetch_id, self.fingerprint, keys, end, specs, self.staged_rows(fetch_id), tier)

    def staged_rows(self, fetch_id: str) -> list[int] | None:
        """The host-tier rows `stage` holds for `fetch_id`; None where it holds none."""
        if fetch_id not in self.staged:
            return None
        offset, nbytes = self.staged[fetch_id]
        return list(range(offset // ROW_BYTES, offset // ROW_BYTES + rows_of(nbytes)))

    def staged_tensors(self, staged: StagedPrefix) -> dict[str, torch.Tensor]:
        """What `stage` put in the rows it holds for `staged`: the entry's tensors, as views."""
        offset, _ = self.staged[staged.fetch_id]
        return self.host.arena.views(offset, staged.specs)

    def unstage(self, fetch_id: str) -> None:
        """The rows `stage` held for `fetch_id` are free (the move is over, either way)."""
        held = self.staged.pop(fetch_id, None)
        if held is not None:
            self.host.release_rows(*held)

    def _find(self, hashes: list[bytes]):
        """(keys, end, specs, tier, fill(views)) of the longest usable prefix held; None."""
        hit = self.prefix_cache.lookup(hashes, (len(hashes) + 1) * self.block_size)
        tiers = self.engine.tiers
        for i in range(len(hashes) - 1, -1, -1):
            end = (i + 1) * self.block_size
            if end <= hit.num_tokens:
                break
            entry = tiers.find(hashes[: i + 1], end)
            if entry is not None:
                tier = "host" if hashes[i] in self.host.entries else "disk"

                def fill(views, entry=entry):
                    self.host.wait()  # a host entry's own copies from the device, if any are queued
                    for name, view in views.items():
                        view.copy_(entry.tensors[name])
                return entry.keys, end, specs_of(entry.tensors), tier, fill
        if not hit.num_tokens:
            return None
        keys, blocks, checkpoint = hashes[: hit.num_tokens // self.block_size], hit.blocks, hit.checkpoint
        specs = entry_specs(self.row_shapes, len(keys), checkpoint is not None)
        return keys, hit.num_tokens, specs, "pool", lambda views: self.rows.gather_into(views, blocks, checkpoint)

    # ------------------------------------------------------------------ the importer's side

    def make_room(self, staged: StagedPrefix) -> int | None:
        """The offset of host-tier rows reserved for `staged`; None where it is refused (logged),
        held here already, or finds no room."""
        why = self._unfit(staged)
        if why is not None:
            self.refused += 1
            log.warning("prefix of %d tokens from another worker refused: %s", staged.end, why)
            return None
        held = self.prefix_cache.lookup(staged.keys, staged.end + 1).num_tokens >= staged.end
        if held or staged.keys[-1] in self.host.entries:
            return None
        offset, below = self.host.reserve_rows(staged.nbytes)
        self.engine.tiers.keep_below(below)
        return offset

    def adopt(self, staged: StagedPrefix, offset: int) -> int:
        """The rows at `offset` hold `staged` now (the transport wrote them): an entry of the
        host tier from here on. The tokens it covers."""
        if staged.keys[-1] in self.host.entries:  # another fetch of it landed first
            self.drop(offset, staged.nbytes)
            return 0
        # its recency is this process's clock, not the exporter's
        self.host.adopt(list(staged.keys), staged.end, staged.specs, offset)
        self.imported += 1
        self.imported_tokens += staged.end
        return staged.end

    def drop(self, offset: int, nbytes: int) -> None:
        """Rows `make_room` reserved that no entry will hold (the move failed)."""
        self.host.release_rows(offset, nbytes)

    def _unfit(self, staged: StagedPrefix) -> str | None:
        if self.host is None:
            return "this worker has no host tier to take it (--host-cache-bytes)"
        if staged.fingerprint != self.fingerprint:
            return f"staged by a cache unlike this one (fingerprint {staged.fingerprint} != {self.fingerprint})"
        if not staged.keys or len(staged.keys) * self.block_size != staged.end:
            return f"{len(staged.keys)} blocks of {self.block_size} tokens do not cover {staged.end} tokens"
        if len(staged.rows) != rows_of(staged.nbytes):
            return f"{len(staged.rows)} rows do not hold its {staged.nbytes} bytes"
        return unfit_specs(staged.specs, len(staged.keys), self.row_shapes)

    def stats(self) -> dict:
        return {"prefix_fetch_exported": self.exported, "prefix_fetch_imported": self.imported,
                "prefix_fetch_imported_tokens": self.imported_tokens, "prefix_fetch_refused": self.refused,
                # what an entry of n blocks weighs (n * block + state bytes), for the router's fetch cost
                "prefix_entry_block_bytes": self.rows.block_bytes, "prefix_entry_state_bytes": self.rows.state_bytes}
