"""Which stacked MoE expert weights keep a checkpoint's FP8, and loading them as stored.

Decided on the meta model, before any storage exists (an FP8 MoE model that fits a GPU only as
FP8 must never be materialized dense): a stacked weight that its module names in
`float8_experts` becomes an engine.models.fp8_experts.Fp8Experts where every checkpoint tensor
it is stacked from is float8_e4m3fn, the activations are dynamic or carry static scales that
each expert's tensors share, and a kernel of the device computes its shape. The family's own
stacking function says which tensors those are: it is run once on meta tensors of the stored
shapes, and again at load on the float8 bytes, on their scales and on the static activation
scales, each stretched to one row per weight row so that they stack as the weights do.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.models import fp8_experts, fp8_linear
from engine.models.fp8_experts import Fp8Experts
from engine.models.fp8_blocks import GEMM_MULTIPLE
from engine.models.fp8_linear import runs_scaled


def use_float8_experts(model: nn.Module, name_map, weights, device: torch.device, dtype: torch.dtype) -> int:
    """On the meta `model`, before storage: replace each stacked expert weight that a module
    names in `float8_experts` by an Fp8Experts where every checkpoint tensor it is stacked
    from is float8_e4m3fn, with dynamic activations or static scales that each expert's tensors
    share; returns how many."""
    fp8 = weights.fp8
    if fp8 is None or not fp8_linear.keeps_float8(device):
        return 0
    if fp8.block is None and not runs_scaled(device, dtype, rowwise=True):
        return 0  # per channel: torch's grouped GEMM alone computes them (block-wise: `kernel_for` per shape)
    if fp8.block is not None and fp8.block[1] % GEMM_MULTIPLE:
        return 0
    count = 0
    for name, module in list(model.named_modules()):
        for attr in getattr(module, "float8_experts", ()):
            stacked = getattr(module, attr)
            if not isinstance(stacked, nn.Parameter) or stacked.dim() != 3:
                continue
            experts, out, inputs = stacked.shape
            source = name_map(f"{name}.{attr}" if name else attr)
            read = _tensors_read(weights, source)
            if not read or any(weights.stored_dtype(n) != "F8_E4M3" for n in read):
                continue
            static = {fp8.input_scale_name(n) in weights for n in read}
            if static != {False} and (static != {True} or fp8.block is not None
                                      or static_input_scales(weights, source) is None):
                continue  # static beside dynamic, static block-wise, or one expert's tensors' scales differ
            # checked before any storage exists: experts the device's kernel refuses load dense,
            # never as FP8 and then a dense copy beside it
            if fp8_experts.kernel_for(device, dtype, out, inputs, fp8.block) is None:
                continue
            delattr(module, attr)  # a parameter's name takes a module only once the parameter is gone
            setattr(module, attr, Fp8Experts(experts, out, inputs, dtype, device=stacked.device))
            count += 1
    return count


def load_stacked(experts: Fp8Experts, weights, source) -> None:
    """Fill `experts` from `source` (the family's function that stacks the experts' tensors from
    a WeightFiles): the float8 weights as stored, their scales stacked the same way, stretched to
    one row per weight row ([out, 1], or [out, in blocks] block-wise) so that they line up
    whatever the stacking. Where it leaves the scales off block boundaries (a gate and an up
    projection that end inside a block), they stay one per row and group: the grouped GEMMs
    take any rows."""
    scales, input_scales = {}, {}

    def stored(name: str) -> torch.Tensor:
        weight, scale, input_scale, block = weights.get_float8(name)
        scale = scale.float()
        scales[name] = (scale.repeat_interleave(block[0], 0)[: weight.shape[0]] if block is not None
                        else scale.reshape(-1, 1).expand(weight.shape[0], 1))
        if input_scale is not None:
            input_scales[name] = _stretched(input_scale, weight.shape[0])
        return weight

    weight = source(_Reads(weights, stored))
    scale = source(_Reads(weights, scales.__getitem__))
    block = weights.fp8.block
    if block is None:  # static scales: use_float8_experts kept these only where each expert's agree
        static = _per_expert(source(_Reads(weights, input_scales.__getitem__))) if input_scales else None
        experts.load_float8(weight, scale[..., 0], None, static)
        return
    rows = block[0]
    per_block = scale[:, ::rows].contiguous()
    if torch.equal(per_block.repeat_interleave(rows, 1)[:, :scale.shape[1]], scale):
        experts.load_float8(weight, per_block, block)
    else:  # stacked projections cut inside a block: the scales as they are, one per row and group
        experts.load_float8(weight, scale, (1, block[1]))


def static_input_scales(weights, source) -> torch.Tensor | None:
    """Each expert's static activation scale [E], from `source` stacking every tensor's scale
    stretched to its rows (the scales alone are read); None where the tensors stacked into one
    expert's rows differ."""
    def read(name: str) -> torch.Tensor:
        return _stretched(weights.get(weights.fp8.input_scale_name(name)), weights.shape_of(name)[0])

    return _per_expert(source(_Reads(weights, read)))


def _stretched(input_scale: torch.Tensor, rows: int) -> torch.Tensor:
    """One static scale as one per weight row, [rows, 1]: stacked as the weights are."""
    return input_scale.float().reshape(1, 1).expand(rows, 1)


def _per_expert(per_row: torch.Tensor) -> torch.Tensor | None:
    """[E, rows, 1] stacked scales -> [E], or None where one expert's rows differ."""
    first = per_row[:, :1]
    return first[:, 0, 0].contiguous() if torch.equal(per_row, first.expand_as(per_row)) else None


class _Reads:
    """A WeightFiles as a family's stacking function reads it (`name in w`, `w.get(name)`), each
    read answered by `read(name)`."""

    def __init__(self, weights, read):
        self.weights, self.model_dir, self.read = weights, weights.model_dir, read

    def __contains__(self, name: str) -> bool:
        return name in self.weights

    def get(self, name: str, shape=None) -> torch.Tensor:
        return self.read(name)


def _tensors_read(weights, source) -> list[str]:
    """The checkpoint tensors a stacking function reads, from a dry run on meta tensors of the
    stored shapes (none where it is not a function, or the dry run cannot follow it)."""
    names = []

    def meta(name: str) -> torch.Tensor:
        names.append(name)
        return torch.empty(weights.shape_of(name), device="meta")

    if not callable(source):
        return []
    try:
        source(_Reads(weights, meta))
    except Exception:  # a stacking this dry run cannot follow: those experts load as before
        return []
    return names
