"""Recurrent state stored at half width (engine.state_format): the stochastically rounded store
of float32 working rows into a bfloat16 / float16 pool, and the exact load back.

`stochastic_round` is the definition, in torch ops: each element rounds to one of its two
neighbours in the narrow format with probability proportional to its nearness, the random bits
a hash of the value, the row's sequence length and the element's index (deterministic, no
host read). As torch ops that is some thirty elementwise kernels over the state, each reading
and writing it whole: on a GPU a decode step would move the state dozens of times per layer.
`state_store_triton` / `state_load_triton` are one pass each (the store reads the float32 rows
once and writes the narrow ones once), at the pool's slots.

The kernels compute in 32-bit integers what engine/kernels/cpu_state.cpp computes (the CPU's
path), and so what `stochastic_round` computes, bit for bit: the nearest narrow value by
integer rounding (ties to even), its neighbour by a step of the magnitude, and one float32
comparison whose every operand is exact (engine.kernels.float_bits: no cast to a narrow format,
which Triton's interpreter rounds otherwise).
"""

from __future__ import annotations

import math

import torch

from engine.kernels._triton import device_function, jit, tl
from engine.kernels.float_bits import half_bits, half_value
from engine.kernels.row_copy import indexed_row

_MASK32 = 0xFFFFFFFF
BLOCK = 1024


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mix of int64 `x` (murmur3's finaliser), elementwise."""
    x = x & _MASK32
    x = ((x ^ (x >> 16)) * 0x85EBCA6B) & _MASK32
    x = ((x ^ (x >> 13)) * 0xC2B2AE35) & _MASK32
    return x ^ (x >> 16)


def stochastic_round(values: torch.Tensor, dtype: torch.dtype, positions: torch.Tensor,
                     elements: torch.Tensor) -> torch.Tensor:
    """float32 `values` [rows, ...] as `dtype`, each element rounded to one of its two
    neighbours in `dtype` with probability proportional to its nearness (values the format
    holds exactly stay as they are). The random draw hashes the value's bits, `positions`
    [rows] (each row's sequence length) and `elements` (each element's index within a row,
    shaped like a row): deterministic, and no host synchronisation (CUDA-graph safe)."""
    nearest = values.to(dtype)
    error = values - nearest.float()
    toward = torch.where(error > 0, float("inf"), float("-inf")).to(dtype)
    gap = (torch.nextafter(nearest, toward).float() - nearest.float()).abs()
    shape = (-1,) + (1,) * (values.dim() - 1)
    salt = (positions.long().view(shape) * 0x9E3779B1 + elements.long() * 0x85EBCA77) & _MASK32
    uniform = (_hash32((values.view(torch.int32).long() & _MASK32) ^ salt) >> 8).float() * (1.0 / (1 << 24))
    away = (uniform * gap < error.abs()) & torch.isfinite(gap)
    return torch.where(away, torch.nextafter(nearest, toward), nearest)


def state_store_triton(working: torch.Tensor, pool: torch.Tensor, slots: torch.Tensor,
                       positions: torch.Tensor) -> None:
    """pool[slots[r]] = stochastic_round(working[slots[r]], pool.dtype, positions[r], its
    elements' indices); working float32 and pool bfloat16 or float16 rows of one shape."""
    row_numel = _check(working, pool, slots)
    if slots.numel() and row_numel:
        _state_store_kernel[(slots.numel(), -(-row_numel // BLOCK))](
            working, pool.view(torch.int16), slots, positions, row_numel, HALF=HALF[pool.dtype], BLOCK=BLOCK)


def state_load_triton(pool: torch.Tensor, working: torch.Tensor, slots: torch.Tensor) -> None:
    """working[slots[r]] = pool[slots[r]] in float32, exactly."""
    row_numel = _check(working, pool, slots)
    if slots.numel() and row_numel:
        _state_load_kernel[(slots.numel(), -(-row_numel // BLOCK))](
            pool.view(torch.int16), working, slots, row_numel, HALF=HALF[pool.dtype], BLOCK=BLOCK)


HALF = {torch.bfloat16: 1, torch.float16: 2}  # a half-width pool's code in load_state / store_state


def in_place_pool(state: torch.Tensor, positions: torch.Tensor | None) -> tuple[torch.Tensor, int]:
    """A decode kernel's state pool as it reads and writes it in place: a float32 pool as it is
    (HALF 0), a half-width one (engine.state_format) as int16 bits with its HALF code, which
    needs each row's sequence length after the step (`positions`) for the rounding."""
    half = HALF.get(state.dtype, 0)
    if half and (positions is None or positions.dtype != torch.int64):
        raise ValueError(f"a {state.dtype} state pool is stored rounded: it needs int64 positions "
                         f"(each row's sequence length after the step)")
    return (state.view(torch.int16) if half else state), half


def store_slots(pool: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor | None) -> None:
    """pool[slots] = float32 `rows`, in the pool's dtype: a half-width pool's stochastically
    rounded (the references of the kernels that update a pool in place)."""
    if pool.dtype not in HALF:
        pool.index_copy_(0, slots, rows.to(pool.dtype))
        return
    elements = torch.arange(math.prod(rows.shape[1:]), device=rows.device).view(rows.shape[1:])
    pool.index_copy_(0, slots, stochastic_round(rows, pool.dtype, positions, elements))


def _check(working: torch.Tensor, pool: torch.Tensor, slots: torch.Tensor) -> int:
    if working.dtype != torch.float32 or pool.dtype not in HALF:
        raise ValueError(f"float32 working rows and a bfloat16 or float16 pool, got {working.dtype} and {pool.dtype}")
    if working.shape[1:] != pool.shape[1:] or not (working.is_contiguous() and pool.is_contiguous()):
        raise ValueError(f"contiguous rows of one shape, got {tuple(working.shape)} and {tuple(pool.shape)}")
    if slots.dtype != torch.int64:
        raise ValueError(f"slots must be int64, got {slots.dtype}")
    return working[0].numel() if working.shape[0] else 0


@device_function
def _mix32(x):  # murmur3's finaliser on uint32, as _hash32
    x = (x ^ (x >> 16)) * 0x85EBCA6B
    x = (x ^ (x >> 13)) * 0xC2B2AE35
    return x ^ (x >> 16)


@device_function
def _inf_or_nan(h, FLOAT16: tl.constexpr):
    exponent = 0x7C00 if FLOAT16 else 0x7F80
    return (h & exponent) == exponent


@device_function
def round_half(v, position, elements, FLOAT16: tl.constexpr):
    """stochastic_round of float32 `v` to bfloat16 / float16 bits (int16): `position` the row's
    sequence length after the step, `elements` the values' indices within the row."""
    salt = (position & 0xFFFFFFFF).to(tl.uint32) * 0x9E3779B1 + elements.to(tl.uint32) * 0x85EBCA77
    bits = v.to(tl.uint32, bitcast=True)
    nearest = half_bits(bits, FLOAT16)
    base = half_value(nearest, FLOAT16)
    error = v - base
    # nextafter(nearest, toward the error): from a zero the smallest subnormal of that sign,
    # else one step of the magnitude, which grows when moving away from zero
    up = (error > 0).to(tl.uint32)
    magnitude = nearest & 0x7FFF
    sign = nearest & 0x8000
    from_zero = (magnitude == 0).to(tl.uint32)
    grows = from_zero | (up ^ (sign >> 15))
    other = tl.where(from_zero != 0, (1 - up) << 15, sign) | (magnitude + 2 * grows - 1)
    gap = tl.abs(half_value(other, FLOAT16) - base)
    uniform = (_mix32(bits ^ salt) >> 8).to(tl.float32)  # 24 random bits
    away = uniform * (1.0 / 16777216.0) * gap < tl.abs(error)
    # inf and nan stay; so do a value past the largest (nearest: inf) and one whose neighbour is inf
    keep = ((bits & 0x7F800000) == 0x7F800000) | _inf_or_nan(nearest, FLOAT16) | _inf_or_nan(other, FLOAT16)
    return tl.where(away & ~keep, other, nearest).to(tl.int16)


@device_function
def load_state(pointers, mask, HALF: tl.constexpr):
    """State values at `pointers` in float32: a pool's own values (HALF 0), or a half-width
    pool's (1: bfloat16, 2: float16) read as int16 bits, exactly."""
    if HALF == 0:
        return tl.load(pointers, mask=mask, other=0.0).to(tl.float32)
    else:
        return half_value(tl.load(pointers, mask=mask, other=0).to(tl.uint32) & 0xFFFF, HALF == 2)


@device_function
def store_state(pointers, values, mask, position, elements, HALF: tl.constexpr):
    """float32 state `values` into the pool at `pointers`: in its dtype (HALF 0), or as the
    half-width store rounds them (round_half)."""
    if HALF == 0:
        tl.store(pointers, values.to(pointers.dtype.element_ty), mask=mask)
    else:
        tl.store(pointers, round_half(values, position, elements, HALF == 2), mask=mask)


@jit
def _state_store_kernel(working_ptr, pool_ptr, slots_ptr, positions_ptr, row_numel,
                        HALF: tl.constexpr, BLOCK: tl.constexpr):
    offsets, elements, ok = indexed_row(slots_ptr, row_numel, BLOCK)
    v = tl.load(working_ptr + offsets, mask=ok, other=0.0)
    store_state(pool_ptr + offsets, v, ok, tl.load(positions_ptr + tl.program_id(0)), elements, HALF)


@jit
def _state_load_kernel(pool_ptr, working_ptr, slots_ptr, row_numel, HALF: tl.constexpr, BLOCK: tl.constexpr):
    offsets, _, ok = indexed_row(slots_ptr, row_numel, BLOCK)
    tl.store(working_ptr + offsets, load_state(pool_ptr + offsets, ok, HALF), mask=ok)
