"""causal-conv1d-update: one decode token through the depthwise causal conv of a Mamba layer.

conv_state[slot] holds the last d_conv inputs of the sequence, oldest first (float32 pool).
Per decode row b:  window = cat(conv_state[slot][:, 1:], x[b]) -> written back to the slot;
                   out[b] = act(sum(window * weight, -1) + bias).
Arithmetic is float32 whatever the input dtype; `out` gets x's dtype. Slots must be distinct
within a call (rows update in place), unless `slot_runs` says that rows sharing one are
adjacent and run in row order (engine.kernels.slot_runs). A half-width pool
(engine.state_format) is read exactly and written stochastically rounded, as its load and
store around the layer would (engine.kernels.state_round), given `positions`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.kernels._triton import jit, next_power_of_2, tl, unit_last_stride
from engine.kernels.slot_runs import in_waves, slot_rows
from engine.kernels.state_round import in_place_pool, load_state, store_slots, store_state

ACTIVATIONS = (None, "silu")


def causal_conv1d_update_ref(conv_state, slots, x, weight, bias=None, activation=None, out=None, positions=None,
                             slot_runs=False):
    """conv_state: [slots, D, K] (updated in place at rows `slots`); slots: int64 [B];
    x: [B, D]; weight: [D, K]; bias: [D] or None; activation: None or "silu"; positions: int64
    [B], each row's sequence length after the step, for a half-width pool; slot_runs: adjacent
    rows may share a slot (engine.kernels.slot_runs). Returns [B, D]."""
    check_conv_update(conv_state, slots, x, weight, bias, activation)
    if slot_runs:
        return in_waves(slots, out if out is not None else torch.empty_like(x), lambda rows: causal_conv1d_update_ref(
            conv_state, slots[rows], x[rows], weight, bias, activation,
            positions=None if positions is None else positions[rows]))
    in_place_pool(conv_state, positions)
    window = torch.cat((conv_state.index_select(0, slots)[:, :, 1:].float(), x.float().unsqueeze(-1)), dim=-1)
    store_slots(conv_state, slots, window, positions)
    y = (window * weight.float()).sum(-1)
    if bias is not None:
        y = y + bias.float()
    if activation == "silu":
        y = F.silu(y)
    if out is None:
        return y.to(x.dtype)
    out.copy_(y)
    return out


def causal_conv1d_update_triton(conv_state, slots, x, weight, bias=None, activation=None, out=None, positions=None,
                                slot_runs=False):
    check_conv_update(conv_state, slots, x, weight, bias, activation)
    pool, half = in_place_pool(conv_state, positions)
    batch, d_inner = x.shape
    d_conv = conv_state.shape[2]
    if out is None:
        out = torch.empty_like(x)
    if batch == 0:
        return out
    x, weight = unit_last_stride(x), unit_last_stride(weight)
    if conv_state.stride(2) != 1 or out.stride(1) != 1:
        raise ValueError("conv_state and out need a unit stride in their last dimension")
    block_d = min(128, next_power_of_2(d_inner))
    grid = (batch, -(-d_inner // block_d))
    _conv_update_kernel[grid](
        pool, slots, positions if half else slots, x, weight, bias if bias is not None else weight, out,
        batch, d_inner, conv_state.stride(0), conv_state.stride(1), x.stride(0), weight.stride(0),
        out.stride(0),
        D_CONV=d_conv, K_PAD=next_power_of_2(d_conv), BLOCK_D=block_d,
        HAS_BIAS=bias is not None, SILU=activation == "silu", HALF=half, SLOT_RUNS=bool(slot_runs),
    )
    return out


def check_conv_update(conv_state, slots, x, weight, bias, activation):
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    if conv_state.dim() != 3 or x.dim() != 2 or weight.shape != conv_state.shape[1:]:
        raise ValueError(f"shapes: conv_state {tuple(conv_state.shape)} (want [slots, D, K]), "
                         f"x {tuple(x.shape)} (want [B, D]), weight {tuple(weight.shape)} (want [D, K])")
    if x.shape[1] != conv_state.shape[1] or slots.shape != (x.shape[0],):
        raise ValueError(f"x {tuple(x.shape)}, slots {tuple(slots.shape)} and conv_state "
                         f"{tuple(conv_state.shape)} disagree")
    if bias is not None and bias.shape != (x.shape[1],):
        raise ValueError(f"bias {tuple(bias.shape)} must be [D]")



@jit
def _conv_update_kernel(state_ptr, slots_ptr, positions_ptr, x_ptr, weight_ptr, bias_ptr, out_ptr,
                        rows, d_inner, state_stride_slot, state_stride_d, x_stride_row, weight_stride_d,
                        out_stride_row,
                        D_CONV: tl.constexpr, K_PAD: tl.constexpr, BLOCK_D: tl.constexpr,
                        HAS_BIAS: tl.constexpr, SILU: tl.constexpr, HALF: tl.constexpr, SLOT_RUNS: tl.constexpr):
    row = tl.program_id(0)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    k = tl.arange(0, K_PAD)
    d_ok = d < d_inner
    tap_ok = d_ok[:, None] & (k[None, :] < D_CONV)
    elements = d[:, None] * state_stride_d + k[None, :]  # within the slot's row (a contiguous pool's)
    weight = tl.load(weight_ptr + d[:, None] * weight_stride_d + k[None, :], mask=tap_ok, other=0.0).to(tl.float32)
    slot, end, ok = slot_rows(slots_ptr, row, rows, tap_ok, SLOT_RUNS)  # this program's rows: engine.kernels.slot_runs
    state = state_ptr + slot * state_stride_slot + elements

    # Row r's window is taps 1 + (r - row) onwards of the slot's old taps followed by the
    # inputs of rows row..r: tap k is old tap t = k + 1 + (r - row) while t < D_CONV, else the
    # input of row row + t - D_CONV (for a run of one, the last tap is the row's own input).
    # The slot is written only after the last row, so every row reads the old taps in place.
    window = tl.zeros([BLOCK_D, K_PAD], dtype=tl.float32)
    for r in range(row, end):
        t = k[None, :] + 1 + (r - row)
        old = load_state(state + 1 + (r - row), d_ok[:, None] & (t < D_CONV), HALF)
        x = tl.load(x_ptr + (row + t - D_CONV) * x_stride_row + d[:, None],
                    mask=tap_ok & (t >= D_CONV), other=0.0).to(tl.float32)
        window = tl.where(t >= D_CONV, x, old)
        y = tl.sum(window * weight, axis=1)
        if HAS_BIAS:
            y += tl.load(bias_ptr + d, mask=d_ok, other=0.0).to(tl.float32)
        if SILU:
            y = y * tl.sigmoid(y)
        tl.store(out_ptr + r * out_stride_row + d, y, mask=d_ok)
    store_state(state, window, ok, tl.load(positions_ptr + end - 1) if HALF else 0, elements, HALF)
