"""fla's chunked gated delta rule as the CUDA prefill of Gated DeltaNet and Kimi Delta Attention
(engine.kernels.fla_rule).

fla's chunked kernels do not run under Triton's interpreter, so on CPU a stand-in takes their
place: it checks each call as fla documents its arguments (layouts, dtypes, the initial state,
the scale and the in-kernel L2 norm) and computes the rule's definition; whole engines of the
three families with this layer kind run through it, judged by transformers. On a GPU with fla
installed, the kernels themselves are held to the definition.
"""

from __future__ import annotations

import random

import pytest
import torch

from engine import LLM, SamplingParams
from engine.kernels import fla_rule
from engine.kernels.gdn_scan import gated_delta_rule_ref
from tests.oracle import judge_greedy


def stand_in(name: str, calls: list):
    def kernel(q, k, v, g, beta, *, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
               cu_seqlens=None):
        _, length, k_heads, k_dim = q.shape
        heads, v_dim = v.shape[2:]
        assert q.shape == k.shape and q.is_contiguous() and k.is_contiguous() and v.shape[:2] == (1, length)
        assert heads % k_heads == 0
        assert g.dtype == torch.float32 and g.shape == ((1, length, heads, k_dim) if name == "kda" else (1, length, heads))
        assert beta.shape == (1, length, heads) and beta.dtype == v.dtype
        bounds = [0, length] if cu_seqlens is None else cu_seqlens.tolist()
        if cu_seqlens is not None:  # fla's varlen form: int64 offsets on q's device, from 0 to every token
            assert cu_seqlens.dtype == torch.long and cu_seqlens.device == q.device
            assert bounds[0] == 0 and bounds[-1] == length and all(a < b for a, b in zip(bounds, bounds[1:]))
        sequences = len(bounds) - 1
        assert initial_state.dtype == torch.float32 and initial_state.shape == (sequences, heads, k_dim, v_dim)
        assert scale == k_dim ** -0.5 and output_final_state and use_qk_l2norm_in_kernel
        calls.append((name, sequences))
        outs, states = [], []
        for n, (start, end) in enumerate(zip(bounds, bounds[1:])):
            o, state = gated_delta_rule_ref(q[0, start:end], k[0, start:end], v[0, start:end], g[0, start:end],
                                            beta[0, start:end].float(), initial_state[n])
            outs.append(o)
            states.append(state)
        return torch.cat(outs).to(v.dtype)[None], torch.stack(states)
    return kernel


@pytest.mark.parametrize("name", ["qwen3_next", "olmo_hybrid", "kimi_linear"])
def test_engines_through_fla_match_transformers(model_factory, monkeypatch, name):
    path, hf = model_factory(name)
    calls: list[str] = []
    monkeypatch.setattr(fla_rule, "_kernels", (stand_in("gated_delta_rule", calls), stand_in("kda", calls)))
    monkeypatch.setattr(fla_rule, "available", lambda v: True)
    llm = LLM(path, block_size=4, max_num_batched_tokens=16)  # chunked: later pieces start from the slot
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 300) for _ in range(n)] for n in (1, 7, 40)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        judge_greedy(hf, prompt, out.token_ids)
    assert {kernel for kernel, _ in calls} == {"kda" if name == "kimi_linear" else "gated_delta_rule"}
    # One call per layer per step for all its prefill rows: the first step holds all three prompts'
    # first pieces, later ones the rest of the 40-token prompt from its slot.
    assert max(sequences for _, sequences in calls) == 3
    assert sum(sequences for _, sequences in calls) >= 2 * 3


def test_a_shape_fla_refuses_falls_back_to_the_reference_once(model_factory, monkeypatch):
    path, hf = model_factory("qwen3_next")
    tries = []

    def refuses(*args, **kwargs):
        tries.append(1)
        raise AssertionError("K must be at most 256")
    monkeypatch.setattr(fla_rule, "_kernels", (refuses, refuses))
    monkeypatch.setattr(fla_rule, "_refused", {})
    monkeypatch.setattr(fla_rule, "available", lambda v: True)
    prompt = [4, 9, 16, 25, 36]
    out = LLM(path, block_size=4).generate([prompt], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))[0]
    judge_greedy(hf, prompt, out.token_ids)
    # the one-call form, then the per-row one: each tried once, then the reference serves both
    assert len(tries) == 2 and sorted(key[-1] for key in fla_rule._refused) == [False, True]


def test_a_varlen_refusal_falls_back_to_fla_per_row(model_factory, monkeypatch):
    path, hf = model_factory("qwen3_next")
    calls: list = []
    per_row = stand_in("gated_delta_rule", calls)

    def no_varlen(*args, cu_seqlens=None, **kwargs):
        if cu_seqlens is not None:
            raise TypeError("unexpected keyword argument 'cu_seqlens'")  # an fla without varlen
        return per_row(*args, **kwargs)
    monkeypatch.setattr(fla_rule, "_kernels", (no_varlen, no_varlen))
    monkeypatch.setattr(fla_rule, "_refused", {})
    monkeypatch.setattr(fla_rule, "available", lambda v: True)
    prompts = [[4, 9, 16, 25, 36], [7, 8]]
    outs = LLM(path, block_size=4).generate(prompts, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        judge_greedy(hf, prompt, out.token_ids)
    assert calls and all(sequences == 1 for _, sequences in calls)
    assert [key[-1] for key in fla_rule._refused] == [True]


def test_without_fla_the_own_paths_run(monkeypatch):
    monkeypatch.setattr(fla_rule, "_kernels", False)
    assert not fla_rule.available(torch.zeros(1))
    monkeypatch.setattr(fla_rule, "_kernels", (None, None))
    assert not fla_rule.available(torch.zeros(1))  # a CPU tensor: never fla
    monkeypatch.setenv("SPLITSERVE_DISABLE_FLA", "1")
    if torch.cuda.is_available():
        assert not fla_rule.available(torch.zeros(1, device="cuda"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("per_channel", [False, True], ids=["gated-deltanet", "kda"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("length,k_heads,heads,k_dim,v_dim", [(300, 16, 32, 128, 128), (1, 2, 4, 64, 64),
                                                              (130, 4, 4, 128, 128)])
def test_fla_matches_the_definition_on_cuda(per_channel, dtype, length, k_heads, heads, k_dim, v_dim):
    if not fla_rule.available(torch.zeros(1, device="cuda")):
        pytest.skip("fla is not installed")
    torch.manual_seed(length + heads)
    q, k = (torch.randn(length, k_heads, k_dim, device="cuda", dtype=dtype) for _ in range(2))
    v = torch.randn(length, heads, v_dim, device="cuda", dtype=dtype)
    g = -torch.rand(length, heads, *((k_dim,) if per_channel else ()), device="cuda")
    beta = torch.rand(length, heads, device="cuda").to(dtype).float()
    h0 = torch.randn(heads, k_dim, v_dim, device="cuda")
    got_o, got_h = fla_rule.chunk_rule(q, k, v, g, beta, h0)
    want_o, want_h = gated_delta_rule_ref(q, k, v, g, beta, h0)
    tol = dict(atol=2e-3, rtol=2e-3) if dtype == torch.float32 else dict(atol=5e-2, rtol=5e-2)
    torch.testing.assert_close(got_o, want_o, **tol)
    torch.testing.assert_close(got_h, want_h, **tol)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("per_channel", [False, True], ids=["gated-deltanet", "kda"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fla_varlen_matches_the_definition_per_sequence_on_cuda(per_channel, dtype):
    if not fla_rule.available(torch.zeros(1, device="cuda")):
        pytest.skip("fla is not installed")
    torch.manual_seed(7)
    lengths, k_heads, heads, k_dim, v_dim = [1, 300, 64, 17], 4, 8, 128, 128
    total = sum(lengths)
    q, k = (torch.randn(total, k_heads, k_dim, device="cuda", dtype=dtype) for _ in range(2))
    v = torch.randn(total, heads, v_dim, device="cuda", dtype=dtype)
    g = -torch.rand(total, heads, *((k_dim,) if per_channel else ()), device="cuda")
    beta = torch.rand(total, heads, device="cuda").to(dtype).float()
    h0 = torch.randn(len(lengths), heads, k_dim, v_dim, device="cuda")
    h0[0] = 0  # a fresh prefill beside continued ones
    cu = torch.tensor([0, *lengths], device="cuda").cumsum(0)
    got_o, got_h = fla_rule.chunk_rule_varlen(q, k, v, g, beta, h0, cu)
    tol = dict(atol=2e-3, rtol=2e-3) if dtype == torch.float32 else dict(atol=5e-2, rtol=5e-2)
    for n, (start, end) in enumerate(zip(cu.tolist(), cu.tolist()[1:])):
        want_o, want_h = gated_delta_rule_ref(q[start:end], k[start:end], v[start:end], g[start:end],
                                              beta[start:end], h0[n])
        torch.testing.assert_close(got_o[start:end], want_o, **tol)
        torch.testing.assert_close(got_h[n], want_h, **tol)
