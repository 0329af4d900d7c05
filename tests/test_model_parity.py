"""Our forward against transformers' on the same checkpoint: logits and greedy generation."""

from __future__ import annotations

import random

import pytest
import torch

from engine import LLM, SamplingParams
from engine.cache import ModelCache, plan_cache
from engine.models import ForwardBatch, load_model
from engine.phase import Phase
from tests.conftest import record_calls
from tests.oracle import CONFIGS, LOGIT_ATOL, hf_logits, judge_greedy

ALL_CONFIGS = sorted(CONFIGS)


def our_prompt_logits(model, ids: list[int], block_size: int = 8) -> torch.Tensor:
    """Logits at every position of a fresh prefill of `ids`, through the paged cache."""
    spec = model.spec
    blocks_needed = -(-len(ids) // block_size)
    sizes = plan_cache(spec, torch.float32, block_size, 2, len(ids) + 1, 1 << 28, blocks_needed + 3)
    cache = ModelCache(spec, sizes, block_size, torch.float32, "cpu")
    table = list(range(blocks_needed + 2, 1, -1))[:blocks_needed]  # deliberately non-contiguous
    n = len(ids)
    batch = ForwardBatch(
        input_ids=torch.tensor(ids), positions=torch.arange(n), query_starts=[0, n],
        context_lens=[n], phases=[Phase.FRESH_PREFILL], state_slots=[1],
        block_tables=torch.tensor([table]),
        kv_write_index=torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(n)]),
        block_size=block_size, logits_indices=torch.arange(n),
    )
    with torch.inference_mode():
        return model(batch, cache.layers)


@pytest.mark.parametrize("name", ALL_CONFIGS)
def test_prompt_logits_match_transformers(name, model_factory):
    path, hf = model_factory(name)
    ours = load_model(path)
    rng = random.Random(name)
    for length in (1, 5, 64, 200):
        ids = [rng.randrange(ours.spec.vocab_size) for _ in range(length)]
        expected = hf_logits(hf, ids)
        got = our_prompt_logits(ours, ids)
        err = (got - expected).abs().max().item()
        assert err < LOGIT_ATOL, f"{name}, prompt of {length}: max |logit diff| {err}"


@pytest.mark.parametrize("name", ALL_CONFIGS)
def test_greedy_batch_matches_transformers(name, model_factory):
    path, hf = model_factory(name)
    llm = LLM(path, block_size=8)
    rng = random.Random(1 + len(name))
    lengths = [1, 1, 2, 8, 9, 31, 120, 300]
    prompts = [[rng.randrange(llm.engine.spec.vocab_size) for _ in range(n)] for n in lengths]
    outs = llm.generate(prompts, SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        assert len(out.token_ids) == 32 and out.finish_reason == "length"
        judge_greedy(hf, prompt, out.token_ids)
    llm.engine.check_integrity()
    assert llm.engine.blocks.num_free_blocks == llm.engine.blocks.num_blocks


@pytest.mark.parametrize("name", ["jamba", "llama"])
def test_greedy_decode_on_torch_ops_matches_transformers(name, model_factory, monkeypatch):
    """With the C++ kernels and packed linears off (SPLITSERVE_DISABLE_CPU_KERNELS, bench
    roofline's ours-torch), every decode path falls back to torch ops and still matches."""
    monkeypatch.setenv("SPLITSERVE_DISABLE_CPU_KERNELS", "1")
    path, hf = model_factory(name)
    llm = LLM(path, block_size=8)
    rng = random.Random(name)
    prompts = [[rng.randrange(llm.engine.spec.vocab_size) for _ in range(n)] for n in (1, 7, 40)]
    for prompt, out in zip(prompts, llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0,
                                                                         ignore_eos=True))):
        judge_greedy(hf, prompt, out.token_ids)


@pytest.mark.parametrize("name", ["bamba", "falcon_h1_nonorm", "nemotron_h"])
def test_mamba2_families_take_the_fused_cpu_epilogue(name, model_factory, monkeypatch):
    """The gated skip and the norm alone run as C++ passes on the projection's views (one
    group, several groups, no norm), and the logits still match transformers."""
    from engine.kernels import cpu

    path, hf = model_factory(name)
    ours = load_model(path)
    calls = record_calls(monkeypatch, cpu, "gated_skip_cpu")
    ids = [random.Random(name).randrange(ours.spec.vocab_size) for _ in range(40)]
    err = (our_prompt_logits(ours, ids) - hf_logits(hf, ids)).abs().max().item()
    assert calls and err < LOGIT_ATOL, f"{name}: {len(calls)} fused calls, max |logit diff| {err}"


def test_jamba_takes_the_fused_dt_b_c_norms(model_factory, monkeypatch):
    """Jamba's three norms over x_proj's output run as one C++ pass, and the logits still match
    transformers."""
    from engine.kernels import cpu

    path, hf = model_factory("jamba")
    ours = load_model(path)
    calls = record_calls(monkeypatch, cpu, "rms_norm_3_cpu")
    ids = [random.Random("jamba").randrange(ours.spec.vocab_size) for _ in range(40)]
    err = (our_prompt_logits(ours, ids) - hf_logits(hf, ids)).abs().max().item()
    mamba_layers = sum(layer.cache_spec().state_kind == "mamba" for layer in ours.layers)
    assert len(calls) == mamba_layers > 0 and err < LOGIT_ATOL, f"{len(calls)} fused calls, max |logit diff| {err}"


def test_falcon_h1_multipliers_are_folded_into_the_weights(model_factory):
    """After loading, no muP multiplier is left to apply at run time (each lives in the weights
    that produce or read its tensor), so q/k/v and gate/up can be packed as one GEMM each; the
    parity tests above judge the folded model (every multiplier away from 1) against transformers."""
    from torch import nn

    path, _ = model_factory("falcon_h1")
    model = load_model(path)
    for layer in model.layers:
        assert (layer.attn_in, layer.attn_out, layer.ssm_out) == (1.0, 1.0, 1.0)
        assert (layer.mamba.in_scale, layer.mamba.part_scales) == (1.0, (1.0,) * 5)
        assert type(layer.self_attn.k_proj) is nn.Linear and layer.feed_forward.packs_fused()
        assert layer.self_attn.pack_weights() == 1 and layer.feed_forward.pack_weights() == 1
