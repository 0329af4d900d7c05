"""Triton kernels against their torch references, and the references against the engine.

Kernel tests (marker `triton`) run compiled on CUDA when there is a GPU, else under
TRITON_INTERPRET=1 on CPU tensors; they skip without Triton. Every output starts as NaN and
must be fully written; pool rows outside the batch must come back bit for bit; KV cache
entries no query may see are NaN, so reading one shows. The tie tests at the end need no
Triton: they pin each reference to what engine.models computes today.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from tests.kernel_support import DEVICE, NAN, kernel_mode, requires_triton  # noqa: F401 (kernel_mode: a fixture) - first: it sets Triton's mode
from engine.kernels import _triton, uses_triton
from engine.kernels.conv_update import causal_conv1d_update_ref, causal_conv1d_update_triton
from engine.kernels.paged_attention import paged_attention_decode_ref, paged_attention_decode_triton
from engine.kernels.row_copy import (copy_rows_ref, copy_rows_triton, gather_rows_ref, gather_rows_triton,
                                     scatter_rows_ref, scatter_rows_triton)
from engine.kernels.ssm_update import selective_state_update_ref, selective_state_update_triton
from engine.models.batch import ForwardBatch
from engine.phase import Phase


def _pool(rows, *shape, dtype=torch.float32):
    return torch.randn(rows, *shape, device=DEVICE).to(dtype)


def _assert_pool(after_kernel, after_ref, before, slots, atol):
    outside = torch.ones(before.shape[0], dtype=torch.bool)
    outside[slots.cpu()] = False
    assert torch.equal(after_kernel[outside.to(DEVICE)], before[outside.to(DEVICE)]), "slot outside the batch changed"
    torch.testing.assert_close(after_kernel, after_ref, atol=atol, rtol=atol)


# ---------------------------------------------------------------- causal-conv1d-update

@pytest.mark.triton
@requires_triton
@pytest.mark.parametrize("d_inner,d_conv,batch,bias,activation,dtype", [
    (40, 4, 3, True, "silu", torch.float32),
    (64, 2, 1, False, None, torch.float32),
    (24, 3, 5, True, None, torch.float32),
    (200, 4, 2, True, "silu", torch.bfloat16),
])
def test_conv_update_kernel(kernel_mode, d_inner, d_conv, batch, bias, activation, dtype):
    pool = _pool(8, d_inner, d_conv)
    slots = torch.randperm(8, device=DEVICE)[:batch]
    x = torch.randn(batch, 2 * d_inner, device=DEVICE).to(dtype)[:, :d_inner]  # strided, like in_proj's chunk
    weight = torch.randn(d_inner, d_conv, device=DEVICE).to(dtype)
    b = torch.randn(d_inner, device=DEVICE).to(dtype) if bias else None
    ref_pool, kernel_pool = pool.clone(), pool.clone()
    want = causal_conv1d_update_ref(ref_pool, slots, x, weight, b, activation)
    out = torch.full((batch, d_inner), NAN, device=DEVICE, dtype=dtype)
    got = causal_conv1d_update_triton(kernel_pool, slots, x, weight, b, activation, out=out)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    _assert_pool(kernel_pool, ref_pool, pool, slots, atol=0)


# ---------------------------------------------------------------- selective-state-update

@pytest.mark.triton
@requires_triton
@pytest.mark.parametrize("d_inner,d_state,batch,fused,raw_dt,dtype", [
    (40, 16, 3, False, False, torch.float32),
    (64, 8, 1, True, False, torch.float32),
    (24, 12, 4, True, True, torch.float32),
    (96, 16, 2, True, True, torch.bfloat16),
])
def test_ssm_update_kernel(kernel_mode, d_inner, d_state, batch, fused, raw_dt, dtype):
    pool = _pool(6, d_inner, d_state)
    slots = torch.randperm(6, device=DEVICE)[:batch]

    def act(*shape):
        return torch.randn(*shape, device=DEVICE).to(dtype)

    x, z, B, C = act(batch, d_inner), act(batch, d_inner), act(batch, d_state), act(batch, d_state)
    dt = torch.rand(batch, d_inner, device=DEVICE).to(dtype)
    A = -torch.rand(d_inner, d_state, device=DEVICE) * 4
    extra = dict(D=torch.randn(d_inner, device=DEVICE), z=z) if fused else {}
    if raw_dt:
        extra.update(dt_bias=torch.randn(d_inner, device=DEVICE), dt_softplus=True)
    ref_pool, kernel_pool = pool.clone(), pool.clone()
    want = selective_state_update_ref(ref_pool, slots, x, dt, A, B, C, **extra)
    out = torch.full((batch, d_inner), NAN, device=DEVICE)
    got = selective_state_update_triton(kernel_pool, slots, x, dt, A, B, C, out=out, **extra)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    _assert_pool(kernel_pool, ref_pool, pool, slots, atol=1e-5)


# ---------------------------------------------------------------- paged-attention decode

def _paged_case(heads, kv_heads, head_dim, block_size, context_lens, dtype, window=None):
    """A cache that is NaN wherever no query may look; random blocks, shuffled per sequence."""
    lens = torch.tensor(context_lens, device=DEVICE)
    width = -(-max(context_lens) // block_size) + 1  # one padding column beyond the longest
    num_blocks = len(context_lens) * width + 3
    order = torch.randperm(num_blocks, device=DEVICE)
    tables = torch.zeros(len(context_lens), width, dtype=torch.long, device=DEVICE)
    k_cache = torch.full((num_blocks, block_size, kv_heads, head_dim), NAN, device=DEVICE)
    v_cache = k_cache.clone()
    used = 0
    for row, length in enumerate(context_lens):
        n = -(-length // block_size)
        tables[row, :n] = order[used:used + n]
        used += n
        first = 0 if window is None else max(0, length - window)
        for pos in range(first, length):
            block, offset = tables[row, pos // block_size], pos % block_size
            k_cache[block, offset] = torch.randn(kv_heads, head_dim, device=DEVICE)
            v_cache[block, offset] = torch.randn(kv_heads, head_dim, device=DEVICE)
    q = torch.randn(len(context_lens), heads, head_dim, device=DEVICE)
    return q.to(dtype), k_cache.to(dtype), v_cache.to(dtype), tables, lens


@pytest.mark.triton
@requires_triton
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size,context_lens,window,splits,dtype", [
    (4, 4, 32, 4, [1, 4, 5, 13], None, 1, torch.float32),            # MHA, lengths around blocks
    (4, 2, 32, 16, [16, 17, 40], None, 3, torch.float32),            # GQA 2, split context
    (8, 2, 24, 4, [9, 33, 2], 6, 1, torch.float32),                  # GQA 4, odd head dim, window
    (4, 1, 16, 16, [50, 7], 20, 4, torch.float32),                   # MQA, window across splits
    (8, 4, 32, 4, [30, 3, 12], None, 2, torch.bfloat16),
    (40, 1, 576, 16, [20, 33], None, 2, torch.float32),              # wide MLA heads: 16 query heads a program
])
def test_paged_attention_kernel(kernel_mode, heads, kv_heads, head_dim, block_size, context_lens,
                                window, splits, dtype):
    q, k_cache, v_cache, tables, lens = _paged_case(heads, kv_heads, head_dim, block_size,
                                                    context_lens, dtype, window)
    scale = head_dim ** -0.5
    want = paged_attention_decode_ref(q, k_cache, v_cache, tables, lens, scale, window)
    assert not want.isnan().any()
    out = torch.full_like(q, NAN)
    got = paged_attention_decode_triton(q, k_cache, v_cache, tables, lens, scale, window, out=out,
                                        num_splits=splits)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)


@pytest.mark.triton
@requires_triton
@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
@pytest.mark.parametrize("as_bytes", [False, True], ids=["float8", "bytes"])
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size,context_lens,window,splits,dtype", [
    (4, 2, 32, 4, [1, 4, 5, 13], None, 1, torch.float32),
    (8, 2, 24, 16, [16, 17, 40], 6, 3, torch.float32),   # odd head dim, a window, split context
    (4, 1, 64, 4, [30, 3, 12], None, 2, torch.bfloat16),  # MQA (an MLA layer's latent rows)
])
def test_paged_attention_reads_an_fp8_cache_in_place(kernel_mode, monkeypatch, fp8, as_bytes, heads, kv_heads,
                                                      head_dim, block_size, context_lens, window, splits, dtype):
    """An FP8 cache read in place with its per-head scales and each sequence's own row at full
    precision (engine.kv_format's all-decode steps): the result over the cache dequantized into
    working rows with the own rows written there, as the format's load gives it; bit for bit in
    float32, where the two read the same values. `bytes`: the cache read as bytes, as on a GPU
    whose Triton has no e4m3 type."""
    from engine.kv_format import dequantize, quantize

    monkeypatch.setenv("SPLITSERVE_FP8_AS_BYTES", str(int(as_bytes)))

    q, k_cache, v_cache, tables, lens = _paged_case(heads, kv_heads, head_dim, block_size, context_lens,
                                                    torch.float32, window)
    scales = tuple(torch.rand(kv_heads, device=DEVICE) * 0.2 + 0.02 for _ in range(2))
    stored = [quantize(cache, s.reshape(-1, 1), fp8) for cache, s in zip((k_cache, v_cache), scales)]
    last_kv = tuple(torch.randn(len(context_lens), kv_heads, head_dim, device=DEVICE).to(dtype) for _ in range(2))
    working = [dequantize(cache, s.reshape(-1, 1), dtype) for cache, s in zip(stored, scales)]
    last = lens - 1
    for rows, own in zip(working, last_kv):
        blocks = tables[torch.arange(len(context_lens), device=DEVICE), last // block_size]
        rows[blocks, last % block_size] = own
    q, scale = q.to(dtype), head_dim ** -0.5
    want = paged_attention_decode_triton(q, *working, tables, lens, scale, window, num_splits=splits)
    got = paged_attention_decode_triton(q, *stored, tables, lens, scale, window, num_splits=splits,
                                        kv_scales=scales, last_kv=last_kv)
    ref = paged_attention_decode_ref(q, *stored, tables, lens, scale, window, kv_scales=scales, last_kv=last_kv)
    assert not want.isnan().any()
    if dtype == torch.float32:
        assert torch.equal(got, want)
        torch.testing.assert_close(ref, want, atol=1e-5, rtol=1e-5)
    else:  # the interpreter's casts to bfloat16 truncate, torch's round: a bfloat16 step apart
        torch.testing.assert_close(got, want, atol=3e-2, rtol=3e-2)
        torch.testing.assert_close(ref, want, atol=3e-2, rtol=3e-2)
    with pytest.raises(ValueError, match="kv_scales exactly when"):
        paged_attention_decode_triton(q, *stored, tables, lens, scale, window)
    with pytest.raises(ValueError, match="last_kv must be"):
        paged_attention_decode_triton(q, *stored, tables, lens, scale, window, kv_scales=scales,
                                      last_kv=(last_kv[0][:, :, :8], last_kv[1][:, :, :8]))


# ---------------------------------------------------------------- block / slot gather-scatter

@pytest.mark.triton
@requires_triton
@pytest.mark.parametrize("row_shape,dtype,last_row_elems", [
    ((4, 2, 8), torch.float32, None),      # a KV block
    ((16, 1, 3), torch.bfloat16, 21),      # odd row bytes, partly filled last block
    ((40, 4), torch.float32, 7),           # a state slot row with a prefix limit
    ((5,), torch.uint8, None),
])
def test_row_copy_kernels(kernel_mode, row_shape, dtype, last_row_elems):
    src = torch.randn(12, *row_shape, device=DEVICE).mul(50).to(dtype)
    ids = torch.tensor([7, 2, 3, 11], device=DEVICE)
    sentinel = torch.full((ids.shape[0], *row_shape), 99, device=DEVICE).to(dtype)
    packed = gather_rows_triton(src, ids, out=sentinel.clone(), last_row_elems=last_row_elems)
    assert torch.equal(packed, gather_rows_ref(src, ids, sentinel.clone(), last_row_elems))
    dst = torch.full_like(src, 99)
    scatter_rows_triton(packed, ids, dst, last_row_elems=last_row_elems)
    assert torch.equal(dst, scatter_rows_ref(packed, ids, torch.full_like(src, 99), last_row_elems))
    if last_row_elems is None:
        assert torch.equal(packed, src[ids]) and torch.equal(dst[ids], src[ids])
    dst_ids = torch.tensor([0, 5, 9, 4], device=DEVICE)  # cache to cache, both sides indexed
    moved = copy_rows_triton(src, ids, torch.full_like(src, 99), dst_ids, last_row_elems)
    assert torch.equal(moved, copy_rows_ref(src, ids, torch.full_like(src, 99), dst_ids, last_row_elems))


# ---------------------------------------------------------------- dispatch

@pytest.mark.triton
def test_dispatch(monkeypatch):
    cpu = torch.zeros(1)
    monkeypatch.delenv("SPLITSERVE_FORCE_TRITON", raising=False)
    monkeypatch.delenv("SPLITSERVE_DISABLE_TRITON", raising=False)
    assert not uses_triton(cpu)
    if _triton.available():
        monkeypatch.setenv("SPLITSERVE_FORCE_TRITON", "1")
        assert uses_triton(cpu)
    monkeypatch.setenv("SPLITSERVE_DISABLE_TRITON", "1")
    assert not uses_triton(cpu)


@pytest.mark.triton
@requires_triton
def test_public_functions_route_their_arguments(kernel_mode, monkeypatch):
    import engine.kernels as kernels

    pool_c, pool_s, slots = _pool(4, 16, 4), _pool(4, 16, 8), torch.tensor([2, 0], device=DEVICE)
    x, z, dt = (torch.randn(2, 16, device=DEVICE) for _ in range(3))
    w, D, A = torch.randn(16, 4, device=DEVICE), torch.randn(16, device=DEVICE), -torch.rand(16, 8, device=DEVICE)
    B, C = torch.randn(2, 8, device=DEVICE), torch.randn(2, 8, device=DEVICE)
    q, k_cache, v_cache, tables, lens = _paged_case(4, 2, 16, 4, [6, 3], torch.float32, window=4)
    rows = torch.tensor([3, 1], device=DEVICE)

    def run_all():
        pc, ps, dst = pool_c.clone(), pool_s.clone(), torch.zeros_like(pool_c)
        return [kernels.causal_conv1d_update(pc, slots, x, w, bias=D, activation="silu"), pc,
                kernels.selective_state_update(ps, slots, x, dt, A, B, C, D=D, z=z, dt_bias=D,
                                               dt_softplus=True), ps,
                kernels.paged_attention_decode(q, k_cache, v_cache, tables, lens, 0.25, sliding_window=4),
                kernels.gather_rows(pool_c, rows, last_row_elems=5),
                kernels.scatter_rows(pool_c[:2], rows, dst, last_row_elems=5),
                kernels.copy_rows(pool_c, rows, torch.zeros_like(pool_c), slots)]

    monkeypatch.setenv("SPLITSERVE_DISABLE_TRITON", "1")
    want = run_all()
    monkeypatch.delenv("SPLITSERVE_DISABLE_TRITON")
    monkeypatch.setenv("SPLITSERVE_FORCE_TRITON", "1")
    for got, ref in zip(run_all(), want):
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def test_engine_kernels_import_and_run_without_triton():
    code = ("import sys; sys.modules['triton'] = None\n"
            "import torch, engine.kernels as k\n"
            "assert not k.triton_available()\n"
            "y = k.gather_rows(torch.arange(6.).view(3, 2), torch.tensor([2, 0]))\n"
            "assert y.tolist() == [[4., 5.], [0., 1.]]\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120,
                   env={**os.environ, "SPLITSERVE_FORCE_TRITON": "0"})


# ---------------------------------------------------------------- references vs the engine

def _decode_batch(slots, context_lens, block_tables, block_size):
    n = len(slots)
    write_index = torch.tensor([int(block_tables[i, (c - 1) // block_size]) * block_size + (c - 1) % block_size
                                for i, c in enumerate(context_lens)])
    return ForwardBatch(
        input_ids=torch.zeros(n, dtype=torch.long), positions=torch.tensor(context_lens) - 1,
        query_starts=list(range(n + 1)), context_lens=list(context_lens), phases=[Phase.DECODE] * n,
        state_slots=list(slots), block_tables=block_tables, kv_write_index=write_index,
        block_size=block_size, logits_indices=torch.arange(n))


@pytest.mark.parametrize("bcdt_norm", [None, 1e-6])
def test_references_compose_to_the_engine_mamba_decode(bcdt_norm):
    from engine.models.ssm import MambaMixer

    torch.manual_seed(1)
    hidden, d_inner, d_state, d_conv, dt_rank = 16, 32, 8, 4, 4
    mixer = MambaMixer(hidden, d_inner, d_state, d_conv, dt_rank, conv_bias=True, proj_bias=False,
                       act="silu", bcdt_norm_eps=bcdt_norm)
    with torch.no_grad():
        for p in mixer.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    slots = [3, 0, 5]
    batch = _decode_batch(slots, [5, 9, 2], torch.zeros(3, 1, dtype=torch.long), 16)
    conv, ssm = torch.randn(6, d_inner, d_conv), torch.randn(6, d_inner, d_state)
    tokens = torch.randn(3, hidden)
    with torch.no_grad():
        engine_conv, engine_ssm = conv.clone(), ssm.clone()
        want = mixer(tokens, batch, (engine_conv, engine_ssm))

        slot_index = torch.tensor(slots)
        x, gate = mixer.in_proj(tokens).chunk(2, dim=-1)
        x = causal_conv1d_update_ref(conv, slot_index, x, mixer.conv_weight, mixer.conv_bias, "silu")
        dt, B, C = torch.split(mixer.x_proj(x), [dt_rank, d_state, d_state], dim=-1)
        if mixer.dt_norm is not None:
            dt, B, C = mixer.dt_norm(dt), mixer.b_norm(B), mixer.c_norm(C)
        dt = F.softplus(dt @ mixer.dt_proj.weight.t() + mixer.dt_proj.bias)
        y = selective_state_update_ref(ssm, slot_index, x, dt, -torch.exp(mixer.A_log), B, C,
                                       D=mixer.D, z=gate)
        got = mixer.out_proj(y)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert torch.equal(conv, engine_conv)
    torch.testing.assert_close(ssm, engine_ssm, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("heads,kv_heads,window", [(4, 4, None), (4, 2, 5), (4, 1, None)])
def test_reference_matches_the_engine_attention_decode(heads, kv_heads, window):
    from engine.models.attention import PagedAttention

    torch.manual_seed(2)
    head_dim, block_size, lens = 8, 4, [3, 12, 7]
    attention = PagedAttention(heads * head_dim, heads, kv_heads, head_dim, False, False, None, window)
    tables = torch.stack([torch.randperm(12)[:4] for _ in lens])
    k_cache, v_cache = torch.randn(2, 12, block_size, kv_heads, head_dim)
    q = torch.randn(len(lens), heads, head_dim)
    batch = _decode_batch([0, 1, 2], lens, tables, block_size)
    want = attention._attend_decodes(q, k_cache, v_cache, batch)
    got = paged_attention_decode_ref(q, k_cache, v_cache, tables, torch.tensor(lens), attention.scale, window)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
