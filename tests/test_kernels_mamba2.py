"""Mamba2 (SSD) kernels against their torch references, and the references against each other.

Kernel tests (marker `triton`) run compiled on CUDA when there is a GPU, else under
TRITON_INTERPRET=1 on CPU tensors; they skip without Triton. Decode outputs start as NaN and
must be fully written; pool rows outside the batch must come back bit for bit. The tests at
the end need no Triton: the chunked scan against the token-by-token definition, split prefills
against whole ones, and a decode step against one token of the scan.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.kernel_support import DEVICE, NAN, kernel_mode, requires_triton, strided  # noqa: F401 (kernel_mode: a fixture) - first: it sets Triton's mode
from engine.kernels.mamba2_update import (NO_LIMIT, mamba2_state_update_ref, mamba2_state_update_triton,
                                          process_dt)
from engine.kernels.ssd_scan import ssd_chunk_scan_ref, ssd_chunk_scan_triton, ssd_chunk_scan_varlen_ref, ssd_scan_ref


def _scan_inputs(length, heads, head_dim, d_state, groups, dtype=torch.float32, dt_max=0.5, a_max=3.0):
    x = strided(length, heads, head_dim, dtype=dtype)
    B, C = strided(length, groups, d_state, dtype=dtype), strided(length, groups, d_state, dtype=dtype)
    dt = torch.rand(length, heads, device=DEVICE) * dt_max  # final dt: float32, >= 0
    A = -torch.rand(heads, device=DEVICE) * a_max - 0.1
    h0 = torch.randn(heads, head_dim, d_state, device=DEVICE)
    return x, dt, A, B, C, h0


# ---------------------------------------------------------------- mamba2-state-update

@pytest.mark.triton
@requires_triton
@pytest.mark.parametrize("heads,head_dim,d_state,groups,batch,extras,dt_limit,dtype", [
    (4, 8, 16, 1, 3, "all", NO_LIMIT, torch.float32),
    (6, 5, 7, 3, 2, "none", NO_LIMIT, torch.float32),        # raw dt, may be negative: no clamp
    (3, 3, 5, 1, 4, "bias", (0.05, math.inf), torch.float32),  # low limit only
    (2, 40, 128, 2, 2, "all", (0.01, 0.3), torch.float32),  # two head_dim blocks
    (4, 12, 10, 2, 2, "all", (0.01, 0.3), torch.bfloat16),
])
def test_mamba2_update_kernel(kernel_mode, heads, head_dim, d_state, groups, batch, extras, dt_limit, dtype):
    pool = torch.randn(7, heads, head_dim, d_state, device=DEVICE)
    slots = torch.randperm(7, device=DEVICE)[:batch]
    x = strided(batch, heads, head_dim, dtype=dtype)
    B, C = strided(batch, groups, d_state, dtype=dtype), strided(batch, groups, d_state, dtype=dtype)
    dt = torch.randn(batch, heads, device=DEVICE).to(dtype)
    A = -torch.rand(heads, device=DEVICE) * 4
    kw = dict(dt_limit=dt_limit)
    if extras in ("bias", "all"):
        kw.update(dt_bias=torch.randn(heads, device=DEVICE), dt_softplus=True)
    if extras == "all":
        kw.update(D=torch.randn(heads, device=DEVICE))
    ref_pool, kernel_pool = pool.clone(), pool.clone()
    want = mamba2_state_update_ref(ref_pool, slots, x, dt, A, B, C, **kw)
    out = torch.full((batch, heads, head_dim), NAN, device=DEVICE)
    got = mamba2_state_update_triton(kernel_pool, slots, x, dt, A, B, C, out=out, **kw)
    assert got is out
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    outside = torch.ones(pool.shape[0], dtype=torch.bool, device=DEVICE)
    outside[slots] = False
    assert torch.equal(kernel_pool[outside], pool[outside]), "slot outside the batch changed"
    torch.testing.assert_close(kernel_pool, ref_pool, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------- SSD chunked prefill scan

@pytest.mark.triton
@requires_triton
@pytest.mark.parametrize("length,heads,head_dim,d_state,groups,chunk_size,dtype", [
    (1, 2, 4, 8, 1, 4, torch.float32),
    (5, 3, 5, 6, 3, 16, torch.float32),      # L < chunk, a group per head
    (37, 4, 6, 7, 2, 8, torch.float32),      # many chunks, the last one partial
    (70, 1, 3, 70, 1, 70, torch.float32),    # large d_state: three token tiles within the chunk
    (45, 2, 17, 16, 1, 32, torch.bfloat16),  # two head_dim blocks
])
def test_ssd_chunk_scan_kernel(kernel_mode, length, heads, head_dim, d_state, groups, chunk_size, dtype):
    x, dt, A, B, C, h0 = _scan_inputs(length, heads, head_dim, d_state, groups, dtype)
    h0_before = h0.clone()
    want_y, want_h = ssd_scan_ref(x, dt, A, B, C, h0)
    got_y, got_h = ssd_chunk_scan_triton(x, dt, A, B, C, h0, chunk_size)
    assert got_y.dtype == got_h.dtype == torch.float32
    torch.testing.assert_close(got_y, want_y, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got_h, want_h, atol=1e-4, rtol=1e-4)
    assert torch.equal(h0, h0_before), "h0 (a view of the state pool in the engine) changed"


@pytest.mark.triton
@requires_triton
def test_ssd_chunk_scan_kernel_strong_decay(kernel_mode):
    """Decays of up to e^-16 per step over a chunk of 100 in four token tiles: differences of
    chunk-long cumulative sums miss this tolerance (checked once by hand); run sums keep it."""
    x, dt, A, B, C, h0 = _scan_inputs(100, 2, 4, 65, 1, dt_max=1.0, a_max=16.0)
    want_y, want_h = ssd_scan_ref(x, dt, A, B, C, h0)
    got_y, got_h = ssd_chunk_scan_triton(x, dt, A, B, C, h0, 100)
    torch.testing.assert_close(got_y, want_y, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_h, want_h, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------- dispatch

@pytest.mark.triton
@requires_triton
def test_public_mamba2_functions_route_their_arguments(kernel_mode, monkeypatch):
    import engine.kernels as kernels

    pool, slots = torch.randn(4, 4, 6, 8, device=DEVICE), torch.tensor([2, 0], device=DEVICE)
    x, dt = torch.randn(2, 4, 6, device=DEVICE), torch.randn(2, 4, device=DEVICE)
    A, D, bias = -torch.rand(4, device=DEVICE), torch.randn(4, device=DEVICE), torch.randn(4, device=DEVICE)
    B, C = torch.randn(2, 2, 8, device=DEVICE), torch.randn(2, 2, 8, device=DEVICE)
    scan = _scan_inputs(11, 4, 6, 8, 2)

    def run_all():
        p = pool.clone()
        y = kernels.mamba2_state_update(p, slots, x, dt, A, B, C, D=D, dt_bias=bias, dt_softplus=True,
                                        dt_limit=(0.01, 2.0))
        return [y, p, *kernels.ssd_chunk_scan(*scan, 4)]

    monkeypatch.setenv("SPLITSERVE_DISABLE_TRITON", "1")
    want = run_all()
    monkeypatch.delenv("SPLITSERVE_DISABLE_TRITON")
    monkeypatch.setenv("SPLITSERVE_FORCE_TRITON", "1")
    for got, ref in zip(run_all(), want):
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------- the references against each other

@pytest.mark.parametrize("length,chunk_size", [(1, 4), (13, 1), (13, 3), (13, 4), (13, 13), (13, 50), (32, 8)])
def test_chunk_scan_reference_matches_the_definition(length, chunk_size):
    torch.manual_seed(3)
    x, dt, A, B, C, h0 = _scan_inputs(length, 4, 5, 6, 2)
    want_y, want_h = ssd_scan_ref(x, dt, A, B, C, h0)
    got_y, got_h = ssd_chunk_scan_ref(x, dt, A, B, C, h0, chunk_size)
    torch.testing.assert_close(got_y, want_y, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_h, want_h, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("lengths,chunk_size", [([1], 4), ([13, 1, 4, 9], 4), ([8, 8], 4), ([3, 30, 2], 50)])
def test_varlen_chunk_scan_equals_each_sequence_alone(lengths, chunk_size):
    """Several sequences in one pass, each from its own state: each equals its own scan (padding
    steps to whole chunks change nothing, and no state leaks between sequences)."""
    torch.manual_seed(5)
    heads, head_dim, d_state, groups = 4, 5, 6, 2
    x, dt, A, B, C, _ = _scan_inputs(sum(lengths), heads, head_dim, d_state, groups)
    h0 = torch.randn(len(lengths), heads, head_dim, d_state, device=DEVICE)
    h0[0] = 0
    bounds = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    got_y, got_h = ssd_chunk_scan_varlen_ref(x, dt, A, B, C, h0, bounds, chunk_size)
    assert got_y.shape == x.shape and got_h.shape == h0.shape
    for n, (start, end) in enumerate(zip(bounds, bounds[1:])):
        want_y, want_h = ssd_scan_ref(x[start:end], dt[start:end], A, B[start:end], C[start:end], h0[n])
        torch.testing.assert_close(got_y[start:end], want_y, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got_h[n], want_h, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="every sequence needs a token"):
        ssd_chunk_scan_varlen_ref(x, dt, A, B, C, h0, [0, 0, *bounds[1:]], chunk_size)


@pytest.mark.parametrize("split,chunk_size", [(1, 4), (5, 4), (8, 4), (12, 5), (19, 64)])
def test_split_prefill_equals_whole(split, chunk_size):
    """A prefill split across engine steps: the second piece starts from the first's state."""
    torch.manual_seed(4)
    x, dt, A, B, C, h0 = _scan_inputs(20, 3, 4, 5, 1)
    want_y, want_h = ssd_chunk_scan_ref(x, dt, A, B, C, h0, chunk_size)
    y1, h1 = ssd_chunk_scan_ref(x[:split], dt[:split], A, B[:split], C[:split], h0, chunk_size)
    y2, h2 = ssd_chunk_scan_ref(x[split:], dt[split:], A, B[split:], C[split:], h1, chunk_size)
    torch.testing.assert_close(torch.cat([y1, y2]), want_y, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(h2, want_h, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dt_limit", [NO_LIMIT, (0.05, 0.4)])
def test_decode_step_is_one_token_of_the_scan(dt_limit):
    torch.manual_seed(5)
    heads, head_dim, d_state, groups, slots = 4, 3, 5, 2, torch.tensor([4, 1, 2])
    pool = torch.randn(6, heads, head_dim, d_state)
    x, B, C = torch.randn(3, heads, head_dim), torch.randn(3, groups, d_state), torch.randn(3, groups, d_state)
    dt, dt_bias, D = torch.randn(3, heads), torch.randn(heads), torch.randn(heads)
    A = -torch.rand(heads) * 3
    states = pool.clone()
    y = mamba2_state_update_ref(states, slots, x, dt, A, B, C, D=D, dt_bias=dt_bias, dt_softplus=True,
                                dt_limit=dt_limit)
    dt_final = process_dt(dt, dt_bias, True, dt_limit)
    for row, slot in enumerate(slots.tolist()):
        one = slice(row, row + 1)
        want_y, want_h = ssd_scan_ref(x[one], dt_final[one], A, B[one], C[one], pool[slot])
        torch.testing.assert_close(y[row], want_y[0] + x[row] * D[:, None], atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(states[slot], want_h, atol=1e-6, rtol=1e-6)
