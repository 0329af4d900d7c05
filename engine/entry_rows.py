"""Where a prefix-cache entry's rows come from and go to (engine.host_tier.Entry: a usable
prefix's KV blocks and checkpoint, whole).

Entries are always in the un-sharded layout, whatever the engine's tensor-parallel size: a
one-rank engine copies its cache's rows (CacheRows); a tensor-parallel engine gathers every
rank's shard of them onto rank 0 and puts them together, and scatters each rank its share on the
way back (RankRows, through the ranks' "gather" / "scatter" commands, engine.tp.staging). So an
entry on disk, or exported to another worker, reads the same for an engine of any TP size, and
its fingerprint (engine.disk_tier.cache_fingerprint) is of that layout.
"""

from __future__ import annotations

import math

import torch

from engine.cache import BLOCK_ROLE, CacheSizes, ModelCache, index_copy
from engine.host_tier import Entry, entry_specs


def entry_key(name: str, role: str) -> str:
    """A cache tensor's name in an entry: "kv:<name>" (rows per block), "state:<name>" (the
    checkpoint's row)."""
    return f"{'kv' if role == BLOCK_ROLE else 'state'}:{name}"


class CacheRows:
    """The rows of a one-rank engine's cache."""

    def __init__(self, cache: ModelCache, needs_state: bool, layout: ModelCache | None = None):
        self.cache = cache
        self.layout = layout or cache  # whose tensors an entry's are shaped like (and fingerprinted by)
        # (hand-off name, role, one row's (shape, dtype)) of each tensor of the layout, in order;
        # and by entry key the rows an entry holds (state only where the prefix cache keeps it).
        self.named = [(name, role, (tuple(t.shape[1:]), t.dtype))
                      for name, _, _, role, t in self.layout.handoff_tensors(checkpoint_rows=True)]
        self.row_shapes = {entry_key(name, role): row for name, role, row in self.named
                           if role == BLOCK_ROLE or needs_state}
        self.kv_tensors = self.cache.block_tensors()
        self.state_tensors = self.cache.whole_state_tensors() if needs_state else []
        row_bytes = {name: math.prod(shape) * dtype.itemsize for name, (shape, dtype) in self.row_shapes.items()}
        self.block_bytes = sum(b for n, b in row_bytes.items() if n.startswith("kv:"))
        self.state_bytes = sum(b for n, b in row_bytes.items() if n.startswith("state:"))

    def copy_out(self, keys: list[bytes], blocks: list[int], checkpoint: int | None, end: int) -> Entry:
        """A usable prefix of the pool (its blocks and checkpoint) copied to host memory whole,
        into tensors of its own."""
        specs = entry_specs(self.row_shapes, len(blocks), checkpoint is not None)
        tensors = {name: torch.empty(shape, dtype=dtype) for name, (shape, dtype) in specs.items()}
        self.gather_into(tensors, blocks, checkpoint)
        if self.cache.device.type == "cuda":
            torch.cuda.current_stream(self.cache.device).synchronize()  # the entry leaves the engine's stream
        return Entry(list(keys), end, tensors)

    def gather_into(self, views: dict[str, torch.Tensor], blocks: list[int], checkpoint: int | None) -> None:
        """A prefix's blocks and checkpoint row into host tensors already there (`views`, by
        entry name): from a GPU queued on the current stream (the caller waits or marks it), on
        the CPU straight into them."""
        index = torch.tensor(blocks, device=self.cache.device)
        for n, t in self.kv_tensors:
            if t.is_cuda:
                views[f"kv:{n}"].copy_(t.index_select(0, index), non_blocking=True)
            else:
                torch.index_select(t, 0, index, out=views[f"kv:{n}"])
        if checkpoint is not None:
            row = self.cache.checkpoint_row(checkpoint)
            for n, t in self.state_tensors:
                views[f"state:{n}"].copy_(t[row], non_blocking=True)

    def fill(self, entry: Entry, rows, blocks: list[int], checkpoint: int | None) -> None:
        """The entry's block rows `rows` (indices into its chain, or a slice) into the pool's
        `blocks`, and (`checkpoint` not None) its checkpoint into that checkpoint row; copies
        from host memory queued on the current stream."""
        if blocks and self.kv_tensors:  # a model without attention layers has no KV to fill
            at = torch.tensor(blocks, device=self.cache.device)
            for name, tensor in self.kv_tensors:
                index_copy(tensor, 0, at, entry.tensors[f"kv:{name}"][rows].to(tensor.device, non_blocking=True))
        if checkpoint is not None:
            row = self.cache.checkpoint_row(checkpoint)
            for name, tensor in self.state_tensors:
                tensor[row].copy_(entry.tensors[f"state:{name}"], non_blocking=True)


class RankRows(CacheRows):
    """The rows of a tensor-parallel engine's cache (rank 0's end), in the un-sharded layout."""

    def __init__(self, engine, needs_state: bool):
        from engine.tp.staging import shard_indices

        config = engine.config
        spec = engine.full_cache_spec
        layout = ModelCache(spec, CacheSizes(1, 1, 0, 0), config.block_size, config.torch_dtype, "cpu",
                            runs_layers=False)
        super().__init__(engine.cache, needs_state, layout)
        self.tp = engine.tp
        self.index = shard_indices(spec, self.tp.group.size, engine.cache.device)

    def gather_into(self, views: dict[str, torch.Tensor], blocks: list[int], checkpoint: int | None) -> None:
        from engine.tp.staging import assemble, gather_rows

        row = self.cache.checkpoint_row(checkpoint) if checkpoint is not None else None
        self.tp.send("gather", blocks, row, True)
        parts = gather_rows(self.tp.group, self.cache, blocks, row, checkpoint_rows=True)
        # Put together in the views where they are on rank 0's device (a CPU engine's), else on
        # the device and then copied into them.
        full, copies = [], []
        for name, role, (shape, dtype) in self.named:
            view = views.get(entry_key(name, role))
            if view is not None and role != BLOCK_ROLE:
                view = view.unsqueeze(0)
            if view is not None and view.device == self.cache.device:
                full.append(view)
                continue
            count = len(blocks) if role == BLOCK_ROLE else int(row is not None)
            full.append(torch.empty((count, *shape), dtype=dtype, device=self.cache.device))
            if view is not None:
                copies.append((view, full[-1]))
        assemble(self.index, [name for name, _, _ in self.named], parts, full)
        for view, rows in copies:
            view.copy_(rows, non_blocking=True)

    def fill(self, entry: Entry, rows, blocks: list[int], checkpoint: int | None) -> None:
        from engine.tp.staging import scatter_rows

        if not blocks and checkpoint is None:
            return
        full = []
        for name, role, (shape, dtype) in self.named:
            if role == BLOCK_ROLE and blocks:
                t = entry.tensors[entry_key(name, role)][rows]
            elif role != BLOCK_ROLE and checkpoint is not None:
                t = entry.tensors[entry_key(name, role)].unsqueeze(0)
            else:  # nothing of this tensor to fill: the ranks still meet in its scatter
                t = torch.empty((0, *shape), dtype=dtype)
            full.append(t.to(self.cache.device, non_blocking=True))
        shapes = [t.shape for t in full]
        row = self.cache.checkpoint_row(checkpoint) if checkpoint is not None else None
        self.tp.send("scatter", shapes, blocks, row, True)
        scatter_rows(self.tp.group, self.cache, self.index, full, shapes, blocks, row, checkpoint_rows=True)


def entry_rows(engine) -> CacheRows:
    """The engine's entry rows: its cache's, or its ranks' put together."""
    needs_state = engine.prefix_cache is not None and engine.prefix_cache.needs_state
    return RankRows(engine, needs_state) if engine.tp is not None else CacheRows(engine.cache, needs_state)
