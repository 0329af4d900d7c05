"""The C++ elementwise epilogues (RMSNorm with the residual add, SwiGLU's product, rotary) against
the torch code they replace, both as kernels and through the layers that dispatch to them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.kernels import cpu
from engine.models.layers import GatedMLP, GatedRMSNorm, RMSNorm, RotaryEmbedding, SparseMoE, _rotate

pytestmark = pytest.mark.skipif(not cpu.available(), reason="no C++ compiler here")


def _reference_norm(x, weight, eps):
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


@pytest.mark.parametrize("shape", [(1, 8), (5, 256), (300, 200), (3, 4, 32)])
def test_rms_norm(shape):
    torch.manual_seed(sum(shape))
    x, weight = torch.randn(*shape) * 3, torch.randn(shape[-1])
    before = x.clone()
    out = cpu.rms_norm_cpu(x, weight, 1e-6)
    torch.testing.assert_close(out, _reference_norm(x, weight, 1e-6), atol=1e-5, rtol=1e-5)
    assert torch.equal(x, before), "the norm without `add` wrote into its input"


@pytest.mark.parametrize("rows,cols", [(1, 8), (64, 256), (300, 200)])
def test_rms_norm_with_the_residual_add(rows, cols):
    torch.manual_seed(rows)
    x, residual, weight = torch.randn(rows, cols), torch.randn(rows, cols), torch.randn(cols)
    residual_before = residual.clone()
    expected_sum = residual + x
    out = cpu.rms_norm_cpu(x, weight, 1e-5, add=residual)
    assert torch.equal(x, expected_sum), "the sum must be exactly residual + x"
    assert torch.equal(residual, residual_before)
    torch.testing.assert_close(out, _reference_norm(expected_sum, weight, 1e-5), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="differs"):
        cpu.rms_norm_cpu(x, weight, 1e-5, add=residual[:, 1:])
    # A column block of a wider projection (Jamba's dt/B/C norms), read in place.
    wide = torch.randn(rows, cols + 7)
    block = wide[:, 3:3 + cols]
    torch.testing.assert_close(cpu.rms_norm_cpu(block, weight, 1e-5), _reference_norm(block, weight, 1e-5),
                               atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="contiguous rows"):
        cpu.rms_norm_cpu(torch.randn(rows, 2 * cols)[:, ::2], weight, 1e-5)


@pytest.mark.parametrize("rows,cols", [(1, 3), (64, 768), (129, 100)])
def test_silu_mul_on_two_tensors_and_on_the_halves_of_one(rows, cols):
    torch.manual_seed(cols)
    gate_up = torch.randn(rows, 2 * cols) * 4
    gate, up = gate_up.chunk(2, dim=-1)
    expected = F.silu(gate) * up
    torch.testing.assert_close(cpu.silu_mul_cpu(gate, up), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(cpu.silu_mul_cpu(gate.contiguous(), up.contiguous()), expected,
                               atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="stride"):
        cpu.silu_mul_cpu(gate, torch.randn(rows, cols + 1)[:, :cols])  # another row stride


@pytest.mark.parametrize("heads,head_dim,rotary_dim", [(8, 32, 32), (3, 16, 8), (1, 10, 10)])
def test_rotary_in_place(heads, head_dim, rotary_dim):
    torch.manual_seed(heads * head_dim)
    tokens = 7
    x = torch.randn(tokens, heads, head_dim)
    angles = torch.rand(tokens, rotary_dim // 2) * 50
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    expected = _rotate(x, cos[:, None, :], sin[:, None, :], rotary_dim)
    out = cpu.rotary_cpu(x, cos, sin)
    assert out is x
    torch.testing.assert_close(x, expected, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="tables"):
        cpu.rotary_cpu(x, cos[:-1], sin[:-1])
    # A column block of a wider projection (q of a fused q/k/v): rotated in place, neighbours untouched.
    fused = torch.randn(tokens, heads * head_dim + 5)
    block = fused[:, : heads * head_dim].view(tokens, heads, head_dim)
    expected, tail = _rotate(block, cos[:, None, :], sin[:, None, :], rotary_dim), fused[:, -5:].clone()
    cpu.rotary_cpu(block, cos, sin)
    torch.testing.assert_close(block, expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(fused[:, -5:], tail)
    with pytest.raises(ValueError, match="heads contiguous"):
        cpu.rotary_cpu(torch.randn(tokens, head_dim, heads).transpose(1, 2), cos, sin)


def _with_and_without_kernels(monkeypatch, run):
    ours = run()
    monkeypatch.setenv("SPLITSERVE_DISABLE_CPU_KERNELS", "1")
    reference = run()
    monkeypatch.delenv("SPLITSERVE_DISABLE_CPU_KERNELS")
    return ours, reference


def test_layers_take_the_kernels_and_agree_with_their_torch_paths(monkeypatch):
    torch.manual_seed(0)
    norm = RMSNorm(64, 1e-6)
    norm.weight.data = torch.randn(64)
    x, residual = torch.randn(9, 64), torch.randn(9, 64)
    calls = []
    for name in ("rms_norm_cpu", "silu_mul_cpu", "rotary_cpu"):
        original = getattr(cpu, name)
        monkeypatch.setattr(cpu, name, lambda *a, _f=original, _n=name, **k: calls.append(_n) or _f(*a, **k))

    ours, ref = _with_and_without_kernels(monkeypatch, lambda: norm(x))
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)
    (h, normed), (h_ref, normed_ref) = _with_and_without_kernels(
        monkeypatch, lambda: norm.add_and_norm(x.clone(), residual))
    assert torch.equal(h, h_ref)
    torch.testing.assert_close(normed, normed_ref, atol=1e-5, rtol=1e-5)

    mlp = GatedMLP(64, 96, "silu")
    moe = SparseMoE(64, 48, num_experts=4, top_k=2, act="silu", normalize_top_k=True)
    for p in moe.parameters():
        p.data = torch.randn_like(p) * 0.2
    for module in (mlp, moe):
        ours, ref = _with_and_without_kernels(monkeypatch, lambda: module(x))
        torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)

    rotary = RotaryEmbedding(16, 16, 10000.0, None, 4096)
    q, k = torch.randn(9, 4, 16), torch.randn(9, 2, 16)
    positions = torch.arange(100, 109)
    ours, ref = _with_and_without_kernels(monkeypatch, lambda: rotary(positions, q.clone(), k.clone()))
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert calls.count("rms_norm_cpu") == 2 and "silu_mul_cpu" in calls and calls.count("rotary_cpu") == 2


@pytest.mark.parametrize("group_size", [48, 16])
def test_gated_norm_of_a_gated_input_equals_the_norm_with_its_gate(group_size):
    """Mamba2's fused CPU epilogue gates first (gated_skip) and then normalises alone."""
    torch.manual_seed(group_size)
    norm = GatedRMSNorm(48, group_size, 1e-5)
    norm.weight.data = torch.randn(48)
    y, z = torch.randn(7, 48), torch.randn(7, 48)
    gated = cpu.gated_skip_cpu(y.clone(), torch.zeros(7, 48), torch.zeros(48), z)
    torch.testing.assert_close(norm.normalise_gated(gated), norm(y, z), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rotary_dim, scaling", [(8, None), (24, {"rope_type": "linear", "factor": 2.0})])
def test_rotary_tables_are_rows_of_the_formula_grown_as_positions_grow(rotary_dim, scaling):
    """On the CPU, cos and sin come from tables of positions 0..n-1; any position's rows equal
    the formula's values for that position alone, whatever batch it is in, past the first
    size of the tables too."""
    rotary = RotaryEmbedding(rotary_dim, rotary_dim, 10000.0, scaling, 4096)

    def formula(positions):
        emb = positions.float()[:, None] * rotary.inv_freq[None, :]
        emb = torch.cat((emb, emb), dim=-1)
        return emb.cos() * rotary.attention_scaling, emb.sin() * rotary.attention_scaling

    for positions in (torch.tensor([3, 4, 5]), torch.tensor([40, 3]), torch.tensor([255, 256, 1000]),
                      torch.tensor([7]), torch.arange(0, 3000, 7)):
        cos, sin = rotary._tables(positions, torch.float32)
        for row, position in enumerate(positions.tolist()):
            alone_cos, alone_sin = formula(torch.tensor([position]))
            torch.testing.assert_close(cos[row:row + 1], alone_cos, atol=1e-6, rtol=0)
            torch.testing.assert_close(sin[row:row + 1], alone_sin, atol=1e-6, rtol=0)
    assert rotary._cpu_tables[torch.float32][0].shape[0] >= 2994
    cos, _ = rotary._tables(torch.tensor([5, 3]), torch.float32)
    assert torch.equal(cos, rotary._tables(torch.tensor([5, 3, 9]), torch.float32)[0][:2])  # batch-independent


def test_gated_skip_and_bias_softplus():
    torch.manual_seed(1)
    projected = torch.randn(33, 80) * 3
    x, z = torch.randn(33, 40), projected[:, 40:]
    y, D = torch.randn(33, 40), torch.randn(40)
    expected = (y + x * D) * F.silu(z)
    assert cpu.gated_skip_cpu(y, x, D, z) is y
    torch.testing.assert_close(y, expected, atol=1e-5, rtol=1e-5)
    dt, bias = torch.randn(17, 40) * 15, torch.randn(40) * 10  # both sides of the threshold at 20
    expected = F.softplus(dt + bias)
    torch.testing.assert_close(cpu.bias_softplus_cpu(dt.clone(), bias), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(cpu.bias_softplus_cpu(dt.clone(), None), F.softplus(dt), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="gated_skip"):
        cpu.gated_skip_cpu(y.t(), x.t(), D, z.t())


@pytest.mark.parametrize("fresh", [False, True])
@pytest.mark.parametrize("silu", [False, True])
@pytest.mark.parametrize("length,channels,width", [(1, 5, 4), (3, 20, 4), (40, 37, 2), (9, 16, 1)])
def test_causal_conv_prefill_matches_varlen_conv(fresh, silu, length, channels, width):
    """Against the torch path of engine.models.ssm.varlen_causal_conv, on a view of a wider
    projection, from a NaN-poisoned slot when fresh (it must read zeros, not the slot)."""
    from engine.models.batch import StateSpans
    from engine.models.ssm import varlen_causal_conv
    from engine.phase import Phase

    class OneRow:
        prefill_rows, decode_rows, query_starts, state_slots = [0], [], [0, length], [1]
        phases = [Phase.FRESH_PREFILL if fresh else Phase.CONTINUED_PREFILL]
        state_captures = ()

    OneRow.state_spans = StateSpans(OneRow)

    torch.manual_seed(length * channels + width)
    x = torch.randn(length, channels + 3)[:, 1:channels + 1]
    weight, bias = torch.randn(channels, width), torch.randn(channels)
    pool = torch.randn(3, channels, width)
    if fresh:
        pool[1] = float("nan")
    ours_pool, ref_pool = pool.clone(), pool.clone()
    out = torch.full((length, channels), float("nan"))
    cpu.causal_conv_prefill_cpu(x, ours_pool[1], weight, bias, fresh, silu, out)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPLITSERVE_DISABLE_CPU_KERNELS", "1")
        expected = varlen_causal_conv(x, OneRow, ref_pool, weight, bias, silu=silu)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours_pool, ref_pool, atol=0, rtol=0, equal_nan=True)


@pytest.mark.parametrize("n,context,heads,kv_heads,head_dim,window", [
    (1, 1, 2, 1, 8, None), (37, 37, 8, 4, 32, None), (5, 40, 4, 2, 16, None), (33, 33, 2, 2, 24, 7),
    (9, 50, 4, 1, 8, 12), (70, 70, 3, 3, 64, None), (20, 130, 4, 2, 80, 40), (130, 130, 2, 1, 48, None)])
def test_prefill_attention_matches_sdpa(n, context, heads, kv_heads, head_dim, window):
    """Against SDPA with an explicit mask (whole prompts, chunks continuing a context, sliding
    windows, GQA), on strided views as a fused q/k/v projection gives them."""
    torch.manual_seed(n + context + head_dim)
    fused = torch.randn(context, (heads + 2 * kv_heads) * head_dim + 3)
    q = fused[-n:, : heads * head_dim].view(n, heads, head_dim)
    k = fused[:, heads * head_dim: (heads + kv_heads) * head_dim].view(context, kv_heads, head_dim)
    v = fused[:, (heads + kv_heads) * head_dim: -3].view(context, kv_heads, head_dim)
    scale = head_dim ** -0.5
    ours = cpu.prefill_attention_cpu(q, k, v, scale, window)
    q_pos, k_pos = torch.arange(context - n, context)[:, None], torch.arange(context)[None, :]
    mask = k_pos <= q_pos
    if window is not None:
        mask &= k_pos > q_pos - window
    expected = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], attn_mask=mask,
        scale=scale, enable_gqa=heads != kv_heads)[0].transpose(0, 1)
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="prefill_attention"):
        cpu.prefill_attention_cpu(q, k[:, :1].expand(-1, 3, -1), v, scale)


def test_prefill_attention_softmax_finds_the_largest_score_anywhere():
    """One key scores 1000 above the rest, at each position in turn (37 keys: two full vectors of
    16 and a remainder): the softmax must subtract that score, or exp overflows to inf and NaN; the
    last query then returns that key's value."""
    torch.manual_seed(5)
    context, head_dim = 37, 16
    v = torch.randn(context, 1, head_dim)
    for j in range(context):
        q = torch.zeros(context, 1, head_dim)
        k = torch.zeros(context, 1, head_dim)
        q[-1, 0, 0], k[j, 0, 0] = 100.0, 10.0
        out = cpu.prefill_attention_cpu(q, k, v, 1.0)
        assert not out.isnan().any() and torch.equal(out[-1], v[j])


@pytest.mark.parametrize("tokens,top_k,hidden", [(1, 1, 8), (9, 2, 64), (50, 3, 40)])
def test_moe_combine(tokens, top_k, hidden):
    torch.manual_seed(tokens * top_k)
    picks, weights = torch.randn(tokens * top_k, hidden), torch.rand(tokens, top_k)
    position = torch.randperm(tokens * top_k)
    expected = (picks[position].view(tokens, top_k, hidden) * weights[:, :, None]).sum(dim=1)
    torch.testing.assert_close(cpu.moe_combine_cpu(picks, position, weights), expected, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="moe_combine"):
        cpu.moe_combine_cpu(picks[1:], position, weights)


@pytest.mark.parametrize("rows,widths", [(1, (16, 16, 16)), (64, (16, 16, 16)), (9, (5, 33, 7))])
def test_rms_norm_3_is_three_norms_of_column_blocks(rows, widths):
    """Jamba's dt, B and C norms over one x_proj output (a strided view of it here)."""
    from engine.models.layers import RMSNorm

    torch.manual_seed(rows + sum(widths))
    full = torch.randn(rows, sum(widths) + 3)
    x = full[:, : sum(widths)]
    norms = [RMSNorm(n, 1e-6) for n in widths]
    for norm in norms:
        norm.weight.data.uniform_(0.5, 1.5)
    blocks = torch.split(x, list(widths), dim=-1)
    expected = [cpu.rms_norm_cpu(b.contiguous(), n.weight, 1e-6) for b, n in zip(blocks, norms)]
    for ours, want in zip(cpu.rms_norm_3_cpu(x, [n.weight for n in norms], 1e-6), expected):
        assert ours.is_contiguous()
        torch.testing.assert_close(ours, want, atol=1e-6, rtol=1e-6)
    with pytest.raises(ValueError, match="rms_norm_3"):
        cpu.rms_norm_3_cpu(x[:, :-1], [n.weight for n in norms], 1e-6)


@pytest.mark.parametrize("tokens,top_k,num_experts", [(1, 1, 4), (64, 2, 4), (37, 3, 16), (5, 2, 64)])
def test_moe_group_is_a_stable_sort_by_expert(tokens, top_k, num_experts):
    """What dispatch_experts took from argsort, bincount and an inverse permutation."""
    torch.manual_seed(tokens + num_experts)
    experts = torch.stack([torch.randperm(num_experts)[:top_k] for _ in range(tokens)])
    counts, token_of_row, position = cpu.moe_group_cpu(experts, num_experts)
    order = torch.argsort(experts.flatten(), stable=True)
    assert counts == torch.bincount(experts.flatten(), minlength=num_experts).tolist()
    assert torch.equal(token_of_row, order // top_k)
    assert torch.equal(order[position], torch.arange(tokens * top_k))
    with pytest.raises(ValueError, match="moe_group: expert ids outside"):
        cpu.moe_group_cpu(experts + num_experts, num_experts)


@pytest.mark.parametrize("tokens,top_k,num_experts,normalize", [(1, 1, 4, False), (64, 2, 4, False),
                                                             (37, 3, 16, True), (5, 8, 64, True)])
def test_moe_route_is_softmax_topk(tokens, top_k, num_experts, normalize):
    """The router's softmax, top-k and renormalisation in one pass: torch's experts in torch's
    order, their weights to float rounding; among equal logits the first expert comes first."""
    torch.manual_seed(tokens + num_experts)
    logits = torch.randn(tokens, num_experts) * 3
    weights, experts = torch.topk(torch.softmax(logits, dim=-1), top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(-1, keepdim=True)
    ids, ours = cpu.moe_route_cpu(logits, top_k, normalize)
    assert torch.equal(ids, experts)
    torch.testing.assert_close(ours, weights, atol=1e-6, rtol=1e-5)
    tied, _ = cpu.moe_route_cpu(torch.tensor([[0.5, 2.0, 2.0, 2.0]]), 2, normalize)
    assert tied.tolist() == [[1, 2]]
    with pytest.raises(ValueError, match="moe_route: top_k"):
        cpu.moe_route_cpu(logits, num_experts + 1, normalize)


def test_tensors_passed_as_they_are_must_be_float32():
    """Kernels that write in place or read through strides get no conversion: another dtype
    would be misread as float32 memory, so it is refused by name."""
    x = torch.randn(4, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match="silu_mul: needs float32"):
        cpu.silu_mul_cpu(x, x)
    with pytest.raises(ValueError, match="rms_norm: needs float32"):
        cpu.rms_norm_cpu(x.bfloat16(), torch.ones(8), 1e-6)
    with pytest.raises(ValueError, match="bias_softplus: needs float32"):
        cpu.bias_softplus_cpu(x, None)


@pytest.mark.parametrize("rows,cols", [(1, 1), (5, 7), (64, 8192), (3, 1001)])
def test_row_argmax_is_torch_argmax(rows, cols):
    """The greedy sampler's argmax, on random rows, rows of small integers (ties: the first one),
    and rows with -inf (grammar masks), +inf, NaN (torch ranks it above all) and -0.0 beside 0.0."""
    torch.manual_seed(rows * cols)
    cases = [torch.randn(rows, cols), torch.randint(-3, 3, (rows, cols)).float()]
    special = torch.randint(-2, 2, (rows, cols)).float()
    special[special == -2] = float("-inf")
    special[special == 1] = -0.0
    special[:, ::5] = float("nan") if cols > 3 else special[:, ::5]
    cases += [special, torch.full((rows, cols), float("-inf")), torch.where(special.isnan(), float("inf"), special)]
    for x in cases:
        assert torch.equal(cpu.row_argmax_cpu(x), x.argmax(dim=-1))
    edge = torch.tensor([[-0.0, 0.0, -1.0], [-1e-45, -0.0, -3.0], [-float("nan"), 1.0, 2.0],
                         [1.0, float("inf"), float("inf")]])
    assert cpu.row_argmax_cpu(edge).tolist() == edge.argmax(dim=-1).tolist() == [0, 1, 0, 1]


def test_row_argmax_finds_the_first_maximum_or_nan_past_the_first_chunks():
    """The kernel keeps each 512-column chunk's maximum and rescans one chunk: the answer must be
    the first chunk holding the maximum, or the chunk of the first NaN, wherever they lie."""
    x = torch.randn(5, 2000)
    x[0, 1500] = 100.0  # the maximum in the third chunk
    x[1, 10], x[1, 700], x[1, 1900] = 100.0, float("nan"), float("nan")  # a NaN after a larger value
    x[2, 600], x[2, 1800] = 50.0, 50.0  # a tie across chunks: the first
    x[3, 1999] = float("nan")  # the last column
    x[4, 511], x[4, 512] = 7.0, 7.0  # a tie across a chunk boundary
    assert cpu.row_argmax_cpu(x).tolist() == x.argmax(dim=-1).tolist() == [1500, 700, 600, 1999, 511]
