"""Hand-offs of a tensor-parallel worker, through rank 0, in the un-sharded layout (the rows
that engine.staging.HandoffStaging moves between the ranks and its staging cache).

The wire carries every request in the un-sharded layout, so prefill and decode workers of any
TP sizes (1->2, 2->1, 2->2) pass the same layout handshake over every transport, and the bytes
on the wire are one un-sharded copy of the request. Rank 0 keeps a small staging cache in that
layout, room for `requests` hand-offs at a time:
- prefill side, when a prompt is done: every rank selects its rows of the request, a gather
  brings them to rank 0, which writes them into staging rows at the indices the shard map
  (engine.tp.plan) gives each rank; the transport sends the staging rows;
- decode side: a reservation's hand-off target is staging rows; once they have landed, rank 0
  scatters them: each rank receives exactly the heads and channels it owns, and writes them into
  the request's own rows.
Inside a worker too, a hand-off moves one un-sharded copy (plus the copies of replicated KV heads
or Mamba2 groups that several ranks keep).
Only rank 0 reads or writes staging; every rank runs the same gather/scatter, in the order rank 0
issues them (engine.tp.ranks), on its engine thread.
"""

from __future__ import annotations

import torch

from engine.cache import BLOCK_ROLE, ModelCache, index_copy
from engine.tp.plan import model_shards

def shard_indices(full_spec, size: int, device="cpu") -> dict[str, list[tuple[int, torch.Tensor]]]:
    """Per hand-off tensor name, per rank: (axis of a selected-rows tensor, un-sharded indices).
    KV rows are [n, block_size, heads, head_dim] (heads: axis 2); state rows [n, *shape] (axis 1)."""
    shards = model_shards(full_spec, size)
    out: dict[str, list[tuple[int, torch.Tensor]]] = {}
    for i, layer in enumerate(full_spec.layers):
        if layer.kv is not None:
            for name in (f"layer{i}.{n}" for n in layer.kv.names):
                out[name] = [(2, torch.tensor(shards[r][i].kv.indices(), device=device)) for r in range(size)]
        for j, tensor in enumerate(layer.state):
            out[f"layer{i}.{tensor.name}"] = [(1, torch.tensor(shards[r][i].state[j].indices(), device=device))
                                              for r in range(size)]
    return out


def local_rows(cache: ModelCache, blocks: list[int], slot: int | None,
               checkpoint_rows: bool = False) -> list[torch.Tensor]:
    """This rank's rows of one request, in hand-off tensor order (`slot` None: no state row).
    `checkpoint_rows`: `slot` may be a checkpoint row (a prefix-cache entry's)."""
    block_index = torch.tensor(blocks, dtype=torch.long, device=cache.device)
    return [t.index_select(0, block_index) if role == BLOCK_ROLE else t[slot:slot + 1] if slot is not None else t[:0]
            for _, _, _, role, t in cache.handoff_tensors(checkpoint_rows)]


def write_local(cache: ModelCache, rows: list[torch.Tensor], blocks: list[int], slot: int | None,
                checkpoint_rows: bool = False) -> None:
    block_index = torch.tensor(blocks, dtype=torch.long, device=cache.device)
    for (_, _, _, role, t), r in zip(cache.handoff_tensors(checkpoint_rows), rows):
        if role == BLOCK_ROLE:
            index_copy(t, 0, block_index, r.to(t.dtype))
        elif slot is not None:
            t[slot:slot + 1] = r


def gather_rows(group, cache: ModelCache, blocks: list[int], slot: int | None,
                checkpoint_rows: bool = False) -> list[list[torch.Tensor]] | None:
    """Every rank: its rows of each tensor, gathered on rank 0 (per tensor, one per rank)."""
    parts = [group.gather_to_first(r) for r in local_rows(cache, blocks, slot, checkpoint_rows)]
    return parts if group.rank == 0 else None


def assemble(index, names: list[str], parts: list[list[torch.Tensor]], out: list[torch.Tensor]) -> None:
    """Rank 0: the gathered `parts` (per tensor, one per rank) written into the un-sharded rows
    `out` (per tensor, on parts' device) at the indices each rank owns."""
    for name, by_rank, rows in zip(names, parts, out):
        for rank, (axis, idx) in enumerate(index[name]):
            index_copy(rows, axis, idx.to(rows.device), by_rank[rank].to(rows.device))


def scatter_rows(group, cache: ModelCache, index, full: list[torch.Tensor] | None, shapes,
                 blocks: list[int], slot: int | None, checkpoint_rows: bool = False) -> None:
    """Every rank: receive exactly its indices of rank 0's un-sharded rows (`full` on rank 0,
    else None and their `shapes`) and keep them in its own rows."""
    mine = []
    for i, (name, _, _, _, t) in enumerate(cache.handoff_tensors(checkpoint_rows)):
        axis, idx = index[name][group.rank]
        parts = [full[i].index_select(a, ix) for a, ix in index[name]] if full is not None else None
        shape = list(shapes[i])
        shape[axis] = len(idx)  # every rank owns as many (the plan splits evenly)
        out = torch.empty(shape, dtype=t.dtype, device=t.device)
        mine.append(group.scatter_from_first(parts, out))
    write_local(cache, mine, blocks, slot, checkpoint_rows)
