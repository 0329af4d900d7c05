"""Block-wise FP8 products: the fine-grained format's weights (one scale per rows x cols block)
kept as float8, times inputs rounded to float8 with a scale per token and block of columns.

    y[m, n] = sum_g scale_x[m, g] * scale_w[n // rows, g] * sum_{k in g} xq[m, k] * wq[n, k]

where g runs over the `cols`-wide groups of the input columns. This is what the checkpoints'
authors ran (DeepSeek's and Qwen's FP8 releases: 128x128 weight blocks, 1x128 input groups)
and what torch's scaled matmul computes on Hopper and newer with CUDA 12.9 or later
(`torch._scaled_mm` with a [tokens, groups] input scale and a [groups, blocks] weight scale).

That call's rules for the scales' memory layout have changed between torch releases, and a
scale in the wrong layout gives wrong numbers, not an error. So no layout is assumed:
`gemm_layout` tries each known one on the device once per weight shape, on random float8
values with a different scale per block, and keeps the first whose product matches
`reference_product` (the same product from dequantized operands, in float32).

Where that call does not apply (blocks other than 128x128, as a tensor-parallel shard that cuts
blocks keeps; a GPU of compute capability 8.9; a float16 output) or no layout matches, the
product runs as one launch of the block-wise Triton kernel (engine.kernels.fp8_moe's linear
form), checked on the device the same way (`fused_fits`); where that fails too, the linear
dequantizes its weight once (engine.models.fp8_linear). On a CPU, where torch has no
block-wise scaled matmul, `reference_product` is the forward (tests run it there, and the
Triton kernel under TRITON_INTERPRET=1 where a test says Triton runs).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from engine.kernels import uses_triton
from engine.kernels.fp8_moe import MIN_TILE, block_fp8_linear_triton
from engine.kernels.fp8_quant import (FP8, FP8_MAX, quantize_groups_ref, quantize_groups_triton, quantize_scaled_ref,
                                      quantize_scaled_triton)
from engine.models.fp8 import expand_blocks

GEMM_BLOCK = (128, 128)  # the only weight block torch's scaled matmul takes
GEMM_MULTIPLE = 16  # the scaled matmuls' rule for K and N on a GPU (and the narrowest group kept)
LAYOUTS = ("contiguous", "padded")  # the weight scale's rows as stored, or padded to 4 (some torch releases)
PROBE_TOLERANCE = 1e-2  # relative error of a probe's product: bfloat16 output rounding is 2^-8
log = logging.getLogger(__name__)
_layouts: dict[tuple, str | None] = {}  # (device, dtype, out, in) -> the layout that matched
_fused: dict[tuple, bool] = {}  # (device, dtype, out, in, block) -> the Triton kernel computes it there


def quantize_groups(rows: torch.Tensor, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """rows [M, K] -> (float8 rows [M, K], a scale per row and `cols`-wide group [M, ceil(K / cols)]):
    one Triton launch where Triton runs, the torch definition elsewhere (engine.kernels.fp8_quant)."""
    return quantize_groups_triton(rows, cols) if uses_triton(rows) else quantize_groups_ref(rows, cols)


def quantize_scaled(rows: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """rows [M, K] -> float8 rows [M, K] by a given float32 scale ([], or per row [M, 1])."""
    return quantize_scaled_triton(rows, scale) if uses_triton(rows) else quantize_scaled_ref(rows, scale)


def dequantize_groups(quantized: torch.Tensor, scale: torch.Tensor, cols: int) -> torch.Tensor:
    """quantize_groups' output back in float32."""
    return quantized.float() * scale.repeat_interleave(cols, 1)[:, : quantized.shape[1]]


def reference_product(quantized: torch.Tensor, scale: torch.Tensor, qweight: torch.Tensor,
                      weight_scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """The block-wise product from dequantized operands, in float32."""
    weight = qweight.float() * expand_blocks(weight_scale, block, qweight.shape)
    return F.linear(dequantize_groups(quantized, scale, block[1]), weight)


def gemm_scale(weight_scale: torch.Tensor, layout: str) -> torch.Tensor:
    """The weight scale [blocks of rows, groups] as torch's scaled matmul takes it for `layout`:
    transposed to [groups, blocks of rows], its storage the untransposed rows (padded to 4)."""
    if layout == "contiguous":
        return weight_scale.contiguous().t()
    rows, groups = weight_scale.shape
    padded = torch.zeros(rows, -(-groups // 4) * 4, dtype=weight_scale.dtype, device=weight_scale.device)
    padded[:, :groups] = weight_scale
    return padded[:, :groups].t()


def scaled_product(quantized: torch.Tensor, scale: torch.Tensor, qweight: torch.Tensor, scale_b: torch.Tensor,
                   out_dtype: torch.dtype) -> torch.Tensor:
    """torch's block-wise scaled matmul, the input scale column-major as it requires (strides
    (1, tokens) even for one token, where .contiguous() of the transpose would keep the rows')."""
    tokens, groups = scale.shape
    column_major = torch.empty_strided((tokens, groups), (1, tokens), dtype=scale.dtype, device=scale.device)
    return torch._scaled_mm(quantized, qweight.t(), scale_a=column_major.copy_(scale), scale_b=scale_b,
                            out_dtype=out_dtype)


def gemm_layout(device: torch.device, dtype: torch.dtype, out_features: int, in_features: int) -> str | None:
    """The weight-scale layout with which torch's scaled matmul computes the block-wise product
    of an [out, in] weight on `device` with `dtype` output, checked against reference_product
    once per shape; None where none does (or raises)."""
    key = (str(device), dtype, out_features, in_features)
    if key not in _layouts:
        _layouts[key] = None
        for layout in LAYOUTS:
            error = _mismatch(device, dtype, out_features, in_features, GEMM_BLOCK,
                              lambda q, s, w, ws, layout=layout: scaled_product(q, s, w, gemm_scale(ws, layout), dtype))
            if error is None:
                _layouts[key] = layout
                break
            log.info("block-wise scaled matmul, %s weight scale, [%d, %d] on %s: %s", layout, out_features,
                     in_features, device, error)
        if _layouts[key] is None:
            log.warning("torch's scaled matmul does not compute 128x128 block-wise FP8 products of [%d, %d] "
                        "weights on %s; those linears take the block-wise Triton kernel where it does, else are "
                        "dequantized", out_features, in_features, device)
    return _layouts[key]


def fused_runs(device: torch.device, block: tuple[int, int]) -> bool:
    """Whether the block-wise Triton kernel can take `block` on `device` (before any probe):
    Triton runs there, and the kernel steps through input groups of a power of two >= 16."""
    cols = block[1]
    return cols >= MIN_TILE and not cols & (cols - 1) and uses_triton(torch.empty(0, device=device))


def fused_fits(device: torch.device, dtype: torch.dtype, out_features: int, in_features: int,
               block: tuple[int, int]) -> bool:
    """Whether the block-wise Triton kernel computes an [out, in] weight's product with `block`
    scales on `device` with `dtype` output, checked against reference_product once per shape
    (where `fused_runs`)."""
    key = (str(device), dtype, out_features, in_features, tuple(block))
    if key not in _fused:
        error = _mismatch(device, dtype, out_features, in_features, block,
                          lambda q, s, w, ws: block_fp8_linear_triton(q, s, w, ws, block, dtype))
        _fused[key] = error is None
        if error is not None:
            log.warning("the block-wise FP8 Triton kernel does not compute [%d, %d] weights per %dx%d block on %s: "
                        "%s; those linears are dequantized", out_features, in_features, *block, device, error)
    return _fused[key]


def _mismatch(device: torch.device, dtype: torch.dtype, out_features: int, in_features: int,
              block: tuple[int, int], product) -> str | None:
    """Why `product(quantized, scale, qweight, weight_scale)` on `device` is not the block-wise
    product of random float8 values with a different scale per block; None where it is."""
    generator = torch.Generator().manual_seed(0)
    rows, cols = block
    qweight = (torch.randn(out_features, in_features, generator=generator) * 64).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    # scales 2^-12 .. 2^-6, different per block: a scale read from the wrong block shows
    weight_scale = torch.exp2(-12 + 6 * torch.rand(-(-out_features // rows), -(-in_features // cols),
                                                   generator=generator))
    qweight, weight_scale = qweight.to(device), weight_scale.to(device)
    try:
        for tokens in (1, 33):  # a decode row, and a count no tile size divides
            x = torch.randn(tokens, in_features, generator=generator).to(device, dtype)
            quantized, scale = quantize_groups(x, cols)
            got = product(quantized, scale, qweight, weight_scale).float()
            want = reference_product(quantized, scale, qweight, weight_scale, block)
            if not (got - want).norm() <= PROBE_TOLERANCE * want.norm():
                return f"relative error {float((got - want).norm() / want.norm()):.3g} at {tokens} tokens"
    except Exception as why:  # noqa: BLE001 - torch's refusals and Triton's compile errors alike
        return f"{type(why).__name__}: {why}"
    return None


def whole_blocks(indices: list[int], size: int, block: int) -> list[int] | None:
    """The blocks of `block` positions (of `size` in all; the last may be shorter) that
    `indices` are, in order, when they are whole blocks; None when they are not."""
    blocks, i = [], 0
    while i < len(indices):
        first = indices[i]
        span = min(block, size - first)
        if first % block or indices[i:i + span] != list(range(first, first + span)):
            return None
        blocks.append(first // block)
        i += span
    return blocks


def narrower_groups(columns: list[int], size: int, block: int) -> tuple[int, list[int]] | None:
    """The widest group width below `block` that divides it, is a multiple of 16, and of whose
    groups `columns` (of `size`) are whole ones, with those groups in order; None where none is."""
    for width in range(block - GEMM_MULTIPLE, GEMM_MULTIPLE - 1, -GEMM_MULTIPLE):
        groups = whole_blocks(columns, size, width) if block % width == 0 else None
        if groups is not None:
            return width, groups
    return None


def shard_rows(scale: torch.Tensor, block: tuple[int, int], rows: list[int], size: int):
    """(block, scale) of a shard of weight rows `rows` (of `size`), for a block-wise scale
    [..., row blocks, groups]: their blocks' scales where they are whole blocks, else a scale
    per row, each its block's (block (1, cols))."""
    blocks = whole_blocks(rows, size, block[0])
    if blocks is not None:
        return block, scale[..., blocks, :]
    per_row = scale.repeat_interleave(block[0], -2)[..., :size, :]
    return (1, block[1]), per_row.index_select(-2, torch.as_tensor(rows, dtype=torch.long, device=scale.device))


def shard_columns(scale: torch.Tensor, block: tuple[int, int], columns: list[int], size: int):
    """(block, scale) of a shard of input columns `columns` (of `size`), for a block-wise scale
    [..., row blocks, groups]: their blocks' scales where they are whole blocks, else the widest
    narrower groups they are whole groups of, each group's scale its block's; None where there
    are none (the shard is dequantized)."""
    blocks = whole_blocks(columns, size, block[1])
    if blocks is not None:
        return block, scale[..., blocks]
    narrower = narrower_groups(columns, size, block[1])
    if narrower is None:
        return None
    width, groups = narrower
    fine = scale.repeat_interleave(block[1] // width, -1)[..., :-(-size // width)]
    return (block[0], width), fine[..., groups]
