"""Micro-benchmarks of the kernels against the device's memory bandwidth (CUDA only).

Each case counts the bytes the operation must move at least (reads + writes of the tensors
it touches); achieved GB/s = bytes / time, shown beside the bandwidth of a large device copy
measured on the spot, which is the floor's yardstick: a kernel at ~100% of it is memory-bound
and done. Shapes are decode-sized and Jamba-like (d_inner 8192, d_state 16, 8 KV heads of 128);
the Mamba2 ones Bamba-like (128 heads of 64, d_state 128), plus one prefill scan of each
family (Mamba: 4 sequences of 2048 tokens; Mamba2: one of 4096).
Used by scripts/gpu_check.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from engine.kernels.conv_update import causal_conv1d_update_ref, causal_conv1d_update_triton
from engine.kernels.mamba2_update import mamba2_state_update_ref, mamba2_state_update_triton
from engine.kernels.paged_attention import paged_attention_decode_ref, paged_attention_decode_triton
from engine.kernels.row_copy import gather_rows_ref, gather_rows_triton, scatter_rows_ref, scatter_rows_triton
from engine.kernels.ssd_scan import ssd_chunk_scan_ref, ssd_chunk_scan_triton
from engine.kernels.ssm_scan import selective_scan_varlen_ref, selective_scan_varlen_triton
from engine.kernels.ssm_update import selective_state_update_ref, selective_state_update_triton


@dataclass
class Case:
    name: str
    shape: str
    nbytes: int
    kernel: Callable[[], object]
    reference: Callable[[], object]


@dataclass
class Result:
    name: str
    shape: str
    nbytes: int
    kernel_us: float
    reference_us: float

    def gbps(self) -> float:
        return self.nbytes / (self.kernel_us * 1e-6) / 1e9


def time_us(fn: Callable[[], object]) -> float:
    """Mean time of one call with a cold L2 (triton.testing.do_bench flushes it between calls)."""
    from triton.testing import do_bench

    return do_bench(fn, warmup=10, rep=50) * 1e3


def copy_bandwidth_gbps(device, nbytes: int = 1 << 30) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / (time_us(lambda: dst.copy_(src)) * 1e-6) / 1e9


def mamba_cases(device, batch=128, d_inner=8192, d_state=16, d_conv=4, dtype=torch.bfloat16):
    slots = torch.randperm(2 * batch, device=device)[:batch]
    ssm = torch.randn(2 * batch, d_inner, d_state, device=device)
    conv = torch.randn(2 * batch, d_inner, d_conv, device=device)

    def act(*shape):
        return torch.randn(*shape, device=device, dtype=dtype)

    x, z, dt = act(batch, d_inner), act(batch, d_inner), act(batch, d_inner).sigmoid()
    B, C = act(batch, d_state), act(batch, d_state)
    A = -torch.rand(d_inner, d_state, device=device)
    D = torch.randn(d_inner, device=device)
    weight, bias = act(d_inner, d_conv), act(d_inner)
    item = x.element_size()
    ssm_bytes = 2 * batch * d_inner * d_state * 4 + 3 * batch * d_inner * item + batch * d_inner * 4 \
        + d_inner * d_state * 4
    conv_bytes = 2 * batch * d_inner * d_conv * 4 + 2 * batch * d_inner * item + d_inner * (d_conv + 1) * item
    args = (ssm, slots, x, dt, A, B, C)
    conv_args = (conv, slots, x, weight, bias, "silu")
    return [
        Case("selective_state_update", f"B={batch} D={d_inner} N={d_state} fused", ssm_bytes,
             lambda: selective_state_update_triton(*args, D=D, z=z),
             lambda: selective_state_update_ref(*args, D=D, z=z)),
        Case("causal_conv1d_update", f"B={batch} D={d_inner} K={d_conv} silu", conv_bytes,
             lambda: causal_conv1d_update_triton(*conv_args), lambda: causal_conv1d_update_ref(*conv_args)),
    ]


def mamba_prefill_case(device, seqs=4, length=2048, d_inner=8192, d_state=16, dtype=torch.bfloat16):
    """All prefills of a batch in one varlen scan, final states into the pool at their slots."""
    tokens = seqs * length
    x, B, C = (torch.randn(tokens, width, device=device, dtype=dtype) for width in (d_inner, d_state, d_state))
    dt = torch.rand(tokens, d_inner, device=device) * 0.1  # final dt is float32 in the mixer
    A = -torch.rand(d_inner, d_state, device=device)
    cu_seqlens = torch.arange(seqs + 1, device=device) * length
    pool = torch.randn(2 * seqs, d_inner, d_state, device=device)
    slots = torch.randperm(2 * seqs, device=device)[:seqs]
    h0 = pool.index_select(0, slots)
    y = torch.empty(tokens, d_inner, device=device)
    item = x.element_size()
    nbytes = tokens * d_inner * (item + 4 + 4) + 2 * tokens * d_state * item + d_inner * d_state * 4 \
        + 2 * seqs * d_inner * d_state * 4  # x, dt, y; B, C; A; h0 read, final states written
    args = (x, dt, A, B, C, cu_seqlens, h0)
    kw = dict(state=pool, slots=slots, out=y)
    return Case("selective_scan_varlen", f"{seqs}x{length} tokens D={d_inner} N={d_state}", nbytes,
                lambda: selective_scan_varlen_triton(*args, **kw), lambda: selective_scan_varlen_ref(*args, **kw))


def mamba2_cases(device, batch=64, length=4096, heads=128, head_dim=64, d_state=128, groups=1,
                 chunk_size=256, dtype=torch.bfloat16):
    slots = torch.randperm(2 * batch, device=device)[:batch]
    ssm = torch.randn(2 * batch, heads, head_dim, d_state, device=device)
    x = torch.randn(batch, heads, head_dim, device=device, dtype=dtype)
    dt = torch.randn(batch, heads, device=device, dtype=dtype)
    B, C = (torch.randn(batch, groups, d_state, device=device, dtype=dtype) for _ in range(2))
    A = -torch.rand(heads, device=device)
    D, dt_bias = torch.randn(heads, device=device), torch.randn(heads, device=device)
    out = torch.empty(batch, heads, head_dim, device=device)
    item = x.element_size()
    update_bytes = 2 * batch * heads * head_dim * d_state * 4 + batch * heads * head_dim * (item + 4) \
        + 2 * batch * groups * d_state * item
    args = (ssm, slots, x, dt, A, B, C)
    kw = dict(D=D, dt_bias=dt_bias, dt_softplus=True, dt_limit=(0.0, 100.0))
    sx = torch.randn(length, heads, head_dim, device=device, dtype=dtype)
    sdt = torch.rand(length, heads, device=device) * 0.1
    sB, sC = (torch.randn(length, groups, d_state, device=device, dtype=dtype) for _ in range(2))
    h0 = torch.randn(heads, head_dim, d_state, device=device)
    scan_bytes = length * heads * head_dim * (item + 4) + 2 * length * groups * d_state * item \
        + length * heads * 4 + 2 * h0.numel() * 4
    scan = (sx, sdt, A, sB, sC, h0, chunk_size)
    return [
        Case("mamba2_state_update", f"B={batch} H={heads} P={head_dim} N={d_state} G={groups}", update_bytes,
             lambda: mamba2_state_update_triton(*args, out=out, **kw),
             lambda: mamba2_state_update_ref(*args, **kw)),
        Case("ssd_chunk_scan", f"L={length} H={heads} P={head_dim} N={d_state} chunk={chunk_size}", scan_bytes,
             lambda: ssd_chunk_scan_triton(*scan), lambda: ssd_chunk_scan_ref(*scan)),
    ]


def attention_case(device, batch, context, heads=32, kv_heads=8, head_dim=128, block_size=16,
                   dtype=torch.bfloat16):
    blocks_per_seq = -(-context // block_size)
    num_blocks = batch * blocks_per_seq
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, device=device, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    tables = torch.randperm(num_blocks, device=device).view(batch, blocks_per_seq)
    lens = torch.full((batch,), context, device=device)
    q = torch.randn(batch, heads, head_dim, device=device, dtype=dtype)
    out = torch.empty_like(q)
    scale = head_dim ** -0.5
    nbytes = 2 * batch * context * kv_heads * head_dim * k_cache.element_size() + 2 * q.numel() * q.element_size()
    return Case("paged_attention_decode", f"B={batch} ctx={context} H={heads} KVH={kv_heads} Dh={head_dim} bs={block_size}",
                nbytes,
                lambda: paged_attention_decode_triton(q, k_cache, v_cache, tables, lens, scale, out=out),
                lambda: paged_attention_decode_ref(q, k_cache, v_cache, tables, lens, scale))


def row_copy_cases(device, rows=4096, row_shape=(16, 8, 128), dtype=torch.bfloat16):
    cache = torch.randn(2 * rows, *row_shape, device=device, dtype=dtype)
    ids = torch.randperm(2 * rows, device=device)[:rows]
    packed = torch.empty(rows, *row_shape, device=device, dtype=dtype)
    nbytes = 2 * packed.numel() * packed.element_size()
    shape = f"{rows} blocks of {list(row_shape)} {str(dtype).removeprefix('torch.')}"
    return [
        Case("gather_rows", shape, nbytes, lambda: gather_rows_triton(cache, ids, out=packed),
             lambda: gather_rows_ref(cache, ids, out=packed)),
        Case("scatter_rows", shape, nbytes, lambda: scatter_rows_triton(packed, ids, cache),
             lambda: scatter_rows_ref(packed, ids, cache)),
    ]


def all_cases(device):
    """Built one group at a time, so each group's tensors are freed before the next."""
    yield from mamba_cases(device)
    yield mamba_prefill_case(device)
    yield from mamba2_cases(device)
    yield attention_case(device, batch=64, context=4096)
    yield attention_case(device, batch=2, context=32768)  # few sequences: split context
    yield from row_copy_cases(device)


def run(case: Case) -> Result:
    result = Result(case.name, case.shape, case.nbytes, time_us(case.kernel), time_us(case.reference))
    torch.cuda.synchronize()
    return result
