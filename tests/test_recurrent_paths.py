"""Recurrent families through the paths where their state is easiest to get wrong.

Every config with a chunked scan (Mamba2's SSD, Gated DeltaNet), not just one per family:
prefill steps that end one token before and one after a scan chunk boundary. One config per
recurrent family: a request resumed from tokens a
caller already has, the cache holding exactly what the layers declare, and a mutation check
that the tests see a fresh prefill reading its slot (the stale-state bug).
"""

from __future__ import annotations

import random

import pytest

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.models import load_model
from engine.models.gated_deltanet import GatedDeltaNetMixer
from engine.models.mamba2 import Mamba2Mixer
from engine.models.short_conv import ShortConvMixer
from engine.request import Resume
from tests.one_call import compare_each_one_call_with_the_chain
from tests.oracle import CONFIGS, MAMBA2_FAMILIES, RECURRENT_FAMILIES, judge_greedy

# Every config whose layers run a chunked scan (Mamba2's SSD, Gated DeltaNet's delta rule).
CHUNKED_SCAN_CONFIGS = sorted(name for name, (family, _) in CONFIGS.items()
                              if family in (*MAMBA2_FAMILIES, "qwen3_next", "kimi_linear"))
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def scan_chunk_size(path) -> int:
    sizes = {m.chunk_size for m in load_model(path).modules() if isinstance(m, (Mamba2Mixer, GatedDeltaNetMixer))}
    assert len(sizes) == 1
    return sizes.pop()


def prompts_of(lengths, seed):
    rng = random.Random(seed)
    return [[rng.randrange(3, 300) for _ in range(n)] for n in lengths]


@pytest.mark.parametrize("name", CHUNKED_SCAN_CONFIGS)
@pytest.mark.parametrize("offset", [-1, 1])
def test_prefill_steps_that_split_a_scan_chunk(model_factory, name, offset):
    path, hf = model_factory(name)
    chunk = scan_chunk_size(path)
    budget = max(1, chunk + offset)
    llm = LLM(path, block_size=4, max_num_batched_tokens=budget)
    prompts = prompts_of([3 * chunk + 2, chunk, 1], chunk + offset)
    for prompt, out in zip(prompts, llm.generate(prompts, GREEDY)):
        judge_greedy(hf, prompt, out.token_ids)
    llm.engine.check_integrity()


def run_to_end(engine: LLMEngine, request_id: str):
    while True:
        for out in engine.step():
            if out.request_id == request_id and out.finished:
                return out


@pytest.mark.parametrize("name", RECURRENT_FAMILIES)
@pytest.mark.parametrize("cut", [1, 5])
def test_resume_from_delivered_tokens_continues_exactly(model_factory, name, cut):
    path, hf = model_factory(name)
    prompt = prompts_of([11], 3)[0]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    full = LLM(path, block_size=4).generate([prompt], params)[0].token_ids
    engine = LLMEngine(EngineConfig(str(path), block_size=4, max_num_batched_tokens=7))
    engine.add_request(prompt, params, request_id="again", resume=Resume(tuple(full[:cut])))
    resumed = run_to_end(engine, "again")
    assert resumed.token_ids == full
    judge_greedy(hf, prompt, resumed.token_ids)


@pytest.mark.parametrize("name", RECURRENT_FAMILIES)
def test_a_fresh_prefill_that_reads_its_slot_is_caught(model_factory, monkeypatch, name):
    """Mutation: treat every FRESH_PREFILL as a CONTINUED_PREFILL inside the model (the guard
    still sees the true phase, and freed slots are not NaN-poisoned, as in production). A
    request then starts from whatever the slot's previous owner left. Honest code gives B the
    same logprobs, bit for bit, after A as alone; the mutant must not (a short conv's stale
    window may leave greedy tokens unchanged, its logprobs never)."""
    from engine.model_runner import ModelRunner
    from engine.phase import Phase

    path, hf = model_factory(name)
    a, b = prompts_of([9, 6], 11)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=0)

    def b_after_a_and_alone():
        shared = LLM(path, block_size=4, max_num_seqs=1, debug=False)
        shared.generate([a], params)
        after = shared.generate([b], params)[0]
        alone = LLM(path, block_size=4, max_num_seqs=1, debug=False).generate([b], params)[0]
        return after, alone

    after, alone = b_after_a_and_alone()
    assert after.token_ids == alone.token_ids and after.logprobs == alone.logprobs
    judge_greedy(hf, b, after.token_ids)

    build = ModelRunner.build_batch

    def reads_slot_when_fresh(self, seqs):
        batch = build(self, seqs)
        batch.phases = [Phase.CONTINUED_PREFILL if p is Phase.FRESH_PREFILL else p for p in batch.phases]
        batch.__post_init__()
        return batch

    monkeypatch.setattr(ModelRunner, "build_batch", reads_slot_when_fresh)
    after, alone = b_after_a_and_alone()
    judge_greedy(hf, b, alone.token_ids)  # a never-used slot holds zeros: still right
    assert after.logprobs != alone.logprobs, "a fresh prefill read a stranger's state unnoticed"


@pytest.mark.parametrize("name", ["falcon_h1", "zamba2", "nemotron_h", "lfm2", "qwen3_next"])
def test_cache_holds_and_poisons_exactly_what_the_layers_declare(model_factory, name):
    import torch

    from engine.cache import ModelCache, plan_cache

    path, _ = model_factory(name)
    spec = load_model(path).spec
    sizes = plan_cache(spec, torch.float32, 4, 3, 32, 1 << 24, None)
    cache = ModelCache(spec, sizes, 4, torch.float32, "cpu")
    declared = [(f"layer{i}.{t.name}", (3, *t.shape)) for i, layer in enumerate(spec.layers) for t in layer.state]
    assert [(n, tuple(t.shape)) for n, t in cache.slot_tensors()] == declared
    assert sizes.bytes_per_slot == sum(4 * torch.Size(shape[1:]).numel() for _, shape in declared)
    assert len(cache.block_tensors()) == 2 * len(spec.attention_layers)
    cache.poison_slot(1)
    for _, tensor in cache.slot_tensors():
        assert tensor[1].isnan().all() and not tensor[0].isnan().any() and not tensor[2].isnan().any()


@pytest.mark.parametrize("name,mixer,fits", [
    ("jamba", "MambaMixer", True), ("mamba", "MambaMixer", True), ("mamba2", "Mamba2Mixer", True),
    ("mamba2_tied_limit", "Mamba2Mixer", True), ("bamba", "Mamba2Mixer", True),
    ("nemotron_h_latent", "Mamba2Mixer", True), ("zamba2_untied_linear_rope", "Mamba2Mixer", True),
    ("granitemoehybrid", "Mamba2Mixer", True), ("falcon_h1", "Mamba2Mixer", True),
    ("falcon_h1_nonorm", "Mamba2Mixer", True), ("falcon_h1_odd_tied", "Mamba2Mixer", True),
    ("qwen3_next", "GatedDeltaNetMixer", True), ("qwen3_next_sparse_step_tied", "GatedDeltaNetMixer", True),
    ("qwen3_next_dense_mqa", "GatedDeltaNetMixer", True), ("lfm2", "ShortConvMixer", True),
    ("lfm2_attn_first_bias_untied", "ShortConvMixer", True), ("lfm2_mqa_kernel4", "ShortConvMixer", True)])
def test_recurrent_decodes_in_one_call_are_the_kernel_chain_bit_for_bit(name, mixer, fits, model_factory, monkeypatch):
    """A Mamba, Mamba2, Gated DeltaNet or short-conv mixer's all-decode step as one C++ call
    (engine/kernels/cpu_layers.cpp mamba_decode, mamba2_decode, short_conv_decode;
    cpu_deltanet.cpp gdn_decode): at
    every decode step of a batch, from the same states, its output and both updated states are the
    bits that forward's chain of kernels gives (for Mamba2: one and several norm groups, dt limits,
    no norm, the norm before the gate, Falcon-H1 with its scales folded into in_proj; for Gated
    DeltaNet: key heads serving 2 and 4 value heads or one each, dk != dv, conv kernels 4 and 3;
    for LFM2: conv kernels 3 and 4, with and without biases); and the batch's tokens are
    transformers'."""
    from engine.kernels import cpu
    from engine.models.ssm import MambaMixer

    if not cpu.available():
        pytest.skip("no C++ compiler for the CPU kernels")
    path, hf = model_factory(name)
    mixer_class = {"MambaMixer": MambaMixer, "Mamba2Mixer": Mamba2Mixer, "GatedDeltaNetMixer": GatedDeltaNetMixer,
                   "ShortConvMixer": ShortConvMixer}[mixer]
    compared = compare_each_one_call_with_the_chain(monkeypatch, mixer_class, lambda hidden, batch, state: hidden.shape[0])
    prompts = [[random.Random(i).randrange(1, 100) for _ in range(3 + 2 * i)] for i in range(3)]
    outputs = LLM(path, max_num_seqs=4).generate(prompts, GREEDY)
    for prompt, output in zip(prompts, outputs):
        judge_greedy(hf, prompt, output.token_ids)
    assert bool(compared) == fits and (not fits or max(compared) == 3)
