"""Gated DeltaNet mixer (Qwen3-Next's linear attention) over a varlen batch with a slot pool.

Per token: projections give q, k (Hk key heads of dk), v, z (Hv value heads of dv) and b, a
(one each per value head); a short causal depthwise conv plus activation runs over q|k|v;
beta = sigmoid(b) and the log decay g = -exp(A_log) * softplus(a + dt_bias) drive the gated
delta rule (engine.kernels.gdn_scan); its output is RMS-normalised per head, gated by
silu(z) and projected out. Per sequence it keeps `conv` [conv_dim, conv_kernel] (the last
conv_kernel inputs of q|k|v) and `recurrent` [Hv, dk, dv], both float32.

By phase (engine.phase): FRESH_PREFILL starts conv and recurrent state from explicit zeros and
only writes the slot; CONTINUED_PREFILL starts from the slot (its own, checked by the runner);
DECODE reads the slot, updates it with one token and writes it back.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels import (chunk_gated_delta_rule, chunk_gated_delta_rule_varlen, cpu, gated_delta_step,
                            gated_delta_varlen_available, native, uses_cpu_kernel)
from engine.models.batch import ForwardBatch
from engine.kernels.decode_plan import GATED_DELTANET, LayerPlan, Needs, all_cpu
from engine.tp.group import TPGroup
from engine.tp.parallel import Apply, RowParallelLinear, check_linear, keep_rows, set_param, span
from engine.tp.plan import deltanet_layout, expand, scaled
from engine.models.hybrid import StateTensorSpec
from engine.models.layers import activation
from engine.models.ssm import PrefillRows, conv_then_act, decodes_in_one_call, packed_fit


class HeadGatedRMSNorm(nn.Module):
    """RMS-normalise each head's dv channels, scale by one [dv] weight shared by all heads, then
    multiply by silu(z) (normalise first, gate after). y, z: [T, Hv, dv]."""

    def __init__(self, head_dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(head_dim))
        self.eps = eps
        self._per_channel = (None, -1, None)  # (the weight it repeats, its version, [heads * head_dim])

    def per_channel(self, heads: int) -> torch.Tensor:
        """The weight repeated for every head, as the C++ norm takes it (made again when the weight
        is replaced or written in place, or the head count changes)."""
        source, version, repeated = self._per_channel
        if (source is not self.weight or version != self.weight._version
                or repeated.numel() != heads * self.weight.numel()):
            repeated = self.weight.detach().float().repeat(heads)
            self._per_channel = (self.weight, self.weight._version, repeated)
        return repeated

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        tokens, heads, head_dim = y.shape
        if uses_cpu_kernel(y) and z.dtype == torch.float32 and self.weight.dtype == torch.float32:
            # z's heads may sit apart in the projection (one block per key head): reshape copies then
            return cpu.skip_norm_gate_cpu(y.view(tokens, -1), None, None, z.reshape(tokens, -1),
                                          self.per_channel(heads), head_dim, self.eps).view(y.shape)
        dtype = y.dtype
        y = y.float()
        y = self.weight * (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)).to(dtype)
        return (y * F.silu(z.float())).to(dtype)


class GatedDeltaNetMixer(nn.Module):
    state_kind = "gated_deltanet"
    # Every decode kernel forward calls takes a half-width state pool in place, given the rows'
    # positions (engine.state_format: an all-decode step on Triton skips the working rows).
    reads_narrow_state_in_place = True

    def __init__(self, hidden: int, num_k_heads: int, num_v_heads: int, k_head_dim: int,
                 v_head_dim: int, conv_kernel: int, act: str, eps: float, chunk_size: int = 64):
        super().__init__()
        if num_k_heads <= 0 or num_v_heads % num_k_heads:
            raise ValueError(f"{num_v_heads} value heads are not a multiple of {num_k_heads} key heads")
        if chunk_size <= 0:
            raise ValueError(f"chunk_size must be positive, got {chunk_size}")
        self.num_k_heads, self.num_v_heads = num_k_heads, num_v_heads
        self.k_head_dim, self.v_head_dim = k_head_dim, v_head_dim
        self.conv_kernel = conv_kernel
        self.chunk_size = chunk_size  # the prefill scan's chunk: our choice, not the checkpoint's
        self.key_dim, self.value_dim = num_k_heads * k_head_dim, num_v_heads * v_head_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.in_proj_qkvz = nn.Linear(hidden, 2 * self.key_dim + 2 * self.value_dim, bias=False)
        self.in_proj_ba = nn.Linear(hidden, 2 * num_v_heads, bias=False)
        self.conv_weight = nn.Parameter(torch.empty(self.conv_dim, conv_kernel))
        self.dt_bias = nn.Parameter(torch.ones(num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(num_v_heads))
        self.norm = HeadGatedRMSNorm(v_head_dim, eps)
        self.out_proj = nn.Linear(self.value_dim, hidden, bias=False)
        self.act = activation(act)
        self._one_call_fit = ((), False)  # (the packed weights it was checked for, the answer)

    def state_spec(self) -> list[StateTensorSpec]:
        return [StateTensorSpec("conv", (self.conv_dim, self.conv_kernel)),
                StateTensorSpec("recurrent", (self.num_v_heads, self.k_head_dim, self.v_head_dim))]

    def split_projections(self, qkvz: torch.Tensor, ba: torch.Tensor):
        """Projection outputs in the checkpoint's layout -> (qkv [T, conv_dim] as q | k | v, each
        head-major; z [T, Hv, dv]; b, a [T, Hv]).

        Qwen3-Next groups both projections by key head: for each key head its q (dk), its k (dk),
        then v and z of the r = Hv / Hk value heads it serves (r * dv each); in_proj_ba holds per
        key head the r b's then the r a's. A family whose checkpoint keeps q, k, v, z, b and a
        apart overrides this."""
        tokens, r = qkvz.shape[0], self.num_v_heads // self.num_k_heads
        q, k, v, z = qkvz.view(tokens, self.num_k_heads, -1).split(
            [self.k_head_dim, self.k_head_dim, r * self.v_head_dim, r * self.v_head_dim], dim=-1)
        qkv = torch.cat((q.reshape(tokens, -1), k.reshape(tokens, -1), v.reshape(tokens, -1)), dim=-1)
        b, a = ba.view(tokens, self.num_k_heads, 2 * r).split([r, r], dim=-1)
        return (qkv, z.reshape(tokens, self.num_v_heads, self.v_head_dim),
                b.reshape(tokens, self.num_v_heads), a.reshape(tokens, self.num_v_heads))

    def project(self, hidden: torch.Tensor):
        """hidden [T, hidden] -> (qkv, z, b, a) as split_projections returns them. A family whose
        checkpoint projects q, k, v, z, b and a apart overrides this (and then runs the layer
        path, not the one-call decode, whose kernel projects in this layout)."""
        return self.split_projections(self.in_proj_qkvz(hidden), self.in_proj_ba(hidden))

    def gates(self, b: torch.Tensor, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """beta = sigmoid(b) and the log decay g = -exp(A_log) softplus(a + dt_bias), float32."""
        if uses_cpu_kernel(b) and uses_cpu_kernel(a):
            return cpu.gdn_gates_cpu(b, a, self.decay(), self.dt_bias)
        return b.sigmoid().float(), self.decay() * F.softplus(a.float() + self.dt_bias.float())

    def decay(self) -> torch.Tensor:
        """-exp(A_log) [Hv], float32, as every path computes it (so the one call gives the chain's bits)."""
        return -torch.exp(self.A_log.float())

    def forward(self, hidden: torch.Tensor, batch: ForwardBatch,
                state: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        if self._decodes_in_one_call(hidden, batch, state):
            return self._decode_in_one_call(hidden, batch, state)
        conv_state, recurrent_state = state
        tokens = hidden.shape[0]
        qkv, z, b, a = self.project(hidden)
        qkv = conv_then_act(self.act, qkv, batch, conv_state, self.conv_weight, None)
        q, k, v = qkv.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = q.view(tokens, self.num_k_heads, self.k_head_dim)
        k = k.view(tokens, self.num_k_heads, self.k_head_dim)
        v = v.view(tokens, self.num_v_heads, self.v_head_dim)
        beta, g = self.gates(b, a)

        out = torch.empty(tokens, self.num_v_heads, self.v_head_dim, dtype=torch.float32, device=hidden.device)
        if batch.prefill_rows and not self._prefill_in_one_call(out, q, k, v, g, beta, batch, recurrent_state):
            for segment in batch.state_spans.segments(recurrent_state):
                start, end, slot = segment.start, segment.end, segment.dst
                h0 = (torch.zeros(recurrent_state.shape[1:], device=hidden.device)
                      if segment.fresh else recurrent_state[slot])
                out[start:end], h = chunk_gated_delta_rule(q[start:end], k[start:end], v[start:end],
                                                           g[start:end], beta[start:end], h0, self.chunk_size)
                recurrent_state[slot] = h.to(recurrent_state.dtype)
        if batch.decode_rows:  # read each slot's state, update it with one token, write it back
            idx = batch.decode_tokens
            out[idx] = gated_delta_step(recurrent_state, batch.decode_slots, q[idx], k[idx], v[idx],
                                        g[idx], beta[idx], positions=batch.decode_context_lens,
                                        slot_runs=batch.decode_slot_runs)
        y = self.norm(out.to(hidden.dtype), z)
        return self.out_proj(y.reshape(tokens, self.value_dim))

    def _prefill_in_one_call(self, out, q, k, v, g, beta, batch: ForwardBatch, recurrent_state) -> bool:
        """Every prefill row of the step through one varlen call (fla on CUDA), each from its
        slot's state or zeros (a fresh prefill); False where none serves them (the caller loops)."""
        if not gated_delta_varlen_available(q, v, g):
            return False
        for round_, rows in enumerate(PrefillRows.rounds(batch, recurrent_state, q.device)):
            cu_seqlens = torch.tensor(rows.bounds, dtype=torch.long).to(q.device, non_blocking=True)
            done = chunk_gated_delta_rule_varlen(*rows.pick(q, k, v, g, beta),
                                                 rows.initial_states(recurrent_state), cu_seqlens)
            if done is None and round_ == 0:
                return False  # nothing written yet: the caller's loop runs every segment
            if done is None:  # fla refuses by shape, the same for every round of a step
                raise RuntimeError("fla turned down a later round of a step it had served")
            rows.put(out, done[0], recurrent_state, done[1])
        return True

    def tp_plan(self, group: TPGroup) -> Apply | None:
        """Value heads split, key heads split or replicated (engine.tp.plan); out_proj row-parallel."""
        if type(self) is not GatedDeltaNetMixer:
            return None
        lay = deltanet_layout(self.num_k_heads, self.num_v_heads, self.k_head_dim, self.v_head_dim,
                              group.size, group.rank)
        for name in ("in_proj_qkvz", "in_proj_ba", "out_proj"):
            check_linear(getattr(self, name), f"Gated DeltaNet {name}")
        dk, dv, r = self.k_head_dim, self.v_head_dim, self.num_v_heads // self.num_k_heads
        qkvz, ba = [], []
        # Both projections are grouped by key head (split_projections): per key head q, k, the
        # v's of its r value heads, their z's; and its r b's, then its r a's.
        for kh in range(*lay.k_heads):
            base = kh * (2 * dk + 2 * r * dv)
            mine = [v - kh * r for v in range(*lay.v_heads) if v // r == kh]
            qkvz += list(range(base, base + 2 * dk))
            qkvz += [base + 2 * dk + j * dv + i for j in mine for i in range(dv)]
            qkvz += [base + 2 * dk + r * dv + j * dv + i for j in mine for i in range(dv)]
            ba += [kh * 2 * r + j for j in mine] + [kh * 2 * r + r + j for j in mine]
        conv = expand(lay.conv)
        v_heads = span(lay.v_heads)
        out_cols = span(scaled(lay.v_heads, dv))

        def apply():
            keep_rows(self.in_proj_qkvz, qkvz)
            keep_rows(self.in_proj_ba, ba)
            set_param(self, "conv_weight", self.conv_weight, 0, conv)
            set_param(self, "dt_bias", self.dt_bias, 0, v_heads)
            set_param(self, "A_log", self.A_log, 0, v_heads)
            self.out_proj = RowParallelLinear.of(self.out_proj, out_cols, group, True, "Gated DeltaNet out_proj")
            self.num_k_heads = lay.k_heads[1] - lay.k_heads[0]
            self.num_v_heads = len(v_heads)
            self.key_dim, self.value_dim = self.num_k_heads * dk, self.num_v_heads * dv
            self.conv_dim = len(conv)
        return apply

    def plan_decode(self, entry: LayerPlan, state, kv, keep: list, rotary: list) -> Needs | None:
        """This mixer's fields of a decode step's one-call plan (engine.kernels.decode_plan)."""
        if type(self) is not GatedDeltaNetMixer or not (all_cpu(state) and self.fits_one_call()):
            return None
        conv_state, recurrent_state = state
        A, norm_weight = self.decay(), self.norm.per_channel(self.num_v_heads)  # the weights are final
        keep += [A, norm_weight]
        entry.mixer = GATED_DELTANET
        entry.key_heads, entry.value_heads = self.num_k_heads, self.num_v_heads
        entry.key_dim, entry.value_dim, entry.d_conv = self.k_head_dim, self.v_head_dim, self.conv_kernel
        entry.in_panels = self.in_proj_qkvz.packed_weight.panels.data_ptr()
        entry.x_panels = self.in_proj_ba.packed_weight.panels.data_ptr()
        entry.conv_state, entry.ssm_state = conv_state.data_ptr(), recurrent_state.data_ptr()
        entry.conv_weight, entry.A, entry.dt_bias = self.conv_weight.data_ptr(), A.data_ptr(), self.dt_bias.data_ptr()
        entry.gate_norm, entry.gate_norm_eps = norm_weight.data_ptr(), self.norm.eps
        entry.out_panels = self.out_proj.packed_weight.panels.data_ptr()
        return Needs(floats=self.one_call_scratch())

    def fits_one_call(self) -> bool:
        """SiLU, the projections in Qwen3-Next's layout (split_projections as is), the norm as
        defined here, the three linears packed (so not sharded), every parameter float32 and
        contiguous."""
        if type(self).project is not GatedDeltaNetMixer.project:
            return False
        return packed_fit(self, (self.in_proj_qkvz, self.in_proj_ba, self.out_proj), lambda: (
            self.act is F.silu and type(self).split_projections is GatedDeltaNetMixer.split_projections
            and type(self).forward is GatedDeltaNetMixer.forward and type(self.norm) is HeadGatedRMSNorm
            and all(m.bias is None for m in (self.in_proj_qkvz, self.in_proj_ba, self.out_proj))))

    def _decodes_in_one_call(self, hidden: torch.Tensor, batch: ForwardBatch, state) -> bool:
        return decodes_in_one_call(self, hidden, batch, state)

    def _decode_in_one_call(self, hidden: torch.Tensor, batch: ForwardBatch, state) -> torch.Tensor:
        conv_state, recurrent_state = state
        rows, size = hidden.shape
        heads, k_dim = self.num_v_heads, self.k_head_dim
        out = torch.empty(rows, size)
        native.call("gdn_decode", h=hidden, rows=rows, hidden=size, k_heads=self.num_k_heads, v_heads=heads,
                    k_dim=k_dim, v_dim=self.v_head_dim, d_conv=self.conv_kernel,
                    qkvz_panels=self.in_proj_qkvz.packed_weight.panels,
                    ba_panels=self.in_proj_ba.packed_weight.panels, conv_state=conv_state,
                    recurrent_state=recurrent_state, slots=cpu.ids(batch.decode_slots),
                    conv_weight=self.conv_weight, A=self.decay(), dt_bias=self.dt_bias,
                    norm_weight=self.norm.per_channel(heads), norm_eps=float(self.norm.eps),
                    out_panels=self.out_proj.packed_weight.panels,
                    scratch=torch.empty(rows * self.one_call_scratch()), out=out)
        return out

    def one_call_scratch(self) -> int:
        """gdn_decode's scratch floats per row."""
        heads = self.num_v_heads
        return 2 * self.key_dim + 6 * self.value_dim + 2 * self.conv_dim + 6 * heads + 2 * heads * self.k_head_dim
