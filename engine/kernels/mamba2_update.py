"""mamba2-state-update: one decode token through the SSD recurrence of a Mamba2 layer.

Per decode row b with state h = ssm_state[slot]  ([H, P, N], float32 pool), head h of group
g = h // (H / G):
    dt  = clamp(softplus(dt + dt_bias), dt_limit)   bias and softplus only when asked
    h   = h * exp(dt A) + dt * x (outer) B_g        -> written back to the slot
    y   = h . C_g  (+ D * x)
A, dt and D are per head (scalars per head: Mamba2's A is a scalar times identity). The clamp
is applied whenever dt_limit is finite: a decode step must compute exactly what the chunked
prefill computes for the same token. `y` is float32 unless `out` is given. Slots must be
distinct within a call: rows update in place.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

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
                            dt_softplus=False, dt_limit=NO_LIMIT, out=None):
    """ssm_state: [slots, H, P, N] (updated at rows `slots`); slots: int64 [b]; x: [b, H, P];
    dt: [b, H]; A, D, dt_bias: [H]; B, C: [b, G, N]. Returns y [b, H, P]."""
    check_state_update(ssm_state, slots, x, dt, A, B, C, D, dt_bias)
    heads, groups = x.shape[1], B.shape[1]
    dt = process_dt(dt, dt_bias, dt_softplus, dt_limit)  # [b, H]
    x = x.float()
    B = B.float().repeat_interleave(heads // groups, dim=1)  # [b, H, N]
    C = C.float().repeat_interleave(heads // groups, dim=1)
    h = ssm_state.index_select(0, slots).float()
    decay = torch.exp(dt * A.float())[:, :, None, None]
    h = h * decay + (dt[:, :, None] * x)[:, :, :, None] * B[:, :, None, :]
    ssm_state.index_copy_(0, slots, h.to(ssm_state.dtype))
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
