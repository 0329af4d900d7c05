"""Stacked MoE expert weights that keep a checkpoint's FP8, run as grouped scaled GEMMs.

An FP8 MoE checkpoint's experts are most of its bytes (Qwen3-Next-80B-A3B-FP8: about 77 of
80 GB), so dequantizing them at load doubles the model's memory: the difference between
fitting one GPU and not. Kept experts are float8_e4m3fn [experts, out, in] with one scale per
expert and output channel (compressed-tensors' per-channel scales; a per-tensor scale is
expanded to its rows) or per 128x128 block (transformers' fine-grained format), and
`engine.models.expert_dispatch.grouped` multiplies the expert-sorted token rows through
`torch._scaled_grouped_mm`: no host read, so CUDA graphs capture it.

That kernel takes scales per row of the input and per expert and output channel only. So:
- per-channel weights: one grouped GEMM per projection, the input rounded to FP8 with a scale
  per token, or with a checkpoint's static activation scale (compressed-tensors' `input_scale`,
  one per expert and projection: each row takes its expert's), accumulated in float32 by the
  kernel:

      y[m, n] = (sum_k xq[m, k] * wq[e(m), n, k]) * scale_x[m] * scale_w[e(m), n]

- block-wise weights: the input is rounded per token and 128 columns, as the checkpoint's
  authors ran it, and the product sums each 128-column group g scaled by its two scales:

      y[m, n] = sum_g (sum_{k in g} xq[m, k] * wq[e(m), n, k]) * scale_x[m, g] * scale_w[e(m), n // 128, g]

  torch's grouped kernel takes no block scales. Where Triton runs (CUDA), one launch of
  engine.kernels.fp8_moe computes the whole sum in float32 ("fused"). Elsewhere, or where the
  device check refuses that kernel, each group is one grouped GEMM whose weight scale per
  output channel is its block's (`gemm_scales` [groups, experts, out], built at load): its
  partial product is written in bfloat16 (the kernel's only output) and summed in float32,
  within 2^-8 relative per group of the fused product ("split").

A static scale is kept where the tensors stacked into each expert's rows share one (a gate and
an up projection read the same input, so calibration gives them the same scale); where they
differ, or beside block-wise weights, the experts are dequantized. Which experts keep FP8 is decided
on the meta model (engine.models.fp8_experts_loading), after the device's kernel is checked once per shape
against the same product from dequantized operands (`kernel_for`): experts that no kernel
computes load dense. A tensor-parallel shard whose rows cut blocks keeps a scale per row; one
whose input columns cut blocks keeps FP8 in narrower groups where it can (`tp_take`).
On a CPU (tests set the policy) `reference_grouped` stands in for torch's kernel with the same
arguments, so the rounding, the group split and the scale layout run here too; the Triton
kernel runs here under TRITON_INTERPRET=1 where a test says Triton is used.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from engine.kernels.fp8_moe import grouped_block_fp8_triton
from engine.models.fp8 import expand_blocks
from engine.models.fp8_blocks import (GEMM_MULTIPLE, PROBE_TOLERANCE, dequantize_groups, fused_runs, quantize_groups,
                                      quantize_scaled, shard_columns, shard_rows)
from engine.models.fp8_linear import FP8, FP8_MAX

log = logging.getLogger(__name__)
_fits: dict[tuple, bool] = {}  # (kernel, device, dtype, out, in, block) -> the kernel computes it there


class Fp8Experts(nn.Module):
    """A stacked expert weight [experts, out, in] kept as float8_e4m3fn with its scales.

    Indexing (`experts[e]`, `experts[a:b]`) gives dequantized weights in the serving dtype, so
    the per-expert and dense ways of expert_dispatch run on it unchanged; `grouped_product` is
    the FP8 way."""

    def __init__(self, experts: int, out_features: int, in_features: int, dtype: torch.dtype, device=None):
        super().__init__()
        self.qweight = nn.Parameter(torch.empty(experts, out_features, in_features, dtype=FP8, device=device),
                                    requires_grad=False)
        self.serving_dtype = dtype
        self.weight_scale: torch.Tensor | None = None  # float32 [E, out] or, block-wise, [E, out blocks, in blocks]
        self.input_scale: torch.Tensor | None = None  # float32 [E]: the checkpoint's static activation scales
        self.block: tuple[int, int] | None = None
        self.fused = False  # block-wise, one launch of the Triton kernel a product (else one grouped GEMM a group)
        self.gemm_scales: torch.Tensor | None = None  # split: [in blocks, E, out], each group's scale per channel
        self.dense: torch.Tensor | None = None  # dequantized, where no kernel of the device takes these

    @property
    def shape(self) -> torch.Size:
        return self.qweight.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.serving_dtype

    @property
    def kept(self) -> bool:
        """Whether products run on the FP8 weights (else on `dense`)."""
        return self.dense is None

    def __getitem__(self, index) -> torch.Tensor:
        return self.dense[index] if self.dense is not None else self.dequantized(index)

    def dequantized(self, index=slice(None)) -> torch.Tensor:
        q, scale = self.qweight[index].float(), self.weight_scale[index]
        full = scale.unsqueeze(-1) if self.block is None else expand_blocks(scale, self.block, q.shape)
        return (q * full).to(self.serving_dtype)

    def load_float8(self, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None,
                    input_scale: torch.Tensor | None = None) -> None:
        """The stacked float8 weight as stored, its scale ([E, out] or [E, out blocks, in blocks])
        and its static activation scales ([E], or None: dynamic)."""
        with torch.no_grad():
            self.qweight.copy_(weight)
        device = self.qweight.device
        self.weight_scale, self.block = scale.float().to(device).contiguous(), block
        self.input_scale = None if input_scale is None else input_scale.float().to(device).contiguous()
        self._fit()

    def quantize_input(self, rows: torch.Tensor, ends: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """rows [M, in] sorted by expert -> (float8 rows, a scale per row [M, 1], or per row and
        block of columns): the row's expert's static scale where the checkpoint has them."""
        if self.input_scale is None:
            return quantize_groups(rows, self.qweight.shape[2] if self.block is None else self.block[1])
        scale = self.input_scale.index_select(0, expert_of_rows(ends, rows.shape[0])).unsqueeze(1)
        return quantize_scaled(rows, scale), scale

    def grouped_product(self, rows: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
        """rows [M, in] sorted by expert, expert e's rows ending at ends[e] (int32, on the device)
        -> [M, out] in rows' dtype: each row times its expert's weight."""
        quantized, scale = self.quantize_input(rows, ends)
        kernel = torch._scaled_grouped_mm if rows.is_cuda else reference_grouped
        if self.block is None:
            return kernel(quantized, self.qweight.transpose(1, 2), scale[:, 0].contiguous(), self.weight_scale,
                          offs=ends, out_dtype=rows.dtype)
        if self.fused:
            return grouped_block_fp8_triton(quantized, scale, self.qweight, self.weight_scale, self.block, ends,
                                            rows.dtype)
        cols, out = self.block[1], None
        for group, start in enumerate(range(0, self.qweight.shape[2], cols)):
            part = kernel(quantized[:, start:start + cols], self.qweight[:, :, start:start + cols].transpose(1, 2),
                          scale[:, group].contiguous(), self.gemm_scales[group], offs=ends, out_dtype=rows.dtype)
            out = part.float() if out is None else out.add_(part)
        return out.to(rows.dtype)

    def tp_take(self, dim: int, positions) -> Fp8Experts:
        """A tensor-parallel shard: `positions` along dim 1 (output channels) or 2 (input
        channels), with their scales. Output channels that cut a weight block keep a scale per
        row (the grouped GEMMs take any rows). Input channels that cut one keep FP8 in the
        widest narrower groups they are whole groups of (`narrower_groups`: Qwen3-Next's
        512-wide experts at TP 8 are 64 columns a rank, half of each 128-column block), each
        group's weight scale its block's; the shard then rounds its input per group of that
        width, finer than the whole weight's, so its product differs from the un-sharded one's
        by FP8 rounding, as a row-parallel shard's own per-token scales do. Where no such width
        is 16 or more (the grouped GEMM's rule), the shard is dequantized."""
        positions = list(positions)
        index = torch.as_tensor(positions, dtype=torch.long, device=self.qweight.device)
        shape = list(self.qweight.shape)
        shape[dim] = len(positions)
        shard = Fp8Experts(*shape, self.serving_dtype, device="meta")
        shard.qweight = nn.Parameter(self.qweight.index_select(dim, index).clone(), requires_grad=False)
        shard.block, shard.input_scale, scale = self.block, self.input_scale, self.weight_scale
        taken = None  # (block, scale) of a block-wise shard that keeps FP8
        if self.block is not None and self.dense is None:
            take = shard_rows if dim == 1 else shard_columns
            taken = take(scale, self.block, positions, self.qweight.shape[dim])
        if self.dense is not None or (self.block is not None and taken is None):
            shard.dense = self[:].index_select(dim, index)
        elif taken is not None:
            shard.block, scale = taken
        elif dim == 1:  # per channel: the kept channels' scales (an input shard keeps them all)
            scale = scale.index_select(1, index)
        shard.weight_scale = scale.contiguous()
        shard._fit()
        return shard

    def _fit(self) -> None:
        """Pick the kernel, or dequantize where none computes these experts on their device (a
        tensor-parallel shard's shape is new; the whole weight's was checked before it was kept)."""
        _, out, inputs = self.qweight.shape
        kernel = kernel_for(self.qweight.device, self.serving_dtype, out, inputs, self.block) if self.kept else None
        self.fused = kernel == "fused"
        if self.kept and kernel is None:
            self.dense = self.dequantized()
        self._build_gemm_scales()

    def _build_gemm_scales(self) -> None:
        """Block-wise and split: each input group's weight scale per expert and output channel."""
        self.gemm_scales = None
        if self.kept and self.block is not None and not self.fused:
            rows, out = self.block[0], self.qweight.shape[1]
            self.gemm_scales = self.weight_scale.permute(2, 0, 1).repeat_interleave(rows, 2)[:, :, :out].contiguous()

    def extra_repr(self) -> str:
        kind = "per {}x{} block".format(*self.block) if self.block is not None else "per channel"
        way = ", fused" if self.fused else "" if self.kept else ", dequantized"
        static = ", static input scales" if self.input_scale is not None else ""
        return f"{tuple(self.qweight.shape)}, float8_e4m3fn, scaled {kind}{static}{way}"


def expert_of_rows(ends: torch.Tensor, rows: int) -> torch.Tensor:
    """Each of `rows` expert-sorted rows' expert, from the experts' ends, on the device (no host
    read: a CUDA graph captures it)."""
    index = torch.arange(rows, device=ends.device, dtype=ends.dtype)
    return torch.searchsorted(ends, index, right=True).clamp_(max=ends.shape[0] - 1)


def reference_grouped(quantized: torch.Tensor, weights: torch.Tensor, scale_rows: torch.Tensor,
                      scale_cols: torch.Tensor, offs: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """torch._scaled_grouped_mm's row-wise product from dequantized operands, in float32:
    quantized [M, K], weights [E, K, N] (the stacked weight transposed), scale_rows [M],
    scale_cols [E, N], offs [E] the groups' ends. Each row's expert is found from `offs` on the
    device, with no host read (as in the kernel it stands in for, so a forward a CUDA graph
    would capture runs it under the tests' host-read guard); each row then gathers its
    expert's weight, M x K x N floats: test sizes only."""
    expert = expert_of_rows(offs, quantized.shape[0])
    product = torch.bmm(quantized.float().unsqueeze(1), weights.float().index_select(0, expert)).squeeze(1)
    return (product * scale_rows[:, None] * scale_cols.index_select(0, expert)).to(out_dtype)


def kernel_for(device: torch.device, dtype: torch.dtype, out_features: int, in_features: int,
               block: tuple[int, int] | None) -> str | None:
    """How experts of this shape keep FP8 on `device`: "fused" (block-wise, the Triton kernel,
    where Triton runs and computes them), "split" (torch's grouped scaled GEMM: on CUDA where it
    computes them; off it, tests, reference_grouped computes any shape), or None: dequantized."""
    if block is not None and fused_runs(device, block) and grouped_fits(device, dtype, out_features, in_features,
                                                                          block, fused=True):
        return "fused"
    if out_features % GEMM_MULTIPLE or in_features % GEMM_MULTIPLE:
        return None
    if device.type != "cuda" or grouped_fits(device, dtype, out_features, in_features, block):
        return "split"
    return None


def grouped_fits(device: torch.device, dtype: torch.dtype, out_features: int, in_features: int,
                 block: tuple[int, int] | None, fused: bool = False) -> bool:
    """Whether the device's kernel (torch's grouped scaled GEMM, or the fused Triton one)
    computes these experts' product (checked once per shape against the product from
    dequantized operands)."""
    if device.type == "cuda" and device.index is None:  # one key whether the caller named the index or not
        device = torch.device("cuda", torch.cuda.current_device())
    key = (fused, str(device), dtype, out_features, in_features, block)
    if key not in _fits:
        try:
            error = _probe(device, dtype, out_features, in_features, block, fused)
        except Exception as why:  # noqa: BLE001 - Triton's compile errors are Exceptions of their own
            error = f"{type(why).__name__}: {why}"
        _fits[key] = error is None
        if error is not None:
            log.warning("%s does not compute FP8 experts [%d, %d] (%s) on %s: %s; those experts %s",
                        "the fused Triton MoE kernel" if fused else "torch's grouped scaled GEMM",
                        out_features, in_features, "per channel" if block is None else "per {}x{} block".format(*block),
                        device, error, "run one grouped GEMM per input group" if fused else "are dequantized")
    return _fits[key]


def _probe(device: torch.device, dtype: torch.dtype, out_features: int, in_features: int,
           block: tuple[int, int] | None, fused: bool) -> str | None:
    generator = torch.Generator().manual_seed(0)
    probe = Fp8Experts(3, out_features, in_features, dtype, device=device)
    # on the host explicitly: the probe also runs while the model is built under torch.device("meta")
    weight = (torch.randn(3, out_features, in_features, generator=generator, device="cpu") * 64).clamp(-FP8_MAX,
                                                                                                     FP8_MAX)
    # scales 2^-12 .. 2^-6, different per expert, channel or block: one read from the wrong place shows
    scale_shape = (3, out_features) if block is None else (3, -(-out_features // block[0]), -(-in_features // block[1]))
    probe.qweight.data.copy_(weight.to(FP8).to(device))
    probe.weight_scale = torch.exp2(-12 + 6 * torch.rand(scale_shape, generator=generator, device="cpu")).to(device)
    probe.block, probe.fused = block, fused
    probe._build_gemm_scales()
    weights = probe.dequantized().float()
    for count in (33, 161):  # no tile divides either; the fused kernel tiles them differently (decode, prefill)
        rows = torch.randn(count, in_features, generator=generator, device="cpu").to(device, dtype)
        ends = torch.tensor([7, 7, count], dtype=torch.int32, device=device)  # the middle expert has no rows
        got = probe.grouped_product(rows, ends).float()
        dequantized = dequantize_groups(*probe.quantize_input(rows, ends), in_features if block is None else block[1])
        want = torch.cat([dequantized[:7] @ weights[0].t(), dequantized[7:] @ weights[2].t()])
        if not (got - want).norm() <= PROBE_TOLERANCE * want.norm():
            return f"relative error {float((got - want).norm() / want.norm()):.3g} at {count} rows"
    return None
