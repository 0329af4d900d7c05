"""The Mamba (v1) varlen prefill scan: kernel against its torch reference, the reference against
the engine's definition (engine.models.ssm.selective_scan_ref).

Kernel tests (marker `triton`) run compiled on CUDA when there is a GPU, else under
TRITON_INTERPRET=1 on CPU tensors; they skip without Triton. Outputs start as NaN: scanned
tokens must be fully written, tokens of rows not scanned must stay NaN, and state-pool rows
outside the batch must come back bit for bit.
"""

from __future__ import annotations


import pytest
import torch

from tests.kernel_support import DEVICE, NAN, kernel_mode, requires_triton, strided  # noqa: F401 (kernel_mode: a fixture) - first: it sets Triton's mode
from engine.kernels.ssm_scan import selective_scan_varlen_ref, selective_scan_varlen_triton


def _scan_inputs(lengths, d_inner, d_state, dtype=torch.float32, dt_max=0.5, a_max=3.0):
    """x, dt, A, B, C, cu_seqlens, h0 for one sequence per entry of `lengths`."""
    tokens = sum(lengths)
    x = strided(tokens, d_inner, dtype=dtype)
    B, C = strided(tokens, d_state, dtype=dtype), strided(tokens, d_state, dtype=dtype)
    dt = torch.rand(tokens, d_inner, device=DEVICE) * dt_max  # final dt: float32, >= 0
    A = -torch.rand(d_inner, d_state, device=DEVICE) * a_max - 0.1
    cu_seqlens = torch.tensor([0, *lengths], device=DEVICE).cumsum(0)
    h0 = torch.randn(len(lengths), d_inner, d_state, device=DEVICE)
    return x, dt, A, B, C, cu_seqlens, h0


@pytest.mark.triton
@requires_triton
@pytest.mark.parametrize("lengths,d_inner,d_state,dtype", [
    ([1], 5, 16, torch.float32),                  # one token, one partial channel block
    ([7, 1, 12], 70, 16, torch.float32),          # two channel blocks, the second partial
    ([3, 9], 24, 7, torch.bfloat16),              # d_state not a power of 2, bf16 inputs
    ([5, 0, 2], 8, 32, torch.float32),            # an empty sequence keeps its h0
    ([4, 6], 20, 64, torch.float32),
])
def test_scan_kernel(kernel_mode, lengths, d_inner, d_state, dtype):
    x, dt, A, B, C, cu, h0 = _scan_inputs(lengths, d_inner, d_state, dtype)
    h0_before = h0.clone()
    want_y, want_h = selective_scan_varlen_ref(x, dt, A, B, C, cu, h0)
    out = torch.full((sum(lengths), d_inner), NAN, device=DEVICE)
    got_y, got_h = selective_scan_varlen_triton(x, dt, A, B, C, cu, h0, out=out)
    assert got_y is out and got_h.dtype == torch.float32
    torch.testing.assert_close(got_y, want_y, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got_h, want_h, atol=1e-4, rtol=1e-4)
    assert torch.equal(h0, h0_before), "h0 changed"


@pytest.mark.triton
@requires_triton
def test_scan_kernel_rows_of_a_mixed_batch_into_the_pool(kernel_mode):
    """Rows 1 and 3 are decodes (not scanned): their tokens stay NaN. Final states go to the
    pool at the slots; every other pool row comes back bit for bit."""
    lengths, d_inner, d_state = [3, 1, 6, 1, 4], 70, 16
    x, dt, A, B, C, cu, _ = _scan_inputs(lengths, d_inner, d_state)
    rows = torch.tensor([0, 2, 4], device=DEVICE)
    pool = torch.randn(7, d_inner, d_state, device=DEVICE)
    slots = torch.tensor([5, 0, 3], device=DEVICE)
    h0 = pool.index_select(0, slots)
    h0[1] = 0.0  # a fresh prefill
    ref_pool, kernel_pool = pool.clone(), pool.clone()
    want_y, none = selective_scan_varlen_ref(x, dt, A, B, C, cu, h0, rows=rows, state=ref_pool, slots=slots,
                                             out=torch.full((sum(lengths), d_inner), NAN, device=DEVICE))
    assert none is None
    out = torch.full((sum(lengths), d_inner), NAN, device=DEVICE)
    got_y, got_h = selective_scan_varlen_triton(x, dt, A, B, C, cu, h0, rows=rows, state=kernel_pool,
                                                slots=slots, out=out)
    assert got_h is None
    decode_tokens = torch.tensor([3, 10], device=DEVICE)
    scanned = torch.ones(sum(lengths), dtype=torch.bool, device=DEVICE)
    scanned[decode_tokens] = False
    assert got_y[decode_tokens].isnan().all(), "a token of a row not scanned was written"
    torch.testing.assert_close(got_y[scanned], want_y[scanned], atol=1e-4, rtol=1e-4)
    outside = torch.ones(pool.shape[0], dtype=torch.bool, device=DEVICE)
    outside[slots] = False
    assert torch.equal(kernel_pool[outside], pool[outside]), "slot outside the batch changed"
    torch.testing.assert_close(kernel_pool, ref_pool, atol=1e-4, rtol=1e-4)


@pytest.mark.triton
@requires_triton
def test_scan_kernel_h0_may_be_the_pool_rows_it_writes(kernel_mode):
    """h0[s] is state[slots[s]] itself: each program reads its h0 before writing its state."""
    x, dt, A, B, C, cu, _ = _scan_inputs([4, 2, 5], 40, 16)
    pool = torch.randn(3, 40, 16, device=DEVICE)
    slots = torch.arange(3, device=DEVICE)
    want_y, want_h = selective_scan_varlen_ref(x, dt, A, B, C, cu, pool.clone())
    got_y, _ = selective_scan_varlen_triton(x, dt, A, B, C, cu, pool, state=pool, slots=slots)
    torch.testing.assert_close(got_y, want_y, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(pool, want_h, atol=1e-4, rtol=1e-4)


@pytest.mark.triton
@requires_triton
def test_public_function_routes_its_arguments(kernel_mode, monkeypatch):
    import engine.kernels as kernels

    x, dt, A, B, C, cu, h0 = _scan_inputs([2, 1, 3], 12, 8)
    rows, slots = torch.tensor([0, 2], device=DEVICE), torch.tensor([1, 3], device=DEVICE)
    pool = torch.randn(4, 12, 8, device=DEVICE)

    def run_all():
        p = pool.clone()
        out = torch.zeros(x.shape, device=DEVICE)
        y, _ = kernels.selective_scan_varlen(x, dt, A, B, C, cu, h0[:2], rows=rows, state=p, slots=slots, out=out)
        return [y, p, *kernels.selective_scan_varlen(x, dt, A, B, C, cu, h0)]

    monkeypatch.setenv("SPLITSERVE_DISABLE_TRITON", "1")
    monkeypatch.setenv("SPLITSERVE_DISABLE_CPU_KERNELS", "1")  # the reference, not a CPU kernel
    want = run_all()
    monkeypatch.delenv("SPLITSERVE_DISABLE_TRITON")
    monkeypatch.setenv("SPLITSERVE_FORCE_TRITON", "1")
    for got, ref in zip(run_all(), want):
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------- the reference against the engine's definition

def test_reference_matches_the_engine_definition_sequence_by_sequence():
    from engine.models.ssm import selective_scan_ref

    torch.manual_seed(3)
    lengths = [4, 1, 9]
    x, dt, A, B, C, cu, h0 = _scan_inputs(lengths, 6, 5)
    y, h_final = selective_scan_varlen_ref(x, dt, A, B, C, cu, h0)
    for s, (start, end) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        want_y, want_h = selective_scan_ref(x[start:end], dt[start:end], A, B[start:end], C[start:end], h0[s])
        torch.testing.assert_close(y[start:end], want_y, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(h_final[s], want_h, atol=1e-6, rtol=1e-6)


def test_shapes_are_checked():
    x, dt, A, B, C, cu, h0 = _scan_inputs([2, 3], 4, 3)
    with pytest.raises(ValueError, match="h0"):
        selective_scan_varlen_ref(x, dt, A, B, C, cu, h0[:1])
    with pytest.raises(ValueError, match="both or neither"):
        selective_scan_varlen_ref(x, dt, A, B, C, cu, h0, state=torch.zeros(2, 4, 3))
