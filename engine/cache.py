"""The cache tensors: paged K/V per attention layer and a state-slot pool per Mamba layer.

Allocated once at start. Bookkeeping (which blocks and slots belong to whom) lives in the
torch-free BlockManager and StateSlotAllocator; this file only owns memory.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.models import LayerCaches, ModelSpec


@dataclass(frozen=True)
class CacheSizes:
    num_blocks: int
    num_slots: int
    bytes_per_block: int
    bytes_per_slot: int


def plan_cache(spec: ModelSpec, dtype: torch.dtype, block_size: int, num_slots: int,
               max_model_len: int, memory_bytes: int, num_blocks: int | None) -> CacheSizes:
    itemsize = torch.empty((), dtype=dtype).element_size()
    per_block = 2 * len(spec.attention_layers) * block_size * spec.num_kv_heads * spec.head_dim * itemsize
    per_slot = len(spec.mamba_layers) * spec.d_inner * (spec.d_conv + spec.d_state) * 4
    if num_blocks is None:
        enough = num_slots * -(-max_model_len // block_size)
        if not spec.attention_layers:
            num_blocks = enough  # pure Mamba: block tables are bookkeeping only, no memory behind them
        else:
            budget = memory_bytes - per_slot * num_slots
            num_blocks = min(enough, budget // per_block)
            if num_blocks < -(-max_model_len // block_size):
                raise ValueError(
                    f"cache_memory_bytes={memory_bytes} leaves room for {num_blocks} KV blocks, "
                    f"fewer than one max_model_len={max_model_len} sequence needs"
                )
    return CacheSizes(num_blocks, num_slots, per_block, per_slot)


class ModelCache:
    def __init__(self, spec: ModelSpec, sizes: CacheSizes, block_size: int, dtype: torch.dtype,
                 device: torch.device | str):
        self.spec = spec
        self.sizes = sizes
        self.block_size = block_size
        kv: list = [None] * len(spec.layer_kinds)
        state: list = [None] * len(spec.layer_kinds)
        for i in spec.attention_layers:
            shape = (sizes.num_blocks, block_size, spec.num_kv_heads, spec.head_dim)
            kv[i] = (torch.zeros(shape, dtype=dtype, device=device),
                     torch.zeros(shape, dtype=dtype, device=device))
        for i in spec.mamba_layers:
            # State stays float32 whatever the model dtype: it accumulates over the whole sequence.
            state[i] = (torch.zeros(sizes.num_slots, spec.d_inner, spec.d_conv, device=device),
                        torch.zeros(sizes.num_slots, spec.d_inner, spec.d_state, device=device))
        self.layers = LayerCaches(kv, state)

    def poison_slot(self, slot: int) -> None:
        for entry in self.layers.state:
            if entry is not None:
                entry[0][slot].fill_(float("nan"))
                entry[1][slot].fill_(float("nan"))

    def block_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """Tensors whose dim 0 is a block id, in layer order (what a KV hand-off moves)."""
        out = []
        for i, entry in enumerate(self.layers.kv):
            if entry is not None:
                out += [(f"layer{i}.k", entry[0]), (f"layer{i}.v", entry[1])]
        return out

    def slot_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """Tensors whose dim 0 is a state slot, in layer order (what a state hand-off moves)."""
        out = []
        for i, entry in enumerate(self.layers.state):
            if entry is not None:
                out += [(f"layer{i}.conv", entry[0]), (f"layer{i}.ssm", entry[1])]
        return out
