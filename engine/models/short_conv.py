"""LFM2's gated short convolution mixer over a varlen batch with a slot-indexed state pool.

One in_proj gives three gates B, C and x; the depthwise causal conv (kernel conv_L_cache)
runs over B * x, its output is gated by C, then out_proj. There is no activation anywhere.
Per sequence it keeps `conv` [hidden, L_cache] (float32): the last L_cache conv inputs
(B * x, not x), oldest first, which is exactly the window `varlen_causal_conv` keeps.

By phase (engine.phase): FRESH_PREFILL starts the conv from explicit zeros and only writes
the slot; CONTINUED_PREFILL and DECODE read the slot and update it.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.kernels import cpu, native
from engine.models.batch import ForwardBatch
from engine.kernels.decode_plan import SHORT_CONV, LayerPlan, Needs, all_cpu, pointer
from engine.tp.group import TPGroup
from engine.tp.parallel import Apply, RowParallelLinear, check_linear, keep_rows, set_param, span
from engine.tp.plan import even_split
from engine.models.hybrid import StateTensorSpec
from engine.models.ssm import decodes_in_one_call, packed_fit, varlen_causal_conv


class ShortConvMixer(nn.Module):
    state_kind = "short_conv"
    # Its decode is the conv update, which takes a half-width state pool in place given the rows'
    # positions (engine.state_format: an all-decode step on Triton skips the working rows).
    reads_narrow_state_in_place = True

    def __init__(self, hidden: int, kernel: int, bias: bool):
        super().__init__()
        self.hidden, self.kernel = hidden, kernel
        # conv_bias switches the biases of both projections as well as the conv's.
        self.in_proj = nn.Linear(hidden, 3 * hidden, bias=bias)
        self.conv_weight = nn.Parameter(torch.empty(hidden, kernel))
        self.conv_bias = nn.Parameter(torch.zeros(hidden)) if bias else None
        self.out_proj = nn.Linear(hidden, hidden, bias=bias)
        self._one_call_fit = ((), False)  # (the packed weights it was checked for, the answer)

    def state_spec(self) -> list[StateTensorSpec]:
        return [StateTensorSpec("conv", (self.hidden, self.kernel))]

    def forward(self, hidden: torch.Tensor, batch: ForwardBatch,
                state: tuple[torch.Tensor]) -> torch.Tensor:
        if self._decodes_in_one_call(hidden, batch, state):
            return self._decode_in_one_call(hidden, batch, state)
        (conv_state,) = state
        b, c, x = self.in_proj(hidden).chunk(3, dim=-1)  # in this order in the checkpoint
        y = varlen_causal_conv(b * x, batch, conv_state, self.conv_weight, self.conv_bias)
        return self.out_proj(c * y)

    def tp_plan(self, group: TPGroup) -> Apply | None:
        """Channels split: each of the B, C and x gates, the conv and its state; out_proj row-parallel."""
        if type(self) is not ShortConvMixer:
            return None
        h = self.hidden
        ch = span(even_split(h, group.size, group.rank, "short conv channels"))
        check_linear(self.in_proj, "short conv in_proj")
        check_linear(self.out_proj, "short conv out_proj")

        def apply():
            keep_rows(self.in_proj, ch + [h + c for c in ch] + [2 * h + c for c in ch])
            set_param(self, "conv_weight", self.conv_weight, 0, ch)
            if self.conv_bias is not None:
                set_param(self, "conv_bias", self.conv_bias, 0, ch)
            self.out_proj = RowParallelLinear.of(self.out_proj, ch, group, True, "short conv out_proj")
            self.hidden = len(ch)
        return apply

    def plan_decode(self, entry: LayerPlan, state, kv, keep: list, rotary: list) -> Needs | None:
        """This mixer's fields of a decode step's one-call plan (engine.kernels.decode_plan)."""
        if type(self) is not ShortConvMixer or not (all_cpu(state) and self.fits_one_call()):
            return None
        (conv_state,) = state
        entry.mixer, entry.d_conv, entry.conv_state = SHORT_CONV, self.kernel, conv_state.data_ptr()
        entry.in_panels, entry.in_bias = self.in_proj.packed_weight.panels.data_ptr(), pointer(self.in_proj.bias)
        entry.conv_weight, entry.conv_bias = self.conv_weight.data_ptr(), pointer(self.conv_bias)
        entry.out_panels, entry.out_bias = self.out_proj.packed_weight.panels.data_ptr(), pointer(self.out_proj.bias)
        return Needs(floats=self.one_call_scratch())

    def fits_one_call(self) -> bool:
        """Both linears packed (so not sharded), every parameter float32 and contiguous: then an
        all-decode step's kernels run as one C++ call (short_conv_decode). Alone it is no faster
        than the chain; the decode stack's one call needs it."""
        return packed_fit(self, (self.in_proj, self.out_proj), lambda: type(self).forward is ShortConvMixer.forward)

    def _decodes_in_one_call(self, hidden: torch.Tensor, batch: ForwardBatch, state) -> bool:
        return decodes_in_one_call(self, hidden, batch, state)

    def one_call_scratch(self) -> int:
        """short_conv_decode's scratch floats per row."""
        return 6 * self.hidden

    def _decode_in_one_call(self, hidden: torch.Tensor, batch: ForwardBatch, state) -> torch.Tensor:
        (conv_state,) = state
        rows = hidden.shape[0]
        out = torch.empty(rows, self.hidden)
        native.call("short_conv_decode", h=hidden, rows=rows, hidden=self.hidden, kernel=self.kernel,
                    in_panels=self.in_proj.packed_weight.panels, in_bias=self.in_proj.bias,
                    conv_state=conv_state, slots=cpu.ids(batch.decode_slots), conv_weight=self.conv_weight,
                    conv_bias=self.conv_bias, out_panels=self.out_proj.packed_weight.panels,
                    out_bias=self.out_proj.bias, scratch=torch.empty(rows * self.one_call_scratch()), out=out)
        return out
