"""Mamba2 (SSD) mixer over a varlen batch with a slot-indexed state pool.

One in_proj gives the gate z, xBC (x, B and C together) and dt per head; a causal depthwise
conv runs over xBC; B and C are shared by groups of heads; A is one scalar per head. Per
sequence it keeps `conv` [conv_dim, d_conv] and `ssm` [heads, head_dim, d_state] (float32).

By phase (engine.phase): FRESH_PREFILL starts conv and ssm from explicit zeros and only
writes the slot; CONTINUED_PREFILL starts from the slot (its own, checked by the runner);
DECODE reads the slot, updates it with one token and writes it back.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels import (cpu, cpu_kernels_ready, mamba2_state_update, native, ssd_chunk_scan, ssd_chunk_scan_varlen,
                            ssd_varlen_available)
from engine.kernels.mamba2_update import process_dt
from engine.kernels.decode_plan import MAMBA2, LayerPlan, Needs, all_cpu, pointer
from engine.tp.group import TPGroup
from engine.tp.parallel import Apply, RowParallelLinear, check_linear, keep_rows, set_param, span
from engine.tp.plan import expand, mamba2_layout, scaled
from engine.models.batch import ForwardBatch
from engine.models.hybrid import StateTensorSpec
from engine.models.layers import GatedRMSNorm, activation
from engine.models.ssm import PrefillRows, conv_then_act, decodes_in_one_call, packed_fit


class Mamba2Mixer(nn.Module):
    state_kind = "mamba2"
    # Every decode kernel forward calls takes a half-width state pool in place, given the rows'
    # positions (engine.state_format: an all-decode step on Triton skips the working rows).
    reads_narrow_state_in_place = True

    def __init__(self, hidden: int, num_heads: int, head_dim: int, n_groups: int, d_state: int,
                 d_conv: int, chunk_size: int, conv_bias: bool, proj_bias: bool, act: str,
                 dt_limit: tuple[float, float], norm: GatedRMSNorm | None):
        super().__init__()
        if n_groups <= 0 or num_heads % n_groups:
            raise ValueError(f"{num_heads} Mamba2 heads are not a multiple of n_groups={n_groups}")
        self.num_heads, self.head_dim, self.n_groups = num_heads, head_dim, n_groups
        self.d_state, self.d_conv, self.chunk_size = d_state, d_conv, chunk_size
        self.d_ssm = num_heads * head_dim
        self.conv_dim = self.d_ssm + 2 * n_groups * d_state
        self.in_proj = nn.Linear(hidden, self.d_ssm + self.conv_dim + num_heads, bias=proj_bias)
        self.conv_weight = nn.Parameter(torch.empty(self.conv_dim, d_conv))
        self.conv_bias = nn.Parameter(torch.zeros(self.conv_dim)) if conv_bias else None
        self.dt_bias = nn.Parameter(torch.empty(num_heads))
        self.A_log = nn.Parameter(torch.empty(num_heads))
        self.D = nn.Parameter(torch.ones(num_heads))
        self.norm = norm  # None: y * silu(z), no norm (a Falcon-H1 option)
        self.out_proj = nn.Linear(self.d_ssm, hidden, bias=proj_bias)
        self.act = activation(act)
        self.dt_limit = (float(dt_limit[0]), float(dt_limit[1]))
        self._one_call_fit = ((), False)  # (the packed weights it was checked for, the answer)

    def state_spec(self) -> list[StateTensorSpec]:
        return [StateTensorSpec("conv", (self.conv_dim, self.d_conv)),
                StateTensorSpec("ssm", (self.num_heads, self.head_dim, self.d_state))]

    def split_projection(self, zxbcdt: torch.Tensor):
        """in_proj output -> (z, xBC, dt). Families that scale the parts override this."""
        return torch.split(zxbcdt, [self.d_ssm, self.conv_dim, self.num_heads], dim=-1)

    def splits_plainly(self) -> bool:
        """Whether forward runs on in_proj(hidden) split as above, unscaled (a family that scales
        the input or the parts says when it does not)."""
        return type(self).split_projection is Mamba2Mixer.split_projection and type(self).forward is Mamba2Mixer.forward

    def forward(self, hidden: torch.Tensor, batch: ForwardBatch,
                state: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        if self._decodes_in_one_call(hidden, batch, state):
            return self._decode_in_one_call(hidden, batch, state)
        conv_state, ssm_state = state
        z, xbc, dt = self.split_projection(self.in_proj(hidden))
        xbc = conv_then_act(self.act, xbc, batch, conv_state, self.conv_weight, self.conv_bias)
        x, B, C = torch.split(xbc, [self.d_ssm, self.n_groups * self.d_state,
                                    self.n_groups * self.d_state], dim=-1)
        tokens = x.shape[0]
        x = x.reshape(tokens, self.num_heads, self.head_dim)
        B = B.reshape(tokens, self.n_groups, self.d_state)
        C = C.reshape(tokens, self.n_groups, self.d_state)
        A, D = self.decay_and_skip()
        y = torch.empty(tokens, self.num_heads, self.head_dim, dtype=torch.float32, device=x.device)
        if batch.prefill_rows:
            dt_full = process_dt(dt, self.dt_bias, True, self.dt_limit)
        if batch.prefill_rows and ssd_varlen_available(ssm_state):  # a round's segments in one pass (CUDA)
            for rows in PrefillRows.rounds(batch, ssm_state, x.device):
                picked_x, picked_dt, picked_B, picked_C = rows.pick(x, dt_full, B, C)
                out, states = ssd_chunk_scan_varlen(picked_x, picked_dt, A, picked_B, picked_C,
                                                    rows.initial_states(ssm_state), rows.bounds, self.chunk_size)
                rows.put(y, out, ssm_state, states)
        elif batch.prefill_rows:
            for segment in batch.state_spans.segments(ssm_state):
                start, end, slot = segment.start, segment.end, segment.dst
                h0 = torch.zeros(ssm_state.shape[1:], device=x.device) if segment.fresh else ssm_state[slot]
                y[start:end], h = ssd_chunk_scan(x[start:end], dt_full[start:end], A, B[start:end],
                                                 C[start:end], h0, self.chunk_size)
                ssm_state[slot] = h.to(ssm_state.dtype)
        if batch.decode_rows:  # read the slot's state, update it in place (Triton on CUDA)
            idx, slots = batch.decode_tokens, batch.decode_slots
            y[idx] = mamba2_state_update(ssm_state, slots, x[idx], dt[idx], A, B[idx], C[idx],
                                         dt_bias=self.dt_bias, dt_softplus=True, dt_limit=self.dt_limit,
                                         positions=batch.decode_context_lens, slot_runs=batch.decode_slot_runs)
        x_rows = x.reshape(tokens, self.d_ssm)  # views into the projection: strided rows
        norm, rows = self.norm, cpu.rows_with_stride(x_rows) and cpu.rows_with_stride(z) and cpu_kernels_ready()
        if rows and norm is not None and norm.norm_before_gate and type(norm) is GatedRMSNorm \
                and norm.weight.dtype == torch.float32:  # y + x D, normed, then gated: one pass
            y = cpu.skip_norm_gate_cpu(y.view(tokens, self.d_ssm), x_rows, D, z, norm.weight, norm.group_size, norm.eps)
        elif rows and (norm is None or not norm.norm_before_gate):
            # (y + x D) * silu(z) in one pass over y, then the norm alone
            y = cpu.gated_skip_cpu(y.view(tokens, self.d_ssm), x_rows, D, z)
            y = norm.normalise_gated(y) if norm is not None else y
        else:
            y = (y + x.float() * self.D.float()[:, None]).reshape(tokens, self.d_ssm)
            y = self.norm(y, z) if self.norm is not None else y * F.silu(z.float())
        return self.out_proj(y.to(hidden.dtype))

    def decay_and_skip(self) -> tuple[torch.Tensor, torch.Tensor]:
        """A [heads] and D one per channel, float32, as every path computes them (so the one-call
        decode gives the chain's bits)."""
        return -torch.exp(self.A_log.float()), self.D.float().repeat_interleave(self.head_dim)

    def tp_plan(self, group: TPGroup) -> Apply | None:
        return self.tp_plan_of_mamba2(group) if type(self) is Mamba2Mixer else None

    def tp_plan_of_mamba2(self, group: TPGroup) -> Apply:
        """Heads split, B/C groups split or replicated (engine.tp.plan); conv channels, dt,
        dt_bias, A_log and D follow; the gated norm all-reduces when its groups span ranks."""
        lay = mamba2_layout(self.num_heads, self.head_dim, self.n_groups, self.d_state, group.size, group.rank)
        check_linear(self.in_proj, "Mamba2 in_proj")
        check_linear(self.out_proj, "Mamba2 out_proj")
        if self.norm is not None and type(self.norm) is not GatedRMSNorm:
            raise ValueError(f"tensor parallelism: Mamba2 norm is a {type(self.norm).__name__}, not a GatedRMSNorm")
        ssm = scaled(lay.heads, self.head_dim)
        conv = expand(lay.conv)
        # in_proj rows: z (d_ssm), then the conv input xBC (conv_dim), then dt (one per head).
        rows = (span(ssm) + [self.d_ssm + c for c in conv]
                + [self.d_ssm + self.conv_dim + h for h in range(*lay.heads)])
        heads = span(lay.heads)

        def apply():
            keep_rows(self.in_proj, rows)
            set_param(self, "conv_weight", self.conv_weight, 0, conv)
            if self.conv_bias is not None:
                set_param(self, "conv_bias", self.conv_bias, 0, conv)
            for name in ("dt_bias", "A_log", "D"):
                set_param(self, name, getattr(self, name), 0, heads)
            if self.norm is not None:
                self.norm = self.norm.tp_slice(ssm, group)
            self.out_proj = RowParallelLinear.of(self.out_proj, span(ssm), group, True, "Mamba2 out_proj")
            self.num_heads = len(heads)
            self.n_groups = lay.groups[1] - lay.groups[0]
            self.d_ssm = ssm[1] - ssm[0]
            self.conv_dim = len(conv)
        return apply

    def plan_decode(self, entry: LayerPlan, state, kv, keep: list, rotary: list) -> Needs | None:
        """This mixer's fields of a decode step's one-call plan (engine.kernels.decode_plan);
        Falcon-H1's too, once its multipliers are folded."""
        if not (all_cpu(state) and self.fits_one_call()):
            return None
        return self.fill_decode_plan(entry, state, keep)

    def fill_decode_plan(self, entry: LayerPlan, state, keep: list) -> Needs:
        conv_state, ssm_state = state
        A, D = self.decay_and_skip()  # the weights are final
        keep += [A, D]
        norm = self.norm
        entry.mixer = MAMBA2
        entry.ssm_heads, entry.ssm_head_dim, entry.groups = self.num_heads, self.head_dim, self.n_groups
        entry.d_state, entry.d_conv = self.d_state, self.d_conv
        entry.in_panels, entry.in_bias = self.in_proj.packed_weight.panels.data_ptr(), pointer(self.in_proj.bias)
        entry.conv_state, entry.ssm_state = conv_state.data_ptr(), ssm_state.data_ptr()
        entry.conv_weight, entry.conv_bias = self.conv_weight.data_ptr(), pointer(self.conv_bias)
        entry.dt_bias, entry.A, entry.D = self.dt_bias.data_ptr(), A.data_ptr(), D.data_ptr()
        entry.dt_lo, entry.dt_hi = cpu.dt_bounds(self.dt_limit)
        if norm is not None:
            entry.gate_norm, entry.gate_norm_group, entry.gate_norm_eps = norm.weight.data_ptr(), norm.group_size, norm.eps
            entry.gate_norm_first = int(norm.norm_before_gate)
        entry.out_panels, entry.out_bias = self.out_proj.packed_weight.panels.data_ptr(), pointer(self.out_proj.bias)
        return Needs(floats=self.one_call_scratch())

    def fits_one_call(self) -> bool:
        """SiLU, the projection split as is (splits_plainly), no norm or a GatedRMSNorm (not a
        sharded one), both linears packed (so not sharded), every parameter float32 and contiguous."""
        return packed_fit(self, (self.in_proj, self.out_proj), lambda: (
            self.act is F.silu and self.splits_plainly() and (self.norm is None or type(self.norm) is GatedRMSNorm)))

    def _decodes_in_one_call(self, hidden: torch.Tensor, batch: ForwardBatch, state) -> bool:
        return decodes_in_one_call(self, hidden, batch, state)

    def _decode_in_one_call(self, hidden: torch.Tensor, batch: ForwardBatch, state) -> torch.Tensor:
        conv_state, ssm_state = state
        rows, size = hidden.shape
        A, D = self.decay_and_skip()
        norm = self.norm
        out = torch.empty(rows, size)
        dt_lo, dt_hi = cpu.dt_bounds(self.dt_limit)
        native.call("mamba2_decode", h=hidden, rows=rows, hidden=size, heads=self.num_heads, head_dim=self.head_dim,
                    groups=self.n_groups, d_state=self.d_state, d_conv=self.d_conv,
                    in_panels=self.in_proj.packed_weight.panels, in_bias=self.in_proj.bias, conv_state=conv_state,
                    ssm_state=ssm_state, slots=cpu.ids(batch.decode_slots), conv_weight=self.conv_weight,
                    conv_bias=self.conv_bias, dt_bias=self.dt_bias, dt_lo=dt_lo, dt_hi=dt_hi, A=A, D=D,
                    norm_weight=None if norm is None else norm.weight,
                    norm_group=0 if norm is None else norm.group_size,
                    norm_first=int(norm is not None and norm.norm_before_gate),
                    norm_eps=0.0 if norm is None else float(norm.eps),
                    out_panels=self.out_proj.packed_weight.panels, out_bias=self.out_proj.bias,
                    scratch=torch.empty(rows * self.one_call_scratch()), out=out)
        return out

    def one_call_scratch(self) -> int:
        """mamba2_decode's scratch floats per row."""
        width = self.in_proj.packed_weight.out_features
        return width + self.conv_dim + self.num_heads + 3 * self.d_ssm + 2 * self.n_groups * self.d_state


def dt_limit_of(value) -> tuple[float, float]:
    """config time_step_limit (a pair, None meaning no limit) -> (low, high)."""
    if value is None:
        return (0.0, math.inf)
    low, high = value
    return (float(low), float(high))
