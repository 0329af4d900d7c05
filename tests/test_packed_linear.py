"""The packed CPU linears (engine.models.packed_linear, engine/kernels/cpu_gemm.cpp) against F.linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels import native
from engine.models import packed_linear
from engine.models.packed_linear import PANEL, linear, pack, pack_linears

pytestmark = pytest.mark.skipif(not native.available(), reason="no C++ compiler for the CPU kernels")


@pytest.mark.parametrize("rows", [1, 7, 8, 9, 32, 64, 700])
@pytest.mark.parametrize("shape", [(136, 128), (4, 256), (20, 96), (512, 16), (1030, 512)])  # [out, in]
@pytest.mark.parametrize("bias", [False, True])
def test_packed_matches_f_linear(rows, shape, bias, monkeypatch):
    """Partial last panels (136, 4, 1030 columns; 20: with AVX-512, a tile of two panels whose
    second is partial), row counts off the kernel's 6-row tiles and past
    one chunk of rows (700 rows of 512 inputs are six chunks), inputs with leading dims and with
    a row stride (a column block of a wider tensor)."""
    torch.manual_seed(rows)
    out_features, in_features = shape
    weight, b = torch.randn(shape), (torch.randn(out_features) if bias else None)
    x, x3 = torch.randn(rows, in_features), torch.randn(2, rows, in_features)
    strided = torch.randn(rows, in_features + 24)[:, 24:]
    expected = [F.linear(t, weight, b) for t in (x, x3, strided)]
    packed = pack(weight)
    monkeypatch.setattr(packed_linear, "F", None)  # the packed path must not fall back
    for t, want in zip((x, x3, strided), expected):
        torch.testing.assert_close(linear(t, weight, b, packed), want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("rows", [7, 8, 9, 32, 65])
def test_a_row_has_the_same_bits_in_any_tile(rows):
    """Rows go through tiles of 1-6 rows (cpu_gemm.cpp rows_in_tile); each row's sums run in the
    same order in any of them, so a row computed alone equals the same row in a batch."""
    torch.manual_seed(rows)
    weight, x = torch.randn(136, 256), torch.randn(rows, 256)
    packed = pack(weight)
    batch = linear(x, weight, None, packed)
    alone = torch.cat([linear(x[i:i + 1], weight, None, packed) for i in range(rows)])
    assert torch.equal(batch, alone)


@pytest.mark.parametrize("rows, shape", [(64, (48, 512)), (64, (8192, 256)), (700, (1030, 512)), (5, (4, 256))])
def test_every_panel_is_computed_once_whatever_the_thread_count(rows, shape):
    """The threads start from contiguous shares and take from each other's ends
    (cpu_kernels.h steal_for): any team size writes every (chunk, panel) pair, each with the bits
    one thread gives, into an output that starts as NaN."""
    torch.manual_seed(1)
    out_features, in_features = shape
    weight, bias, x = torch.randn(shape), torch.randn(out_features), torch.randn(rows, in_features)
    packed, results = pack(weight), []
    for threads in (1, 2, 3, 5):
        out = torch.full((rows, out_features), float("nan"))
        native.library().packed_linear(x.data_ptr(), in_features, packed.panels.data_ptr(), bias.data_ptr(),
                                       out.data_ptr(), out_features, rows, out_features, in_features, threads)
        results.append(out)
    torch.testing.assert_close(results[0], F.linear(x, weight, bias), atol=1e-4, rtol=1e-4)
    for out in results[1:]:
        assert torch.equal(out, results[0])


def test_the_panel_layout_pads_with_zeros():
    weight = torch.arange(20 * 3, dtype=torch.float32).view(20, 3)
    packed = pack(weight)
    assert packed.panels.shape == (2, 3, PANEL) and (packed.out_features, packed.in_features) == (20, 3)
    assert torch.equal(packed.panels[1, :, :4], weight[16:].t()) and not packed.panels[1, :, 4:].any()
    assert torch.equal(packed.panels[0], weight[:16].t())


def test_disabled_kernels_and_autograd_take_f_linear_exactly(monkeypatch):
    weight = torch.randn(32, 16)
    packed = pack(weight)
    x = torch.randn(64, 16)
    tracked = x.clone().requires_grad_()
    out = linear(tracked, weight, None, packed)
    assert torch.equal(out, F.linear(x, weight)) and out.requires_grad
    monkeypatch.setenv("SPLITSERVE_DISABLE_CPU_KERNELS", "1")
    assert torch.equal(linear(x, weight, None, packed), F.linear(x, weight))


def test_an_empty_batch_gives_an_empty_output():
    weight = torch.randn(24, 8)
    assert linear(torch.empty(0, 8), weight, None, pack(weight)).shape == (0, 24)


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
def test_fused_projections_match_their_linears(bias, monkeypatch):
    """q/k/v (or gate/up) as one packed GEMM: column views equal to each linear's own output;
    pack_linears packs the fused set once and leaves its members unpacked; with the kernels off
    the linears run one by one, exactly."""
    from engine.models.attention import PagedAttention
    from engine.models.layers import GatedMLP
    from engine.models.packed_linear import fused_linear, pack_fused

    torch.manual_seed(3)
    parts = [nn.Linear(128, n, bias=bias) for n in (96, 32, 32)]
    x = torch.randn(40, 128)
    fused = pack_fused(*parts)
    outputs = fused_linear(x, fused, *parts)
    for out, part in zip(outputs, parts):
        assert out.shape == (40, part.out_features)
        torch.testing.assert_close(out, F.linear(x, part.weight, part.bias), atol=1e-4, rtol=1e-4)
    with monkeypatch.context() as patched:
        patched.setenv("SPLITSERVE_DISABLE_CPU_KERNELS", "1")
        for out, part in zip(fused_linear(x, fused, *parts), parts):
            assert torch.equal(out, F.linear(x, part.weight, part.bias))
    assert pack_fused(nn.Linear(32, 8), nn.Linear(16, 8)) is None  # different inputs
    assert pack_fused(nn.Linear(32, 8), nn.Linear(32, 8, bias=False)) is None

    attention = PagedAttention(32, 4, 2, 8, qkv_bias=bias, out_bias=False, rotary=None)
    mlp = GatedMLP(32, 24, "silu")
    model = nn.ModuleList([attention, mlp])
    assert pack_linears(model) == 2 + 2  # qkv, gate-up; o_proj and down_proj on their own
    assert attention.qkv_fused is not None and mlp.gate_up_fused is not None
    assert not hasattr(attention.q_proj, "packed_weight") and hasattr(attention.o_proj, "packed_weight")


@pytest.mark.parametrize("tokens,inter", [(1, 48), (5, 48), (64, 48), (300, 48), (2100, 48), (64, 40), (2100, 40)])
def test_all_experts_in_one_call_equal_the_expert_loop(tokens, inter, monkeypatch):
    """SparseMoE's SwiGLU experts as one C++ call (packed_linear.silu_experts, what the layer's
    one call runs): bit for bit the per-expert loop on the same packed weights (one token leaves
    two of four experts with no rows; 2100 tokens give experts more rows than one chunk; an
    intermediate size of 48 takes gate and up a panel at a time into silu * up, 40 writes them out
    first), the whole layer as one call bit for bit the layer's chain
    of kernels, and F.linear's result to float rounding; counts that do not fit are refused."""
    from engine.kernels import cpu
    from engine.models.expert_dispatch import expert_ranges as _expert_ranges
    from engine.models.layers import SparseMoE
    from engine.models.packed_linear import silu_experts

    torch.manual_seed(tokens)
    moe = SparseMoE(64, inter, 4, 2, "silu", True)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.1)
    x = torch.randn(tokens, 64)
    with torch.inference_mode():
        unpacked = moe(x)
        assert pack_linears(moe) == 2 * 4 + 1 and moe.panel_pointers.shape == (4, 2)
        whole_layer = moe(x)  # router to combine in one call (engine/kernels/cpu_layers.cpp)
        monkeypatch.setattr(SparseMoE, "_runs_in_one_call", lambda *args: False)
        one_by_one = moe(x)  # the chain: each expert on its own, on the same packed weights
        experts, _ = cpu.moe_route_cpu(moe.router(x), 2, True)
        counts, token_of_row, _ = cpu.moe_group_cpu(experts, 4)
        routed = x.index_select(0, token_of_row)
        at_once = silu_experts(routed, counts, moe.panel_pointers, inter)
        loop = torch.cat([moe._expert(e, routed[start:end]) for e, start, end in _expert_ranges(counts)])
    assert torch.equal(at_once, loop) and torch.equal(whole_layer, one_by_one)
    torch.testing.assert_close(whole_layer, unpacked, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="silu_experts: 3 rows"):
        silu_experts(torch.randn(3, 64), [1, 1, 0, 0], moe.panel_pointers, 48)
