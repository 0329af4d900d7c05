"""oneDNN-packed CPU linears (engine.models.packed_linear) against F.linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from engine.models import packed_linear
from engine.models.packed_linear import MIN_ROWS, SMALL_SIDE, SMALL_WEIGHT_ROWS, linear, pack, pack_linears

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")


@pytest.mark.parametrize("rows", [MIN_ROWS, 64, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_matches_f_linear(rows, bias, monkeypatch):
    torch.manual_seed(rows)
    weight, b = torch.randn(SMALL_SIDE + 8, SMALL_SIDE), (torch.randn(SMALL_SIDE + 8) if bias else None)
    x, x3 = torch.randn(rows, SMALL_SIDE), torch.randn(2, rows, SMALL_SIDE)  # any leading dims
    expected, expected3 = F.linear(x, weight, b), F.linear(x3, weight, b)
    monkeypatch.setattr(packed_linear, "F", None)  # the packed path must not fall back
    torch.testing.assert_close(linear(x, weight, b, pack(weight)), expected, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(linear(x3, weight, b, pack(weight)), expected3, atol=1e-4, rtol=1e-4)


def test_small_calls_and_disabled_runs_take_f_linear_exactly(monkeypatch):
    weight = torch.randn(32, 16)
    packed = pack(weight)
    small = torch.randn(MIN_ROWS - 1, 16)
    assert torch.equal(linear(small, weight, None, packed), F.linear(small, weight))
    big = torch.randn(64, 16)
    monkeypatch.setenv("SPLITSERVE_DISABLE_CPU_KERNELS", "1")
    assert torch.equal(linear(big, weight, None, packed), F.linear(big, weight))


def test_small_weights_run_packed_only_for_many_rows(monkeypatch):
    """A weight with a side under SMALL_SIDE (a router, Mamba's x_proj and dt_proj) keeps F.linear
    in decode, where oneDNN's call overhead outweighs its GEMM, and runs packed in prefill."""
    torch.manual_seed(1)
    for weight in (torch.randn(48, 512), torch.randn(512, 16)):
        packed = pack(weight)
        decode = torch.randn(64, weight.shape[1])
        assert torch.equal(linear(decode, weight, None, packed), F.linear(decode, weight))
        prefill = torch.randn(SMALL_WEIGHT_ROWS, weight.shape[1])
        expected = F.linear(prefill, weight)
        with monkeypatch.context() as patched:
            patched.setattr(packed_linear, "F", None)  # must not fall back
            torch.testing.assert_close(linear(prefill, weight, None, packed), expected, atol=1e-4, rtol=1e-4)


def test_only_float32_cpu_weights_are_packed():
    assert pack(torch.randn(8, 8)) is not None
    assert pack(torch.randn(8, 8).bfloat16()) is None
    assert pack(torch.randn(8)) is None


def test_pack_linears_routes_plain_linears_and_leaves_subclasses():
    class Scaled(nn.Linear):
        pass

    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), Scaled(32, 16), nn.Linear(16, 8).bfloat16())
    x = torch.randn(20, 16)
    before = model[2](model[1](model[0](x)))
    assert pack_linears(model) == 1
    assert model[0].packed_weight is not None and not hasattr(model[2], "packed_weight")
    torch.testing.assert_close(model[2](model[1](model[0](x))), before, atol=1e-4, rtol=1e-4)
    assert "packed_weight" not in model.state_dict() and len(model.state_dict()) == 6
    assert packed_linear.enabled()


@pytest.mark.parametrize("bias", [False, True])
def test_fused_projections_match_their_linears(bias):
    """q/k/v (or gate/up) as one packed GEMM: column views equal to each linear's own output;
    pack_linears packs the fused set once and leaves its members unpacked; few rows and
    disabled kernels take the linears one by one, exactly."""
    from engine.models.attention import PagedAttention
    from engine.models.layers import GatedMLP
    from engine.models.packed_linear import fused_linear, pack_fused

    torch.manual_seed(3)
    parts = [nn.Linear(SMALL_SIDE, n, bias=bias) for n in (96, 32, 32)]
    x = torch.randn(40, SMALL_SIDE)
    fused = pack_fused(*parts)
    outputs = fused_linear(x, fused, *parts)
    for out, part in zip(outputs, parts):
        assert out.shape == (40, part.out_features)
        torch.testing.assert_close(out, F.linear(x, part.weight, part.bias), atol=1e-4, rtol=1e-4)
    small = x[: MIN_ROWS - 1]
    for out, part in zip(fused_linear(small, fused, *parts), parts):
        assert torch.equal(out, F.linear(small, part.weight, part.bias))
    assert pack_fused(nn.Linear(32, 8), nn.Linear(16, 8)) is None  # different inputs
    assert pack_fused(nn.Linear(32, 8), nn.Linear(32, 8, bias=False)) is None

    attention = PagedAttention(32, 4, 2, 8, qkv_bias=bias, out_bias=False, rotary=None)
    mlp = GatedMLP(32, 24, "silu")
    model = nn.ModuleList([attention, mlp])
    assert pack_linears(model) == 2 + 2  # qkv, gate-up; o_proj and down_proj on their own
    assert attention.qkv_fused is not None and mlp.gate_up_fused is not None
    assert not hasattr(attention.q_proj, "packed_weight") and hasattr(attention.o_proj, "packed_weight")
