"""Rounding rows to float8_e4m3fn, in one launch: with a scale per row and group of columns
computed from the rows (dynamic activations), or with given scales (static ones).

    scale[m, g] = max(max_{k in g} |x[m, k]| / 448, float32 tiny)
    xq[m, k] = e4m3(clamp(x[m, k] / scale[m, g(k)], -448, 448))

`quantize_groups`: rows [M, K] (any float dtype) -> (float8_e4m3fn [M, K], float32
[M, ceil(K / cols)]); the last group is shorter where `cols` does not divide K, and cols = K is
a scale per row. `quantize_scaled`: rows and a float32 scale, one ([]) or per row ([M, 1]) ->
float8 rows. Every FP8 linear and expert rounds its input one of these ways before each product
(engine.models.fp8_linear, fp8_experts): in torch that is four to nine kernels a call (a pad,
the float copy, abs, amax, divisions, clamps, the cast), which a CUDA-graph decode step of an
FP8 model repeats for every linear of every layer; here it is one.

The kernel is bit for bit the reference: both divisions round to nearest, and the value is
rounded to the e4m3 grid in float32 arithmetic (engine.kernels.float_bits: ties to even, as
torch's cast) before an exact cast.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.kernels._triton import jit, next_power_of_2, tl
from engine.kernels.float_bits import FP8_CAPABILITY, round_to_fp8_grid

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max
TINY = torch.finfo(torch.float32).tiny
TILE_VALUES = 2048  # a program rounds about this many values: several rows where a group is narrow
MIN_CAPABILITY = FP8_CAPABILITY  # FP8 weights stay FP8 from there on (engine.models.fp8_linear.keeps_float8)


def quantize_groups_ref(rows: torch.Tensor, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    m, k = rows.shape
    groups = F.pad(rows.float(), (0, -k % cols)).reshape(m, -(-k // cols), cols)  # m may be 0
    scale = (groups.abs().amax(-1) / FP8_MAX).clamp(min=TINY)
    quantized = (groups / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8).reshape(m, groups.shape[1] * cols)
    return (quantized if k % cols == 0 else quantized[:, :k].contiguous()), scale


def quantize_scaled_ref(rows: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (rows.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def quantize_groups_triton(rows: torch.Tensor, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    m, k = rows.shape
    scale = torch.empty(m, -(-k // cols), dtype=torch.float32, device=rows.device)
    return _launch(rows, cols, scale, static=False), scale


def quantize_scaled_triton(rows: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    if scale.dim() not in (0, 2) or scale.numel() not in (1, rows.shape[0]) or scale.dtype != torch.float32:
        raise ValueError(f"a float32 scale [] or [{rows.shape[0]}, 1] is needed, got {scale.dtype} {tuple(scale.shape)}")
    return _launch(rows, rows.shape[1], scale.contiguous(), static=True)


def _launch(rows: torch.Tensor, cols: int, scale: torch.Tensor, static: bool) -> torch.Tensor:
    """The kernel over (block of rows, group): `scale` written (dynamic) or read (static: one for
    all rows, or one per row)."""
    m, k = rows.shape
    quantized = torch.empty(m, k, dtype=FP8, device=rows.device)
    if m == 0 or k == 0:
        return quantized
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    block, groups = next_power_of_2(cols), -(-k // cols)
    row_block = max(1, min(next_power_of_2(m), TILE_VALUES // block))
    values = row_block * block
    _quantize_groups_kernel[(-(-m // row_block), groups)](
        rows, quantized, scale, m, k, groups, rows.stride(0), 1 if scale.numel() == m and m > 1 else 0, FP8_MAX, TINY,
        COLS=cols, BLOCK=block, ROWS=row_block, STATIC=static,
        num_warps=4 if values <= 1024 else 8 if values <= 4096 else 16,
    )
    return quantized


@jit
def _quantize_groups_kernel(x_ptr, q_ptr, scale_ptr, M, K, GROUPS, stride_x, static_stride, fp8_max, tiny,
                            COLS: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr, STATIC: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    group = tl.program_id(1)
    offsets = tl.arange(0, BLOCK)
    cols = group * COLS + offsets
    row_ok = rows < M
    ok = row_ok[:, None] & ((offsets < COLS) & (cols < K))[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    if STATIC:
        scale = tl.load(scale_ptr + rows * static_stride, mask=row_ok, other=1.0)
    else:
        scale = tl.maximum(tl.math.div_rn(tl.max(tl.abs(x), axis=1), fp8_max), tiny)
        tl.store(scale_ptr + rows * GROUPS + group, scale, mask=row_ok)
    v = tl.minimum(tl.maximum(tl.math.div_rn(x, scale[:, None]), -fp8_max), fp8_max)
    tl.store(q_ptr + rows[:, None] * K + cols[None, :], round_to_fp8_grid(v, 3, -6).to(q_ptr.dtype.element_ty), mask=ok)
