"""Mamba (v1) mixer over a varlen batch with a slot-indexed state pool.

Per sequence, by phase (see engine.phase):
- FRESH_PREFILL: conv and ssm state start from explicit zeros; the slot is only written.
- CONTINUED_PREFILL: starts from the slot's state (this request's own, checked by the runner).
- DECODE: reads the slot's state, updates it with one token, writes it back.
Prefill on CUDA scans every prefill row of the batch in one Triton launch
(engine.kernels.selective_scan_varlen); on CPU in float32 the C++ scan per row
(engine.kernels.cpu.selective_scan_cpu); elsewhere a blocked torch scan per row (`selective_scan`:
whole-block ops plus one in-place [D, N] multiply-add per token). `selective_scan_ref` is the
definition all are tested against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels import (causal_conv1d_update, cpu, native, selective_scan_varlen, selective_state_update,
                            uses_cpu_kernel, uses_triton)
from engine.models.batch import ForwardBatch, StateSegment
from engine.kernels.decode_plan import MAMBA, LayerPlan, Needs, all_cpu, pointer
from engine.tp.group import TPGroup
from engine.tp.parallel import Apply, RowParallelLinear, check_linear, keep_rows, set_param, span
from engine.tp.plan import even_split
from engine.models.hybrid import StateTensorSpec
from engine.models.layers import RMSNorm, activation

# Elements of one [block, d_inner, d_state] scan tensor: 64 tokens at d_inner*d_state = 8192.
SCAN_BLOCK_ELEMENTS = 1 << 19


def selective_scan_ref(x, dt, A, B, C, h0):
    """Definition: h_t = exp(dt_t A) h_{t-1} + dt_t B_t x_t ; y_t = C_t . h_t (no D, no gate).

    x, dt: [L, D]; A: [D, N]; B, C: [L, N]; h0: [D, N]. Returns y [L, D], h_L [D, N].
    """
    h = h0.float()
    ys = []
    for t in range(x.shape[0]):
        h = torch.exp(dt[t, :, None] * A) * h + dt[t, :, None] * B[t, None, :] * x[t, :, None]
        ys.append(h @ C[t])
    return torch.stack(ys), h


def selective_scan(x, dt, A, B, C, h0):
    """Same contract as `selective_scan_ref`, computed block by block.

    Per block of tokens the decays a_t = exp(dt_t A) and inputs b_t = dt_t x_t B_t are made
    in two whole-block ops, the recurrence h_t = a_t h_{t-1} + b_t runs in place as one
    [D, N] multiply-add per token, and y = C . h is one multiply and one sum for the block.
    On CPU (profiled with 1-2 threads at d_inner*d_state = 8192) this beats a Hillis-Steele
    doubling scan by 2-3x: the doubling scan does log2(block) full passes of extra multiplies
    and copies, while per-token ops of 32 KiB are cheap enough that dispatch does not dominate.
    """
    length, d_inner = x.shape
    d_state = A.shape[1]
    block = max(1, min(256, SCAN_BLOCK_ELEMENTS // (d_inner * d_state)))
    y = torch.empty(length, d_inner, dtype=torch.float32, device=x.device)
    dt_x = dt * x
    h = h0.float()
    for start in range(0, length, block):
        end = min(start + block, length)
        a = torch.mul(dt[start:end, :, None], A).exp_()  # [n, D, N]
        b = torch.mul(dt_x[start:end, :, None], B[start:end, None, :])
        prev = h
        for a_t, b_t in zip(a.unbind(0), b.unbind(0)):  # b becomes h_t, row by row
            b_t.addcmul_(a_t, prev)
            prev = b_t
        torch.mul(b, C[start:end, None, :], out=a)  # a is free again: reuse it
        torch.sum(a, dim=-1, out=y[start:end])
        h = b[-1].clone()
    return y, h


class MambaMixer(nn.Module):
    state_kind = "mamba"
    # Every decode kernel forward calls takes a half-width state pool in place, given the rows'
    # positions (engine.state_format: an all-decode step on Triton skips the working rows).
    reads_narrow_state_in_place = True

    def __init__(self, hidden: int, d_inner: int, d_state: int, d_conv: int, dt_rank: int,
                 conv_bias: bool, proj_bias: bool, act: str, bcdt_norm_eps: float | None):
        super().__init__()
        self.d_inner, self.d_state, self.d_conv, self.dt_rank = d_inner, d_state, d_conv, dt_rank
        self.in_proj = nn.Linear(hidden, 2 * d_inner, bias=proj_bias)
        self.conv_weight = nn.Parameter(torch.empty(d_inner, d_conv))
        self.conv_bias = nn.Parameter(torch.zeros(d_inner)) if conv_bias else None
        self.x_proj = nn.Linear(d_inner, dt_rank + 2 * d_state, bias=False)
        self.dt_proj = nn.Linear(dt_rank, d_inner, bias=True)
        self.A_log = nn.Parameter(torch.empty(d_inner, d_state))
        self.D = nn.Parameter(torch.ones(d_inner))
        self.out_proj = nn.Linear(d_inner, hidden, bias=proj_bias)
        self.act = activation(act)
        self._one_call_fit = ((), False)  # (the packed weights it was checked for, the answer)
        # Jamba normalises dt, B and C before use; plain Mamba does not.
        if bcdt_norm_eps is not None:
            self.dt_norm = RMSNorm(dt_rank, bcdt_norm_eps)
            self.b_norm = RMSNorm(d_state, bcdt_norm_eps)
            self.c_norm = RMSNorm(d_state, bcdt_norm_eps)
        else:
            self.dt_norm = self.b_norm = self.c_norm = None

    def state_spec(self) -> list[StateTensorSpec]:
        return [StateTensorSpec("conv", (self.d_inner, self.d_conv)),
                StateTensorSpec("ssm", (self.d_inner, self.d_state))]

    def forward(self, hidden: torch.Tensor, batch: ForwardBatch,
                state: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        if self._decodes_in_one_call(hidden, batch, state):
            return self._decode_in_one_call(hidden, batch, state)
        conv_state, ssm_state = state
        x, gate = self.in_proj(hidden).chunk(2, dim=-1)
        x = self._conv(x, batch, conv_state)
        dbc = self.x_proj(x)
        if self.dt_norm is not None and uses_cpu_kernel(dbc) and self.dt_norm.weight.dtype == torch.float32:
            norms = (self.dt_norm, self.b_norm, self.c_norm)  # one eps (bcdt_norm_eps): one C++ pass
            dt, B, C = cpu.rms_norm_3_cpu(dbc, [n.weight for n in norms], self.dt_norm.eps)
        else:
            dt, B, C = torch.split(dbc, [self.dt_rank, self.d_state, self.d_state], dim=-1)
            if self.dt_norm is not None:
                dt, B, C = self.dt_norm(dt), self.b_norm(B), self.c_norm(C)
        if uses_cpu_kernel(self.dt_proj.weight):  # the packed linear with its bias, softplus in place
            dt = cpu.bias_softplus_cpu(self.dt_proj(dt), None)
        else:
            dt = F.softplus(dt @ self.dt_proj.weight.t() + self.dt_proj.bias.float())
        A = -torch.exp(self.A_log.float())
        y = torch.empty_like(x, dtype=torch.float32)
        if batch.prefill_rows:
            self._prefill_scan(x, dt, A, B, C, batch, ssm_state, y)
        if batch.decode_rows:  # read the slot's state, update it in place (Triton on CUDA)
            idx, slots = batch.decode_tokens, batch.decode_slots
            into_decode_rows(y, idx, selective_state_update, ssm_state, slots, x[idx].float(), dt[idx].float(), A,
                             B[idx].float(), C[idx].float(), positions=batch.decode_context_lens,
                             slot_runs=batch.decode_slot_runs)
        if uses_cpu_kernel(x) and gate.dtype == torch.float32 and gate.stride(-1) == 1:
            y = cpu.gated_skip_cpu(y, x, self.D, gate)
        else:
            y = (y + x * self.D) * F.silu(gate)
        return self.out_proj(y.to(hidden.dtype))

    def _decodes_in_one_call(self, hidden: torch.Tensor, batch: ForwardBatch, state) -> bool:
        return decodes_in_one_call(self, hidden, batch, state)

    def tp_plan(self, group: TPGroup) -> Apply | None:
        """Channels split; x_proj row-parallel (dt, B, C all-reduced before use), dt_proj
        column-parallel, out_proj row-parallel."""
        if type(self) is not MambaMixer:
            return None
        d = self.d_inner
        ch = span(even_split(d, group.size, group.rank, "Mamba d_inner channels"))
        for name in ("in_proj", "dt_proj", "x_proj", "out_proj"):
            check_linear(getattr(self, name), f"Mamba {name}")

        def apply():
            keep_rows(self.in_proj, ch + [d + c for c in ch])  # x then gate
            set_param(self, "conv_weight", self.conv_weight, 0, ch)
            if self.conv_bias is not None:
                set_param(self, "conv_bias", self.conv_bias, 0, ch)
            self.x_proj = RowParallelLinear.of(self.x_proj, ch, group, True, "Mamba x_proj")
            keep_rows(self.dt_proj, ch)
            set_param(self, "A_log", self.A_log, 0, ch)
            set_param(self, "D", self.D, 0, ch)
            self.out_proj = RowParallelLinear.of(self.out_proj, ch, group, True, "Mamba out_proj")
            self.d_inner = len(ch)
        return apply

    def plan_decode(self, entry: LayerPlan, state, kv, keep: list, rotary: list) -> Needs | None:
        """This mixer's fields of a decode step's one-call plan (engine.kernels.decode_plan)."""
        if type(self) is not MambaMixer or not (all_cpu(state) and self.fits_one_call()):
            return None
        conv_state, ssm_state = state
        A = -torch.exp(self.A_log.float())  # as forward computes it each call; the weights are final
        keep.append(A)
        entry.mixer = MAMBA
        entry.d_inner, entry.d_state, entry.dt_rank, entry.d_conv = self.d_inner, self.d_state, self.dt_rank, self.d_conv
        entry.in_panels, entry.in_bias = self.in_proj.packed_weight.panels.data_ptr(), pointer(self.in_proj.bias)
        entry.conv_state, entry.ssm_state = conv_state.data_ptr(), ssm_state.data_ptr()
        entry.conv_weight, entry.conv_bias = self.conv_weight.data_ptr(), pointer(self.conv_bias)
        entry.x_panels = self.x_proj.packed_weight.panels.data_ptr()
        if self.dt_norm is not None:
            entry.dt_norm, entry.b_norm, entry.c_norm = (n.weight.data_ptr() for n in (self.dt_norm, self.b_norm,
                                                                                       self.c_norm))
            entry.bcdt_eps = self.dt_norm.eps
        entry.dt_panels, entry.dt_bias = self.dt_proj.packed_weight.panels.data_ptr(), pointer(self.dt_proj.bias)
        entry.A, entry.D = A.data_ptr(), self.D.data_ptr()
        entry.out_panels, entry.out_bias = self.out_proj.packed_weight.panels.data_ptr(), pointer(self.out_proj.bias)
        return Needs(floats=self.one_call_scratch())

    def fits_one_call(self) -> bool:
        """SiLU, the four linears packed, every parameter float32 and contiguous."""
        return packed_fit(self, (self.in_proj, self.x_proj, self.dt_proj, self.out_proj), lambda: self.act is F.silu)

    def _decode_in_one_call(self, hidden: torch.Tensor, batch: ForwardBatch, state) -> torch.Tensor:
        conv_state, ssm_state = state
        rows = hidden.shape[0]
        di, n, r = self.d_inner, self.d_state, self.dt_rank
        norm_modules = (self.dt_norm, self.b_norm, self.c_norm)
        norms = [None] * 3 if self.dt_norm is None else [m.weight for m in norm_modules]
        out = torch.empty(rows, hidden.shape[1])
        dt_norm, b_norm, c_norm = norms
        native.call("mamba_decode", h=hidden, rows=rows, hidden=hidden.shape[1], d_inner=di, d_state=n, dt_rank=r,
                    d_conv=self.d_conv, in_panels=self.in_proj.packed_weight.panels, in_bias=self.in_proj.bias,
                    conv_state=conv_state, ssm_state=ssm_state, slots=cpu.ids(batch.decode_slots),
                    conv_weight=self.conv_weight, conv_bias=self.conv_bias,
                    x_panels=self.x_proj.packed_weight.panels, dt_norm=dt_norm, b_norm=b_norm, c_norm=c_norm,
                    norm_eps=float(self.dt_norm.eps if self.dt_norm is not None else 0.0),
                    dt_panels=self.dt_proj.packed_weight.panels, dt_bias=self.dt_proj.bias,
                    A=-torch.exp(self.A_log.float()), D=self.D, out_panels=self.out_proj.packed_weight.panels,
                    out_bias=self.out_proj.bias, scratch=torch.empty(rows * self.one_call_scratch()), out=out)
        return out

    def one_call_scratch(self) -> int:
        """mamba_decode's scratch floats per row."""
        return 5 * self.d_inner + 2 * self.dt_rank + 4 * self.d_state

    def _prefill_scan(self, x, dt, A, B, C, batch: ForwardBatch, ssm_state, y) -> None:
        """Every prefill segment (engine.models.batch.StateSpans) from its starting state (zeros
        when fresh), final states into their rows; y written at the prefill rows' tokens."""
        spans = batch.state_spans
        if uses_triton(x):  # a round's segments in one launch
            device = x.device
            bounds = torch.tensor(spans.bounds, device=device)
            for segments in spans.prepared_rounds(ssm_state):
                slots = torch.tensor([s.dst for s in segments], device=device)
                fresh = torch.tensor([s.fresh for s in segments], device=device)
                # Fresh segments start from zeros, whatever their row holds (NaN poison included).
                h0 = ssm_state.index_select(0, slots).float().masked_fill_(fresh[:, None, None], 0.0)
                selective_scan_varlen(x.float(), dt.float(), A, B.float(), C.float(), bounds, h0,
                                      rows=torch.tensor([s.index for s in segments], device=device),
                                      state=ssm_state, slots=slots, out=y)
            return
        for segment in spans.segments(ssm_state):
            start, end, slot = segment.start, segment.end, segment.dst
            h0 = (torch.zeros(self.d_inner, self.d_state, device=x.device)
                  if segment.fresh else ssm_state[slot])
            args = (x[start:end].float(), dt[start:end].float(), A, B[start:end].float(), C[start:end].float(), h0)
            if uses_cpu_kernel(x):
                _, h = cpu.selective_scan_cpu(*args, out=y[start:end])
            else:
                y[start:end], h = selective_scan(*args)
            ssm_state[slot] = h.to(ssm_state.dtype)

    def _conv(self, x: torch.Tensor, batch: ForwardBatch, conv_state: torch.Tensor) -> torch.Tensor:
        return conv_then_act(self.act, x, batch, conv_state, self.conv_weight, self.conv_bias)


def decodes_in_one_call(mixer: nn.Module, hidden: torch.Tensor, batch: ForwardBatch, state) -> bool:
    """Every row a decode on the CPU kernels, float32 throughout, and `mixer` fits its one-call
    path: then its forward's kernels run as one C++ call (engine/kernels/cpu_layers.cpp)."""
    # decode_tokens is slice(None) only when every row is a decode on the CPU (ForwardBatch).
    return (isinstance(batch.decode_tokens, slice) and uses_cpu_kernel(hidden) and hidden.is_contiguous()
            and all(uses_cpu_kernel(t) for t in state) and mixer.fits_one_call())


def packed_fit(mixer: nn.Module, linears, fits) -> bool:
    """Whether `mixer` can take its one-call path: `linears` packed, every parameter float32 and
    contiguous, and fits(). Asked again only when the packed weights change (kept in
    mixer._one_call_fit): weights are final before they are packed (pack_linears), and walking
    the parameters every step cost more than the check."""
    packed = tuple(getattr(m, "packed_weight", None) for m in linears)
    checked_for, answer = mixer._one_call_fit
    if len(checked_for) != len(packed) or any(a is not b for a, b in zip(checked_for, packed)):
        answer = (all(w is not None for w in packed) and fits()
                  and all(p.dtype == torch.float32 and p.is_contiguous() for p in mixer.parameters()))
        mixer._one_call_fit = (packed, answer)
    return answer


def conv_then_act(act, x: torch.Tensor, batch: ForwardBatch, conv_state: torch.Tensor,
                  weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """act(varlen_causal_conv(...)), with SiLU fused into the conv where it is SiLU."""
    if act is F.silu:
        return varlen_causal_conv(x, batch, conv_state, weight, bias, silu=True)
    return act(varlen_causal_conv(x, batch, conv_state, weight, bias))


def varlen_causal_conv(x: torch.Tensor, batch: ForwardBatch, conv_state: torch.Tensor,
                       weight: torch.Tensor, bias: torch.Tensor | None, silu: bool = False) -> torch.Tensor:
    """Causal depthwise conv over each sequence (then SiLU if `silu`), continuing from and
    updating its state: conv_state[slot] holds the sequence's last d_conv inputs, oldest first.

    x: [T, channels]; weight: [channels, d_conv]. FRESH_PREFILL rows start from explicit zeros
    and only write their slot; other rows read it. On CPU in float32 each prefill row is one
    C++ pass (engine.kernels.cpu.causal_conv_prefill_cpu) instead of a concat, a conv and copies.
    """
    channels, d_conv = weight.shape
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    kernel = x.dtype == torch.float32 and x.stride(-1) == 1 and uses_cpu_kernel(conv_state)
    for segment in batch.state_spans.segments(conv_state) if batch.prefill_rows else ():
        start, end, slot, fresh = segment.start, segment.end, segment.dst, segment.fresh
        if kernel:
            cpu.causal_conv_prefill_cpu(x[start:end], conv_state[slot], weight, bias, fresh, silu, out[start:end])
            continue
        if fresh:
            history = torch.zeros(channels, d_conv, dtype=x.dtype, device=x.device)
        else:
            history = conv_state[slot].to(x.dtype)
        window = torch.cat((history, x[start:end].t()), dim=1)  # [channels, d_conv + L]
        conv = F.conv1d(window.unsqueeze(0), weight.unsqueeze(1), bias, groups=channels)
        conv = conv[0, :, -(end - start):].t()
        out[start:end] = F.silu(conv) if silu else conv
        conv_state[slot] = window[:, -d_conv:].to(conv_state.dtype)
    if batch.decode_rows:
        idx, slots = batch.decode_tokens, batch.decode_slots
        into_decode_rows(out, idx, causal_conv1d_update, conv_state, slots, x[idx], weight, bias,
                         activation="silu" if silu else None, positions=batch.decode_context_lens,
                         slot_runs=batch.decode_slot_runs)
    return out


def into_decode_rows(out: torch.Tensor, idx, update, *args, **kwargs) -> None:
    """out[idx] = update(*args, **kwargs); when idx is slice(None) (every token a decode's, on
    CPU) the update writes into `out` itself instead of a result then copied."""
    if isinstance(idx, slice):
        update(*args, out=out, **kwargs)
    else:
        out[idx] = update(*args, **kwargs)


class PrefillRows:
    """One round of a step's prefill segments (engine.models.batch.StateSpans) packed for one
    varlen call: their tokens back to back (`index` into the step's tokens, `bounds` the host
    offsets, 0 ... total), the state rows they run from and to, and which start fresh (from
    zeros) rather than from their row's state."""

    def __init__(self, segments: list[StateSegment], device: torch.device):
        self.bounds = [0]
        for segment in segments:
            self.bounds.append(self.bounds[-1] + segment.end - segment.start)
        # non_blocking: a host -> device copy that waits only for itself, not for the step's queued work
        self.index = torch.cat([torch.arange(s.start, s.end) for s in segments]).to(device, non_blocking=True)
        self.slots = torch.tensor([s.dst for s in segments], dtype=torch.long).to(device, non_blocking=True)
        self.fresh = torch.tensor([s.fresh for s in segments]).to(device, non_blocking=True)

    @staticmethod
    def rounds(batch: ForwardBatch, pool: torch.Tensor, device: torch.device):
        """A PrefillRows per round of `batch`'s segments, `pool` prepared for each round."""
        for segments in batch.state_spans.prepared_rounds(pool):
            yield PrefillRows(segments, device)

    def pick(self, *tensors: torch.Tensor) -> list[torch.Tensor]:
        return [t.index_select(0, self.index) for t in tensors]

    def initial_states(self, pool: torch.Tensor) -> torch.Tensor:
        """[rows, *state] float32: each row's slot, zeros for a fresh prefill (never read)."""
        states = pool.index_select(0, self.slots).float()
        return states.masked_fill(self.fresh.view(-1, *[1] * (states.dim() - 1)), 0.0)

    def put(self, out: torch.Tensor, values: torch.Tensor, pool: torch.Tensor, states: torch.Tensor) -> None:
        """The rows' outputs into `out` at their tokens, their final states into their slots."""
        out.index_copy_(0, self.index, values.to(out.dtype))
        pool.index_copy_(0, self.slots, states.to(pool.dtype))
