"""selective-state-update: one decode token through the selective scan of a Mamba (v1) layer.

Per decode row b with state h = ssm_state[slot]  ([D, N], float32 pool):
    dt  = softplus(dt + dt_bias)   only when asked; the engine passes its final dt
    h   = h * exp(dt A) + (dt x) B   -> written back to the slot
    y   = h . C  (+ D_skip * x)  (* silu(z))
Without D_skip and z this is exactly the decode part of MambaMixer.forward, which applies
both to all rows afterwards; with them it is the fused form. `y` is float32 unless `out` is
given (its dtype is then used). Slots must be distinct within a call (rows update in place),
unless `slot_runs` says that rows sharing one are adjacent and run in row order
(engine.kernels.slot_runs). A
half-width pool (engine.state_format) is read exactly and written stochastically rounded, as
its load and store around the layer would (engine.kernels.state_round), given `positions`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.kernels._triton import jit, next_power_of_2, tl, unit_last_stride
from engine.kernels.slot_runs import in_waves, slot_rows
from engine.kernels.state_round import in_place_pool, load_state, store_slots, store_state


def selective_state_update_ref(ssm_state, slots, x, dt, A, B, C, D=None, z=None,
                               dt_bias=None, dt_softplus=False, out=None, positions=None, slot_runs=False):
    """ssm_state: [slots, D, N] (updated at rows `slots`); slots: int64 [B]; x, dt, z: [B, D];
    A: [D, N]; B, C: [B, N]; D, dt_bias: [D]; positions: int64 [B], each row's sequence length
    after the step, for a half-width pool; slot_runs: adjacent rows may share a slot
    (engine.kernels.slot_runs). Returns y [B, D]."""
    _check(ssm_state, slots, x, dt, A, B, C, D, z, dt_bias)
    if slot_runs:
        y = out if out is not None else torch.empty(x.shape, dtype=torch.float32, device=x.device)
        return in_waves(slots, y, lambda rows: selective_state_update_ref(
            ssm_state, slots[rows], x[rows], dt[rows], A, B[rows], C[rows], D, None if z is None else z[rows],
            dt_bias, dt_softplus, positions=None if positions is None else positions[rows]))
    in_place_pool(ssm_state, positions)
    dt = dt.float()
    if dt_bias is not None:
        dt = dt + dt_bias.float()
    if dt_softplus:
        dt = F.softplus(dt)
    x = x.float()
    h = ssm_state.index_select(0, slots).float()  # index_select/index_copy_: no advanced-indexing pass
    h = torch.exp(dt[:, :, None] * A.float()) * h + dt[:, :, None] * B.float()[:, None, :] * x[:, :, None]
    store_slots(ssm_state, slots, h, positions)
    y = torch.einsum("bdn,bn->bd", h, C.float())
    if D is not None:
        y = y + x * D.float()
    if z is not None:
        y = y * F.silu(z.float())
    if out is None:
        return y
    out.copy_(y)
    return out


def selective_state_update_triton(ssm_state, slots, x, dt, A, B, C, D=None, z=None,
                                  dt_bias=None, dt_softplus=False, out=None, positions=None, slot_runs=False):
    _check(ssm_state, slots, x, dt, A, B, C, D, z, dt_bias)
    pool, half = in_place_pool(ssm_state, positions)
    batch, d_inner = x.shape
    d_state = A.shape[1]
    if out is None:
        out = torch.empty(batch, d_inner, dtype=torch.float32, device=x.device)
    if batch == 0:
        return out
    x, dt, A, B, C = (unit_last_stride(t) for t in (x, dt, A, B, C))
    z = unit_last_stride(z) if z is not None else None
    if ssm_state.stride(2) != 1 or out.stride(1) != 1:
        raise ValueError("ssm_state and out need a unit stride in their last dimension")
    n_pad = next_power_of_2(d_state)
    block_d = max(1, min(next_power_of_2(d_inner), 4096 // n_pad, 64))  # bounds registers per program
    grid = (batch, -(-d_inner // block_d))
    _ssm_update_kernel[grid](
        pool, slots, positions if half else slots, x, dt, A, B, C,
        D if D is not None else x, z if z is not None else x,
        dt_bias if dt_bias is not None else x, out,
        batch, d_inner, d_state,
        ssm_state.stride(0), ssm_state.stride(1), x.stride(0), dt.stride(0), A.stride(0),
        B.stride(0), C.stride(0), z.stride(0) if z is not None else 0, out.stride(0),
        N_PAD=n_pad, BLOCK_D=block_d, HAS_D=D is not None, HAS_Z=z is not None,
        HAS_DT_BIAS=dt_bias is not None, DT_SOFTPLUS=bool(dt_softplus), HALF=half,
        SLOT_RUNS=bool(slot_runs),
    )
    return out


def _check(ssm_state, slots, x, dt, A, B, C, D, z, dt_bias):
    batch, d_inner = x.shape
    d_state = ssm_state.shape[2]
    wanted = {"ssm_state": (ssm_state, (ssm_state.shape[0], d_inner, d_state)),
              "slots": (slots, (batch,)), "dt": (dt, (batch, d_inner)), "A": (A, (d_inner, d_state)),
              "B": (B, (batch, d_state)), "C": (C, (batch, d_state)), "D": (D, (d_inner,)),
              "z": (z, (batch, d_inner)), "dt_bias": (dt_bias, (d_inner,))}
    for name, (tensor, shape) in wanted.items():
        if tensor is not None and tuple(tensor.shape) != shape:
            raise ValueError(f"{name} has shape {tuple(tensor.shape)}, expected {shape} "
                             f"(x is {tuple(x.shape)}, ssm_state {tuple(ssm_state.shape)})")



@jit
def _ssm_update_kernel(state_ptr, slots_ptr, positions_ptr, x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr,
                       D_ptr, z_ptr, dt_bias_ptr, out_ptr,
                       rows, d_inner, d_state,
                       state_stride_slot, state_stride_d, x_stride_row, dt_stride_row,
                       A_stride_d, B_stride_row, C_stride_row, z_stride_row, out_stride_row,
                       N_PAD: tl.constexpr, BLOCK_D: tl.constexpr, HAS_D: tl.constexpr,
                       HAS_Z: tl.constexpr, HAS_DT_BIAS: tl.constexpr, DT_SOFTPLUS: tl.constexpr,
                       HALF: tl.constexpr, SLOT_RUNS: tl.constexpr):
    row = tl.program_id(0)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    n = tl.arange(0, N_PAD)
    d_ok = d < d_inner
    n_ok = n < d_state
    dn_ok = d_ok[:, None] & n_ok[None, :]
    elements = d[:, None] * state_stride_d + n[None, :]  # within the slot's row
    A = tl.load(A_ptr + d[:, None] * A_stride_d + n[None, :], mask=dn_ok, other=0.0).to(tl.float32)
    slot, end, ok = slot_rows(slots_ptr, row, rows, dn_ok, SLOT_RUNS)  # this program's rows: engine.kernels.slot_runs
    state = state_ptr + slot * state_stride_slot + elements
    h = load_state(state, ok, HALF)
    for r in range(row, end):
        x = tl.load(x_ptr + r * x_stride_row + d, mask=d_ok, other=0.0).to(tl.float32)
        dt = tl.load(dt_ptr + r * dt_stride_row + d, mask=d_ok, other=0.0).to(tl.float32)
        if HAS_DT_BIAS:
            dt += tl.load(dt_bias_ptr + d, mask=d_ok, other=0.0).to(tl.float32)
        if DT_SOFTPLUS:
            dt = tl.where(dt <= 20.0, tl.log(1.0 + tl.exp(dt)), dt)  # torch's softplus threshold
        B = tl.load(B_ptr + r * B_stride_row + n, mask=n_ok, other=0.0).to(tl.float32)
        C = tl.load(C_ptr + r * C_stride_row + n, mask=n_ok, other=0.0).to(tl.float32)
        h = h * tl.exp(dt[:, None] * A) + dt[:, None] * B[None, :] * x[:, None]
        y = tl.sum(h * C[None, :], axis=1)
        if HAS_D:
            y += x * tl.load(D_ptr + d, mask=d_ok, other=0.0).to(tl.float32)
        if HAS_Z:
            z = tl.load(z_ptr + r * z_stride_row + d, mask=d_ok, other=0.0).to(tl.float32)
            y = y * (z * tl.sigmoid(z))
        tl.store(out_ptr + r * out_stride_row + d, y, mask=d_ok)
    store_state(state, h, ok, tl.load(positions_ptr + end - 1) if HALF else 0, elements, HALF)
