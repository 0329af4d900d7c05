"""The C++ CPU kernels (engine.kernels.cpu, built by engine.kernels.native) against their torch references.

As for the Triton kernels: outputs start as NaN and must be fully written where they should be
and untouched elsewhere, pool rows outside the batch come back bit for bit, and KV entries no
query may see are NaN, so reading one shows.
"""

from __future__ import annotations

import pytest
import torch

from engine import kernels
from engine.kernels import cpu
from engine.kernels.mamba2_update import mamba2_state_update_ref
from engine.kernels.paged_attention import paged_attention_decode_ref
from engine.kernels.ssm_update import selective_state_update_ref
from tests.conftest import record_calls

NAN = float("nan")


def _outside_unchanged(after, before, slots):
    outside = torch.ones(before.shape[0], dtype=torch.bool)
    outside[slots] = False
    assert torch.equal(after[outside], before[outside]), "a pool row outside the batch changed"


@pytest.mark.parametrize("bias,softplus,limit", [(True, True, (0.0, float("inf"))), (True, True, (0.01, 2.0)),
                                                 (False, False, (0.0, float("inf"))), (False, True, (0.0, 0.5))])
def test_mamba2_dt_is_process_dt(bias, softplus, limit):
    """Mamba2's dt in one C++ pass, read in place from a projection (a strided column block):
    process_dt's values, negatives kept where no limit is set, both bounds where one is."""
    from engine.kernels.mamba2_update import process_dt

    torch.manual_seed(3)
    proj = torch.randn(7, 30) * 8
    dt, dt_bias = proj[:, 20:26], (torch.randn(6) if bias else None)
    got = cpu.mamba2_dt_cpu(dt, dt_bias, softplus, limit)
    torch.testing.assert_close(got, process_dt(dt, dt_bias, softplus, limit), atol=1e-6, rtol=1e-5)
    if not softplus:
        assert (got < 0).any()


@pytest.mark.parametrize("cols,group", [(64, 64), (48, 16), (30, 10)])
def test_group_rms_norm_is_the_gated_norms_definition(cols, group):
    """The gated norm's two C++ forms against GatedRMSNorm's torch definition: the norm alone
    (after the gate) and, from y, x, D and z read in place, the skip, the norm, then the gate."""
    from engine.models.layers import GatedRMSNorm

    torch.manual_seed(cols)
    norm = GatedRMSNorm(cols, group, 1e-5)
    torch.nn.init.normal_(norm.weight)
    x = torch.randn(5, cols)
    want = norm.weight * norm._group_rms(x)
    torch.testing.assert_close(cpu.group_rms_norm_cpu(x, norm.weight.detach(), group, 1e-5), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(norm.normalise_gated(x), want, atol=1e-5, rtol=1e-5)
    proj = torch.randn(5, 2 * cols + 7)
    skip, z, D = proj[:, 3:3 + cols], proj[:, 3 + cols:3 + 2 * cols], torch.randn(cols)
    first = GatedRMSNorm(cols, group, 1e-5, norm_before_gate=True)
    first.weight.data.copy_(norm.weight.data)
    with torch.no_grad():
        want = first(x + skip * D, z)
    got = cpu.skip_norm_gate_cpu(x, skip, D, z, first.weight.detach(), group, 1e-5)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("d_inner,d_state,batch", [(64, 16, 5), (32, 32, 3), (33, 4, 1), (128, 7, 9)])
@pytest.mark.parametrize("fused", [False, True])
def test_ssm_update(d_inner, d_state, batch, fused):
    torch.manual_seed(d_inner + batch)
    pool = torch.randn(batch + 3, d_inner, d_state)
    slots = torch.randperm(batch + 3)[:batch]
    x, dt, z = torch.randn(batch, d_inner), torch.randn(batch, d_inner), torch.randn(batch, d_inner)
    A = -torch.rand(d_inner, d_state) * 4
    B, C = torch.randn(batch, d_state), torch.randn(batch, d_state)
    extra = dict(D=torch.randn(d_inner), z=z, dt_bias=torch.randn(d_inner), dt_softplus=True) if fused else {}
    if not fused:
        dt = torch.nn.functional.softplus(dt)
    ours, ref = pool.clone(), pool.clone()
    y = cpu.selective_state_update_cpu(ours, slots, x, dt, A, B, C, **extra)
    y_ref = selective_state_update_ref(ref, slots, x, dt, A, B, C, **extra)
    torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)
    _outside_unchanged(ours, pool, slots)
    again, out = pool.clone(), torch.full((batch, d_inner), float("nan"))  # into `out`, as given or via a copy
    assert cpu.selective_state_update_cpu(again, slots, x, dt, A, B, C, out=out, **extra) is out
    assert torch.equal(out, y) and torch.equal(again, ours)


@pytest.mark.parametrize("d_state", [16, 32])
def test_ssm_update_sixteen_channels_at_a_time_keeps_the_bits(d_state):
    """Where d_inner and d_state are multiples of 16, the kernel sums 16 channels' dot products in
    one transposed tree: the same state bits as the channel-at-a-time loop it takes otherwise (49
    channels, the first 48 the same), and y to rounding (with -march=native the per-channel
    reduction's order follows the compiler's vector width, which differs between CPUs)."""
    torch.manual_seed(d_state)
    batch = 5
    pool = torch.randn(batch + 2, 49, d_state)
    slots = torch.randperm(batch + 2)[:batch]
    x, dt = torch.randn(batch, 49), torch.rand(batch, 49)
    A, B, C = -torch.rand(49, d_state) * 4, torch.randn(batch, d_state), torch.randn(batch, d_state)
    by_channel = pool.clone()
    y_by_channel = cpu.selective_state_update_cpu(by_channel, slots, x, dt, A, B, C)
    blocked = pool[:, :48].contiguous()
    y_blocked = cpu.selective_state_update_cpu(blocked, slots, x[:, :48].contiguous(), dt[:, :48].contiguous(),
                                               A[:48].contiguous(), B, C)
    torch.testing.assert_close(y_blocked, y_by_channel[:, :48], rtol=1e-6, atol=1e-6 * float(y_by_channel.abs().max()))
    assert torch.equal(blocked, by_channel[:, :48])
    assert not torch.equal(blocked, pool[:, :48])


@pytest.mark.parametrize("length,d_inner,d_state", [(1, 16, 16), (37, 40, 16), (70, 33, 7)])
def test_selective_scan(length, d_inner, d_state):
    """One sequence's Mamba prefill from a non-zero state: y and the final state."""
    from engine.models.ssm import selective_scan_ref

    torch.manual_seed(length + d_inner)
    x, dt = torch.randn(length, d_inner), torch.rand(length, d_inner) * 0.5
    A = -torch.rand(d_inner, d_state) * 4
    B, C, h0 = torch.randn(length, d_state), torch.randn(length, d_state), torch.randn(d_inner, d_state)
    before = h0.clone()
    y, h = cpu.selective_scan_cpu(x, dt, A, B, C, h0)
    y_ref, h_ref = selective_scan_ref(x, dt, A, B, C, h0)
    torch.testing.assert_close(y, y_ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(h, h_ref, atol=1e-4, rtol=1e-4)
    assert torch.equal(h0, before)  # the caller's starting state is not written
    out = torch.full((length + 2, d_inner), NAN)  # written in place: a slice of the layer's y
    y_out, _ = cpu.selective_scan_cpu(x, dt, A, B, C, h0, out=out[1:-1])
    assert y_out.data_ptr() == out[1:-1].data_ptr() and torch.equal(out[1:-1], y)
    assert out[0].isnan().all() and out[-1].isnan().all()


@pytest.mark.parametrize("heads,head_dim,groups,d_state,batch", [(8, 16, 1, 32, 5), (4, 32, 2, 16, 3), (6, 3, 3, 5, 2)])
@pytest.mark.parametrize("fused", [False, True])
def test_mamba2_update(heads, head_dim, groups, d_state, batch, fused):
    torch.manual_seed(heads + batch)
    pool = torch.randn(batch + 3, heads, head_dim, d_state)
    slots = torch.randperm(batch + 3)[:batch]
    x, dt = torch.randn(batch, heads, head_dim), torch.randn(batch, heads)
    A = -torch.rand(heads) * 4
    B, C = torch.randn(batch, groups, d_state), torch.randn(batch, groups, d_state)
    extra = dict(D=torch.randn(heads), dt_bias=torch.randn(heads), dt_softplus=True,
                 dt_limit=(0.01, 2.0)) if fused else {}
    if not fused:
        dt = dt.abs()
    ours, ref = pool.clone(), pool.clone()
    y = cpu.mamba2_state_update_cpu(ours, slots, x, dt, A, B, C, **extra)
    y_ref = mamba2_state_update_ref(ref, slots, x, dt, A, B, C, **extra)
    torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)
    _outside_unchanged(ours, pool, slots)


@pytest.mark.parametrize("d_state", [16, 32])
def test_mamba2_update_sixteen_rows_at_a_time_keeps_the_bits(d_state):
    """Where head_dim and d_state are multiples of 16, 16 rows of a head share one exp and one
    lane_sums: the same state bits as the row-at-a-time loop (head_dim 17, the first 16 the
    same), and y to rounding (the row loop's reduction order follows the compiler's vector width)."""
    torch.manual_seed(d_state)
    batch, heads, groups = 3, 4, 2
    pool = torch.randn(batch + 2, heads, 17, d_state)
    slots = torch.randperm(batch + 2)[:batch]
    x, dt, A = torch.randn(batch, heads, 17), torch.rand(batch, heads), -torch.rand(heads) * 4
    B, C = torch.randn(batch, groups, d_state), torch.randn(batch, groups, d_state)
    by_row = pool.clone()
    y_by_row = cpu.mamba2_state_update_cpu(by_row, slots, x, dt, A, B, C)
    blocked = pool[:, :, :16].contiguous()
    y_blocked = cpu.mamba2_state_update_cpu(blocked, slots, x[:, :, :16].contiguous(), dt, A, B, C)
    torch.testing.assert_close(y_blocked, y_by_row[:, :, :16], rtol=1e-6, atol=1e-6 * float(y_by_row.abs().max()))
    assert torch.equal(blocked, by_row[:, :, :16])
    assert not torch.equal(blocked, pool[:, :, :16])


@pytest.mark.parametrize("per_channel", [False, True], ids=["decay-per-head", "decay-per-key-channel"])
@pytest.mark.parametrize("k_heads,heads,k_dim,v_dim,batch", [(2, 4, 16, 8, 3), (1, 1, 5, 7, 1), (2, 2, 32, 32, 6)])
def test_gated_delta_step(k_heads, heads, k_dim, v_dim, batch, per_channel):
    from engine.kernels.gdn_scan import gated_delta_step_ref

    torch.manual_seed(heads * k_dim + batch)
    pool = torch.randn(batch + 3, heads, k_dim, v_dim)
    pool[batch:] = NAN  # rows outside the batch: a read would show
    slots = torch.randperm(batch + 3)[:batch]
    pool[slots] = torch.randn(batch, heads, k_dim, v_dim)
    q, k = torch.randn(batch, k_heads, k_dim), torch.randn(batch, k_heads, k_dim)
    v, beta = torch.randn(batch, heads, v_dim), torch.rand(batch, heads)
    g = -torch.rand(batch, heads, k_dim) * 2 if per_channel else -torch.rand(batch, heads)
    ours, ref = pool.clone(), pool.clone()
    o = cpu.gated_delta_step_cpu(ours, slots, q, k, v, g, beta)
    o_ref = gated_delta_step_ref(ref, slots, q, k, v, g, beta)
    torch.testing.assert_close(o, o_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours[slots], ref[slots], atol=1e-5, rtol=1e-5)
    outside = torch.ones(batch + 3, dtype=torch.bool)
    outside[slots] = False
    torch.testing.assert_close(ours[outside], pool[outside], atol=0, rtol=0, equal_nan=True)
    assert kernels.uses_cpu_kernel(pool)  # so the engine's gated_delta_step takes this kernel


@pytest.mark.parametrize("k_heads,heads,k_dim,v_dim", [(2, 4, 8, 8), (3, 3, 6, 10), (1, 4, 16, 8)])
def test_gated_deltanet_elementwise_kernels_are_their_torch_definitions(k_heads, heads, k_dim, v_dim, monkeypatch):
    """The C++ steps around the delta rule (the chain and the one-call decode both take them):
    q and k prepared from column blocks of the conv's output, the gates (softplus past its
    threshold of 20 included), and the per-head norm times silu(z) from z's blocks per key head."""
    from engine.kernels.gdn_scan import prepare_qk
    from engine.models.gated_deltanet import HeadGatedRMSNorm

    torch.manual_seed(heads + k_dim)
    key_dim = k_heads * k_dim
    conv = torch.randn(7, 2 * key_dim + heads * v_dim) * 3
    q, k = conv[:, :key_dim].view(7, k_heads, k_dim), conv[:, key_dim:2 * key_dim].view(7, k_heads, k_dim)
    got, want = cpu.prepare_qk_cpu(q, k, heads), prepare_qk(q, k, heads)
    for ours, ref in zip(got, want):
        assert ours.shape == (7, heads, k_dim)
        torch.testing.assert_close(ours, ref, atol=1e-6, rtol=1e-5)

    b, a = torch.randn(7, heads) * 4, torch.randn(7, heads) * 12  # some a + dt_bias past 20
    A_log, dt_bias = torch.randn(heads), torch.randn(heads) * 10
    beta, g = cpu.gdn_gates_cpu(b, a, -torch.exp(A_log), dt_bias)
    torch.testing.assert_close(beta, b.sigmoid(), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(g, -torch.exp(A_log) * torch.nn.functional.softplus(a + dt_bias), atol=1e-5, rtol=1e-5)
    assert ((a + dt_bias) > 20).any()

    norm = HeadGatedRMSNorm(v_dim, 1e-6)
    torch.nn.init.normal_(norm.weight)
    y = torch.randn(7, heads, v_dim)
    z = torch.randn(7, k_heads, 2 * (heads // k_heads) * v_dim)[..., :(heads // k_heads) * v_dim]  # blocks apart
    z = z.reshape(7, heads, v_dim) if k_heads == 1 else z.view(7, k_heads, -1).reshape(7, heads, v_dim)
    calls = record_calls(monkeypatch, cpu, "skip_norm_gate_cpu")
    with torch.no_grad():
        ours = norm(y, z)
        want = norm.weight * (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-6)) * torch.nn.functional.silu(z)
    assert len(calls) == 1  # the C++ norm, not the torch ops its result is compared with
    torch.testing.assert_close(ours, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("per_channel", [False, True], ids=["decay-per-head", "decay-per-key-channel"])
@pytest.mark.parametrize("length,k_heads,heads,k_dim,v_dim", [(1, 1, 1, 5, 7), (70, 2, 4, 16, 8), (130, 4, 8, 32, 32)])
def test_gated_delta_rule_prefill_matches_the_definition(monkeypatch, length, k_heads, heads, k_dim, v_dim,
                                                         per_channel):
    """The token-by-token CPU prefill, through the dispatcher, on strided views of one projection
    (the decay per head, or per key channel as Kimi Delta Attention's)."""
    from engine.kernels.gdn_scan import gated_delta_rule_ref

    torch.manual_seed(length + heads)
    qkv = torch.randn(length, 2 * k_heads * k_dim + heads * v_dim + 3)
    q = qkv[:, : k_heads * k_dim].view(length, k_heads, k_dim)
    k = qkv[:, k_heads * k_dim: 2 * k_heads * k_dim].view(length, k_heads, k_dim)
    v = qkv[:, 2 * k_heads * k_dim: -3].view(length, heads, v_dim)
    beta, h0 = torch.rand(length, heads), torch.randn(heads, k_dim, v_dim)
    g = -torch.rand(length, heads, k_dim) if per_channel else -torch.rand(length, heads)
    h0_before, calls = h0.clone(), record_calls(monkeypatch, cpu, "gated_delta_rule_cpu")
    o, S = kernels.chunk_gated_delta_rule(q, k, v, g, beta, h0, 64)
    o_ref, S_ref = gated_delta_rule_ref(q, k, v, g, beta, h0)
    assert [args[2].shape for args in calls] == [(length, heads, v_dim)]
    torch.testing.assert_close(o, o_ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(S, S_ref, atol=1e-4, rtol=1e-4)
    assert torch.equal(h0, h0_before)
    with pytest.raises(ValueError):
        cpu.gated_delta_rule_cpu(q, k, v, g[:-1], beta, h0)


@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", [(8, 4, 32, 16), (4, 1, 16, 5), (2, 2, 8, 3),
                                                                (4, 2, 64, 16), (2, 1, 80, 4), (4, 2, 12, 4)])
@pytest.mark.parametrize("window", [None, 7])
def test_paged_attention_decode(heads, kv_heads, head_dim, block_size, window):
    torch.manual_seed(heads * block_size + head_dim)
    context_lens = torch.tensor([1, 13, block_size, 40, 67])
    batch = context_lens.shape[0]
    width = -(-int(context_lens.max()) // block_size) + 1
    num_blocks = batch * width + 2
    k_cache = torch.full((num_blocks, block_size, kv_heads, head_dim), NAN)
    v_cache = torch.full((num_blocks, block_size, kv_heads, head_dim), NAN)
    tables = torch.zeros(batch, width, dtype=torch.long)
    free = torch.randperm(num_blocks - 1) + 1  # block 0 is the padding id and stays NaN
    for b, length in enumerate(context_lens.tolist()):
        first = 0 if window is None else max(0, length - window)
        for pos in range(length):
            block = free[b * width + pos // block_size]
            tables[b, pos // block_size] = block
            if pos >= first:  # positions before the window stay NaN: reading them shows
                k_cache[block, pos % block_size] = torch.randn(kv_heads, head_dim)
                v_cache[block, pos % block_size] = torch.randn(kv_heads, head_dim)
    q = torch.randn(batch, heads, head_dim)
    ours = cpu.paged_attention_decode_cpu(q, k_cache, v_cache, tables, context_lens, 0.3, window)
    ref = paged_attention_decode_ref(q, k_cache, v_cache, tables, context_lens, 0.3, window)
    assert not ours.isnan().any()
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)


def test_dispatch_picks_the_cpu_kernels(monkeypatch):
    t = torch.zeros(2)
    assert kernels.uses_cpu_kernel(t)
    assert not kernels.uses_cpu_kernel(t.bfloat16())  # bf16 pools take the reference
    monkeypatch.setenv("SPLITSERVE_DISABLE_CPU_KERNELS", "1")
    assert not kernels.uses_cpu_kernel(t)


def test_a_request_does_not_depend_on_its_batch_neighbours():
    """Every row's arithmetic is the same whatever else the call holds: bit-identical results."""
    torch.manual_seed(1)
    pool = torch.randn(6, 32, 8)
    x, dt = torch.randn(4, 32), torch.rand(4, 32)
    A, B, C = -torch.rand(32, 8), torch.randn(4, 8), torch.randn(4, 8)
    together = pool.clone()
    y_all = cpu.selective_state_update_cpu(together, torch.tensor([0, 1, 2, 3]), x, dt, A, B, C)
    alone = pool.clone()
    y_one = cpu.selective_state_update_cpu(alone, torch.tensor([2]), x[2:3], dt[2:3], A, B[2:3], C[2:3])
    assert torch.equal(y_all[2], y_one[0]) and torch.equal(together[2], alone[2])

    k_cache, v_cache = torch.randn(20, 4, 2, 16), torch.randn(20, 4, 2, 16)
    tables, lens, q = torch.randperm(20)[:16].view(4, 4), torch.tensor([3, 16, 9, 12]), torch.randn(4, 4, 16)
    batch = cpu.paged_attention_decode_cpu(q, k_cache, v_cache, tables, lens, 0.25)
    one = cpu.paged_attention_decode_cpu(q[2:3], k_cache, v_cache, tables[2:3], lens[2:3], 0.25)
    assert torch.equal(batch[2], one[0])


def test_the_kernels_build_here():
    """CI machines have a C++ compiler: a build that fails must fail the suite, not quietly
    turn every CPU kernel test into a test of the fallback."""
    assert cpu.available()


def test_launches_from_several_threads_at_once():
    """Engines in one process may run on different threads, each launching its own OpenMP team."""
    import threading

    torch.manual_seed(2)
    pool = torch.randn(8, 64, 16)
    x, dt = torch.randn(8, 64), torch.rand(8, 64)
    A, B, C = -torch.rand(64, 16), torch.randn(8, 16), torch.randn(8, 16)
    expected = selective_state_update_ref(pool.clone(), torch.arange(8), x, dt, A, B, C)
    results, errors = [], []

    def work():
        try:
            for _ in range(50):
                results.append(cpu.selective_state_update_cpu(pool.clone(), torch.arange(8), x, dt, A, B, C))
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(results) == 150
    for y in results:
        torch.testing.assert_close(y, expected, atol=1e-5, rtol=1e-5)


def test_paged_attention_decode_softmax_finds_the_largest_score_anywhere():
    """As for prefill: one key scores 1000 above the rest, at each of 37 positions in turn, and
    the output is that key's value, not NaN."""
    torch.manual_seed(6)
    context, block_size, head_dim = 37, 8, 16
    blocks = -(-context // block_size)
    tables = torch.arange(1, blocks + 1)[None]
    v_cache = torch.randn(blocks + 1, block_size, 1, head_dim)
    q = torch.zeros(1, 1, head_dim)
    q[0, 0, 0] = 100.0
    for j in range(context):
        k_cache = torch.zeros(blocks + 1, block_size, 1, head_dim)
        k_cache[1 + j // block_size, j % block_size, 0, 0] = 10.0
        out = cpu.paged_attention_decode_cpu(q, k_cache, v_cache, tables, torch.tensor([context]), 1.0)
        assert torch.equal(out[0], v_cache[1 + j // block_size, j % block_size])


def test_a_failed_build_falls_back_to_the_references(monkeypatch, tmp_path):
    """No working compiler: the library is None (logged), dispatch takes the torch ops."""
    from engine.kernels import native

    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("SPLITSERVE_KERNEL_CACHE", str(tmp_path / "cache"))
    native.library.cache_clear()
    try:
        assert native.library() is None
        assert not kernels.uses_cpu_kernel(torch.zeros(2))
    finally:
        monkeypatch.undo()
        native.library.cache_clear()
    assert native.available()


@pytest.mark.parametrize("length,heads,head_dim,groups,d_state", [
    (1, 1, 1, 1, 1), (70, 4, 8, 2, 6), (37, 6, 20, 3, 16), (50, 2, 64, 1, 128)])
def test_ssd_scan_matches_the_definition_on_projection_views(monkeypatch, length, heads, head_dim, groups, d_state):
    """The Mamba2 prefill scan against the token-by-token definition, reading x, B and C as
    column blocks of one projection (as the model hands them over), through the dispatcher."""
    from engine.kernels.ssd_scan import ssd_scan_ref

    torch.manual_seed(length + heads + d_state)
    width = heads * head_dim + 2 * groups * d_state
    xbc = torch.randn(length, width + 5)
    x = xbc[:, : heads * head_dim].view(length, heads, head_dim)
    B = xbc[:, heads * head_dim: heads * head_dim + groups * d_state].view(length, groups, d_state)
    C = xbc[:, heads * head_dim + groups * d_state: width].view(length, groups, d_state)
    dt, A, h0 = torch.rand(length, heads) * 0.3, -torch.rand(heads) * 2, torch.randn(heads, head_dim, d_state)
    h0_before, calls = h0.clone(), record_calls(monkeypatch, cpu, "ssd_scan_cpu")
    y, h = kernels.ssd_chunk_scan(x, dt, A, B, C, h0, 32)
    y_ref, h_ref = ssd_scan_ref(x, dt, A, B, C, h0)
    assert [args[0].shape for args in calls] == [(length, heads, head_dim)]
    torch.testing.assert_close(y, y_ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(h, h_ref, atol=1e-4, rtol=1e-4)
    assert torch.equal(h0, h0_before)  # the caller's state is not written
    with pytest.raises(ValueError, match="shape"):
        cpu.ssd_scan_cpu(x, dt[:-1], A, B, C, h0)


@pytest.mark.parametrize("activation", [None, "silu"])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("channels,width,batch", [(64, 4, 5), (7, 2, 1)])
def test_conv_update(activation, with_bias, channels, width, batch):
    from engine.kernels.conv_update import causal_conv1d_update_ref

    torch.manual_seed(channels + width + batch)
    pool = torch.randn(batch + 3, channels, width)
    slots = torch.randperm(batch + 3)[:batch]
    x, weight = torch.randn(batch, channels), torch.randn(channels, width)
    bias = torch.randn(channels) if with_bias else None
    ours, ref = pool.clone(), pool.clone()
    y = cpu.causal_conv1d_update_cpu(ours, slots, x, weight, bias, activation)
    y_ref = causal_conv1d_update_ref(ref, slots, x, weight, bias, activation)
    torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(ours, ref)  # the state only shifts: bit for bit
    _outside_unchanged(ours, pool, slots)
    assert kernels.uses_cpu_kernel(pool)
    # x a column block of a wider projection, read in place; the result written into `out`
    wide = torch.randn(batch, 2 * channels)
    wide[:, channels:] = x
    again, out = pool.clone(), torch.empty(batch, channels)
    assert cpu.causal_conv1d_update_cpu(again, slots, wide[:, channels:], weight, bias, activation, out=out) is out
    assert torch.equal(out, y) and torch.equal(again, ours)
    # a bfloat16 x (a bf16 model over a float32 pool) gets its result back in bfloat16
    assert cpu.causal_conv1d_update_cpu(pool.clone(), slots, x.bfloat16(), weight, bias, activation).dtype == torch.bfloat16
