"""Prefill attention for every prefill row of a step in one call over the paged KV cache.

On CUDA in bf16/fp16, where this torch's `torch.nn.attention.varlen.varlen_attn` takes a block
table (its FlashAttention over a paged pool), the prefill rows of a step (fresh prompts, chunks
that continue one, prefix-cache hits) attend in one launch: no per-row Python loop, no gathered
copy of a long context, no materialised score matrix. Anywhere else (CPU, float32, an older
torch, or a device or block size the kernel turns down when first probed) the caller keeps its
per-row SDPA path.

The semantics it is called with (and `varlen_attention_ref` defines, in plain torch): sequence
i has queries q[cu_seq_q[i]:cu_seq_q[i + 1]], the last positions of a context of seqused_k[i]
tokens whose keys and values sit in the pool's blocks block_table[i] (write-then-read: this
step's tokens are already there). Causal, aligned at the end of the context (query j of n sees
keys up to context - n + j), optionally within a sliding window of `window` keys counting its
own; GQA by repeating each KV head over its group of query heads.
"""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)


@dataclass
class VarlenRows:
    """The prefill rows of a step as the varlen call takes them (built once per step)."""

    tokens: torch.Tensor | slice  # flat token indices of the prefill rows' queries, in row order
    cu_seq_q: torch.Tensor  # int32 [N + 1]
    cu_seq_k: torch.Tensor  # int32 [N + 1]: cumulative contexts
    seqused_k: torch.Tensor  # int32 [N]: each row's context, its new tokens included
    block_table: torch.Tensor  # int32 [N, max blocks]
    max_q: int
    max_k: int

    @classmethod
    def of(cls, batch) -> VarlenRows:
        """The batch's prefill rows, built once per step (kept in batch.varlen_rows)."""
        if batch.varlen_rows is None:
            batch.varlen_rows = cls._build(batch)
        return batch.varlen_rows

    @classmethod
    def _build(cls, batch) -> VarlenRows:
        rows = batch.prefill_rows
        device = batch.block_tables.device
        lens = [batch.query_starts[r + 1] - batch.query_starts[r] for r in rows]
        contexts = [batch.context_lens[r] for r in rows]
        if len(rows) == batch.num_seqs:  # every row a prefill: their tokens are the whole batch
            tokens: torch.Tensor | slice = slice(None)
        else:
            tokens = torch.tensor([t for r in rows for t in range(batch.query_starts[r], batch.query_starts[r + 1])],
                                  dtype=torch.long).to(device)
        cumulative = [0]
        for n in lens:
            cumulative.append(cumulative[-1] + n)
        cumulative_k = [0]
        for n in contexts:
            cumulative_k.append(cumulative_k[-1] + n)
        table = batch.block_tables.index_select(0, torch.tensor(rows, dtype=torch.long).to(device))
        return cls(tokens, torch.tensor(cumulative, dtype=torch.int32).to(device),
                   torch.tensor(cumulative_k, dtype=torch.int32).to(device),
                   torch.tensor(contexts, dtype=torch.int32).to(device), table.to(torch.int32),
                   max(lens), max(contexts))


def _torch_varlen():
    """torch's paged varlen attention, or None where this torch has none that takes a block
    table, GQA, a window and a scale."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    takes = set(inspect.signature(varlen_attn).parameters)
    return varlen_attn if {"block_table", "seqused_k", "enable_gqa", "window_size", "scale"} <= takes else None


_UNRESOLVED = object()
# Resolved at the first CUDA check, not at import: importing torch's varlen module imports
# torch._dynamo, about a second of every worker process's start where nothing will call it.
_kernel = _UNRESOLVED
_refused: dict[tuple, str] = {}  # (device, dtype, block size, head dim) -> why the kernel turned it down


def varlen_attention_ref(q, k_cache, v_cache, rows: VarlenRows, scale: float, window: int | None) -> torch.Tensor:
    """The definition (module docstring), one sequence at a time in plain torch."""
    out = torch.empty_like(q)
    bounds = rows.cu_seq_q.tolist()
    for i, context in enumerate(rows.seqused_k.tolist()):
        start, end = bounds[i], bounds[i + 1]
        n, block_size = end - start, k_cache.shape[1]
        blocks = rows.block_table[i, : -(-context // block_size)].long()
        keys = k_cache.index_select(0, blocks).flatten(0, 1)[:context].to(q.dtype)
        values = v_cache.index_select(0, blocks).flatten(0, 1)[:context].to(q.dtype)
        q_pos = torch.arange(context - n, context, device=q.device)[:, None]
        k_pos = torch.arange(context, device=q.device)[None, :]
        mask = k_pos <= q_pos
        if window is not None:
            mask &= k_pos > q_pos - window
        o = F.scaled_dot_product_attention(q[start:end].transpose(0, 1)[None], keys.transpose(0, 1)[None],
                                           values.transpose(0, 1)[None], attn_mask=mask, scale=scale,
                                           enable_gqa=q.shape[1] != keys.shape[1])
        out[start:end] = o[0].transpose(0, 1)
    return out


def available(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether the one-call path runs for these queries and this pool (the caller's cheap check)."""
    return (q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) and k_cache.dtype == q.dtype
            and _resolved_kernel() is not None and _key(q, k_cache) not in _refused)


def _resolved_kernel():
    global _kernel
    if _kernel is _UNRESOLVED:
        _kernel = _torch_varlen()
    return _kernel


def _key(q, k_cache) -> tuple:
    return (str(q.device), q.dtype, k_cache.shape[1], q.shape[-1])


def varlen_attention(q, k_cache, v_cache, rows: VarlenRows, scale: float, window: int | None) -> torch.Tensor | None:
    """q: [T, heads, head_dim], the prefill rows' queries in row order; caches [blocks,
    block_size, kv_heads, head_dim]. Returns [T, heads, head_dim], or None where the kernel
    turned this shape down (remembered, logged once: the caller's per-row path serves it)."""
    key = _key(q, k_cache)
    try:
        return _kernel(q, k_cache, v_cache, rows.cu_seq_q, rows.cu_seq_k, rows.max_q, rows.max_k, scale=scale,
                       window_size=(-1 if window is None else window - 1, 0),
                       enable_gqa=q.shape[1] != k_cache.shape[2], seqused_k=rows.seqused_k,
                       block_table=rows.block_table)
    except (RuntimeError, ValueError, TypeError, NotImplementedError) as error:
        _refused[key] = f"{type(error).__name__}: {error}"
        log.warning("varlen prefill attention unavailable for %s (%s); prefill rows attend one by one", key, error)
        return None
