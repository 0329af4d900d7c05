"""mamba2-state-update: one decode token through the SSD recurrence of a Mamba2 layer.

Per decode row b with state h = ssm_state[slot]  ([H, P, N], float32 pool), head h of group
g = h // (H / G):
    dt  = clamp(softplus(dt + dt_bias), dt_limit)   bias and softplus only when asked
    h   = h * exp(dt A) + dt * x (outer) B_g        -> written back to the slot
    y   = h . C_g  (+ D * x)
A, dt and D are per head (scalars per head: Mamba2's A is a scalar times identity). The clamp
is applied whenever dt_limit is finite: a decode step must compute exactly what the chunked
prefill computes for the same token. `y` is float32 unless `out` is given. Slots must be
distinct within a call (rows update in place), unless `slot_runs` says that rows sharing one
are adjacent and run in row order (engine.kernels.slot_runs). A half-width pool (engine.state_format) is read
exactly and written stochastically rounded, as its load and store around the layer would
(engine.kernels.state_round), given `positions`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from engine.kernels._triton import jit, next_power_of_2, tl, unit_last_stride
from engine.kernels.slot_runs import in_waves, slot_rows
from engine.kernels.state_round import in_place_pool, load_state, store_slots, store_state

NO_LIMIT = (0.0, math.inf)


def process_dt(dt, dt_bias=None, dt_softplus=False, dt_limit=NO_LIMIT):
    """The dt every Mamba2 path uses: float32, + bias, softplus, clamped to the config's limits."""
    dt = dt.float()
    if dt_bias is not None:
        dt = dt + dt_bias.float()
    if dt_softplus:
        dt = F.softplus(dt)
    lo, hi = dt_limit
    if lo > 0.0 or hi != math.inf:
        dt = dt.clamp(min=lo, max=hi)
    return dt


def mamba2_state_update_ref(ssm_state, slots, x, dt, A, B, C, D=None, dt_bias=None,
                            dt_softplus=False, dt_limit=NO_LIMIT, out=None, positions=None, slot_runs=False):
    """ssm_state: [slots, H, P, N] (updated at rows `slots`); slots: int64 [b]; x: [b, H, P];
    dt: [b, H]; A, D, dt_bias: [H]; B, C: [b, G, N]; positions: int64 [b], each row's sequence
    length after the step, for a half-width pool; slot_runs: adjacent rows may share a slot
    (engine.kernels.slot_runs). Returns y [b, H, P]."""
    check_state_update(ssm_state, slots, x, dt, A, B, C, D, dt_bias)
    if slot_runs:
        y = out if out is not None else torch.empty(x.shape, dtype=torch.float32, device=x.device)
        return in_waves(slots, y, lambda rows: mamba2_state_update_ref(
            ssm_state, slots[rows], x[rows], dt[rows], A, B[rows], C[rows], D, dt_bias, dt_softplus, dt_limit,
            positions=None if positions is None else positions[rows]))
    in_place_pool(ssm_state, positions)
    heads, groups = x.shape[1], B.shape[1]
    dt = process_dt(dt, dt_bias, dt_softplus, dt_limit)  # [b, H]
    x = x.float()
    B = B.float().repeat_interleave(heads // groups, dim=1)  # [b, H, N]
    C = C.float().repeat_interleave(heads // groups, dim=1)
    h = ssm_state.index_select(0, slots).float()
    decay = torch.exp(dt * A.float())[:, :, None, None]
    h = h * decay + (dt[:, :, None] * x)[:, :, :, None] * B[:, :, None, :]
    store_slots(ssm_state, slots, h, positions)
    y = torch.einsum("bhpn,bhn->bhp", h, C)
    if D is not None:
        y = y + x * D.float()[None, :, None]
    if out is None:
        return y
    out.copy_(y)
    return out


def check_state_update(ssm_state, slots, x, dt, A, B, C, D, dt_bias):
    if x.dim() != 3 or ssm_state.dim() != 4 or B.dim() != 3:
        raise ValueError(f"shapes: ssm_state {tuple(ssm_state.shape)} (want [slots, H, P, N]), "
                         f"x {tuple(x.shape)} (want [b, H, P]), B {tuple(B.shape)} (want [b, G, N])")
    batch, heads, head_dim = x.shape
    groups, d_state = B.shape[1], ssm_state.shape[3]
    if groups == 0 or heads % groups:
        raise ValueError(f"{heads} heads are not a multiple of {groups} groups")
    wanted = {"ssm_state": (ssm_state, (ssm_state.shape[0], heads, head_dim, d_state)),
              "slots": (slots, (batch,)), "dt": (dt, (batch, heads)), "A": (A, (heads,)),
              "B": (B, (batch, groups, d_state)), "C": (C, (batch, groups, d_state)),
              "D": (D, (heads,)), "dt_bias": (dt_bias, (heads,))}
    for name, (tensor, shape) in wanted.items():
        if tensor is not None and tuple(tensor.shape) != shape:
            raise ValueError(f"{name} has shape {tuple(tensor.shape)}, expected {shape} "
                             f"(x is {tuple(x.shape)}, ssm_state {tuple(ssm_state.shape)})")


def mamba2_state_update_triton(ssm_state, slots, x, dt, A, B, C, D=None, dt_bias=None,
                               dt_softplus=False, dt_limit=NO_LIMIT, out=None, positions=None, slot_runs=False):
    check_state_update(ssm_state, slots, x, dt, A, B, C, D, dt_bias)
    pool, half = in_place_pool(ssm_state, positions)
    batch, heads, head_dim = x.shape
    groups, d_state = B.shape[1], ssm_state.shape[3]
    if out is None:
        out = torch.empty(batch, heads, head_dim, dtype=torch.float32, device=x.device)
    if batch == 0:
        return out
    x, B, C = (unit_last_stride(t) for t in (x, B, C))
    if ssm_state.stride(3) != 1 or out.stride(2) != 1:
        raise ValueError("ssm_state and out need a unit stride in their last dimension")
    lo, hi = (float(v) for v in dt_limit)
    n_pad = next_power_of_2(d_state)
    block_p = max(1, min(next_power_of_2(head_dim), 4096 // n_pad, 64))  # bounds registers per program
    grid = (batch, heads, -(-head_dim // block_p))
    _mamba2_update_kernel[grid](
        pool, slots, positions if half else slots, x, dt, A, B, C,
        D if D is not None else A, dt_bias if dt_bias is not None else A, out,
        batch, head_dim, d_state, heads // groups, lo, hi,
        ssm_state.stride(0), ssm_state.stride(1), ssm_state.stride(2),
        x.stride(0), x.stride(1), dt.stride(0), dt.stride(1), A.stride(0),
        B.stride(0), B.stride(1), C.stride(0), C.stride(1),
        D.stride(0) if D is not None else 0, dt_bias.stride(0) if dt_bias is not None else 0,
        out.stride(0), out.stride(1),
        N_PAD=n_pad, BLOCK_P=block_p, HAS_D=D is not None, HAS_DT_BIAS=dt_bias is not None,
        DT_SOFTPLUS=bool(dt_softplus),
        # the reference clamps only then; an unclamped dt may be negative without softplus
        DT_CLAMP=lo > 0.0 or hi != math.inf, HALF=half, SLOT_RUNS=bool(slot_runs),
    )
    return out



@jit
def _mamba2_update_kernel(state_ptr, slots_ptr, positions_ptr, x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr,
                          dt_bias_ptr, out_ptr,
                          rows, head_dim, d_state, heads_per_group, dt_lo, dt_hi,
                          state_stride_slot, state_stride_h, state_stride_p,
                          x_stride_row, x_stride_h, dt_stride_row, dt_stride_h, A_stride,
                          B_stride_row, B_stride_g, C_stride_row, C_stride_g, D_stride, dt_bias_stride,
                          out_stride_row, out_stride_h,
                          N_PAD: tl.constexpr, BLOCK_P: tl.constexpr, HAS_D: tl.constexpr,
                          HAS_DT_BIAS: tl.constexpr, DT_SOFTPLUS: tl.constexpr, DT_CLAMP: tl.constexpr,
                          HALF: tl.constexpr, SLOT_RUNS: tl.constexpr):
    row = tl.program_id(0)
    head = tl.program_id(1)
    group = head // heads_per_group
    p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    n = tl.arange(0, N_PAD)
    p_ok = p < head_dim
    n_ok = n < d_state
    pn_ok = p_ok[:, None] & n_ok[None, :]
    elements = head * state_stride_h + p[:, None] * state_stride_p + n[None, :]  # within the slot's row
    A = tl.load(A_ptr + head * A_stride).to(tl.float32)
    D = tl.load(D_ptr + head * D_stride).to(tl.float32) if HAS_D else 0.0
    dt_bias = tl.load(dt_bias_ptr + head * dt_bias_stride).to(tl.float32) if HAS_DT_BIAS else 0.0
    slot, end, ok = slot_rows(slots_ptr, row, rows, pn_ok, SLOT_RUNS)  # this program's rows: engine.kernels.slot_runs
    state = state_ptr + slot * state_stride_slot + elements
    h = load_state(state, ok, HALF)
    for r in range(row, end):
        x = tl.load(x_ptr + r * x_stride_row + head * x_stride_h + p, mask=p_ok, other=0.0).to(tl.float32)
        dt = tl.load(dt_ptr + r * dt_stride_row + head * dt_stride_h).to(tl.float32) + dt_bias
        if DT_SOFTPLUS:
            dt = tl.where(dt <= 20.0, tl.log(1.0 + tl.exp(dt)), dt)  # torch's softplus threshold
        if DT_CLAMP:
            dt = tl.minimum(tl.maximum(dt, dt_lo), dt_hi)  # dt_hi may be inf
        B = tl.load(B_ptr + r * B_stride_row + group * B_stride_g + n, mask=n_ok, other=0.0).to(tl.float32)
        C = tl.load(C_ptr + r * C_stride_row + group * C_stride_g + n, mask=n_ok, other=0.0).to(tl.float32)
        h = h * tl.exp(dt * A) + (dt * x)[:, None] * B[None, :]
        y = tl.sum(h * C[None, :], axis=1)
        if HAS_D:
            y += x * D
        tl.store(out_ptr + r * out_stride_row + head * out_stride_h + p, y, mask=p_ok)
    store_state(state, h, ok, tl.load(positions_ptr + end - 1) if HALF else 0, elements, HALF)
