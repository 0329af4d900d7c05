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


@njit(parallel=True, cache=True)
def ssm_state_update(state, slots, x, dt, A, B, C, y):
    """Mamba decode step: per row b, channel c, h = state[slots[b], c] in place:
    h = h * exp(dt A) + dt B x ; y[b, c] = h . C[b]."""
    batch, d_inner = x.shape
    d_state = A.shape[1]
    for i in prange(batch * d_inner):
        b = i // d_inner
        c = i - b * d_inner
        h = state[slots[b], c]
        dt_v = dt[b, c]
        dt_x = dt_v * x[b, c]
        acc = np.float32(0.0)
        for k in range(d_state):
            h_k = h[k] * math.exp(dt_v * A[c, k]) + dt_x * B[b, k]
            h[k] = h_k
            acc += h_k * C[b, k]
        y[b, c] = acc


@njit(parallel=True, cache=True)
def ssm_scan_varlen(x, dt, A, B, C, cu_seqlens, rows, h, y):
    """Mamba prefill scan of several sequences: sequence s owns the tokens of batch row rows[s],
    cu_seqlens[r]:[r + 1], and starts from h[s] ([D, N], updated in place to its final state);
    y[t, c] = h_t[c] . C[t] at those tokens only."""
    num_seqs = rows.shape[0]
    d_inner = x.shape[1]
    d_state = A.shape[1]
    for i in prange(num_seqs * d_inner):
        s = i // d_inner
        c = i - s * d_inner
        h_c = h[s, c]
        for t in range(cu_seqlens[rows[s]], cu_seqlens[rows[s] + 1]):
            dt_v = dt[t, c]
            dt_x = dt_v * x[t, c]
            acc = np.float32(0.0)
            for k in range(d_state):
                h_k = h_c[k] * math.exp(dt_v * A[c, k]) + dt_x * B[t, k]
                h_c[k] = h_k
                acc += h_k * C[t, k]
            y[t, c] = acc


@njit(fastmath={"reassoc", "contract"}, cache=True, inline="always")
def _dot(a, b):
    acc = np.float32(0.0)
    for i in range(a.shape[0]):
        acc += a[i] * b[i]
    return acc


@njit(parallel=True, cache=True, fastmath={"reassoc", "contract"})
def paged_attention_decode(q, k_cache, v_cache, block_tables, context_lens, scale, window, out):
    """One query per sequence over its paged KV (write-then-read: context_lens count the current
    token). q, out: [B, H, Dh]; caches: [blocks, block_size, KVH, Dh]; window 0 = none."""
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
        for g in range(group):
            head = kvh * group + g
            q_h = q[b, head]
            top = -np.inf
            for j in range(first, context):
                key = k_cache[block_tables[b, j // block_size], j % block_size, kvh]
                s = _dot(q_h, key) * scale
                scores[j - first] = s
                top = max(top, s)
            total = np.float32(0.0)
            acc[:] = 0.0
            for j in range(first, context):
                p = math.exp(scores[j - first] - top)
                total += p
                value = v_cache[block_tables[b, j // block_size], j % block_size, kvh]
                for d in range(head_dim):
                    acc[d] += p * value[d]
            for d in range(head_dim):
                out[b, head, d] = acc[d] / total


@njit(parallel=True, cache=True)
def conv_state_update(state, slots, x, weight, bias, silu, y):
    """Depthwise causal conv, one decode token: per row b, channel c, the window
    state[slots[b], c] shifts left by one with x[b, c] appended (in place);
    y[b, c] = window . weight[c] + bias[c], then silu when asked. bias: [D] (zeros for none)."""
    batch, channels = x.shape
    width = weight.shape[1]
    for i in prange(batch * channels):
        b = i // channels
        c = i - b * channels
        window = state[slots[b], c]
        for k in range(width - 1):
            window[k] = window[k + 1]
        window[width - 1] = x[b, c]
        acc = np.float32(0.0)
        for k in range(width):
            acc += window[k] * weight[c, k]
        acc += bias[c]
        if silu:
            acc = acc / (np.float32(1.0) + math.exp(-acc))
        y[b, c] = acc


@njit(parallel=True, cache=True)
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
