"""The Triton kernels at realistic shapes: each against its torch reference (error, compile
time) and, on CUDA, against the device's memory bandwidth (scripts/gpu_check.py).

Each case counts the bytes the operation must move at least (reads + writes of the tensors it
touches); achieved GB/s = bytes / time, beside the bandwidth of a large device copy measured
on the spot: a kernel near 100% of it is memory-bound and done. Shapes follow released models:
Mamba (Jamba) d_inner 8192 x d_state 16; Mamba2 (Bamba, Granite 4.0-H) 128 heads x 64 x 128;
Gated DeltaNet (Qwen3-Next) 32 value heads of 128 x 128 keys; attention head_dim 128 and 256;
decode steps at batch 64-128 and one prefill of each recurrent kind; rounding rows to FP8 per
128 columns, storing recurrent state at half width and KV blocks in FP8, against the torch ops
they replace; the block-wise FP8 MoE product at Qwen3-Next-80B's expert sizes, whose reference
column is the split it replaces (one torch grouped GEMM per 128-column group), so its ratio is
the fused kernel's gain; and the same kernel as a block-wise FP8 linear, against the linear
dequantized to bf16 (what one that torch's scaled matmul does not take ran as). `scale`
divides every size (the CPU dry run checks the same cases, small, under Triton's interpreter).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from collections.abc import Callable

import torch

from engine.kernels.conv_update import causal_conv1d_update_ref, causal_conv1d_update_triton
from engine.kernels.float_bits import FP8_CAPABILITY
from engine.kernels.fp8_quant import quantize_groups_ref, quantize_groups_triton
from engine.kernels.kv_fp8 import kv_load_triton, kv_store_rows_triton, kv_store_triton
from engine.kernels.gdn_scan import chunk_gated_delta_rule_ref, gated_delta_step_ref
from engine.kernels.gdn_triton import chunk_gated_delta_rule_triton, gated_delta_step_triton
from engine.kernels.mamba2_update import mamba2_state_update_ref, mamba2_state_update_triton
from engine.kernels.paged_attention import paged_attention_decode_ref, paged_attention_decode_triton
from engine.kernels.row_copy import gather_rows_ref, gather_rows_triton, scatter_rows_ref, scatter_rows_triton
from engine.kernels.ssd_scan import ssd_chunk_scan_ref, ssd_chunk_scan_triton
from engine.kernels.ssm_scan import selective_scan_varlen_ref, selective_scan_varlen_triton
from engine.kernels.ssm_update import selective_state_update_ref, selective_state_update_triton
from engine.kernels.state_round import state_load_triton, state_store_triton, stochastic_round
from engine.kv_format import dequantize, quantize
from engine.models import fp8_blocks, fp8_linear
from engine.models.fp8 import expand_blocks
from engine.models.fp8_experts import Fp8Experts
from engine.models.fp8_linear import FP8, Fp8Linear


@dataclass
class Case:
    name: str
    shape: str
    nbytes: int
    kernel: Callable[[], object]
    reference: Callable[[], object]
    state: tuple[torch.Tensor, ...] = ()  # what both update in place (pools, out= buffers)
    dtype: str = field(default="")


@dataclass
class Check:
    case: Case
    compile_s: float  # the kernel's first call: Triton's compile (or cache load) and one run
    error: float  # max |kernel - reference| over outputs and updated state
    scale: float  # max |reference| there

    def ok(self) -> bool:
        tolerance = 2e-2 if self.case.dtype == "bfloat16" else 2e-3
        return self.error == self.error and self.error <= tolerance * max(1.0, self.scale)


def check(case: Case) -> Check:
    """Run the kernel, then the reference from the same inputs, and compare what each wrote."""
    saved = [t.clone() for t in case.state]
    sync = torch.cuda.synchronize if any(t.is_cuda for t in saved) else (lambda: None)
    started = time.perf_counter()
    got = _tensors(case.kernel()) + [t.clone() for t in case.state]
    sync()
    compile_s = time.perf_counter() - started
    for tensor, before in zip(case.state, saved):
        tensor.copy_(before)
    want = _tensors(case.reference()) + [t.clone() for t in case.state]
    error = scale = 0.0
    for a, b in zip(got, want):
        a, b = a.float(), b.float()
        error = max(error, float((a - b).abs().max())) if a.numel() else error
        scale = max(scale, float(b.abs().max())) if b.numel() else scale
    return Check(case, compile_s, error, scale)


def _tensors(out) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out.clone()]
    return [t.clone() for t in out or () if isinstance(t, torch.Tensor)]


def time_us(fn: Callable[[], object]) -> float:
    """Mean time of one call with a cold L2 (triton.testing.do_bench flushes it between calls)."""
    from triton.testing import do_bench

    return do_bench(fn, warmup=10, rep=50) * 1e3


def copy_bandwidth_gbps(device, nbytes: int = 1 << 30) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / (time_us(lambda: dst.copy_(src)) * 1e-6) / 1e9


def _rand(device, dtype):
    return lambda *shape: torch.randn(*shape, device=device, dtype=dtype)


def mamba_cases(device, dtype, scale=1, batch=128, d_inner=8192, d_state=16, d_conv=4, length=2048):
    batch, d_inner, length = max(2, batch // scale), max(32, d_inner // scale), max(16, length // scale)
    act, item = _rand(device, dtype), torch.empty((), dtype=dtype).element_size()
    slots = torch.randperm(2 * batch, device=device)[:batch]
    ssm = torch.randn(2 * batch, d_inner, d_state, device=device)
    conv = torch.randn(2 * batch, d_inner, d_conv, device=device)
    x, z, dt = act(batch, d_inner), act(batch, d_inner), act(batch, d_inner).sigmoid()
    B, C = act(batch, d_state), act(batch, d_state)
    A = -torch.rand(d_inner, d_state, device=device)
    D = torch.randn(d_inner, device=device)
    weight, bias = act(d_inner, d_conv), act(d_inner)
    ssm_bytes = 2 * batch * d_inner * d_state * 4 + 3 * batch * d_inner * item + batch * d_inner * 4 \
        + d_inner * d_state * 4
    conv_bytes = 2 * batch * d_inner * d_conv * 4 + 2 * batch * d_inner * item + d_inner * (d_conv + 1) * item
    args, conv_args = (ssm, slots, x, dt, A, B, C), (conv, slots, x, weight, bias, "silu")
    seqs = 4
    tokens = seqs * length
    sx, sB, sC = (act(tokens, width) for width in (d_inner, d_state, d_state))
    sdt = torch.rand(tokens, d_inner, device=device) * 0.1
    cu_seqlens = torch.arange(seqs + 1, device=device) * length
    pool = torch.randn(2 * seqs, d_inner, d_state, device=device)
    pool_slots = torch.randperm(2 * seqs, device=device)[:seqs]
    h0 = pool.index_select(0, pool_slots)
    y = torch.empty(tokens, d_inner, device=device)
    scan_bytes = tokens * d_inner * (item + 4 + 4) + 2 * tokens * d_state * item + d_inner * d_state * 4 \
        + 2 * seqs * d_inner * d_state * 4
    scan_args, scan_kw = (sx, sdt, A, sB, sC, cu_seqlens, h0), dict(state=pool, slots=pool_slots, out=y)
    return [
        Case("selective_state_update", f"B={batch} D={d_inner} N={d_state} fused", ssm_bytes,
             lambda: selective_state_update_triton(*args, D=D, z=z),
             lambda: selective_state_update_ref(*args, D=D, z=z), (ssm,)),
        Case("causal_conv1d_update", f"B={batch} D={d_inner} K={d_conv} silu", conv_bytes,
             lambda: causal_conv1d_update_triton(*conv_args), lambda: causal_conv1d_update_ref(*conv_args), (conv,)),
        Case("selective_scan_varlen", f"{seqs}x{length} tokens D={d_inner} N={d_state}", scan_bytes,
             lambda: selective_scan_varlen_triton(*scan_args, **scan_kw),
             lambda: selective_scan_varlen_ref(*scan_args, **scan_kw), (pool, y)),
    ]


def mamba2_cases(device, dtype, scale=1, batch=64, length=4096, heads=128, head_dim=64, d_state=128,
                 groups=1, chunk_size=256):
    batch, heads, length = max(2, batch // scale), max(2, heads // scale), max(16, length // scale)
    chunk_size = min(chunk_size, length)
    act, item = _rand(device, dtype), torch.empty((), dtype=dtype).element_size()
    slots = torch.randperm(2 * batch, device=device)[:batch]
    ssm = torch.randn(2 * batch, heads, head_dim, d_state, device=device)
    x, dt = act(batch, heads, head_dim), act(batch, heads)
    B, C = act(batch, groups, d_state), act(batch, groups, d_state)
    A = -torch.rand(heads, device=device)
    D, dt_bias = torch.randn(heads, device=device), torch.randn(heads, device=device)
    out = torch.empty(batch, heads, head_dim, device=device)
    update_bytes = 2 * batch * heads * head_dim * d_state * 4 + batch * heads * head_dim * (item + 4) \
        + 2 * batch * groups * d_state * item
    args = (ssm, slots, x, dt, A, B, C)
    kw = dict(D=D, dt_bias=dt_bias, dt_softplus=True, dt_limit=(0.0, 100.0))
    sx, sB, sC = act(length, heads, head_dim), act(length, groups, d_state), act(length, groups, d_state)
    sdt = torch.rand(length, heads, device=device) * 0.1
    h0 = torch.randn(heads, head_dim, d_state, device=device)
    scan_bytes = length * heads * head_dim * (item + 4) + 2 * length * groups * d_state * item \
        + length * heads * 4 + 2 * h0.numel() * 4
    scan = (sx, sdt, A, sB, sC, h0, chunk_size)
    return [
        Case("mamba2_state_update", f"B={batch} H={heads} P={head_dim} N={d_state} G={groups}", update_bytes,
             lambda: mamba2_state_update_triton(*args, out=out, **kw), lambda: mamba2_state_update_ref(*args, **kw),
             (ssm,)),
        Case("ssd_chunk_scan", f"L={length} H={heads} P={head_dim} N={d_state} chunk={chunk_size}", scan_bytes,
             lambda: ssd_chunk_scan_triton(*scan), lambda: ssd_chunk_scan_ref(*scan)),
    ]


def gdn_cases(device, dtype, scale=1, batch=64, length=4096, k_heads=16, heads=32, k_dim=128, v_dim=128,
              chunk_size=64):
    batch, length = max(2, batch // scale), max(16, length // scale)
    k_heads, heads = max(1, k_heads // scale), max(2, heads // scale)
    act, item = _rand(device, dtype), torch.empty((), dtype=dtype).element_size()
    state = torch.randn(2 * batch, heads, k_dim, v_dim, device=device) * 0.1
    slots = torch.randperm(2 * batch, device=device)[:batch]
    q, k, v = act(batch, k_heads, k_dim), act(batch, k_heads, k_dim), act(batch, heads, v_dim)
    g = -torch.rand(batch, heads, device=device)
    beta = torch.rand(batch, heads, device=device)
    step_bytes = 2 * batch * heads * k_dim * v_dim * 4 + batch * (2 * k_heads * k_dim + heads * v_dim) * item \
        + batch * heads * v_dim * 4
    sq, sk, sv = act(length, k_heads, k_dim), act(length, k_heads, k_dim), act(length, heads, v_dim)
    sg, sbeta = -torch.rand(length, heads, device=device) * 0.1, torch.rand(length, heads, device=device)
    h0 = torch.randn(heads, k_dim, v_dim, device=device) * 0.1
    rule_bytes = length * (2 * k_heads * k_dim + heads * v_dim) * item + length * heads * v_dim * 4 + 2 * h0.numel() * 4
    rule = (sq, sk, sv, sg, sbeta, h0, chunk_size)
    step = (state, slots, q, k, v, g, beta)
    return [
        Case("gated_delta_step", f"B={batch} Hk={k_heads} Hv={heads} dk={k_dim} dv={v_dim}", step_bytes,
             lambda: gated_delta_step_triton(*step), lambda: gated_delta_step_ref(*step), (state,)),
        Case("chunk_gated_delta_rule", f"L={length} Hk={k_heads} Hv={heads} dk={k_dim} dv={v_dim}", rule_bytes,
             lambda: chunk_gated_delta_rule_triton(*rule), lambda: chunk_gated_delta_rule_ref(*rule)),
    ]


def decode_updates(device, rows: int, scale: int = 1) -> dict:
    """The four decode kernels that update a state pool in place, at a serving model's sizes
    (over `scale`): {name: (the state row's shape, run(pool, slots, positions, reference=False,
    slot_runs=False) -> output)}, on fixed random bf16 inputs for `rows` decode rows; the
    Triton kernel, or with `reference` its torch reference."""
    generator = None if torch.device(device).type == "meta" else torch.Generator(device).manual_seed(1)
    r = lambda *shape: torch.randn(*shape, device=device, generator=generator)  # noqa: E731
    u = lambda *shape: torch.rand(*shape, device=device, generator=generator)  # noqa: E731
    half = lambda *shape: r(*shape).to(torch.bfloat16)  # noqa: E731
    d_inner, heads, k_heads = max(32, 8192 // scale), max(2, 128 // scale), max(1, 16 // scale)
    conv = half(rows, d_inner), half(d_inner, 4), half(d_inner)
    mamba = half(rows, d_inner), u(rows, d_inner), -u(d_inner, 16), half(rows, 16), half(rows, 16), r(d_inner)
    mamba2 = half(rows, heads, 64), half(rows, heads), -u(heads), half(rows, 1, 128), half(rows, 1, 128), r(heads), r(heads)
    gdn = half(rows, k_heads, 128), half(rows, k_heads, 128), half(rows, 2 * k_heads, 128), -u(rows, 2 * k_heads), \
        u(rows, 2 * k_heads)
    calls = {  # name: (the state row's shape, (Triton kernel, reference), its call on this step's inputs)
        "causal_conv1d_update": ((d_inner, 4), (causal_conv1d_update_triton, causal_conv1d_update_ref),
                                 lambda fn, pool, slots, pos, **kw: fn(pool, slots, *conv[:2], bias=conv[2],
                                                                       activation="silu", positions=pos, **kw)),
        "selective_state_update": ((d_inner, 16), (selective_state_update_triton, selective_state_update_ref),
                                   lambda fn, pool, slots, pos, **kw: fn(pool, slots, *mamba[:5], D=mamba[5],
                                                                         dt_softplus=True, positions=pos, **kw)),
        "mamba2_state_update": ((heads, 64, 128), (mamba2_state_update_triton, mamba2_state_update_ref),
                                lambda fn, pool, slots, pos, **kw: fn(pool, slots, *mamba2[:5], D=mamba2[5],
                                                                      dt_bias=mamba2[6], dt_softplus=True,
                                                                      positions=pos, **kw)),
        "gated_delta_step": ((2 * k_heads, 128, 128), (gated_delta_step_triton, gated_delta_step_ref),
                             lambda fn, pool, slots, pos, **kw: fn(pool, slots, *gdn, positions=pos, **kw)),
    }
    return {name: (shape, lambda pool, slots, pos, reference=False, slot_runs=False, impls=impls, call=call:
                   call(impls[reference], pool, slots, pos, slot_runs=slot_runs))
            for name, (shape, impls, call) in calls.items()}


def verify_state_cases(device, dtype, scale=1, requests=16, width=5):
    """The four decode kernels on a verify step's rows (engine.model_runner.verify_host_batch):
    `requests` sequences of `width` tokens each (a pending token and 4 drafts), a sequence's rows
    adjacent on its one slot and run in order (engine.kernels.slot_runs: one program a run, the
    state in registers), against the references, which run them in waves of distinct slots.
    Bytes: each slot's state read and written once, and every row's inputs."""
    if dtype != torch.bfloat16:
        return []  # the serving dtype only
    requests = max(2, requests // scale)
    slots = torch.randperm(2 * requests, device=device)[:requests].repeat_interleave(width)
    cases = []
    for name, (shape, run) in decode_updates(device, requests * width, scale).items():
        pool = torch.randn(2 * requests, *shape, device=device) * 0.5
        nbytes = 2 * requests * math.prod(shape) * 4
        cases.append(Case(f"{name}_verify", f"{requests}x{width} rows state {list(shape)}", nbytes,
                          lambda pool=pool, run=run: run(pool, slots, None, slot_runs=True),
                          lambda pool=pool, run=run: run(pool, slots, None, reference=True, slot_runs=True), (pool,)))
    return cases


def narrow_state_cases(device, dtype, scale=1, batch=64):
    """The decode kernels on a bfloat16 state pool (--mamba-state-dtype bfloat16): read exactly
    and stored rounded by the kernel itself, in place (what an all-decode step runs), against
    loading the step's slots into float32 working rows, the update there and the rounded store
    back (the path it replaces; the reference)."""
    if dtype != torch.bfloat16:
        return []  # the serving dtype only
    batch = max(2, batch // scale)
    slots = torch.randperm(2 * batch, device=device)[:batch]
    positions = torch.randint(1, 4096, (batch,), device=device)
    cases = []
    for name, (shape, run) in decode_updates(device, batch, scale).items():
        pool = (torch.randn(2 * batch, *shape, device=device) * 0.5).to(torch.bfloat16)
        working = torch.zeros(2 * batch, *shape, device=device)

        def working_rows(pool=pool, working=working, run=run):
            state_load_triton(pool, working, slots)
            out = run(working, slots, None)
            state_store_triton(working, pool, slots, positions)
            return out

        nbytes = 2 * batch * math.prod(shape) * 2
        cases.append(Case(f"{name}_bf16_state", f"B={batch} state {list(shape)} in place", nbytes,
                          lambda pool=pool, run=run: run(pool, slots, positions), working_rows, (pool,)))
    return cases


def attention_case(device, dtype, scale=1, batch=64, context=4096, heads=32, kv_heads=8, head_dim=128,
                   block_size=16):
    batch, context = max(1, batch // scale), max(block_size, context // scale)
    blocks_per_seq = -(-context // block_size)
    num_blocks = batch * blocks_per_seq
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, device=device, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    tables = torch.randperm(num_blocks, device=device).view(batch, blocks_per_seq)
    lens = torch.full((batch,), context, device=device)
    q = torch.randn(batch, heads, head_dim, device=device, dtype=dtype)
    out = torch.empty_like(q)
    nbytes = 2 * batch * context * kv_heads * head_dim * k_cache.element_size() + 2 * q.numel() * q.element_size()
    return Case("paged_attention_decode",
                f"B={batch} ctx={context} H={heads} KVH={kv_heads} Dh={head_dim} bs={block_size}", nbytes,
                lambda: paged_attention_decode_triton(q, k_cache, v_cache, tables, lens, head_dim ** -0.5, out=out),
                lambda: paged_attention_decode_ref(q, k_cache, v_cache, tables, lens, head_dim ** -0.5))


def row_copy_cases(device, dtype, scale=1, rows=4096, row_shape=(16, 8, 128)):
    rows = max(4, rows // scale)
    cache = torch.randn(2 * rows, *row_shape, device=device, dtype=dtype)
    ids = torch.randperm(2 * rows, device=device)[:rows]
    packed = torch.empty(rows, *row_shape, device=device, dtype=dtype)
    nbytes = 2 * packed.numel() * packed.element_size()
    shape = f"{rows} blocks of {list(row_shape)}"
    return [
        Case("gather_rows", shape, nbytes, lambda: gather_rows_triton(cache, ids, out=packed),
             lambda: gather_rows_ref(cache, ids, out=packed), (packed,)),
        Case("scatter_rows", shape, nbytes, lambda: scatter_rows_triton(packed, ids, cache),
             lambda: scatter_rows_ref(packed, ids, cache), (cache,)),
    ]


def state_round_cases(device, dtype, scale=1, batch=64, heads=32, k_dim=128, v_dim=128, slots=256):
    """A batch-64 decode step's Gated DeltaNet states (Qwen3-Next's [32, 128, 128]) stored at
    half width, stochastically rounded, and loaded back (`mamba_state_dtype`): bfloat16 in
    the bf16 pass, float16 in the float32 one."""
    narrow = torch.bfloat16 if dtype == torch.bfloat16 else torch.float16
    batch, heads, slots = max(2, batch // scale), max(1, heads // scale), max(4, slots // scale)
    working = torch.randn(slots, heads, k_dim, v_dim, device=device)
    pool = torch.zeros(slots, heads, k_dim, v_dim, device=device, dtype=narrow)
    rows = torch.randperm(slots, device=device)[:batch]
    positions = torch.randint(1, 1 << 20, (batch,), device=device)
    elements = torch.arange(working[0].numel(), device=device).view(working.shape[1:])
    shape = f"B={batch} [{heads}, {k_dim}, {v_dim}] as {str(narrow).removeprefix('torch.')}"
    nbytes = batch * working[0].numel() * 6
    return [
        Case("state_store", shape, nbytes, lambda: state_store_triton(working, pool, rows, positions),
             lambda: pool.index_copy_(0, rows, stochastic_round(working.index_select(0, rows), narrow, positions,
                                                                 elements)), (pool,)),
        Case("state_load", shape, nbytes, lambda: state_load_triton(pool, working, rows),
             lambda: working.index_copy_(0, rows, pool.index_select(0, rows).float()), (working,)),
    ]


def kv_fp8_cases(device, dtype, scale=1, batch=64, context=1024, kv_heads=8, head_dim=128, block_size=16):
    """An FP8 KV cache (`kv_cache_dtype` fp8_e4m3, a scale per KV head) around one attention
    layer of a batch-64 decode step at context 1024: the load of every block the rows' tables
    hold into working rows in the compute dtype, and the store of the step's 64 token rows."""
    if dtype != torch.bfloat16:
        return []  # the serving dtype only
    batch, context = max(2, batch // scale), max(block_size, context // scale)
    blocks = batch * -(-context // block_size)
    pool = (torch.randn(blocks, block_size, kv_heads, head_dim, device=device) * 50).to(torch.float8_e4m3fn)
    working = torch.zeros(blocks, block_size, kv_heads, head_dim, device=device, dtype=dtype)
    table = torch.randperm(blocks, device=device)
    written = torch.randperm(blocks * block_size, device=device)[:batch]
    scales = torch.linspace(0.5, 2.0, kv_heads, device=device).reshape(-1, 1)
    shape = f"B={batch} ctx={context} KVH={kv_heads} Dh={head_dim} bs={block_size} e4m3"

    def load_ref():  # NarrowKV's torch path
        rows = pool.view(torch.uint8).index_select(0, table).view(pool.dtype)
        working.index_copy_(0, table, dequantize(rows, scales, dtype))

    def store_ref():
        flat, flat_pool = working.view(-1, kv_heads, head_dim), pool.view(torch.uint8).view(-1, kv_heads, head_dim)
        flat_pool.index_copy_(0, written, quantize(flat.index_select(0, written), scales, pool.dtype).view(torch.uint8))

    return [
        Case("kv_fp8_load", shape, pool.numel() * 3, lambda: kv_load_triton(pool, table, working, scales),
             load_ref, (working,)),
        Case("kv_fp8_store", f"{batch} tokens of KVH={kv_heads} Dh={head_dim} e4m3", batch * kv_heads * head_dim * 3,
             lambda: kv_store_triton(working, written, pool, scales), store_ref, (pool,)),
    ]


def fp8_attention_case(device, dtype, scale=1, batch=64, context=1024, heads=32, kv_heads=8, head_dim=128,
                       block_size=16):
    """An all-decode step's attention layer over an FP8 cache: its token rows stored quantized
    and the blocks read in place through their scales (what the engine runs, engine.kv_format),
    against the path that dequantizes the step's blocks into working rows, writes the tokens
    there, reads those and stores the tokens back quantized (the reference)."""
    if dtype != torch.bfloat16:
        return []  # the serving dtype only
    batch, context = max(2, batch // scale), max(block_size, context // scale)
    per_seq = -(-context // block_size)
    blocks = batch * per_seq
    pools = tuple((torch.randn(blocks, block_size, kv_heads, head_dim, device=device) * 50).to(torch.float8_e4m3fn)
                  for _ in range(2))
    working = [torch.zeros(blocks, block_size, kv_heads, head_dim, device=device, dtype=dtype) for _ in range(2)]
    tables = torch.randperm(blocks, device=device).view(batch, per_seq)
    lens = torch.full((batch,), context, device=device)
    last = tables[:, (context - 1) // block_size] * block_size + (context - 1) % block_size
    scales = tuple(torch.linspace(0.01, 0.02, kv_heads, device=device) for _ in range(2))
    q = torch.randn(batch, heads, head_dim, device=device, dtype=dtype)
    own = tuple(torch.randn(batch, kv_heads, head_dim, device=device, dtype=dtype) for _ in range(2))
    out = torch.empty_like(q)

    def in_place():
        for pool, new, kv_scale in zip(pools, own, scales):
            kv_store_rows_triton(new, last, pool, kv_scale)
        return paged_attention_decode_triton(q, *pools, tables, lens, head_dim ** -0.5, out=out, kv_scales=scales,
                                             last_kv=own)

    def working_rows():
        for pool, rows, kv_scale, new in zip(pools, working, scales, own):
            kv_load_triton(pool, tables.reshape(-1), rows, kv_scale)
            rows.view(-1, kv_heads, head_dim).index_copy_(0, last, new)
        paged_attention_decode_triton(q, *working, tables, lens, head_dim ** -0.5, out=out)
        for pool, rows, kv_scale in zip(pools, working, scales):
            kv_store_triton(rows, last, pool, kv_scale)
        return out

    nbytes = 2 * batch * context * kv_heads * head_dim + 2 * q.numel() * q.element_size()
    return [Case("paged_attention_fp8", f"B={batch} ctx={context} H={heads} KVH={kv_heads} Dh={head_dim} e4m3",
                 nbytes, in_place, working_rows, pools)]


def _fp8_units(device) -> bool:
    """Whether FP8 weights stay FP8 on `device` (their kernels' MIN_CAPABILITY); a CPU's and meta
    tensors run them all (the interpreter, bench.kernel_compile)."""
    return device.type != "cuda" or torch.cuda.get_device_capability(device) >= FP8_CAPABILITY


def fp8_quant_cases(device, dtype, scale=1, hidden=2048):
    """Rounding a decode step's and a prefill's rows to FP8 per 128 columns, as every FP8
    linear and expert does before its product."""
    if dtype != torch.bfloat16 or not _fp8_units(device):
        return []  # the serving dtype only; FP8 needs the units
    hidden, cases = max(32, hidden // scale), []
    cols = min(128, hidden)
    for tokens in (64, 8192):
        tokens = max(1, tokens // scale)
        rows = torch.randn(tokens, hidden, device=device, dtype=dtype)
        nbytes = rows.numel() * (rows.element_size() + 1) + tokens * (hidden // cols) * 4
        cases.append(Case("fp8_quantize_groups", f"T={tokens} K={hidden} per {cols} columns", nbytes,
                          lambda rows=rows: quantize_groups_triton(rows, cols),
                          lambda rows=rows: quantize_groups_ref(rows, cols)))
    return cases


def fp8_moe_cases(device, dtype, scale=1, experts=512, top_k=10, hidden=2048, intermediate=512):
    """Qwen3-Next-80B-A3B-FP8's experts (128x128 blocks): gate_up and down at a batch-64 decode
    step, gate_up at a 2048-token prefill, and one rank's down at tensor-parallel 8 (64 input
    columns: half of each block, kept in 64-column groups, Fp8Experts.tp_take); the fused
    kernel against the split products."""
    if dtype != torch.bfloat16 or not _fp8_units(device):
        return []  # the serving dtype only; FP8 needs the units
    experts = max(2, experts // scale)
    top_k = min(top_k, max(1, experts // 4))
    hidden, intermediate = max(32, hidden // scale), max(16, intermediate // scale)
    whole = (min(128, 2 * intermediate), min(128, hidden, intermediate))
    # drawn where they are used (GBs at these sizes); meta tensors (bench.kernel_compile) draw nothing
    generator = None if device.type == "meta" else torch.Generator(device).manual_seed(0)
    cases = []
    shard = (whole[0], max(16, whole[1] // 2))
    for name, tokens, out, inputs, block in (
            ("gate_up", 64, 2 * intermediate, hidden, whole), ("down", 64, hidden, intermediate, whole),
            ("gate_up", 2048, 2 * intermediate, hidden, whole), ("down TP8", 64, hidden, shard[1], shard)):
        tokens = max(1, tokens // scale)
        picks = torch.rand(tokens, experts, device=device, generator=generator).topk(top_k, dim=1).indices.flatten()
        counts = torch.zeros(experts, dtype=torch.long, device=device).index_add_(0, picks, torch.ones_like(picks))
        ends = counts.cumsum(0).to(torch.int32)
        weight = (torch.randn(experts, out, inputs, device=device, generator=generator) * 64).clamp(-448, 448)
        qweight = torch.nn.Parameter(weight.to(torch.float8_e4m3fn), requires_grad=False)
        del weight
        weight_scale = torch.exp2(-12 + 6 * torch.rand(experts, -(-out // block[0]), -(-inputs // block[1]),
                                                       device=device, generator=generator))
        fused, split = (Fp8Experts(experts, out, inputs, dtype, device="meta") for _ in range(2))
        for stacked, is_fused in ((fused, True), (split, False)):  # both ways, whatever the device check says
            stacked.qweight, stacked.weight_scale, stacked.block, stacked.fused = qweight, weight_scale, block, is_fused
            stacked._build_gemm_scales()
        rows = torch.randn(tokens * top_k, inputs, device=device, generator=generator).to(dtype)
        hit = min(experts, tokens * top_k) if device.type == "meta" else int((counts > 0).sum())  # no values on meta
        nbytes = hit * out * inputs + weight_scale[0].numel() * 4 * hit + rows.numel() * 2 + rows.shape[0] * out * 2
        cases.append(Case("fp8_moe_block", f"{name} T={tokens} top{top_k} E={experts} [{out}, {inputs}]", nbytes,
                          lambda fused=fused, rows=rows, ends=ends: fused.grouped_product(rows, ends),
                          lambda split=split, rows=rows, ends=ends: split.grouped_product(rows, ends)))
    return cases


def fp8_linear_cases(device, dtype, scale=1, hidden=2048, heads=16, head_dim=256, shared=512):
    """Qwen3-Next-80B-A3B-FP8's block-wise linears on the Triton kernel (Fp8Linear.fused):
    o_proj (128x128 blocks) at a batch-64 decode step and a 2048-token prefill, and one rank's
    shared-expert down projection at tensor-parallel 8 (64 input columns: half of each block,
    kept in 64-column groups, Fp8Linear.tp_columns), which torch's scaled matmul does not take;
    against the same linear dequantized to bf16, which is what such a linear ran as without it.
    Where torch's block-wise scaled matmul runs (Hopper), the o_proj rows are repeated with it
    as the kernel: which of the two an Fp8Linear should prefer there."""
    if dtype != torch.bfloat16 or not _fp8_units(device):
        return []  # the serving dtype only; FP8 needs the units
    hidden, attention, shared = max(32, hidden // scale), max(32, heads * head_dim // scale), max(16, shared // scale)
    whole = min(128, hidden, attention)
    shard = (whole, max(16, min(shared // 8, whole // 2)))
    generator = None if device.type == "meta" else torch.Generator(device).manual_seed(0)
    cases = []
    for name, tokens, out, inputs, block in (("o_proj", 64, hidden, attention, (whole, whole)),
                                             ("o_proj", 2048, hidden, attention, (whole, whole)),
                                             ("shared down TP8", 64, hidden, shard[1], shard)):
        tokens = max(1, tokens // scale)
        qweight = (torch.randn(out, inputs, device=device, generator=generator) * 64).clamp(-448, 448).to(FP8)
        weight_scale = torch.exp2(-12 + 6 * torch.rand(-(-out // block[0]), -(-inputs // block[1]), device=device,
                                                       generator=generator))
        layout = (fp8_blocks.gemm_layout(device, dtype, out, inputs)
                  if device.type == "cuda" and fp8_linear.runs_scaled(device, dtype, True, block) else None)
        # each way, whatever the device check says
        dense = _block_linear(qweight, weight_scale, block, dtype,
                              dense=(qweight.float() * expand_blocks(weight_scale, block, qweight.shape)).to(dtype))
        kernels = {"": _block_linear(qweight, weight_scale, block, dtype, fused=True)}
        if layout is not None:
            kernels[", torch's scaled matmul"] = _block_linear(qweight, weight_scale, block, dtype,
                                                               gemm_scale=fp8_blocks.gemm_scale(weight_scale, layout))
        rows = torch.randn(tokens, inputs, device=device, generator=generator).to(dtype)
        nbytes = out * inputs + weight_scale.numel() * 4 + rows.numel() * 2 + tokens * out * 2
        for label, linear in kernels.items():
            cases.append(Case("fp8_linear_block", f"{name} T={tokens} [{out}, {inputs}] per {block[0]}x{block[1]}{label}",
                              nbytes, lambda linear=linear, rows=rows: linear(rows),
                              lambda dense=dense, rows=rows: dense(rows)))
    return cases


def _block_linear(qweight, weight_scale, block, dtype, **way) -> Fp8Linear:
    """An Fp8Linear of these block-wise weights that runs one way (`fused`, `gemm_scale` or `dense` set)."""
    linear = Fp8Linear(qweight.shape[1], qweight.shape[0], False, dtype, device="meta")
    linear.qweight = torch.nn.Parameter(qweight, requires_grad=False)
    linear.weight_scale, linear.block = weight_scale, block
    for name, value in way.items():
        setattr(linear, name, value)
    return linear


GROUPS = (
    lambda d, t, s: mamba_cases(d, t, s),
    lambda d, t, s: mamba2_cases(d, t, s),
    lambda d, t, s: gdn_cases(d, t, s),
    lambda d, t, s: [attention_case(d, t, s)],
    lambda d, t, s: [attention_case(d, t, s, batch=2, context=32768)],  # few sequences: split context
    lambda d, t, s: [attention_case(d, t, s, heads=16, kv_heads=2, head_dim=256)],
    lambda d, t, s: [attention_case(d, t, s, heads=32, kv_heads=1, head_dim=576)],  # Kimi Linear's MLA, absorbed
    lambda d, t, s: verify_state_cases(d, t, s),
    lambda d, t, s: row_copy_cases(d, t, s),
    lambda d, t, s: state_round_cases(d, t, s),
    lambda d, t, s: narrow_state_cases(d, t, s),
    lambda d, t, s: kv_fp8_cases(d, t, s),
    lambda d, t, s: fp8_attention_case(d, t, s),
    lambda d, t, s: fp8_quant_cases(d, t, s),
    lambda d, t, s: fp8_moe_cases(d, t, s),
    lambda d, t, s: fp8_linear_cases(d, t, s),
)


def all_cases(device, dtype=torch.bfloat16, scale=1):
    """Built one group at a time, so each group's tensors are freed before the next."""
    for group in GROUPS:
        for case in group(device, dtype, scale):
            case.dtype = str(dtype).removeprefix("torch.")
            yield case


@dataclass
class Result:
    name: str
    shape: str
    nbytes: int
    kernel_us: float
    reference_us: float

    def gbps(self) -> float:
        return self.nbytes / (self.kernel_us * 1e-6) / 1e9


def run(case: Case) -> Result:
    result = Result(case.name, case.shape, case.nbytes, time_us(case.kernel), time_us(case.reference))
    torch.cuda.synchronize()
    return result
