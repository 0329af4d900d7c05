"""Block-wise FP8 grouped GEMM: token rows sorted by expert, each times its expert's float8
weight, in one launch; and a block-wise FP8 linear, the one-expert case.

    y[m, n] = sum_g scale_x[m, g] * scale_w[e(m), n // rows, g] * sum_{k in g} xq[m, k] * wq[e(m), n, k]

quantized: float8 [M, K] rows sorted by expert, rounded per row and `cols`-wide group g;
scale: float32 [M, ceil(K / cols)]; qweight: float8 [E, N, K]; weight_scale: float32
[E, ceil(N / rows), ceil(K / cols)] for a (rows, cols) weight block (rows 1: a scale per
output row, as a tensor-parallel shard that cuts blocks keeps); ends: int32 [E], expert e's
rows ending at ends[e] (on the device: nothing here reads it on the host, so a CUDA graph
captures the call).

This is the fine-grained FP8 checkpoints' MoE product (Qwen's and DeepSeek's releases: 128x128
weight blocks, 1x128 input groups). torch's grouped scaled GEMM takes one scale per row and
output channel, so without this kernel the product is one grouped GEMM per input group
(engine.models.fp8_experts). Here each program computes one tile of rows of a single expert
against a tile of output channels, stepping through the input one group at a time and scaling
each group's float32 partial product by its two scales, so the whole sum stays in float32.

The tile schedule is built on the device from `ends`: an expert with c rows gets ceil(c / BM)
tiles; the grid is an upper bound on the tile count that depends on shapes alone (M and E),
and programs past the last tile return at once.

A linear (`block_fp8_linear_triton`: qweight [N, K], weight_scale [ceil(N / rows), ceil(K /
cols)]) is the same kernel compiled with ONE_EXPERT: every row is expert 0's and tile t is
rows t * BM onwards, so it builds no schedule and reads no `ends`. It computes the block-wise
products torch's scaled matmul does not take: blocks other than 128x128 (a tensor-parallel
shard's per-row scales or narrower groups), and GPUs of compute capability 8.9.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.kernels._triton import jit, next_power_of_2, tl
from engine.kernels.float_bits import FP8_CAPABILITY

MIN_TILE = 16  # tl.dot's smallest tile side
MIN_DOT_K = 32  # ... and on float8 operands its smallest K (the MMA's): a narrower group is read that wide, masked
MIN_CAPABILITY = FP8_CAPABILITY  # FP8 weights stay FP8 from there on (engine.models.fp8_linear.keeps_float8)


def grouped_block_fp8_ref(quantized: torch.Tensor, scale: torch.Tensor, qweight: torch.Tensor,
                          weight_scale: torch.Tensor, block: tuple[int, int], ends: torch.Tensor,
                          out_dtype: torch.dtype) -> torch.Tensor:
    """The definition, from dequantized operands in float32 (reads `ends` on the host)."""
    rows, cols = block
    m, k = quantized.shape
    x = quantized.float() * scale.repeat_interleave(cols, 1)[:, :k]
    out = torch.empty(m, qweight.shape[1], dtype=out_dtype, device=quantized.device)
    start = 0
    for expert, end in enumerate(ends.tolist()):
        if end > start:
            w_scale = weight_scale[expert].repeat_interleave(rows, 0)[: qweight.shape[1]]
            weight = qweight[expert].float() * w_scale.repeat_interleave(cols, 1)[:, :k]
            out[start:end] = (x[start:end] @ weight.t()).to(out_dtype)
        start = end
    return out


def grouped_block_fp8_triton(quantized: torch.Tensor, scale: torch.Tensor, qweight: torch.Tensor,
                             weight_scale: torch.Tensor, block: tuple[int, int], ends: torch.Tensor,
                             out_dtype: torch.dtype) -> torch.Tensor:
    _check(quantized, scale, qweight, weight_scale, block, ends)
    m, k = quantized.shape
    experts, n, _ = qweight.shape
    out = torch.empty(m, n, dtype=out_dtype, device=quantized.device)
    if m == 0 or n == 0:
        return out
    # decode steps give most experts one or two rows: the smallest tile wastes least
    block_m = MIN_TILE if m <= MIN_TILE * experts else 64
    tile_expert, tile_row = tile_schedule(ends, m, block_m)
    _launch(quantized, scale, qweight, weight_scale, block, out, block_m, ends, tile_expert, tile_row)
    return out


def block_fp8_linear_triton(quantized: torch.Tensor, scale: torch.Tensor, qweight: torch.Tensor,
                            weight_scale: torch.Tensor, block: tuple[int, int], out_dtype: torch.dtype) -> torch.Tensor:
    """quantized [M, K] (scale [M, ceil(K / cols)]) times qweight [N, K] (weight_scale
    [ceil(N / rows), ceil(K / cols)]): one expert of grouped_block_fp8_triton, without its schedule."""
    m = quantized.shape[0]
    _check(quantized, scale, qweight[None], weight_scale[None], block)
    out = torch.empty(m, qweight.shape[0], dtype=out_dtype, device=quantized.device)
    if m == 0 or qweight.shape[0] == 0:
        return out
    block_m = MIN_TILE if m <= MIN_TILE else 64
    _launch(quantized, scale, qweight[None], weight_scale[None], block, out, block_m)
    return out


def _launch(quantized, scale, qweight, weight_scale, block, out, block_m, ends=None, tile_expert=None, tile_row=None):
    """Tiles of `block_m` rows by up to 128 output channels; with no schedule, one expert's rows in order."""
    m, k = quantized.shape
    experts, n, _ = qweight.shape
    block_n = min(128, max(MIN_TILE, next_power_of_2(n)))
    one_expert = tile_expert is None
    tiles = -(-m // block_m) if one_expert else tile_expert.shape[0]
    quantized, scale = quantized.contiguous(), scale.contiguous()
    qweight, weight_scale = qweight.contiguous(), weight_scale.contiguous()
    if one_expert:  # unread pointers: the kernel's ONE_EXPERT branch takes rows from the grid
        ends = tile_expert = tile_row = scale
    _grouped_block_fp8_kernel[(tiles, -(-n // block_n))](
        quantized, scale, qweight, weight_scale, ends, tile_expert, tile_row, out,
        experts, m, n, k, scale.shape[1], weight_scale.shape[1],
        SCALE_ROWS=block[0], BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block[1], DOT_K=max(block[1], MIN_DOT_K),
        ONE_EXPERT=one_expert, num_warps=4, num_stages=3,
    )


def tile_schedule(ends: torch.Tensor, rows: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(expert, first row) of each BLOCK_M-row tile, on the device; tiles past the last are
    expert E. Their count, min(rows, ceil(rows / block_m) + E), bounds the real one: each
    expert's last tile is its only partial one, and each tile has a row."""
    experts = ends.shape[0]
    ends = ends.long()
    starts = F.pad(ends[:-1], (1, 0))
    tiles = (ends - starts + block_m - 1) // block_m
    tile_ends = torch.cumsum(tiles, 0)
    index = torch.arange(min(rows, -(-rows // block_m) + experts), device=ends.device)
    tile_expert = torch.searchsorted(tile_ends, index, right=True)
    owner = tile_expert.clamp(max=experts - 1)
    tile_row = starts[owner] + (index - (tile_ends - tiles)[owner]) * block_m
    return tile_expert.to(torch.int32), tile_row.to(torch.int32)


def _check(quantized, scale, qweight, weight_scale, block, ends=None) -> None:
    m, k = quantized.shape
    experts, n, k_weight = qweight.shape
    rows, cols = block
    if k_weight != k:
        raise ValueError(f"rows have {k} columns, the experts' weights {k_weight}")
    if cols < MIN_TILE or cols & (cols - 1):
        raise ValueError(f"the kernel steps through whole {cols}-column groups: it needs a power of two >= {MIN_TILE}")
    if tuple(scale.shape) != (m, -(-k // cols)):
        raise ValueError(f"input scale {tuple(scale.shape)}, expected {(m, -(-k // cols))}")
    if tuple(weight_scale.shape) != (experts, -(-n // rows), -(-k // cols)):
        raise ValueError(f"weight scale {tuple(weight_scale.shape)}, expected {(experts, -(-n // rows), -(-k // cols))}")
    if ends is not None and (ends.shape != (experts,) or ends.dtype != torch.int32):
        raise ValueError(f"ends must be int32 [{experts}], got {ends.dtype} {tuple(ends.shape)}")


@jit
def _grouped_block_fp8_kernel(x_ptr, x_scale_ptr, w_ptr, w_scale_ptr, ends_ptr, tile_expert_ptr, tile_row_ptr,
                              out_ptr, NUM_EXPERTS, M, N, K, K_GROUPS, N_SCALES, SCALE_ROWS: tl.constexpr,
                              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                              DOT_K: tl.constexpr, ONE_EXPERT: tl.constexpr):
    tile = tl.program_id(0)
    if ONE_EXPERT:  # a linear: tile t is rows t * BLOCK_M onwards, of M
        expert = 0
        first = tile * BLOCK_M
        end = M
    else:
        expert = tl.load(tile_expert_ptr + tile)
        if expert >= NUM_EXPERTS:
            return
        first = tl.load(tile_row_ptr + tile)
        end = tl.load(ends_ptr + expert)
    rows = first + tl.arange(0, BLOCK_M)
    row_ok = rows < end
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    offsets = tl.arange(0, DOT_K)
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * K
    w_cols = w_ptr + (expert * N).to(tl.int64) * K + cols.to(tl.int64)[None, :] * K
    w_scales = w_scale_ptr + (expert * N_SCALES + cols // SCALE_ROWS) * K_GROUPS
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for group in range(0, K_GROUPS):
        k = group * BLOCK_K + offsets
        k_ok = (offsets < BLOCK_K) & (k < K)
        a = tl.load(x_rows + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(w_cols + k[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        a_scale = tl.load(x_scale_ptr + rows * K_GROUPS + group, mask=row_ok, other=0.0)
        b_scale = tl.load(w_scales + group, mask=col_ok, other=0.0)
        acc += tl.dot(a, b) * a_scale[:, None] * b_scale[None, :]
    out = out_ptr + rows.to(tl.int64)[:, None] * N + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])
