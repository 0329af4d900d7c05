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

from engine.models.batch import ForwardBatch
from engine.models.hybrid import StateTensorSpec
from engine.models.ssm import varlen_causal_conv


class ShortConvMixer(nn.Module):
    state_kind = "short_conv"

    def __init__(self, hidden: int, kernel: int, bias: bool):
        super().__init__()
        self.hidden, self.kernel = hidden, kernel
        # conv_bias switches the biases of both projections as well as the conv's.
        self.in_proj = nn.Linear(hidden, 3 * hidden, bias=bias)
        self.conv_weight = nn.Parameter(torch.empty(hidden, kernel))
        self.conv_bias = nn.Parameter(torch.zeros(hidden)) if bias else None
        self.out_proj = nn.Linear(hidden, hidden, bias=bias)

    def state_spec(self) -> list[StateTensorSpec]:
        return [StateTensorSpec("conv", (self.hidden, self.kernel))]

    def forward(self, hidden: torch.Tensor, batch: ForwardBatch,
                state: tuple[torch.Tensor]) -> torch.Tensor:
        (conv_state,) = state
        b, c, x = self.in_proj(hidden).chunk(3, dim=-1)  # in this order in the checkpoint
        y = varlen_causal_conv(b * x, batch, conv_state, self.conv_weight, self.conv_bias)
        return self.out_proj(c * y)
