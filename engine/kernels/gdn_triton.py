"""Triton kernels for the gated delta rule (engine.kernels.gdn_scan holds the definitions).

`gated_delta_step_triton` is `gated_delta_step_ref` in one launch: a program per (decode row,
value head, block of dv columns) reads its slice of state[slot] ([dk, BLOCK_V]: the columns of
S are independent under the rule), L2-normalises q and k of the key head h // (Hv / Hk) in
registers, applies one token and writes the slice back in the pool's dtype (a half-width pool's
stochastically rounded, given `positions`: engine.kernels.state_round).

`gated_delta_scan_triton` is `gated_delta_rule_ref` token by token in one launch, the state
slice in registers: the Triton prefill for a decay per key channel (Kimi Delta Attention).

`chunk_gated_delta_rule_triton` is `chunk_gated_delta_rule_ref` in three launches, with the
same WY (UT transform) chunking as the module docstring of gdn_scan:
1. per (chunk, value head): A[j, m] = beta_j D(j, m) k_j . k_m (m < j), T = (I + A)^-1 by
   forward substitution over the chunk's rows (T unit lower triangular), then
   W = T (beta V) and X = T (beta P K), written to scratch [L, Hv, dv] / [L, Hv, dk];
2. per (value head, block of dv columns), sequentially over the chunks: store the state S0
   entering the chunk, U = W - X S0 (written over W, which nothing reads again), and
   S <- P_last S0 + sum_m exp(g[m+1..last]) k_m (outer) u_m; the last S is the returned state;
3. per (chunk, value head, block of dv columns): o_i = P_i S0^T q_i + sum_{m<=i} D(i, m)
   (q_i . k_m) u_m.
Every decay exponent is a sum over a contiguous run of steps: prefixes as a cumsum from the
chunk start, D(i, m) as a column-wise cumsum of g masked to steps m+1..i, the suffixes as a
masked row sum; never a difference of two chunk-long cumsums. The chunk is the caller's
chunk_size capped at MAX_CHUNK (the triangular solve is a [chunk, chunk] tile in registers);
as for a prefill split across engine steps, only the float summation order depends on it.
Blocks are at least 16 wide (tl.dot's minimum on GPUs); masks cover the padding, and padded
steps load g = 0, beta = 0, k = 0, so they change nothing.
"""

from __future__ import annotations

import torch

from engine.kernels._triton import device_function, jit, next_power_of_2, tl, unit_last_stride
from engine.kernels.gdn_scan import L2_EPS, check_rule, check_step
from engine.kernels.slot_runs import slot_rows
from engine.kernels.state_round import in_place_pool, load_state, store_state

MAX_CHUNK = 64


def _empty(*shape, device):
    """Every buffer the kernels fill (outputs and scratch); tests swap in NaN-filled ones."""
    return torch.empty(*shape, dtype=torch.float32, device=device)



# ---------------------------------------------------------------- decode: one token on the slot pool

def gated_delta_step_triton(state, slots, q, k, v, g, beta, positions=None, slot_runs=False):
    """state: [slots, Hv, dk, dv] (rows `slots` read, updated, written back; slots distinct
    unless `slot_runs`: engine.kernels.slot_runs);
    slots: int64 [b]; q, k: [b, Hk, dk]; v: [b, Hv, dv]; g: [b, Hv] or [b, Hv, dk] (a decay per
    key channel); beta: [b, Hv]. Returns o [b, Hv, dv] float32."""
    check_step(state, slots, q, k, v, g, beta)
    pool, half = in_place_pool(state, positions)
    batch, k_heads, k_dim = q.shape
    heads, v_dim = v.shape[1:]
    out = _empty(batch, heads, v_dim, device=v.device)
    if batch == 0:
        return out
    q, k, v = (unit_last_stride(t) for t in (q, k, v))
    if state.stride(3) != 1:
        raise ValueError("state needs a unit stride in its last dimension")
    dk_pad = next_power_of_2(k_dim)
    block_v = max(1, min(next_power_of_2(v_dim), 4096 // dk_pad, 64))  # bounds registers per program
    grid = (batch, heads, -(-v_dim // block_v))
    _gdn_step_kernel[grid](
        pool, slots, positions if half else slots, q, k, v, g, beta, out,
        batch, k_dim, v_dim, heads // k_heads, float(k_dim) ** -0.5, L2_EPS,
        state.stride(0), state.stride(1), state.stride(2),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        g.stride(0), g.stride(1), g.stride(2) if g.dim() == 3 else 0,
        beta.stride(0), beta.stride(1), out.stride(0), out.stride(1),
        DK_PAD=dk_pad, BLOCK_V=block_v, HALF=half, SLOT_RUNS=bool(slot_runs),
    )
    return out


@jit
def _gdn_step_kernel(state_ptr, slots_ptr, positions_ptr, q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, out_ptr,
                     rows, k_dim, v_dim, heads_per_key, scale, eps,
                     state_stride_slot, state_stride_h, state_stride_k,
                     q_stride_b, q_stride_h, k_stride_b, k_stride_h, v_stride_b, v_stride_h,
                     g_stride_b, g_stride_h, g_stride_k, beta_stride_b, beta_stride_h, out_stride_b, out_stride_h,
                     DK_PAD: tl.constexpr, BLOCK_V: tl.constexpr, HALF: tl.constexpr, SLOT_RUNS: tl.constexpr):
    row = tl.program_id(0)
    head = tl.program_id(1)
    key_head = head // heads_per_key
    d = tl.arange(0, DK_PAD)
    e = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    d_ok = d < k_dim
    e_ok = e < v_dim
    de_ok = d_ok[:, None] & e_ok[None, :]
    elements = head * state_stride_h + d[:, None] * state_stride_k + e[None, :]  # within the slot's row
    slot, end, ok = slot_rows(slots_ptr, row, rows, de_ok, SLOT_RUNS)  # this program's rows: engine.kernels.slot_runs
    state = state_ptr + slot * state_stride_slot + elements
    S = load_state(state, ok, HALF)
    for r in range(row, end):
        q = tl.load(q_ptr + r * q_stride_b + key_head * q_stride_h + d, mask=d_ok, other=0.0)
        k = tl.load(k_ptr + r * k_stride_b + key_head * k_stride_h + d, mask=d_ok, other=0.0)
        v = tl.load(v_ptr + r * v_stride_b + head * v_stride_h + e, mask=e_ok, other=0.0)
        # One decay per key row of S: per channel, or the head's one (g_stride_k 0) on every row.
        g = tl.load(g_ptr + r * g_stride_b + head * g_stride_h + d * g_stride_k, mask=d_ok, other=0.0)
        beta = tl.load(beta_ptr + r * beta_stride_b + head * beta_stride_h)
        S, o = _rule_token(S, q, k, v, g, beta, scale, eps)
        tl.store(out_ptr + r * out_stride_b + head * out_stride_h + e, o, mask=e_ok)
    store_state(state, S, ok, tl.load(positions_ptr + end - 1) if HALF else 0, elements, HALF)


@device_function
def _rule_token(S, q, k, v, g, beta, scale, eps):
    """One token of the rule on a [dk, BLOCK_V] slice of S (float32): q and k L2-normalised and
    q scaled here, S decayed row by row by exp(g), the delta written. Returns (S, o [BLOCK_V])."""
    q, k, v = q.to(tl.float32), k.to(tl.float32), v.to(tl.float32)
    q = q * tl.rsqrt(tl.sum(q * q, axis=0) + eps) * scale
    k = k * tl.rsqrt(tl.sum(k * k, axis=0) + eps)
    S = S * tl.exp(g.to(tl.float32))[:, None]
    predicted = tl.sum(S * k[:, None], axis=0)  # S^T k: [BLOCK_V]
    S = S + k[:, None] * ((v - predicted) * beta.to(tl.float32))[None, :]
    return S, tl.sum(S * q[:, None], axis=0)


# ---------------------------------------------------------------- prefill: token by token

def gated_delta_scan_triton(q, k, v, g, beta, h0):
    """`gated_delta_rule_ref` in one launch: a program per (value head, block of dv columns)
    holds its [dk, BLOCK_V] slice of the state in registers and applies the rule token after
    token (as the C++ scan does on a CPU). The prefill Triton path for a decay per key channel
    (g [L, Hv, dk]: Kimi Delta Attention), which the chunked kernels below do not take; it also
    takes a per-head g. h0 is read only. Returns o [L, Hv, dv] and the final state, float32."""
    check_rule(q, k, v, g, beta, h0)
    length, k_heads, k_dim = q.shape
    heads, v_dim = v.shape[1:]
    state = h0.float().clone().contiguous()  # a copy: h0 may be a view of the engine's state pool
    out = _empty(length, heads, v_dim, device=v.device)
    if length == 0:
        return out, state
    q, k, v = (unit_last_stride(t) for t in (q, k, v))
    dk_pad = next_power_of_2(k_dim)
    block_v = max(1, min(next_power_of_2(v_dim), 4096 // dk_pad, 64))
    _gdn_scan_kernel[(heads, -(-v_dim // block_v))](
        state, q, k, v, g, beta, out, length, k_dim, v_dim, heads // k_heads, float(k_dim) ** -0.5, L2_EPS,
        state.stride(0), state.stride(1), q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        v.stride(0), v.stride(1), g.stride(0), g.stride(1), g.stride(2) if g.dim() == 3 else 0,
        beta.stride(0), beta.stride(1), out.stride(0), out.stride(1),
        DK_PAD=dk_pad, BLOCK_V=block_v,
    )
    return out, state


@jit
def _gdn_scan_kernel(state_ptr, q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, out_ptr, length,
                     k_dim, v_dim, heads_per_key, scale, eps, state_stride_h, state_stride_k,
                     q_stride_l, q_stride_h, k_stride_l, k_stride_h, v_stride_l, v_stride_h,
                     g_stride_l, g_stride_h, g_stride_k, beta_stride_l, beta_stride_h, out_stride_l, out_stride_h,
                     DK_PAD: tl.constexpr, BLOCK_V: tl.constexpr):
    head = tl.program_id(0)
    key_head = head // heads_per_key
    d = tl.arange(0, DK_PAD)
    e = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    d_ok = d < k_dim
    e_ok = e < v_dim
    de_ok = d_ok[:, None] & e_ok[None, :]
    state = state_ptr + head * state_stride_h + d[:, None] * state_stride_k + e[None, :]
    S = tl.load(state, mask=de_ok, other=0.0)
    for t in range(0, length):
        q = tl.load(q_ptr + t * q_stride_l + key_head * q_stride_h + d, mask=d_ok, other=0.0)
        k = tl.load(k_ptr + t * k_stride_l + key_head * k_stride_h + d, mask=d_ok, other=0.0)
        v = tl.load(v_ptr + t * v_stride_l + head * v_stride_h + e, mask=e_ok, other=0.0)
        g = tl.load(g_ptr + t * g_stride_l + head * g_stride_h + d * g_stride_k, mask=d_ok, other=0.0)
        beta = tl.load(beta_ptr + t * beta_stride_l + head * beta_stride_h)
        S, o = _rule_token(S, q, k, v, g, beta, scale, eps)
        tl.store(out_ptr + t * out_stride_l + head * out_stride_h + e, o, mask=e_ok)
    tl.store(state, S, mask=de_ok)


# ---------------------------------------------------------------- prefill: chunks of one sequence

def chunk_gated_delta_rule_triton(q, k, v, g, beta, h0, chunk_size):
    """q, k: [L, Hk, dk]; v: [L, Hv, dv]; g, beta: [L, Hv]; h0: [Hv, dk, dv] (read only).
    Returns o [L, Hv, dv] and the final state [Hv, dk, dv], both float32."""
    check_rule(q, k, v, g, beta, h0)
    length, heads, v_dim = v.shape
    k_heads, k_dim = q.shape[1:]
    h0 = h0.float().contiguous()  # read only: it may be a view of the engine's state pool
    if length == 0:
        return torch.zeros(v.shape, dtype=torch.float32, device=v.device), h0.clone()
    q, k, v = (unit_last_stride(t) for t in (q, k, v))
    chunk = max(1, min(chunk_size, length, MAX_CHUNK))
    n_chunks = -(-length // chunk)
    block_t = max(16, next_power_of_2(chunk))
    dk_pad = max(16, next_power_of_2(k_dim))
    block_v = max(16, min(next_power_of_2(v_dim), 32 if dk_pad > 64 else 64))
    v_blocks = -(-v_dim // block_v)
    dev = v.device
    W = _empty(length, heads, v_dim, device=dev)  # W, then U = W - X S0 in place
    X = _empty(length, heads, k_dim, device=dev)
    starts = _empty(n_chunks, heads, k_dim, v_dim, device=dev)  # the state entering each chunk
    out = _empty(length, heads, v_dim, device=dev)
    h_last = _empty(heads, k_dim, v_dim, device=dev)
    common = (length, chunk, k_dim, v_dim, heads // k_heads, L2_EPS,
              k.stride(0), k.stride(1), g.stride(0), g.stride(1), W.stride(0), W.stride(1),
              X.stride(0), X.stride(1))

    _gdn_chunk_prepare_kernel[(n_chunks, heads)](
        k, v, g, beta, W, X, *common, v.stride(0), v.stride(1), beta.stride(0), beta.stride(1), v_blocks,
        BLOCK_T=block_t, DK_PAD=dk_pad, BLOCK_V=block_v)
    # the chunk loop double-buffered: three stages take 180 KB of shared memory with float32
    # inputs, past the 163 KB an A100 gives a block
    _gdn_state_kernel[(heads, v_blocks)](
        k, g, W, X, h0, starts, h_last, n_chunks, *common,
        BLOCK_T=block_t, DK_PAD=dk_pad, BLOCK_V=block_v, num_stages=2)
    _gdn_chunk_output_kernel[(n_chunks, heads, v_blocks)](
        q, k, g, W, starts, out, *common, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        float(k_dim) ** -0.5,
        BLOCK_T=block_t, DK_PAD=dk_pad, BLOCK_V=block_v)
    return out, h_last


@jit
def _gdn_chunk_prepare_kernel(k_ptr, v_ptr, g_ptr, beta_ptr, w_ptr, x_ptr,
                              length, chunk, k_dim, v_dim, heads_per_key, eps,
                              k_stride_l, k_stride_h, g_stride_l, g_stride_h, w_stride_l, w_stride_h,
                              x_stride_l, x_stride_h, v_stride_l, v_stride_h, beta_stride_l, beta_stride_h,
                              v_blocks,
                              BLOCK_T: tl.constexpr, DK_PAD: tl.constexpr, BLOCK_V: tl.constexpr):
    """For chunk c, value head h: T = (I + A)^-1, W = T (beta V), X = T (beta P K)."""
    c = tl.program_id(0)
    head = tl.program_id(1)
    key_head = head // heads_per_key
    r = tl.arange(0, BLOCK_T)
    d = tl.arange(0, DK_PAD)
    t = c.to(tl.int64) * chunk + r  # int64: t * stride may exceed 2**31
    ok = (r < chunk) & (t < length)
    d_ok = d < k_dim

    K = tl.load(k_ptr + t[:, None] * k_stride_l + key_head * k_stride_h + d[None, :],
                mask=ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
    K = K * tl.rsqrt(tl.sum(K * K, axis=1) + eps)[:, None]
    g = tl.load(g_ptr + t * g_stride_l + head * g_stride_h, mask=ok, other=0.0).to(tl.float32)
    beta = tl.load(beta_ptr + t * beta_stride_l + head * beta_stride_h, mask=ok, other=0.0).to(tl.float32)
    prefix = tl.cumsum(g, axis=0)  # g[chunk start..i]
    below = r[:, None] > r[None, :]
    seg = tl.cumsum(tl.where(below, g[:, None], 0.0), axis=0)  # [i, j] = g[j+1..i] for i > j

    kk = tl.dot(K, tl.trans(K), input_precision="ieee")  # not tf32: it keeps ~3 significant digits
    A = tl.where(below, beta[:, None] * tl.exp(seg) * kk, 0.0)
    # Forward substitution, T = I - A T: row i of T needs only the rows before it.
    T = tl.where(r[:, None] == r[None, :], 1.0, 0.0)
    n_rows = tl.minimum(chunk, length - c * chunk)  # rows past it: A is zero, T stays I
    for i in range(1, n_rows):
        a_i = tl.sum(tl.where(r[:, None] == i, A, 0.0), axis=0)  # A[i, :], zero from i on
        T = T - tl.where(r[:, None] == i, tl.sum(a_i[:, None] * T, axis=0)[None, :], 0.0)

    Xc = tl.dot(T, K * (beta * tl.exp(prefix))[:, None], input_precision="ieee")
    tl.store(x_ptr + t[:, None] * x_stride_l + head * x_stride_h + d[None, :], Xc,
             mask=ok[:, None] & d_ok[None, :])
    for vb in range(v_blocks):
        e = vb * BLOCK_V + tl.arange(0, BLOCK_V)
        te_ok = ok[:, None] & (e < v_dim)[None, :]
        V = tl.load(v_ptr + t[:, None] * v_stride_l + head * v_stride_h + e[None, :],
                    mask=te_ok, other=0.0).to(tl.float32)
        Wc = tl.dot(T, V * beta[:, None], input_precision="ieee")
        tl.store(w_ptr + t[:, None] * w_stride_l + head * w_stride_h + e[None, :], Wc, mask=te_ok)


@jit
def _gdn_state_kernel(k_ptr, g_ptr, w_ptr, x_ptr, h0_ptr, starts_ptr, h_last_ptr, n_chunks,
                      length, chunk, k_dim, v_dim, heads_per_key, eps,
                      k_stride_l, k_stride_h, g_stride_l, g_stride_h, w_stride_l, w_stride_h,
                      x_stride_l, x_stride_h,
                      BLOCK_T: tl.constexpr, DK_PAD: tl.constexpr, BLOCK_V: tl.constexpr):
    """Sequentially over the chunks, for value head h and a block of dv columns: starts[c] <- S0,
    W <- U = W - X S0, S <- exp(g[start..last]) S0 + sum_m exp(g[m+1..last]) k_m (outer) u_m."""
    head = tl.program_id(0)
    key_head = head // heads_per_key
    heads = tl.num_programs(0)
    r = tl.arange(0, BLOCK_T)
    d = tl.arange(0, DK_PAD)
    e = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    d_ok = d < k_dim
    e_ok = e < v_dim
    de_ok = d_ok[:, None] & e_ok[None, :]
    after = r[None, :] > r[:, None]  # [i, m]: m after i

    size = k_dim * v_dim
    S = tl.load(h0_ptr + head * size + d[:, None] * v_dim + e[None, :], mask=de_ok, other=0.0)
    for c in range(n_chunks):
        start = starts_ptr + (c * heads + head).to(tl.int64) * size
        tl.store(start + d[:, None] * v_dim + e[None, :], S, mask=de_ok)
        t = (c * chunk + r).to(tl.int64)  # int64: t * stride may exceed 2**31
        ok = (r < chunk) & (t < length)
        K = tl.load(k_ptr + t[:, None] * k_stride_l + key_head * k_stride_h + d[None, :],
                    mask=ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
        K = K * tl.rsqrt(tl.sum(K * K, axis=1) + eps)[:, None]
        g = tl.load(g_ptr + t * g_stride_l + head * g_stride_h, mask=ok, other=0.0).to(tl.float32)
        suffix = tl.sum(tl.where(after, g[None, :], 0.0), axis=1)  # g[i+1..chunk end]
        Xc = tl.load(x_ptr + t[:, None] * x_stride_l + head * x_stride_h + d[None, :],
                     mask=ok[:, None] & d_ok[None, :], other=0.0)
        w_at = w_ptr + t[:, None] * w_stride_l + head * w_stride_h + e[None, :]
        te_ok = ok[:, None] & e_ok[None, :]
        U = tl.load(w_at, mask=te_ok, other=0.0) - tl.dot(Xc, S, input_precision="ieee")
        tl.store(w_at, U, mask=te_ok)
        K_write = K * tl.exp(suffix)[:, None]
        S = S * tl.exp(tl.sum(g, axis=0)) + tl.dot(tl.trans(K_write), U, input_precision="ieee")
    tl.store(h_last_ptr + head * size + d[:, None] * v_dim + e[None, :], S, mask=de_ok)


@jit
def _gdn_chunk_output_kernel(q_ptr, k_ptr, g_ptr, u_ptr, starts_ptr, out_ptr,
                             length, chunk, k_dim, v_dim, heads_per_key, eps,
                             k_stride_l, k_stride_h, g_stride_l, g_stride_h, u_stride_l, u_stride_h,
                             x_stride_l, x_stride_h, q_stride_l, q_stride_h, out_stride_l, out_stride_h,
                             scale,
                             BLOCK_T: tl.constexpr, DK_PAD: tl.constexpr, BLOCK_V: tl.constexpr):
    """o_i = exp(g[start..i]) S0^T q_i + sum_{m<=i} exp(g[m+1..i]) (q_i . k_m) u_m for the rows
    of chunk c, value head h, a block of dv columns; S0 the state entering the chunk."""
    c = tl.program_id(0)
    head = tl.program_id(1)
    key_head = head // heads_per_key
    heads = tl.num_programs(1)
    r = tl.arange(0, BLOCK_T)
    d = tl.arange(0, DK_PAD)
    e = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    t = c.to(tl.int64) * chunk + r  # int64: t * stride may exceed 2**31
    ok = (r < chunk) & (t < length)
    d_ok = d < k_dim
    e_ok = e < v_dim
    td_ok = ok[:, None] & d_ok[None, :]
    te_ok = ok[:, None] & e_ok[None, :]

    Q = tl.load(q_ptr + t[:, None] * q_stride_l + key_head * q_stride_h + d[None, :],
                mask=td_ok, other=0.0).to(tl.float32)
    Q = Q * (tl.rsqrt(tl.sum(Q * Q, axis=1) + eps) * scale)[:, None]
    K = tl.load(k_ptr + t[:, None] * k_stride_l + key_head * k_stride_h + d[None, :],
                mask=td_ok, other=0.0).to(tl.float32)
    K = K * tl.rsqrt(tl.sum(K * K, axis=1) + eps)[:, None]
    g = tl.load(g_ptr + t * g_stride_l + head * g_stride_h, mask=ok, other=0.0).to(tl.float32)
    prefix = tl.cumsum(g, axis=0)  # g[chunk start..i]
    below = r[:, None] > r[None, :]
    seg = tl.cumsum(tl.where(below, g[:, None], 0.0), axis=0)  # [i, m] = g[m+1..i] for i > m, 0 on i = m
    U = tl.load(u_ptr + t[:, None] * u_stride_l + head * u_stride_h + e[None, :], mask=te_ok, other=0.0)
    S0 = tl.load(starts_ptr + (c * heads + head).to(tl.int64) * (k_dim * v_dim) + d[:, None] * v_dim
                 + e[None, :], mask=d_ok[:, None] & e_ok[None, :], other=0.0)

    qk = tl.dot(Q, tl.trans(K), input_precision="ieee")  # not tf32: it keeps ~3 significant digits
    attend = tl.where(below | (r[:, None] == r[None, :]), qk * tl.exp(seg), 0.0)
    o = tl.dot(Q * tl.exp(prefix)[:, None], S0, input_precision="ieee")
    o += tl.dot(attend, U, input_precision="ieee")
    tl.store(out_ptr + t[:, None] * out_stride_l + head * out_stride_h + e[None, :], o, mask=te_ok)
