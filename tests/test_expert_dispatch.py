"""The three ways experts run (engine.models.expert_dispatch) give the same result, and the two
a CUDA graph can capture read nothing on the host. Judged against the per-expert loop."""

from __future__ import annotations

import pytest
import torch

from engine.models import expert_dispatch as ed
from engine.models.layers import SparseMoE
from engine.models.nemotron_moe import NemotronMoE
from tests.host_reads import no_host_reads


def _moe(kind: str, hidden: int, inter: int, experts: int, top_k: int, dtype):
    torch.manual_seed(hidden * 7 + inter)
    if kind == "sparse":
        moe = SparseMoE(hidden, inter, experts, top_k, "silu", normalize_top_k=True)
    else:
        moe = NemotronMoE(hidden, inter, 8, experts, top_k, 1, 1, True, 1.5, None, "relu2", False)
    for p in moe.parameters():
        p.data.normal_(0, 0.3)
    return moe.to(dtype)


def _route(moe, x):
    if isinstance(moe, SparseMoE):
        weights, experts = torch.topk(torch.softmax(moe.router(x).float(), -1), moe.top_k, -1)
        return experts, (weights / weights.sum(-1, keepdim=True)).to(x.dtype), (moe.gate_up, moe.down, moe._between)
    experts, weights = moe.route(x)
    return experts, weights.to(x.dtype), (moe.up, moe.down, moe.act)


@pytest.mark.parametrize("kind", ["sparse", "nemotron"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 5, 64])
def test_grouped_and_dense_equal_the_loop_without_host_reads(kind, dtype, tokens):
    moe = _moe(kind, 32, 16, 6, 2, dtype)
    x = torch.randn(tokens, 32, dtype=dtype)
    experts, weights, stacked = _route(moe, x)
    loop = ed.by_expert_loop(x, experts, weights, 6, moe._expert)
    assert ed.grouped_supported(x, stacked[0], stacked[1])
    with no_host_reads():
        grouped = ed.grouped(x, experts, weights, *stacked)
        dense = ed.dense(x, experts, weights, *stacked)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(grouped, loop, atol=tol, rtol=tol)
    torch.testing.assert_close(dense, loop, atol=tol, rtol=tol)


def test_dense_in_chunks_of_experts_and_unaligned_widths(monkeypatch):
    moe = _moe("sparse", 24, 12, 7, 3, torch.float32)  # 12 * 2 bytes... 24-byte rows in bf16
    x = torch.randn(9, 24)
    experts, weights, stacked = _route(moe, x)
    assert not ed.grouped_supported(x.bfloat16(), stacked[0].bfloat16(), stacked[1].bfloat16())
    monkeypatch.setattr(ed, "DENSE_CHUNK_ELEMENTS", 9 * 24 * 2)  # two experts per matmul
    torch.testing.assert_close(ed.dense(x, experts, weights, *stacked),
                               ed.by_expert_loop(x, experts, weights, 7, moe._expert), atol=1e-5, rtol=1e-5)


def test_dispatch_picks_a_way_by_device_and_size(monkeypatch):
    moe = _moe("sparse", 32, 16, 4, 2, torch.float32)
    x = torch.randn(3, 32)
    experts, weights, stacked = _route(moe, x)
    used = []
    for way in ("grouped", "dense", "by_expert_loop", "_cpu_grouped"):
        real = getattr(ed, way)
        monkeypatch.setattr(ed, way, lambda *a, _w=way, _r=real: used.append(_w) or _r(*a))
    monkeypatch.setenv("SPLITSERVE_DISABLE_CPU_KERNELS", "1")
    monkeypatch.delenv(ed.STATIC_ENV, raising=False)
    ed.dispatch_experts(x, experts, weights, 4, moe._expert, stacked)
    monkeypatch.setenv(ed.STATIC_ENV, "1")
    ed.dispatch_experts(x, experts, weights, 4, moe._expert, stacked)
    monkeypatch.setattr(ed, "grouped_supported", lambda *a: False)
    ed.dispatch_experts(x, experts, weights, 4, moe._expert, stacked)
    monkeypatch.setattr(ed, "DENSE_MAX_TOKENS", 2)  # a prefill-sized step: the loop
    ed.dispatch_experts(x, experts, weights, 4, moe._expert, stacked)
    assert used == ["by_expert_loop", "grouped", "dense", "by_expert_loop"]


def test_the_guard_catches_the_loops_host_read():
    from tests.host_reads import HostReadError

    moe = _moe("sparse", 32, 16, 4, 2, torch.float32)
    x = torch.randn(3, 32)
    experts, weights, _ = _route(moe, x)
    with pytest.raises(HostReadError, match="bincount"), no_host_reads():
        ed.by_expert_loop(x, experts, weights, 4, moe._expert)
    with pytest.raises(HostReadError, match="item"), no_host_reads():
        x.sum().item()
