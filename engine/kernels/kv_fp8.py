"""KV blocks stored in FP8 (engine.kv_format): the dequantizing load of whole blocks into the
working rows an attention layer reads, and the quantizing store of the rows a step wrote.

    load:  working[b] = (float32(pool[b]) * scale[head]) in the compute dtype, b in blocks
    store: pool[t] = fp8(clamp(float32(working[t]) / scale[head], -largest, largest)), t in written

Where Triton has no e4m3 type (a GPU before compute capability 8.9: float_bits.fp8_as_bytes)
the pool moves as bytes, decoded and encoded exactly in integer arithmetic.

The store also takes the step's rows themselves (kv_store_rows_triton): an all-decode step
reads the pool in place (engine.kernels.paged_attention) and writes no working rows.

`scale` is one float32 number for the tensor or one per KV head (rows [..., heads, head_dim]).
In torch ops each is five to six kernels (a gather, widening and narrowing copies, the scaling,
the clamp, a scatter), each reading and writing the blocks whole; a GPU step's load covers
every block its rows' tables hold, for every attention layer. Here each is one pass at the
blocks' or tokens' rows. Both are bit for bit the torch path (engine.kv_format.quantize /
dequantize) on finite values: the divisions and products round to nearest, and the narrow
results are rounded in float32 arithmetic (engine.kernels.float_bits) before an exact cast.
"""

from __future__ import annotations

import math

import torch

from engine.kernels._triton import device_function, jit, tl
from engine.kernels.float_bits import FP8_FORMATS, fp8_as_bytes, fp8_bits, fp8_value, half_bits, round_to_fp8_grid
from engine.kernels.row_copy import indexed_row

BLOCK = 1024
_OUT = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def kv_load_triton(pool: torch.Tensor, blocks: torch.Tensor, working: torch.Tensor, scale) -> None:
    """working[blocks] = pool[blocks] * scale, in working's dtype (blocks may repeat)."""
    scales, per_head = _scales(scale, pool)
    block_numel = math.prod(pool.shape[1:])
    _check(pool, working, blocks)
    if blocks.numel() and block_numel:
        out = working if working.dtype == torch.float32 else working.view(torch.int16)
        as_bytes = fp8_as_bytes(pool)
        mantissa, min_exponent = FP8_FORMATS[pool.dtype]
        _kv_load_kernel[(blocks.numel(), -(-block_numel // BLOCK))](
            pool.view(torch.uint8) if as_bytes else pool, blocks, out, scales, block_numel, pool.shape[-1],
            pool.shape[-2] if pool.dim() > 2 else 1, PER_HEAD=per_head, OUT=_OUT[working.dtype],
            AS_BYTES=as_bytes, MANTISSA_BITS=mantissa, MIN_EXPONENT=min_exponent, BLOCK=BLOCK)


def kv_store_triton(working: torch.Tensor, written: torch.Tensor, pool: torch.Tensor, scale) -> None:
    """pool's token rows `written` (rows of working and pool seen as [-1, *row]) = working's,
    divided by scale, saturated and rounded to pool's float8 format."""
    _check(pool, working, written)
    _store(working, 0, written, pool, scale, source_indexed=True)


def kv_store_rows_triton(rows: torch.Tensor, written: torch.Tensor, pool: torch.Tensor, scale) -> None:
    """pool's token row written[t] = rows[t] ([T, *row], each row contiguous), quantized as
    kv_store_triton does: a step's K or V rows stored straight from the projection."""
    _check(pool, None, written)
    if rows.dtype not in _OUT or rows.shape[1:] != pool.shape[2:] or rows.shape[0] != written.numel() or (
            rows.numel() and not rows[0].is_contiguous()):
        raise ValueError(f"rows [{written.numel()}, *{tuple(pool.shape[2:])}] in float32 / bfloat16 / float16, "
                         f"each contiguous, got {tuple(rows.shape)} {rows.dtype}")
    _store(rows, rows.stride(0), written, pool, scale, source_indexed=False)


def _store(source: torch.Tensor, source_stride: int, written: torch.Tensor, pool: torch.Tensor, scale,
           source_indexed: bool) -> None:
    scales, per_head = _scales(scale, pool)
    token_numel = math.prod(pool.shape[2:])
    if written.numel() and token_numel:
        mantissa, min_exponent = FP8_FORMATS[pool.dtype]
        as_bytes = fp8_as_bytes(pool)
        _kv_store_kernel[(written.numel(), -(-token_numel // BLOCK))](
            source, source_stride, written, pool.view(torch.uint8) if as_bytes else pool, scales, token_numel,
            pool.shape[-1], pool.shape[-2] if pool.dim() > 2 else 1, torch.finfo(pool.dtype).max, PER_HEAD=per_head,
            SOURCE_INDEXED=source_indexed, AS_BYTES=as_bytes, MANTISSA_BITS=mantissa, MIN_EXPONENT=min_exponent,
            BLOCK=BLOCK)


def _scales(scale, pool: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """A scale as engine.kv_format.scale_tensor gives it (a number, or [heads, 1]) -> float32 on
    the pool's device, and whether it is per head."""
    if isinstance(scale, torch.Tensor):
        return scale.reshape(-1).float().contiguous(), True
    return torch.tensor([float(scale)], dtype=torch.float32, device=pool.device), False


def _check(pool: torch.Tensor, working: torch.Tensor | None, rows: torch.Tensor) -> None:
    """A float8 pool, int64 row indices, and working rows (where given) laid out as the pool."""
    if pool.dtype not in FP8_FORMATS or not pool.is_contiguous():
        raise ValueError(f"a contiguous float8 pool, got {pool.dtype}")
    if working is not None and (working.dtype not in _OUT or pool.shape != working.shape
                                or not working.is_contiguous()):
        raise ValueError(f"contiguous float32 / bfloat16 / float16 rows shaped as the pool {tuple(pool.shape)}, "
                         f"got {working.dtype} {tuple(working.shape)}")
    if rows.dtype != torch.int64:
        raise ValueError(f"row indices must be int64, got {rows.dtype}")


@device_function
def _scale(scale_ptr, elements, ok, head_dim, heads, PER_HEAD: tl.constexpr):
    """Each element's scale: its KV head's (rows [..., heads, head_dim]), or the one."""
    if PER_HEAD:
        return tl.load(scale_ptr + (elements // head_dim) % heads, mask=ok, other=1.0)
    else:
        return tl.load(scale_ptr)


@jit
def _kv_load_kernel(pool_ptr, blocks_ptr, working_ptr, scale_ptr, block_numel, head_dim, heads,
                    PER_HEAD: tl.constexpr, OUT: tl.constexpr, AS_BYTES: tl.constexpr, MANTISSA_BITS: tl.constexpr,
                    MIN_EXPONENT: tl.constexpr, BLOCK: tl.constexpr):
    offsets, elements, ok = indexed_row(blocks_ptr, block_numel, BLOCK)
    v = tl.load(pool_ptr + offsets, mask=ok, other=0.0)
    v = fp8_value(v, MANTISSA_BITS, MIN_EXPONENT) if AS_BYTES else v.to(tl.float32)
    v = v * _scale(scale_ptr, elements, ok, head_dim, heads, PER_HEAD)
    if OUT == 0:
        tl.store(working_ptr + offsets, v, mask=ok)
    else:
        bits = half_bits(v.to(tl.uint32, bitcast=True), OUT == 2)
        tl.store(working_ptr + offsets, bits.to(tl.int16), mask=ok)


@jit
def _kv_store_kernel(source_ptr, source_stride, written_ptr, pool_ptr, scale_ptr, token_numel, head_dim, heads,
                     largest, PER_HEAD: tl.constexpr, SOURCE_INDEXED: tl.constexpr, AS_BYTES: tl.constexpr,
                     MANTISSA_BITS: tl.constexpr, MIN_EXPONENT: tl.constexpr, BLOCK: tl.constexpr):
    offsets, elements, ok = indexed_row(written_ptr, token_numel, BLOCK)
    if SOURCE_INDEXED:  # working rows laid out as the pool
        source = offsets
    else:  # the step's rows, one per written token
        source = tl.program_id(0).to(tl.int64) * source_stride + elements
    v = tl.load(source_ptr + source, mask=ok, other=0.0).to(tl.float32)
    scale = _scale(scale_ptr, elements, ok, head_dim, heads, PER_HEAD)
    v = tl.minimum(tl.maximum(tl.math.div_rn(v, scale), -largest), largest)
    v = round_to_fp8_grid(v, MANTISSA_BITS, MIN_EXPONENT)
    if AS_BYTES:
        tl.store(pool_ptr + offsets, fp8_bits(v, MANTISSA_BITS, MIN_EXPONENT), mask=ok)
    else:
        tl.store(pool_ptr + offsets, v.to(pool_ptr.dtype.element_ty), mask=ok)
