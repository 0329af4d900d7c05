"""What a worker's cache looks like (CacheLayout) and the live tensors behind it (CacheTensors).

A cache is a list of named tensors. "block" tensors are indexed by block id in dim 0
(attention K and V: [num_blocks, block_size, heads, head_dim]); "slot" tensors are
indexed by state slot in dim 0 (whatever state tensors a recurrent layer declares, such as
a conv window and an SSM state). Entries are ordered by
model layer index, so a sender can ship layer i as soon as layer i is computed.
Two workers can exchange state only if their layouts agree on everything except the
number of rows (each worker sizes its own cache) and the block size (kvtransfer/grid.py).
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from math import prod

import torch

from kvtransfer.errors import LayoutMismatchError

BLOCK = "block"
SLOT = "slot"


@dataclass(frozen=True)
class TensorSpec:
    name: str  # e.g. "layer3.k"
    layer: int  # model layer index
    layer_kind: str  # "attention", or the state kind the layer declared
    role: str  # BLOCK or SLOT: what dim 0 indexes
    row_shape: tuple[int, ...]  # shape of one row (one block or one slot)
    dtype: str  # torch dtype name without "torch.", e.g. "bfloat16"

    def __post_init__(self) -> None:
        if self.role not in (BLOCK, SLOT):
            raise ValueError(f"{self.name}: role must be {BLOCK!r} or {SLOT!r}, got {self.role!r}")
        if self.layer < 0:
            raise ValueError(f"{self.name}: layer index must be >= 0, got {self.layer}")
        object.__setattr__(self, "row_shape", tuple(int(d) for d in self.row_shape))

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def token_shape(self) -> tuple[int, ...]:
        """What must match between two sides: a block row's shape without its block size."""
        return self.row_shape[1:] if self.role == BLOCK else self.row_shape

    @functools.cached_property  # computed on every hand-off's critical path otherwise
    def row_bytes(self) -> int:
        return prod(self.row_shape) * self.torch_dtype.itemsize


@dataclass(frozen=True)
class CacheLayout:
    block_size: int
    specs: tuple[TensorSpec, ...]  # sorted by (layer, name)
    # Which part of a tensor-parallel worker's cache these tensors are: "" the whole
    # (un-sharded) cache, else "rank r of N" (engine.tp.rank_handoffs). Two sides must agree:
    # equal shapes alone would let rank 1's heads land in rank 0's.
    shard: str = ""
    # The speculative decoding setting (engine.speculative) of the worker, as canonical JSON; ""
    # without one. The two sides of a pair must agree, as vLLM's split requires: a hand-off
    # carries nothing for n-gram or a draft model (the decode worker prefills the draft), but
    # a method whose state does travel (an MTP head's) needs the same setting on both sides.
    speculative: str = ""

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        names = [s.name for s in self.specs]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate tensor names in layout: {names}")
        object.__setattr__(self, "specs", tuple(sorted(self.specs, key=lambda s: (s.layer, s.name))))

    @functools.cached_property
    def layers(self) -> list[int]:
        return sorted({s.layer for s in self.specs})

    @property
    def has_blocks(self) -> bool:
        return any(s.role == BLOCK for s in self.specs)

    @property
    def has_slots(self) -> bool:
        return any(s.role == SLOT for s in self.specs)

    def specs_of_layer(self, layer: int) -> list[TensorSpec]:
        return self._specs_by_layer.get(layer, [])

    @functools.cached_property
    def _specs_by_layer(self) -> dict[int, list[TensorSpec]]:
        by_layer: dict[int, list[TensorSpec]] = {}
        for spec in self.specs:
            by_layer.setdefault(spec.layer, []).append(spec)
        return by_layer

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size) if self.has_blocks else 0

    def handoff_bytes(self, num_tokens: int) -> int:
        """Bytes one request of num_tokens prompt tokens moves (whole blocks, one slot)."""
        blocks = self.num_blocks_for(num_tokens)
        return sum(s.row_bytes * (blocks if s.role == BLOCK else 1) for s in self.specs)

    def to_dict(self) -> dict:
        return {
            "block_size": self.block_size,
            "shard": self.shard,
            "speculative": self.speculative,
            "specs": [
                [s.name, s.layer, s.layer_kind, s.role, list(s.row_shape), s.dtype] for s in self.specs
            ],
        }

    @classmethod
    def from_dict(cls, data: dict) -> CacheLayout:
        specs = tuple(TensorSpec(n, lay, kind, role, tuple(shape), dt) for n, lay, kind, role, shape, dt in data["specs"])
        return cls(int(data["block_size"]), specs, str(data.get("shard", "")), str(data.get("speculative", "")))

    def differences(self, other: CacheLayout) -> list[str]:
        """Human-readable list of what differs; empty when the two can exchange state."""
        diffs = []  # block sizes may differ: kvtransfer/grid.py re-blocks
        if self.shard != other.shard:
            diffs.append(f"shard {self.shard or 'whole cache'!r} vs {other.shard or 'whole cache'!r}")
        if self.speculative != other.speculative:
            diffs.append(f"speculative_config {self.speculative or 'none'} vs {other.speculative or 'none'}")
        kinds = [{layer: "+".join(sorted({s.layer_kind for s in layout.specs if s.layer == layer}))
                  for layer in layout.layers} for layout in (self, other)]
        other_kind = set()
        for layer in sorted(kinds[0].keys() | kinds[1].keys()):
            a, b = kinds[0].get(layer, "no cache"), kinds[1].get(layer, "no cache")
            if a != b:
                diffs.append(f"layer {layer}: {a} vs {b}")
                other_kind.add(layer)
        mine = {s.name: s for s in self.specs if s.layer not in other_kind}
        theirs = {s.name: s for s in other.specs if s.layer not in other_kind}
        for name in sorted(mine.keys() - theirs.keys()):
            diffs.append(f"tensor {name!r} only on this side")
        for name in sorted(theirs.keys() - mine.keys()):
            diffs.append(f"tensor {name!r} only on the peer")
        for name in sorted(mine.keys() & theirs.keys()):
            a, b = mine[name], theirs[name]
            for field in ("layer", "role", "dtype"):
                if getattr(a, field) != getattr(b, field):
                    diffs.append(f"{name}: {field} {getattr(a, field)} vs {getattr(b, field)}")
            if a.token_shape != b.token_shape:
                what = "token shape" if a.role == b.role == BLOCK else "row_shape"
                diffs.append(f"{name}: {what} {a.token_shape} vs {b.token_shape}")
        return diffs

    def check_compatible(self, other: CacheLayout, this_side: str, peer_side: str) -> None:
        diffs = self.differences(other)
        if diffs:
            shown = "; ".join(diffs[:8]) + (f"; ... {len(diffs) - 8} more" if len(diffs) > 8 else "")
            raise LayoutMismatchError(
                f"cache layout mismatch between {this_side} and {peer_side} "
                f"(values are {this_side} vs {peer_side}): {shown}"
            )


@dataclass(frozen=True)
class CacheEntry:
    name: str
    layer: int
    layer_kind: str
    role: str
    tensor: torch.Tensor


class CacheTensors:
    """The live cache tensors of one worker, validated, with their layout."""

    def __init__(self, block_size: int, entries: list[CacheEntry], shard: str = "", speculative: str = ""):
        if not entries:
            raise ValueError("a cache needs at least one tensor")
        self.layout = CacheLayout(
            block_size,
            tuple(
                TensorSpec(e.name, e.layer, e.layer_kind, e.role, tuple(e.tensor.shape[1:]), str(e.tensor.dtype).removeprefix("torch."))
                for e in entries
            ),
            shard,
            speculative,
        )
        self.tensors = {e.name: e.tensor for e in entries}
        self.device = entries[0].tensor.device
        rows = {BLOCK: set(), SLOT: set()}
        for e in entries:
            if e.tensor.device != self.device:
                raise ValueError(f"{e.name} is on {e.tensor.device}, other cache tensors on {self.device}")
            if not e.tensor.is_contiguous() or e.tensor.dim() < 1:
                raise ValueError(f"{e.name} must be a contiguous tensor with a row dimension")
            if e.role == BLOCK and (e.tensor.dim() < 2 or e.tensor.shape[1] != block_size):
                raise ValueError(f"{e.name}: a block tensor is [blocks, block_size={block_size}, ...], got {tuple(e.tensor.shape)}")
            rows[e.role].add(e.tensor.shape[0])
        for role, counts in rows.items():
            if len(counts) > 1:
                raise ValueError(f"all {role} tensors must have the same dim 0, got {sorted(counts)}")
        self.num_blocks = rows[BLOCK].pop() if rows[BLOCK] else 0
        self.num_slots = rows[SLOT].pop() if rows[SLOT] else 0

    @classmethod
    def hybrid(
        cls,
        block_size: int,
        attention: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None,
        state: dict[int, tuple[str, dict[str, torch.Tensor]]] | None = None,
    ) -> CacheTensors:
        """attention: {model layer: (k_cache, v_cache)};
        state: {model layer: (state kind, {tensor name: per-slot tensor})}."""
        entries = []
        for layer, (k, v) in sorted((attention or {}).items()):
            entries += [
                CacheEntry(f"layer{layer}.k", layer, "attention", BLOCK, k),
                CacheEntry(f"layer{layer}.v", layer, "attention", BLOCK, v),
            ]
        for layer, (kind, tensors) in sorted((state or {}).items()):
            entries += [CacheEntry(f"layer{layer}.{name}", layer, kind, SLOT, t) for name, t in tensors.items()]
        return cls(block_size, entries)

    @classmethod
    def from_named(cls, block_size: int, named: list[tuple[str, int, str, str, torch.Tensor]], shard: str = "",
                   speculative: str = "") -> CacheTensors:
        """From engine.cache.ModelCache.handoff_tensors(): (name, layer, kind, role, tensor) rows,
        whatever kinds of state the model's layers declared."""
        entries = []
        for name, layer, kind, role, tensor in named:
            if re.fullmatch(rf"layer{layer}\.\w+", name) is None:
                raise ValueError(f"cache tensor name {name!r} is not of the form 'layer{layer}.<part>'")
            entries.append(CacheEntry(name, layer, kind, role, tensor))
        return cls(block_size, entries, shard, speculative)

    def check_rows(self, block_ids: list[int], slot: int | None, what: str) -> None:
        """Refuse ids outside this cache before any byte moves."""
        bad = [b for b in block_ids if not 0 <= b < self.num_blocks]
        if bad:
            raise ValueError(f"{what}: block ids {bad[:5]} outside [0, {self.num_blocks})")
        if len(set(block_ids)) != len(block_ids):
            raise ValueError(f"{what}: duplicate block ids")
        if self.layout.has_slots:
            if slot is None or not 0 <= slot < self.num_slots:
                raise ValueError(f"{what}: state slot {slot} outside [0, {self.num_slots})")
        elif slot is not None:
            raise ValueError(f"{what}: this cache has no state slots but slot {slot} was given")
