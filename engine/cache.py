"""The cache tensors: paged K/V per attention layer and a state-slot pool per recurrent layer.

Allocated once at start from what the model's layers declare (engine.models.hybrid): KV rows
for attention, named state tensors for recurrent layers, whatever their kind. Bookkeeping
(which blocks and slots belong to whom) lives in the torch-free BlockManager and
StateSlotAllocator; this file only owns memory.

Every tensor has one row more than the allocators know of: block `num_blocks` and slot
`num_slots` are scratch, where the padded rows of a static decode batch (engine.cuda_graphs)
read and write. No request is ever given them, and the hand-off tensors stop before them.
State tensors then carry `num_checkpoints` rows for the prefix cache's checkpoints
(engine.prefix_cache): copied from and into request slots, never read by a forward in place.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.kernels import copy_rows, uses_triton
from engine.models import LayerCaches, ModelSpec
from engine.cache_formats import NarrowCache, kv_working_bytes_per_block, narrow_kv_layers
from engine.state_format import working_bytes

BLOCK_ROLE, SLOT_ROLE = "block", "slot"  # what dim 0 of a hand-off tensor indexes


@dataclass(frozen=True)
class CacheSizes:
    num_blocks: int
    num_slots: int
    bytes_per_block: int
    bytes_per_slot: int
    num_checkpoints: int = 0

    @property
    def checkpoint_bytes(self) -> int:
        return self.num_checkpoints * self.bytes_per_slot


def index_copy(dst: torch.Tensor, dim: int, index: torch.Tensor, src: torch.Tensor) -> None:
    """dst.index_copy_(dim, index, src), float8 rows too (as bytes: torch's CPU index_copy_ takes
    no float8 dtype)."""
    if dst.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        dst.view(torch.uint8).index_copy_(dim, index, src.to(dst.dtype).view(torch.uint8))
    else:
        dst.index_copy_(dim, index, src)


def kv_dtype(kv, dtype: torch.dtype) -> torch.dtype:
    """What a layer's KV rows are stored in: its format's dtype (engine.kv_format), else the model's."""
    return getattr(torch, kv.stored_dtype) if kv.stored_dtype is not None else dtype


def bytes_per_block(spec: ModelSpec, dtype: torch.dtype, block_size: int) -> int:
    return sum(len(layer.kv.names) * block_size * layer.kv.num_kv_heads * layer.kv.head_dim
               * torch.empty((), dtype=kv_dtype(layer.kv, dtype)).element_size()
               for layer in spec.layers if layer.kv is not None)


def bytes_per_slot(spec: ModelSpec) -> int:
    total = 0
    for layer in spec.layers:
        for tensor in layer.state:
            numel = 1
            for d in tensor.shape:
                numel *= d
            total += numel * tensor.storage_dtype.itemsize
    return total


def wasted_formats(full: ModelSpec, narrow: ModelSpec, dtype: torch.dtype, block_size: int) -> list[str]:
    """Why a narrow format saves nothing for this model: its one layer of full-width working rows
    costs as much as narrowing the other layers saves (a model with one or two such layers)."""
    reasons = []
    kv_layers = len(narrow_kv_layers(narrow))
    if kv_layers and bytes_per_block(narrow, dtype, block_size) + kv_working_bytes_per_block(narrow, dtype, block_size) \
            >= bytes_per_block(full, dtype, block_size):
        reasons.append(f"kv_cache_dtype: with {kv_layers} attention layer(s), the FP8 blocks and one layer of "
                       "full-width working rows take as much as the model's dtype: no more blocks fit")
    state_layers = sum(1 for layer in narrow.layers if any(t.stored_dtype for t in layer.state))
    if state_layers and bytes_per_slot(narrow) + working_bytes(narrow, 1) >= bytes_per_slot(full):
        reasons.append(f"mamba_state_dtype: with {state_layers} recurrent layer(s), the half-width state and one "
                       "layer of float32 working rows take as much as float32 state")
    return reasons


def plan_cache(spec: ModelSpec, dtype: torch.dtype, block_size: int, num_slots: int,
               max_model_len: int, memory_bytes: int, num_blocks: int | None,
               num_checkpoints: int = 0) -> CacheSizes:
    per_block = bytes_per_block(spec, dtype, block_size)
    per_slot = bytes_per_slot(spec)
    # FP8 KV layers run on working rows in the compute dtype (engine.kv_format): their memory
    # grows with the block count too.
    per_block_used = per_block + kv_working_bytes_per_block(spec, dtype, block_size)
    num_checkpoints = num_checkpoints if spec.state_layers else 0
    if num_blocks is None:
        enough = num_slots * -(-max_model_len // block_size)
        if not spec.attention_layers:
            num_blocks = enough  # no attention: block tables are bookkeeping only, no memory behind them
        else:
            budget = (memory_bytes - per_slot * (num_slots + 1 + num_checkpoints) - per_block_used  # + scratch
                      - working_bytes(spec, num_slots + 1))
            num_blocks = min(enough, budget // per_block_used)
            if num_blocks < -(-max_model_len // block_size):
                raise ValueError(
                    f"cache_memory_bytes={memory_bytes} leaves room for {num_blocks} KV blocks, "
                    f"fewer than one max_model_len={max_model_len} sequence needs"
                )
    return CacheSizes(num_blocks, num_slots, per_block, per_slot, num_checkpoints)


class ModelCache:
    def __init__(self, spec: ModelSpec, sizes: CacheSizes, block_size: int, dtype: torch.dtype,
                 device: torch.device | str, runs_layers: bool = True):
        """`runs_layers` False: rows that are only copied (hand-off staging), no working rows."""
        self.spec = spec
        self.sizes = sizes
        self.block_size = block_size
        self.device = torch.device(device)
        self.scratch_block, self.scratch_slot = sizes.num_blocks, sizes.num_slots
        kv: list = [None] * len(spec.layers)
        state: list = [None] * len(spec.layers)
        for i, layer in enumerate(spec.layers):
            if layer.kv is not None:
                shape = (sizes.num_blocks + 1, block_size, layer.kv.num_kv_heads, layer.kv.head_dim)
                kv[i] = tuple(torch.zeros(shape, dtype=kv_dtype(layer.kv, dtype), device=device)
                              for _ in layer.kv.names)
            if layer.state:
                rows = sizes.num_slots + 1 + sizes.num_checkpoints
                state[i] = tuple(torch.zeros((rows, *t.shape), dtype=t.storage_dtype, device=device)
                                 for t in layer.state)
        self.layers = LayerCaches(kv, state)
        if runs_layers:  # layers stored narrower than computed run on working rows (engine.cache_formats)
            self.layers.narrow = NarrowCache.of(self.layers, spec, sizes.num_blocks + 1, sizes.num_slots + 1, dtype)

    def poison_slot(self, slot: int) -> None:
        for entry in self.layers.state:
            for tensor in entry or ():
                if tensor.is_floating_point():
                    tensor[slot].fill_(float("nan"))

    def checkpoint_row(self, checkpoint: int) -> int:
        return self.sizes.num_slots + 1 + checkpoint

    def whole_state_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """Every state tensor with all its rows (checkpoint rows included), named as in the
        hand-off: what a prefix-cache tier copies a checkpoint row from and into."""
        return [(name, t) for name, _, _, role, t in self.handoff_tensors(checkpoint_rows=True) if role == SLOT_ROLE]

    def copy_state(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole state rows (every recurrent layer's tensors), source -> destination; no
        row is both (rows copy at once). One launch a tensor on Triton (a verify's scratch
        copies, prefix checkpoints), where torch's gather and scatter take two; on the CPU those
        two are the cheaper call."""
        if not pairs:
            return
        src = torch.tensor([p[0] for p in pairs], device=self.device)
        dst = torch.tensor([p[1] for p in pairs], device=self.device)
        for entry in self.layers.state:
            for tensor in entry or ():
                if uses_triton(tensor):
                    copy_rows(tensor, src, tensor, dst)
                else:
                    tensor.index_copy_(0, dst, tensor.index_select(0, src))

    def block_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """Tensors whose dim 0 is a block id, in layer order (what a KV hand-off moves)."""
        return [(name, t) for name, _, _, role, t in self.handoff_tensors() if role == BLOCK_ROLE]

    def slot_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """Tensors whose dim 0 is a state slot, in layer order (what a state hand-off moves)."""
        return [(name, t) for name, _, _, role, t in self.handoff_tensors() if role == SLOT_ROLE]

    def handoff_tensors(self, checkpoint_rows: bool = False) -> list[tuple[str, int, str, str, torch.Tensor]]:
        """(name, layer, kind, role, tensor) for every cache tensor, in layer order: the hand-off
        and its layout handshake are built from this alone. Views without the scratch rows;
        `checkpoint_rows`: state tensors whole, checkpoint rows included (what a prefix-cache
        entry copies its checkpoint from and into)."""
        out = []
        blocks = self.sizes.num_blocks
        slots = None if checkpoint_rows else self.sizes.num_slots
        for i, layer in enumerate(self.spec.layers):
            if layer.kv is not None:
                out += [(f"layer{i}.{name}", i, layer.kv.kind, BLOCK_ROLE, rows[:blocks])
                        for name, rows in zip(layer.kv.names, self.layers.kv[i])]
            for tensor_spec, tensor in zip(layer.state, self.layers.state[i] or ()):
                out.append((f"layer{i}.{tensor_spec.name}", i, layer.state_kind, SLOT_ROLE, tensor[:slots]))
        return out
