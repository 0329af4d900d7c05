"""Numba kernels for the CPU hot loops (see engine.kernels.cpu for the torch-facing wrappers).

Imported only through engine.kernels.cpu, on the first call, so that importing the engine never
pays numba's start-up. Compiled code is cached on disk (cache=True): a new process loads it
in milliseconds instead of compiling for seconds.

All arrays are float32 except ids (int64). Each kernel parallelises over independent rows
(sequence x channel, or sequence x KV head) with prange; every row's arithmetic is the same
sequence of operations whatever the batch holds, so a request's result does not depend on its
batch neighbours. Only the attention dot products allow reassociation (to vectorise them).
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

# Reassociation lets LLVM vectorise the reductions (y = h . C, q . k); still deterministic, and
# the same for a row whatever its batch holds.
FAST = {"reassoc", "contract"}


@njit(parallel=True, cache=True, fastmath=FAST)
def ssm_state_update(state, slots, decay, dt_x, B, C, y):
    """Mamba decode step: per row b, channel c, h = state[slots[b], c] in place:
    h = h * decay[b, c] + dt_x[b, c] B[b] ; y[b, c] = h . C[b].  decay = exp(dt A) comes in
    precomputed by torch, one vectorised op over the whole [B, D, N] block."""
    batch, d_inner = dt_x.shape
    d_state = B.shape[1]
    for i in prange(batch * d_inner):
        b = i // d_inner
        c = i - b * d_inner
        h = state[slots[b], c]
        a = decay[b, c]
        u = dt_x[b, c]
        acc = np.float32(0.0)
        for k in range(d_state):
            h_k = h[k] * a[k] + u * B[b, k]
            h[k] = h_k
            acc += h_k * C[b, k]
        y[b, c] = acc


@njit(fastmath=FAST, cache=True, inline="always")
def _dot(a, b):
    acc = np.float32(0.0)
    for i in range(a.shape[0]):
        acc += a[i] * b[i]
    return acc


@njit(parallel=True, cache=True, fastmath=FAST, error_model="numpy")
def paged_attention_decode(q, k_cache, v_cache, block_tables, context_lens, scale, window, out):
    """One query per sequence over its paged KV (write-then-read: context_lens count the current
    token). q, out: [B, H, Dh]; caches: [blocks, block_size, KVH, Dh]; window 0 = none.
    Keys are walked block by block (one table lookup per block, no division per key: with the
    divisions and Python's error model this ran 1.5x slower)."""
    batch, heads, head_dim = q.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = heads // kv_heads
    for i in prange(batch * kv_heads):
        b = i // kv_heads
        kvh = i - b * kv_heads
        context = context_lens[b]
        first = 0
        if window > 0 and context > window:
            first = context - window
        scores = np.empty(context - first, dtype=np.float32)
        acc = np.empty(head_dim, dtype=np.float32)
        first_block, end_block = first // block_size, (context + block_size - 1) // block_size
        for g in range(group):
            head = kvh * group + g
            q_h = q[b, head]
            top = -np.inf
            for block_index in range(first_block, end_block):
                block, base = block_tables[b, block_index], block_index * block_size
                for t in range(max(first - base, 0), min(context - base, block_size)):
                    s = _dot(q_h, k_cache[block, t, kvh]) * scale
                    scores[base + t - first] = s
                    top = max(top, s)
            total = np.float32(0.0)
            for m in range(context - first):
                p = math.exp(scores[m] - top)
                scores[m] = p
                total += p
            acc[:] = 0.0
            for block_index in range(first_block, end_block):
                block, base = block_tables[b, block_index], block_index * block_size
                for t in range(max(first - base, 0), min(context - base, block_size)):
                    p = scores[base + t - first]
                    value = v_cache[block, t, kvh]
                    for d in range(head_dim):
                        acc[d] += p * value[d]
            for d in range(head_dim):
                out[b, head, d] = acc[d] / total


@njit(parallel=True, cache=True, fastmath=FAST)
def mamba2_state_update(state, slots, x, dt, A, B, C, y):
    """Mamba2 decode step: per row b, head h (group g), channel p, the row h = state[slots[b], h, p]
    in place: h = h * exp(dt A) + dt x B_g ; y[b, h, p] = h . C_g. dt final (bias, softplus, clamp)."""
    batch, heads, head_dim = x.shape
    groups, d_state = B.shape[1], B.shape[2]
    per_group = heads // groups
    for i in prange(batch * heads * head_dim):
        b = i // (heads * head_dim)
        rest = i - b * heads * head_dim
        h = rest // head_dim
        p = rest - h * head_dim
        g = h // per_group
        row = state[slots[b], h, p]
        dt_v = dt[b, h]
        decay = math.exp(dt_v * A[h])
        dt_x = dt_v * x[b, h, p]
        acc = np.float32(0.0)
        for n in range(d_state):
            h_n = row[n] * decay + dt_x * B[b, g, n]
            row[n] = h_n
            acc += h_n * C[b, g, n]
        y[b, h, p] = acc
