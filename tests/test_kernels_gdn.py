"""Gated DeltaNet kernels against their torch references, and the references against each other.

Kernel tests (marker `triton`) run compiled on CUDA when there is a GPU, else under
TRITON_INTERPRET=1 on CPU tensors; they skip without Triton. Every buffer the kernels fill
(outputs and scratch) starts as NaN, so a missed row or a read of one never written fails;
pool rows outside the batch must come back bit for bit. The tests at the end need no Triton:
the chunked reference against the token-by-token definition, split prefills against whole
ones, and a decode step against one token of the definition; each with the decay per head and
per key channel (Kimi Delta Attention).
"""

from __future__ import annotations


import pytest
import torch

from tests.kernel_support import DEVICE, NAN, enter_kernel_mode, requires_triton, strided  # first: it sets Triton's mode
from engine.kernels import gdn_triton
from engine.kernels.gdn_scan import chunk_gated_delta_rule_ref, gated_delta_rule_ref, gated_delta_step_ref
from engine.kernels.gdn_triton import chunk_gated_delta_rule_triton, gated_delta_scan_triton, gated_delta_step_triton


@pytest.fixture
def kernel_mode(monkeypatch):
    enter_kernel_mode()
    monkeypatch.setattr(gdn_triton, "_empty",
                        lambda *shape, device: torch.full(shape, NAN, dtype=torch.float32, device=device))


def _rule_inputs(length, k_heads, heads, k_dim, v_dim, dtype=torch.float32, g_max=1.0, per_channel=False):
    q, k = strided(length, k_heads, k_dim, dtype=dtype), strided(length, k_heads, k_dim, dtype=dtype)
    v = strided(length, heads, v_dim, dtype=dtype)
    # log decay per step, <= 0 (float32): per head, or per key channel (Kimi Delta Attention)
    g = -torch.rand(length, heads, *((k_dim,) if per_channel else ()), device=DEVICE) * g_max
    beta = torch.rand(length, heads, device=DEVICE)  # a sigmoid in the model
    h0 = torch.randn(heads, k_dim, v_dim, device=DEVICE)
    return q, k, v, g, beta, h0


# ---------------------------------------------------------------- decode step on the slot pool

@pytest.mark.triton
@requires_triton
@pytest.mark.parametrize("k_heads,heads,k_dim,v_dim,batch,g_max,dtype", [
    (2, 4, 8, 16, 3, 1.0, torch.float32),     # two value heads per key head
    (3, 3, 5, 7, 2, 1.0, torch.float32),      # Hk == Hv, odd sizes
    (1, 2, 20, 80, 2, 1.0, torch.float32),    # two dv blocks
    (2, 2, 6, 9, 4, 40.0, torch.float32),     # strong decay: exp(g) down to e^-40
    (1, 3, 12, 10, 2, 1.0, torch.bfloat16),   # bf16 inputs and pool
])
@pytest.mark.parametrize("per_channel", [False, True], ids=["decay-per-head", "decay-per-key-channel"])
def test_gated_delta_step_kernel(kernel_mode, k_heads, heads, k_dim, v_dim, batch, g_max, dtype, per_channel):
    pool = torch.randn(7, heads, k_dim, v_dim, device=DEVICE).to(dtype)
    slots = torch.randperm(7, device=DEVICE)[:batch]
    q, k, v, g, beta, _ = _rule_inputs(batch, k_heads, heads, k_dim, v_dim, dtype, g_max, per_channel)
    ref_pool, kernel_pool = pool.clone(), pool.clone()
    # a half-width pool (engine.state_format) is stored stochastically rounded, salted by each row's length
    positions = None if dtype == torch.float32 else torch.arange(5, 5 + batch, device=DEVICE)
    want = gated_delta_step_ref(ref_pool, slots, q, k, v, g, beta, positions)
    got = gated_delta_step_triton(kernel_pool, slots, q, k, v, g, beta, positions)
    assert got.dtype == torch.float32 and got.shape == (batch, heads, v_dim)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    outside = torch.ones(pool.shape[0], dtype=torch.bool, device=DEVICE)
    outside[slots] = False
    assert torch.equal(kernel_pool[outside], pool[outside]), "slot outside the batch changed"
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else {}
    torch.testing.assert_close(kernel_pool, ref_pool, **tol)


@pytest.mark.triton
@requires_triton
def test_gated_delta_step_kernel_empty_batch(kernel_mode):
    pool = torch.randn(3, 2, 4, 4, device=DEVICE)
    q, k, v, g, beta, _ = _rule_inputs(0, 1, 2, 4, 4)
    got = gated_delta_step_triton(pool.clone(), torch.zeros(0, dtype=torch.int64, device=DEVICE), q, k, v, g, beta)
    assert got.shape == (0, 2, 4)


# ---------------------------------------------------------------- chunked prefill

@pytest.mark.triton
@requires_triton
@pytest.mark.parametrize("length,k_heads,heads,k_dim,v_dim,chunk_size,dtype", [
    (1, 1, 2, 4, 8, 4, torch.float32),        # one token
    (5, 2, 2, 5, 7, 16, torch.float32),       # L < chunk, Hk == Hv, odd sizes
    (37, 1, 3, 6, 5, 8, torch.float32),       # many chunks, the last one partial, Hk < Hv
    (70, 1, 1, 4, 4, 100, torch.float32),     # chunk_size past MAX_CHUNK: 64 + 6 inside the kernel
    (45, 2, 4, 17, 70, 32, torch.bfloat16),   # two dv blocks, dk past 16
])
def test_chunk_gated_delta_rule_kernel(kernel_mode, length, k_heads, heads, k_dim, v_dim, chunk_size, dtype):
    q, k, v, g, beta, h0 = _rule_inputs(length, k_heads, heads, k_dim, v_dim, dtype)
    h0_before = h0.clone()
    want_o, want_h = gated_delta_rule_ref(q, k, v, g, beta, h0)
    got_o, got_h = chunk_gated_delta_rule_triton(q, k, v, g, beta, h0, chunk_size)
    assert got_o.dtype == got_h.dtype == torch.float32
    torch.testing.assert_close(got_o, want_o, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got_h, want_h, atol=1e-4, rtol=1e-4)
    assert torch.equal(h0, h0_before), "h0 (a view of the state pool in the engine) changed"


@pytest.mark.triton
@requires_triton
def test_chunk_gated_delta_rule_kernel_strong_decay(kernel_mode):
    """Decays of up to e^-16 per step over chunks of 64: run sums keep a tight tolerance."""
    q, k, v, g, beta, h0 = _rule_inputs(100, 1, 2, 8, 8, g_max=16.0)
    want_o, want_h = gated_delta_rule_ref(q, k, v, g, beta, h0)
    got_o, got_h = chunk_gated_delta_rule_triton(q, k, v, g, beta, h0, 64)
    torch.testing.assert_close(got_o, want_o, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_h, want_h, atol=1e-5, rtol=1e-5)


@pytest.mark.triton
@requires_triton
def test_chunk_gated_delta_rule_kernel_empty(kernel_mode):
    q, k, v, g, beta, h0 = _rule_inputs(0, 1, 2, 4, 4)
    got_o, got_h = chunk_gated_delta_rule_triton(q, k, v, g, beta, h0, 8)
    assert got_o.shape == (0, 2, 4) and torch.equal(got_h, h0) and got_h.data_ptr() != h0.data_ptr()


@pytest.mark.triton
@requires_triton
@pytest.mark.parametrize("length,k_heads,heads,k_dim,v_dim,per_channel,dtype", [
    (1, 1, 2, 4, 8, True, torch.float32),       # one token
    (37, 1, 3, 6, 5, True, torch.float32),      # Hk < Hv, odd sizes
    (45, 2, 4, 17, 70, True, torch.bfloat16),   # two dv blocks, dk past 16
    (20, 2, 2, 8, 8, False, torch.float32),     # a per-head decay through the same kernel
])
def test_gated_delta_scan_kernel(kernel_mode, length, k_heads, heads, k_dim, v_dim, per_channel, dtype):
    """The token-by-token Triton prefill (a decay per key channel's Triton path) against the definition."""
    q, k, v, g, beta, h0 = _rule_inputs(length, k_heads, heads, k_dim, v_dim, dtype, g_max=3.0, per_channel=per_channel)
    h0_before = h0.clone()
    want_o, want_h = gated_delta_rule_ref(q, k, v, g, beta, h0)
    got_o, got_h = gated_delta_scan_triton(q, k, v, g, beta, h0)
    assert got_o.dtype == got_h.dtype == torch.float32
    torch.testing.assert_close(got_o, want_o, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got_h, want_h, atol=1e-4, rtol=1e-4)
    assert torch.equal(h0, h0_before), "h0 (a view of the state pool in the engine) changed"


# ---------------------------------------------------------------- dispatch

@pytest.mark.triton
@requires_triton
def test_public_gdn_functions_route_their_arguments(kernel_mode, monkeypatch):
    import engine.kernels as kernels

    pool, slots = torch.randn(4, 4, 6, 8, device=DEVICE), torch.tensor([2, 0], device=DEVICE)
    step = _rule_inputs(2, 2, 4, 6, 8)[:5]
    rule = _rule_inputs(11, 2, 4, 6, 8)
    per_channel = _rule_inputs(11, 2, 4, 6, 8, per_channel=True)
    calls = []
    for name in ("gated_delta_step_triton", "chunk_gated_delta_rule_triton", "gated_delta_scan_triton"):
        kernel = getattr(kernels, name)
        monkeypatch.setattr(kernels, name, lambda *a, _k=kernel, _n=name, **kw: calls.append(_n) or _k(*a, **kw))

    def run_all():
        p = pool.clone()
        o = kernels.gated_delta_step(p, slots, *step)
        return [o, p, *kernels.chunk_gated_delta_rule(*rule, 4), *kernels.chunk_gated_delta_rule(*per_channel, 4)]

    monkeypatch.setenv("SPLITSERVE_DISABLE_TRITON", "1")
    want = run_all()
    assert calls == []
    monkeypatch.delenv("SPLITSERVE_DISABLE_TRITON")
    monkeypatch.setenv("SPLITSERVE_FORCE_TRITON", "1")
    got = run_all()
    assert calls == ["gated_delta_step_triton", "chunk_gated_delta_rule_triton", "gated_delta_scan_triton"]
    for g, ref in zip(got, want):
        torch.testing.assert_close(g, ref, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------- the references against each other

@pytest.mark.parametrize("per_channel", [False, True], ids=["decay-per-head", "decay-per-key-channel"])
@pytest.mark.parametrize("length,k_heads,chunk_size", [
    (1, 2, 4), (13, 2, 1), (13, 1, 3), (13, 2, 4), (13, 4, 13), (13, 1, 50), (32, 2, 8)])
def test_chunk_reference_matches_the_definition(length, k_heads, chunk_size, per_channel):
    torch.manual_seed(3)
    q, k, v, g, beta, h0 = _rule_inputs(length, k_heads, 4, 5, 6, g_max=3.0 if per_channel else 1.0,
                                        per_channel=per_channel)
    want_o, want_h = gated_delta_rule_ref(q, k, v, g, beta, h0)
    got_o, got_h = chunk_gated_delta_rule_ref(q, k, v, g, beta, h0, chunk_size)
    torch.testing.assert_close(got_o, want_o, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_h, want_h, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("per_channel", [False, True], ids=["decay-per-head", "decay-per-key-channel"])
@pytest.mark.parametrize("split,chunk_size", [(1, 4), (5, 4), (8, 4), (12, 5), (19, 64)])
def test_split_prefill_equals_whole(split, chunk_size, per_channel):
    """A prefill split across engine steps: the second piece starts from the first's state."""
    torch.manual_seed(4)
    q, k, v, g, beta, h0 = _rule_inputs(20, 1, 3, 4, 5, per_channel=per_channel)
    want_o, want_h = chunk_gated_delta_rule_ref(q, k, v, g, beta, h0, chunk_size)
    first, second = slice(0, split), slice(split, None)
    o1, h1 = chunk_gated_delta_rule_ref(q[first], k[first], v[first], g[first], beta[first], h0, chunk_size)
    o2, h2 = chunk_gated_delta_rule_ref(q[second], k[second], v[second], g[second], beta[second], h1, chunk_size)
    torch.testing.assert_close(torch.cat([o1, o2]), want_o, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(h2, want_h, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("per_channel", [False, True], ids=["decay-per-head", "decay-per-key-channel"])
def test_decode_step_is_one_token_of_the_definition(per_channel):
    torch.manual_seed(5)
    k_heads, heads, k_dim, v_dim, slots = 2, 4, 3, 5, torch.tensor([4, 1, 2])
    pool = torch.randn(6, heads, k_dim, v_dim)
    q, k, v, g, beta, _ = _rule_inputs(3, k_heads, heads, k_dim, v_dim, per_channel=per_channel)
    states = pool.clone()
    o = gated_delta_step_ref(states, slots, q, k, v, g, beta)
    for row, slot in enumerate(slots.tolist()):
        one = slice(row, row + 1)
        want_o, want_h = gated_delta_rule_ref(q[one], k[one], v[one], g[one], beta[one], pool[slot])
        torch.testing.assert_close(o[row], want_o[0], atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(states[slot], want_h, atol=1e-6, rtol=1e-6)
    untouched = [s for s in range(6) if s not in slots.tolist()]
    assert torch.equal(states[untouched], pool[untouched])
