"""Rounding float32 to the narrow formats inside Triton kernels, in integer and exact float32
arithmetic: round to nearest, ties to even, as torch's casts round.

The kernels that store narrow values (engine.kernels.fp8_quant, state_round, kv_fp8) use these
instead of Triton's own casts to the narrow formats, for one reason: the same code then gives
the same bits compiled and under Triton's interpreter, whose casts round otherwise (bfloat16 by
truncation; float8 losing a carry into the exponent), so the CPU tests check what a GPU runs.
A value already on a format's grid then casts exactly everywhere.

fp8_value and fp8_bits convert between float8 bits and float32 exactly, for the GPUs whose
Triton has no e4m3 type (fp8_as_bytes): there a kernel reads and writes the float8 tensor as
bytes.
"""

from __future__ import annotations

import os

import torch

from engine.kernels._triton import device_function, tl

# From compute capability 8.9 on a GPU has FP8 units, and Triton its e4m3 type (fp8e4nv).
FP8_CAPABILITY = (8, 9)
# the float8 formats: (mantissa bits, smallest normal exponent)
FP8_FORMATS = {torch.float8_e4m3fn: (3, -6), torch.float8_e5m2: (2, -14)}


def fp8_as_bytes(tensor: torch.Tensor) -> bool:
    """Whether kernels move float8 `tensor` as bytes, decoded (fp8_value) and encoded (fp8_bits)
    in integer arithmetic: e4m3 on a GPU before compute capability 8.9, where Triton has no
    such type (it refuses to compile fp8e4nv there; e5m2 it has everywhere). For any float8
    tensor where SPLITSERVE_FP8_AS_BYTES=1 (the tests: such GPUs are not where they run)."""
    if tensor.dtype not in FP8_FORMATS:
        return False
    if os.environ.get("SPLITSERVE_FP8_AS_BYTES", "0") not in ("", "0"):
        return True
    return (tensor.dtype == torch.float8_e4m3fn and tensor.is_cuda
            and torch.cuda.get_device_capability(tensor.device) < FP8_CAPABILITY)


@device_function
def round_to_fp8_grid(v, MANTISSA_BITS: tl.constexpr, MIN_EXPONENT: tl.constexpr):
    """float32 v, within the format's range, to the nearest value of a float8 format with
    MANTISSA_BITS (e4m3: 3, e5m2: 2) and smallest normal exponent MIN_EXPONENT (-6, -14), in
    float32; the sign bit kept, a negative zero's too."""
    bits = v.to(tl.int32, bitcast=True)
    # the grid's spacing at v: 2^(exponent - MANTISSA_BITS), the subnormals' below the normals
    exponent = tl.maximum(((bits >> 23) & 0xFF) - 127, MIN_EXPONENT)
    spacing = ((exponent - MANTISSA_BITS + 127) << 23).to(tl.float32, bitcast=True)
    inverse = ((127 - exponent + MANTISSA_BITS) << 23).to(tl.float32, bitcast=True)
    units = tl.abs(v) * inverse  # exact: a power of two, units < 2^(MANTISSA_BITS + 1)
    units = (units + 12582912.0) - 12582912.0  # 1.5 * 2^23: float32 addition rounds to an integer, ties to even
    magnitude = units * spacing
    return tl.where(bits < 0, -magnitude, magnitude)


@device_function
def half_bits(bits, FLOAT16: tl.constexpr):
    """The bfloat16 or float16 bits (uint32 < 2^16) nearest to float32 `bits` (uint32), ties to
    even, as engine/kernels/cpu_state.cpp computes them (inf and nan: see it)."""
    if FLOAT16:
        sign = (bits >> 16) & 0x8000
        a = bits & 0x7FFFFFFF
        # below 2^-14: adding 0.5 leaves the subnormal's bits, rounded to even, at the sum's bottom
        subnormal = (a.to(tl.float32, bitcast=True) + 0.5).to(tl.uint32, bitcast=True) - 0x3F000000
        normal = (a + 0xC8000FFF + ((a >> 13) & 1)) >> 13  # rebias the exponent, round 13 bits to even
        out = tl.where(a > 0x7F800000, 0x7E00,
                       tl.where(a >= 0x47800000, 0x7C00, tl.where(a < 0x38800000, subnormal, normal)))
        return out.to(tl.uint32) | sign
    else:
        return (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16


@device_function
def half_value(h, FLOAT16: tl.constexpr):
    """The float32 value of bfloat16 or float16 bits `h` (uint32 < 2^16), exactly."""
    if FLOAT16:
        sign = (h & 0x8000) << 16
        magnitude = h & 0x7FFF
        normal = (magnitude << 13) + 0x38000000
        subnormal = (magnitude.to(tl.float32) * 5.9604644775390625e-8).to(tl.uint32, bitcast=True)  # 2^-24
        special = (magnitude << 13) | 0x7F800000
        out = sign | tl.where(magnitude < 0x400, subnormal, tl.where(magnitude >= 0x7C00, special, normal))
        return out.to(tl.float32, bitcast=True)
    else:
        return (h << 16).to(tl.float32, bitcast=True)


@device_function
def fp8_value(bits, MANTISSA_BITS: tl.constexpr, MIN_EXPONENT: tl.constexpr):
    """The float32 value of float8 bits (uint8), exactly: e4m3fn (MANTISSA_BITS 3, MIN_EXPONENT
    -6: no infinities, NaN at all ones) or e5m2 (2, -14: IEEE's infinities and NaNs)."""
    b = bits.to(tl.uint32) & 0xFF
    sign = (b & 0x80) << 24
    exponent = (b & 0x7F) >> MANTISSA_BITS
    mantissa = b & ((1 << MANTISSA_BITS) - 1)
    normal = ((exponent + (126 + MIN_EXPONENT)) << 23) | (mantissa << (23 - MANTISSA_BITS))
    unit = (((b * 0) + (127 + MIN_EXPONENT - MANTISSA_BITS)) << 23).to(tl.float32, bitcast=True)
    subnormal = (mantissa.to(tl.float32) * unit).to(tl.uint32, bitcast=True)  # exact: a power of two
    top = (1 << (7 - MANTISSA_BITS)) - 1  # the exponent field all ones
    if MANTISSA_BITS == 3:
        special = tl.where(mantissa == 7, 0x7FC00000, normal)
    else:
        special = tl.where(mantissa == 0, 0x7F800000, 0x7FC00000 | (mantissa << 21))  # NaNs quiet, as torch's
    magnitude = tl.where(exponent == 0, subnormal, tl.where(exponent == top, special, normal))
    return (sign | magnitude).to(tl.float32, bitcast=True)


@device_function
def fp8_bits(v, MANTISSA_BITS: tl.constexpr, MIN_EXPONENT: tl.constexpr):
    """The float8 bits (uint8) of float32 v lying on the format's grid within its range (as
    round_to_fp8_grid leaves it); a NaN to the format's NaN, its sign kept."""
    bits = v.to(tl.uint32, bitcast=True)
    sign = (bits >> 24) & 0x80
    magnitude = (bits & 0x7FFFFFFF).to(tl.int32)
    exponent = (magnitude >> 23) - 127
    normal = ((exponent + (1 - MIN_EXPONENT)) << MANTISSA_BITS) | ((magnitude >> (23 - MANTISSA_BITS))
                                                                 & ((1 << MANTISSA_BITS) - 1))
    unit = (((magnitude * 0) + (127 + MANTISSA_BITS - MIN_EXPONENT)) << 23).to(tl.float32, bitcast=True)
    # exact for a subnormal (an integer below 2^MANTISSA_BITS); bounded so others convert too
    subnormal = tl.minimum(tl.abs(v) * unit, 1 << MANTISSA_BITS).to(tl.int32)
    out = tl.where(magnitude > 0x7F800000, 0x7F, tl.where(exponent < MIN_EXPONENT, subnormal, normal))
    return (out.to(tl.uint32) | sign).to(tl.uint8)
