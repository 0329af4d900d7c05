"""The FP8 kernels against their definitions: rounding rows to float8 per group of columns
(engine.kernels.fp8_quant), bit for bit, and the fused block-wise MoE product
(engine.kernels.fp8_moe) with its tile schedule.

Kernel tests (marker `triton`) run compiled on CUDA when there is a GPU, else under
TRITON_INTERPRET=1 on CPU tensors; they skip without Triton. MoE groups are 32 columns or
wider here, as Hopper's FP8 tensor cores step through 32 at a time.
"""

from __future__ import annotations

import pytest
import torch

from tests.kernel_support import DEVICE, kernel_mode, requires_triton  # noqa: F401 (kernel_mode: a fixture) - first: it sets Triton's mode
from engine.kernels.fp8_moe import block_fp8_linear_triton, grouped_block_fp8_ref, grouped_block_fp8_triton, tile_schedule
from engine.kernels.fp8_quant import (quantize_groups_ref, quantize_groups_triton, quantize_scaled_ref,
                                      quantize_scaled_triton)
from engine.models import fp8_blocks
from engine.models.fp8_blocks import FP8, FP8_MAX, quantize_groups, quantize_scaled


def same_bits(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]) -> bool:
    return torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8)) and torch.equal(got[1], want[1])


# ---------------------------------------------------------------- rounding to FP8

@pytest.mark.triton
@requires_triton
@pytest.mark.parametrize("rows, cols_total, cols, dtype", [
    (5, 256, 128, torch.float32), (3, 80, 32, torch.bfloat16),  # 80: the last group 16 wide
    (7, 2048, 2048, torch.bfloat16), (4, 100, 128, torch.float16),  # a scale per row; one group shorter than cols
    (2, 100, 48, torch.float32),  # groups narrower than the kernel's power-of-two block
    (37, 256, 128, torch.bfloat16),  # several programs' blocks of rows, the last one partial
    (0, 64, 32, torch.float32)])
def test_rounding_to_fp8_is_the_reference_bit_for_bit(kernel_mode, rows, cols_total, cols, dtype):
    """Rows whose magnitudes span 10^-4 .. 10^3, a group of zeros (the scale's floor), and a
    view whose rows are strided as a projection's split leaves them."""
    generator = torch.Generator().manual_seed(rows)
    wide = torch.randn(rows, cols_total + 8, generator=generator) * 10 ** (torch.rand(rows, 1, generator=generator) * 7 - 4)
    if rows:
        wide[0, :min(cols, cols_total)] = 0
    x = wide.to(DEVICE, dtype)[:, 8:]
    assert same_bits(quantize_groups_triton(x, cols), quantize_groups_ref(x, cols))


@pytest.mark.triton
@requires_triton
def test_rounding_to_fp8_ties_to_even_across_the_whole_grid(kernel_mode):
    """Every finite float8_e4m3fn value and every midpoint between neighbours (the ties), in a
    row whose 448 makes the scale 1: rounded as torch's cast rounds them."""
    grid = torch.arange(256, dtype=torch.uint8).view(FP8).float()
    grid = grid[torch.isfinite(grid)].unique()
    values = torch.cat([grid, (grid[1:] + grid[:-1]) / 2, torch.tensor([FP8_MAX])])
    x = values[None, :].to(DEVICE)
    got, want = quantize_groups_triton(x, x.shape[1]), quantize_groups_ref(x, x.shape[1])
    assert float(want[1]) == 1.0 and same_bits(got, want)


@pytest.mark.triton
@requires_triton
@pytest.mark.parametrize("per_row", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rounding_by_static_scales_is_the_reference_bit_for_bit(kernel_mode, per_row, dtype):
    """A checkpoint's static scale (one for all rows, or a row's expert's): small enough that
    some values clamp at 448, from strided rows."""
    generator = torch.Generator().manual_seed(1)
    x = (torch.randn(6, 104, generator=generator) * 4).to(DEVICE, dtype)[:, 4:]
    scale = (torch.rand(6, 1, generator=generator) * 0.02 + 0.005) if per_row else torch.tensor(0.011)
    scale = scale.to(DEVICE)
    got, want = quantize_scaled_triton(x, scale), quantize_scaled_ref(x, scale)
    assert (want.float().abs() == FP8_MAX).any() and torch.equal(got.view(torch.uint8), want.view(torch.uint8))


def test_a_static_scale_of_the_wrong_shape_is_refused():
    with pytest.raises(ValueError, match=r"a float32 scale \[\] or \[3, 1\]"):
        quantize_scaled_triton(torch.randn(3, 8), torch.ones(2, 1))


@requires_triton
def test_rounding_takes_the_kernels_where_triton_runs_and_torch_elsewhere(monkeypatch):
    calls = []

    def counted(name, ref):
        def kernel(rows, arg):
            calls.append(name)
            return ref(rows, arg)
        return kernel

    monkeypatch.setattr(fp8_blocks, "quantize_groups_triton", counted("groups", quantize_groups_ref))
    monkeypatch.setattr(fp8_blocks, "quantize_scaled_triton", counted("scaled", quantize_scaled_ref))
    monkeypatch.setattr(fp8_blocks, "uses_triton", lambda tensor: True)
    x, scale = torch.randn(3, 64), torch.tensor(0.01)
    assert same_bits(quantize_groups(x, 32), quantize_groups_ref(x, 32))
    assert torch.equal(quantize_scaled(x, scale).view(torch.uint8), quantize_scaled_ref(x, scale).view(torch.uint8))
    assert calls == ["groups", "scaled"]
    monkeypatch.setattr(fp8_blocks, "uses_triton", lambda tensor: False)
    quantize_groups(x, 32), quantize_scaled(x, scale)
    assert calls == ["groups", "scaled"]


# ---------------------------------------------------------------- the fused MoE product

def operands(counts: list[int], out: int, inputs: int, block: tuple[int, int], seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    experts = len(counts)
    rows = torch.randn(sum(counts), inputs, generator=generator)
    rows[:, 0] *= 40  # one column dominates its group's scale: a group read with another's scale shows
    quantized, scale = quantize_groups(rows, block[1])
    weight = (torch.randn(experts, out, inputs, generator=generator) * 64).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    # scales 2^-12 .. 2^-6, different per expert and block: one read from the wrong place shows
    weight_scale = torch.exp2(-12 + 6 * torch.rand(experts, -(-out // block[0]), -(-inputs // block[1]),
                                                   generator=generator))
    ends = torch.tensor(counts).cumsum(0).to(torch.int32)
    return [t.to(DEVICE) for t in (quantized, scale, weight, weight_scale)] + [ends.to(DEVICE)]


@pytest.mark.triton
@requires_triton
@pytest.mark.parametrize("counts, out, inputs, block", [
    ([7, 0, 26], 96, 128, (32, 32)),  # an expert with no rows between two that have some
    ([0, 3, 0, 150], 80, 96, (64, 32)),  # 150 rows: three tiles of one expert; 80 outputs end inside a block
    ([1, 0, 1, 1, 0, 2, 1, 0, 0, 1], 64, 80, (32, 32)),  # decode: a row or two an expert; a 16-column last group
    ([5, 9], 40, 64, (1, 32)),  # a scale per output row (a tensor-parallel shard that cuts blocks)
    ([3, 30, 1], 384, 256, (128, 128)),  # the published checkpoints' blocks
])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_the_fused_kernel_is_the_block_wise_product(kernel_mode, counts, out, inputs, block, out_dtype):
    quantized, scale, weight, weight_scale, ends = operands(counts, out, inputs, block)
    got = grouped_block_fp8_triton(quantized, scale, weight, weight_scale, block, ends, out_dtype)
    want = grouped_block_fp8_ref(quantized, scale, weight, weight_scale, block, ends, torch.float32)
    # float32 accumulation both ways, in another order; bfloat16 output rounds to 2^-8 relative
    rtol = 1e-5 if out_dtype == torch.float32 else 2 ** -8
    torch.testing.assert_close(got.float(), want, rtol=rtol, atol=rtol * float(want.abs().max()))


@pytest.mark.triton
@requires_triton
@pytest.mark.parametrize("rows, out, inputs, block", [
    (1, 96, 128, (32, 32)),  # a decode row: the 16-row tile
    (37, 80, 96, (64, 32)),  # the 64-row tile, partial; 80 outputs end inside a block
    (70, 40, 64, (1, 32)),  # a scale per output row (a tensor-parallel shard that cuts blocks)
    (5, 384, 256, (128, 64)),  # 64-column groups of 128-row blocks (an input shard in narrower groups)
])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_the_linear_form_is_the_one_expert_product(kernel_mode, rows, out, inputs, block, out_dtype):
    quantized, scale, weight, weight_scale, ends = operands([rows], out, inputs, block)
    got = block_fp8_linear_triton(quantized, scale, weight[0], weight_scale[0], block, out_dtype)
    want = grouped_block_fp8_ref(quantized, scale, weight, weight_scale, block, ends, torch.float32)
    rtol = 1e-5 if out_dtype == torch.float32 else 2 ** -8
    torch.testing.assert_close(got.float(), want, rtol=rtol, atol=rtol * float(want.abs().max()))
    assert block_fp8_linear_triton(quantized[:0], scale[:0], weight[0], weight_scale[0], block,
                                   out_dtype).shape == (0, out)


@pytest.mark.triton
@requires_triton
def test_the_fused_kernel_writes_nothing_for_no_rows(kernel_mode):
    quantized, scale, weight, weight_scale, ends = operands([0, 0], 32, 64, (32, 32))
    assert grouped_block_fp8_triton(quantized, scale, weight, weight_scale, (32, 32), ends,
                                    torch.float32).shape == (0, 32)


def test_the_reference_is_the_sum_over_groups_of_scaled_partial_products():
    """The definition written out once per element for a few, against grouped_block_fp8_ref."""
    counts, block = [2, 3], (16, 32)
    quantized, scale, weight, weight_scale, ends = (t.cpu() for t in operands(counts, 32, 64, block))
    got = grouped_block_fp8_ref(quantized, scale, weight, weight_scale, block, ends, torch.float32)
    for m, n in [(0, 0), (1, 17), (2, 31), (4, 5)]:
        expert = 0 if m < 2 else 1
        want = sum(float(scale[m, g]) * float(weight_scale[expert, n // 16, g])
                   * float((quantized[m, 32 * g:32 * g + 32].float() * weight[expert, n, 32 * g:32 * g + 32].float()).sum())
                   for g in range(2))
        assert abs(float(got[m, n]) - want) <= 1e-5 * max(1.0, abs(want))


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("block_m", [16, 64])
def test_the_tile_schedule_covers_each_row_once_within_its_expert(seed, block_m):
    generator = torch.Generator().manual_seed(seed)
    experts = int(torch.randint(1, 12, (1,), generator=generator))
    counts = torch.randint(0, 3 * block_m, (experts,), generator=generator) * torch.randint(0, 2, (experts,),
                                                                                              generator=generator)
    rows = int(counts.sum())
    if rows == 0:
        counts[0], rows = 1, 1
    ends = counts.cumsum(0).to(torch.int32)
    tile_expert, tile_row = tile_schedule(ends, rows, block_m)
    covered = torch.zeros(rows, dtype=torch.long)
    for expert, first in zip(tile_expert.tolist(), tile_row.tolist()):
        if expert == experts:  # past the last tile
            continue
        start = 0 if expert == 0 else int(ends[expert - 1])
        assert start <= first < int(ends[expert]) and (first - start) % block_m == 0
        covered[first:min(first + block_m, int(ends[expert]))] += 1
    assert torch.equal(covered, torch.ones(rows, dtype=torch.long)), counts.tolist()


@pytest.mark.parametrize("change, message", [
    (lambda a: dict(a, block=(32, 24)), "power of two"),
    (lambda a: dict(a, scale=a["scale"][:, :1]), "input scale"),
    (lambda a: dict(a, weight_scale=a["weight_scale"][:, :1]), "weight scale"),
    (lambda a: dict(a, ends=a["ends"].long()), "int32"),
])
def test_misshapen_operands_are_refused_naming_them(change, message):
    quantized, scale, weight, weight_scale, ends = (t.cpu() for t in operands([4, 4], 64, 64, (32, 32)))
    args = dict(quantized=quantized, scale=scale, qweight=weight, weight_scale=weight_scale, block=(32, 32),
                ends=ends, out_dtype=torch.float32)
    with pytest.raises(ValueError, match=message):
        grouped_block_fp8_triton(**change(args))


@pytest.mark.parametrize("change, message", [
    (lambda a: dict(a, block=(32, 24)), "power of two"),
    (lambda a: dict(a, scale=a["scale"][:, :1]), "input scale"),
    (lambda a: dict(a, weight_scale=a["weight_scale"][:1]), "weight scale"),
])
def test_the_linear_form_refuses_misshapen_operands_naming_them(change, message):
    quantized, scale, weight, weight_scale, _ = (t.cpu() for t in operands([4], 64, 64, (32, 32)))
    args = dict(quantized=quantized, scale=scale, qweight=weight[0], weight_scale=weight_scale[0], block=(32, 32),
                out_dtype=torch.float32)
    with pytest.raises(ValueError, match=message):
        block_fp8_linear_triton(**change(args))
