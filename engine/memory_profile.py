"""Sizing a GPU cache from what the device has free: `gpu_memory_utilization`, as vLLM does.

The cache gets  utilization x total memory  minus what is not ours (other processes, the CUDA
context) minus what the model needs besides its cache: its weights and the peak of the
largest step the scheduler may run (one prefill of max_num_batched_tokens tokens), measured by
running that step once on a throwaway cache just big enough for it. CUDA graphs, captured
later, take a little of the rest from their own pool. A tensor-parallel engine runs the step on
every rank at once (its collectives must meet) and sizes every rank's shard of the cache by the
smallest budget (engine.tp.ranks: the "profile" command).
"""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Callable

import torch

from engine.cache import CacheSizes, ModelCache, bytes_per_block, bytes_per_slot
from engine.models.batch import ForwardBatch
from engine.phase import Phase


@dataclass(frozen=True)
class DeviceMemory:
    """What the budget is computed from, in bytes (tests pass their own numbers)."""

    total: int
    free: int  # before the profile step, weights loaded
    allocated: int  # by this process's torch allocator, then
    peak: int  # the allocator's peak during the profile step, its cache included
    profile_cache: int  # the throwaway cache's share of that peak


def cache_budget(memory: DeviceMemory, utilization: float) -> int:
    """Bytes the cache may take: all of `utilization` of the device that neither other users
    nor this model's weights and peak step take."""
    others = memory.total - memory.free - memory.allocated  # other processes, CUDA context, allocator slack
    model = memory.peak - memory.profile_cache  # weights + the largest step's activations
    return int(utilization * memory.total) - others - model


def measure(model, spec, dtype: torch.dtype, block_size: int, tokens: int, device: torch.device,
            stats: Callable[[torch.device], tuple[int, int, int]] | None = None) -> DeviceMemory:
    """Run one fresh prefill of `tokens` tokens on a throwaway cache; `stats(device)` returns
    (free, total, allocated) and, after a step, the peak is the allocator's."""
    stats = stats or _cuda_stats
    free, total, allocated = stats(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    blocks = -(-tokens // block_size)
    sizes = CacheSizes(blocks, 1, bytes_per_block(spec, dtype, block_size), bytes_per_slot(spec))
    cache = ModelCache(spec, sizes, block_size, dtype, device)
    profile_cache = sizes.num_blocks * sizes.bytes_per_block + 2 * sizes.bytes_per_slot
    positions = torch.arange(tokens, device=device)
    batch = ForwardBatch(
        input_ids=torch.zeros(tokens, dtype=torch.long, device=device), positions=positions,
        query_starts=[0, tokens], context_lens=[tokens], phases=[Phase.FRESH_PREFILL], state_slots=[0],
        block_tables=torch.arange(blocks, device=device)[None], kv_write_index=positions,
        block_size=block_size, logits_indices=torch.tensor([tokens - 1], device=device))
    with torch.inference_mode():
        model(batch, cache.layers)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device)
    else:
        peak = allocated + profile_cache
    del cache, batch
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return DeviceMemory(total, free, allocated, peak, profile_cache)


def device_stats(device: torch.device) -> tuple[int, int, int]:
    """(free, total, allocated) of a CUDA device; zeros for a CPU one, which has no budget of its
    own to size (CPU tensor-parallel ranks run the profile step only to keep in step)."""
    return _cuda_stats(device) if device.type == "cuda" else (0, 0, 0)


def rank_budget(memories: list[DeviceMemory], utilization: float) -> tuple[int, int]:
    """(bytes each rank's cache may take, the rank that limits it): the ranks hold equal shards
    of one cache, so the smallest budget over their devices sizes all of them."""
    budgets = [cache_budget(m, utilization) for m in memories]
    rank = min(range(len(budgets)), key=budgets.__getitem__)
    return budgets[rank], rank


def _cuda_stats(device: torch.device) -> tuple[int, int, int]:
    if device.type != "cuda":
        raise ValueError("gpu_memory_utilization sizes a CUDA cache; this engine is on the CPU")
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    return free, total, torch.cuda.memory_allocated(device)
