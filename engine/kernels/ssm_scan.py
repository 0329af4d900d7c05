"""The selective scan of a Mamba (v1) layer over every prefill sequence of a batch, in one launch.

Per sequence s, tokens t in [cu_seqlens[r], cu_seqlens[r + 1]) of row r = rows[s] (r = s
without `rows`), from the state h = h0[s]:
    h = exp(dt_t A) h + dt_t x_t (outer) B_t ;  y_t = h . C_t
with x, dt: [T, D] (dt final: bias and softplus applied), A: [D, N], B, C: [T, N],
cu_seqlens: int64 [R + 1] token offsets of the batch's rows, h0: [S, D, N]. This is
engine.models.ssm.selective_scan_ref per sequence (no D skip, no gate); y is float32 unless
`out` is given. `rows` lets the prefill rows of a batch that interleaves them with decode
rows be scanned in place, without packing their tokens: y is written at their tokens only.

Final states: returned as h_final [S, D, N] float32, or, with `state` and `slots`, written
straight into the state pool at state[slots[s]] (in the pool's dtype; h_final is then None).
Slots must be distinct. h0 is read once per program before its final state is written, so h0
may be the pool's own rows only if h0[s] is state[slots[s]]; a gathered copy is always safe.

`selective_scan_varlen_triton` is one program per (sequence, block of channels): the
[BLOCK_D, N] state stays in registers and the program loops over its sequence's tokens,
reading the bounds from cu_seqlens itself, so the launch neither loops over tokens in Python
nor syncs with the host (the grid depends on S and D only). The loop is a `tl.range` with
`num_stages`, which lets the compiler keep the loads of the next tokens in flight while the
current one is applied (a hint: it pipelines what it can and runs the plain loop otherwise).
"""

from __future__ import annotations

import torch

from engine.kernels._triton import jit, next_power_of_2, tl, unit_last_stride

LOOP_STAGES = 4  # tokens whose loads may be in flight at once in the kernel's loop


def selective_scan_varlen_ref(x, dt, A, B, C, cu_seqlens, h0, rows=None, state=None, slots=None, out=None):
    """The definition, one token at a time. Returns (y [T, D], h_final [S, D, N] or None)."""
    rows = _check(x, dt, A, B, C, cu_seqlens, h0, rows, state, slots, out)
    y = out if out is not None else torch.empty(x.shape, dtype=torch.float32, device=x.device)
    bounds = cu_seqlens.tolist()
    A = A.float()
    finals = []
    for s, row in enumerate(rows.tolist()):
        h = h0[s].float()
        for t in range(bounds[row], bounds[row + 1]):
            dt_t = dt[t].float()[:, None]
            h = torch.exp(dt_t * A) * h + dt_t * x[t].float()[:, None] * B[t].float()[None, :]
            y[t] = h @ C[t].float()
        finals.append(h)
    h_final = torch.stack(finals) if finals else h0.new_zeros(h0.shape, dtype=torch.float32)
    if state is None:
        return y, h_final
    state.index_copy_(0, slots, h_final.to(state.dtype))
    return y, None


def selective_scan_varlen_triton(x, dt, A, B, C, cu_seqlens, h0, rows=None, state=None, slots=None,
                                 out=None):
    rows_given = rows is not None
    rows = _check(x, dt, A, B, C, cu_seqlens, h0, rows, state, slots, out)
    tokens, d_inner = x.shape
    d_state = A.shape[1]
    seqs = rows.shape[0]
    y = out if out is not None else torch.empty(tokens, d_inner, dtype=torch.float32, device=x.device)
    h_final = None if state is not None else torch.empty(seqs, d_inner, d_state, dtype=torch.float32,
                                                         device=x.device)
    if seqs == 0:
        return y, h_final
    final = state if state is not None else h_final
    x, dt, A, B, C, h0 = (unit_last_stride(t) for t in (x, dt, A, B, C, h0))
    if final.stride(2) != 1 or y.stride(1) != 1:
        raise ValueError("state and out need a unit stride in their last dimension")
    n_pad = next_power_of_2(d_state)
    block_d = max(1, min(next_power_of_2(d_inner), 4096 // n_pad, 64))  # bounds registers per program
    grid = (seqs, -(-d_inner // block_d))
    _selective_scan_varlen_kernel[grid](
        x, dt, A, B, C, cu_seqlens, rows, h0, final, slots if slots is not None else rows, y,
        d_inner, d_state,
        x.stride(0), dt.stride(0), A.stride(0), B.stride(0), C.stride(0),
        h0.stride(0), h0.stride(1), final.stride(0), final.stride(1), y.stride(0),
        N_PAD=n_pad, BLOCK_D=block_d, HAS_ROWS=rows_given, HAS_SLOTS=state is not None,
        STAGES=LOOP_STAGES,
    )
    return y, h_final


def _check(x, dt, A, B, C, cu_seqlens, h0, rows, state, slots, out):
    """Validates shapes; returns rows as an int64 tensor (0..R-1 when not given)."""
    if x.dim() != 2 or A.dim() != 2 or cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 1:
        raise ValueError(f"shapes: x {tuple(x.shape)} (want [T, D]), A {tuple(A.shape)} (want [D, N]), "
                         f"cu_seqlens {tuple(cu_seqlens.shape)} (want [R + 1])")
    if (state is None) != (slots is None):
        raise ValueError("state and slots go together: both or neither")
    tokens, d_inner = x.shape
    d_state = A.shape[1]
    if rows is None:
        rows = torch.arange(cu_seqlens.shape[0] - 1, device=cu_seqlens.device)
    seqs = rows.shape[0]
    wanted = {"dt": (dt, (tokens, d_inner)), "A": (A, (d_inner, d_state)), "B": (B, (tokens, d_state)),
              "C": (C, (tokens, d_state)), "h0": (h0, (seqs, d_inner, d_state)), "rows": (rows, (seqs,)),
              "slots": (slots, (seqs,)), "out": (out, (tokens, d_inner)),
              "state": (state, (state.shape[0] if state is not None else 0, d_inner, d_state))}
    for name, (tensor, shape) in wanted.items():
        if tensor is not None and tuple(tensor.shape) != shape:
            raise ValueError(f"{name} has shape {tuple(tensor.shape)}, expected {shape} "
                             f"(x is {tuple(x.shape)}, A {tuple(A.shape)}, {seqs} sequences)")
    return rows


@jit
def _selective_scan_varlen_kernel(x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, cu_ptr, rows_ptr, h0_ptr, final_ptr,
                                  slots_ptr, y_ptr, d_inner, d_state,
                                  x_stride_t, dt_stride_t, A_stride_d, B_stride_t, C_stride_t,
                                  h0_stride_s, h0_stride_d, final_stride_s, final_stride_d, y_stride_t,
                                  N_PAD: tl.constexpr, BLOCK_D: tl.constexpr, HAS_ROWS: tl.constexpr,
                                  HAS_SLOTS: tl.constexpr, STAGES: tl.constexpr):
    seq = tl.program_id(0)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    n = tl.arange(0, N_PAD)
    d_ok = d < d_inner
    n_ok = n < d_state
    dn_ok = d_ok[:, None] & n_ok[None, :]
    if HAS_ROWS:
        row = tl.load(rows_ptr + seq)
    else:
        row = seq
    start = tl.load(cu_ptr + row).to(tl.int64)  # int64: t * stride may exceed 2**31
    end = tl.load(cu_ptr + row + 1).to(tl.int64)

    # Padded lanes: A = 0 and B = x = dt = 0 keep their state 0 (exp(0) = 1 times 0, plus 0).
    A = tl.load(A_ptr + d[:, None] * A_stride_d + n[None, :], mask=dn_ok, other=0.0).to(tl.float32)
    h = tl.load(h0_ptr + seq.to(tl.int64) * h0_stride_s + d[:, None] * h0_stride_d + n[None, :],
                mask=dn_ok, other=0.0).to(tl.float32)
    for t in tl.range(start, end, num_stages=STAGES):
        x = tl.load(x_ptr + t * x_stride_t + d, mask=d_ok, other=0.0).to(tl.float32)
        dt = tl.load(dt_ptr + t * dt_stride_t + d, mask=d_ok, other=0.0).to(tl.float32)
        B = tl.load(B_ptr + t * B_stride_t + n, mask=n_ok, other=0.0).to(tl.float32)
        C = tl.load(C_ptr + t * C_stride_t + n, mask=n_ok, other=0.0).to(tl.float32)
        h = h * tl.exp(dt[:, None] * A) + (dt * x)[:, None] * B[None, :]
        tl.store(y_ptr + t * y_stride_t + d, tl.sum(h * C[None, :], axis=1), mask=d_ok)

    if HAS_SLOTS:
        slot = tl.load(slots_ptr + seq).to(tl.int64)
    else:
        slot = seq.to(tl.int64)
    tl.store(final_ptr + slot * final_stride_s + d[:, None] * final_stride_d + n[None, :], h, mask=dn_ok)
