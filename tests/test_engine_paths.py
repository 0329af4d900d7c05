"""Every scheduling path must give the transformers answer, on every family."""

from __future__ import annotations

import random

import pytest
import torch

from engine import LLM, SamplingParams
from engine.state_slots import StateOwnershipError
from tests.one_call import compare_decoder_layers_with_the_layer_path, compare_each_one_call_with_the_chain
from tests.oracle import assert_same_tokens, judge_greedy

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
BLOCK = 4


def prompts_of(lengths, vocab, seed):
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def test_mixed_lengths_around_block_boundaries(family_model):
    family, path, hf = family_model
    llm = LLM(path, block_size=BLOCK)
    lengths = [1, BLOCK - 1, BLOCK, BLOCK + 1, 2 * BLOCK, 2 * BLOCK + 1, 3 * BLOCK, 3 * BLOCK - 1]
    prompts = prompts_of(lengths, llm.engine.spec.vocab_size, 1)
    for prompt, out in zip(prompts, llm.generate(prompts, GREEDY)):
        judge_greedy(hf, prompt, out.token_ids)
    llm.engine.check_integrity()


@pytest.mark.parametrize("budget", [1, 7, BLOCK, 9, 18])
def test_chunked_prefill(family_model, budget):
    """Budgets of 1, 7, block_size, 9 and prompt length - 1 (the 19-token prompt below); 7 and
    9 are the SSD chunk size (8) +/- 1 of the Mamba2 families' main configs: a prefill step
    that ends inside an SSD chunk."""
    family, path, hf = family_model
    llm = LLM(path, block_size=BLOCK, max_num_batched_tokens=budget)
    prompts = prompts_of([19, 5, 1], llm.engine.spec.vocab_size, budget)
    outs = llm.generate(prompts, GREEDY)
    for prompt, out in zip(prompts, outs):
        judge_greedy(hf, prompt, out.token_ids)
    llm.engine.check_integrity()


@pytest.mark.parametrize("b_len", [6, 1])
def test_slot_reuse_gives_the_fresh_engine_answer(family_model, b_len):
    """A runs to the end in the only slot; B (incl. a 1-token B) must not see A's state."""
    family, path, hf = family_model
    vocab = hf.config.vocab_size
    a, b = prompts_of([9, b_len], vocab, 7 + b_len)
    shared = LLM(path, block_size=BLOCK, max_num_seqs=1)
    shared.generate([a], GREEDY)
    slot_before = shared.engine.slots.num_free_slots
    b_after_a = shared.generate([b], GREEDY)[0].token_ids
    b_alone = LLM(path, block_size=BLOCK, max_num_seqs=1).generate([b], GREEDY)[0].token_ids
    assert slot_before == 1
    assert_same_tokens(hf, b, b_after_a, b_alone)
    judge_greedy(hf, b, b_after_a)


def test_forced_preemption_then_recompute(family_model):
    family, path, hf = family_model
    # 6 blocks of 4 tokens: three 7-token prompts generating 12 tokens cannot all fit.
    llm = LLM(path, block_size=BLOCK, num_kv_blocks=6, max_num_seqs=4)
    prompts = prompts_of([7, 7, 7], hf.config.vocab_size, 3)
    outs = llm.generate(prompts, GREEDY)
    assert llm.engine.scheduler.num_preemptions > 0
    for prompt, out in zip(prompts, outs):
        judge_greedy(hf, prompt, out.token_ids)
    llm.engine.check_integrity()
    assert llm.engine.blocks.num_free_blocks == 6


def test_200_random_requests_through_a_small_cache(family_model):
    family, path, hf = family_model
    rng = random.Random(200)
    vocab = hf.config.vocab_size
    lengths = [rng.randint(1, 24) for _ in range(200)]
    prompts = prompts_of(lengths, vocab, 201)
    params = [SamplingParams(max_tokens=rng.randint(1, 10), temperature=0.0, ignore_eos=True)
              for _ in prompts]
    small = LLM(path, block_size=BLOCK, num_kv_blocks=24, max_num_seqs=8, max_num_batched_tokens=32)
    outs = small.generate(prompts, params)
    # The reference: one roomy engine, no preemption and no chunking (its own answers are judged
    # against transformers by the tests above), in one batch rather than 200 solo runs.
    roomy = LLM(path, block_size=BLOCK, max_num_seqs=256).generate(prompts, params)
    for prompt, p, out, ref in zip(prompts, params, outs, roomy):
        assert len(out.token_ids) == p.max_tokens
        assert_same_tokens(hf, prompt, out.token_ids, ref.token_ids)
    engine = small.engine
    assert engine.scheduler.num_preemptions > 0
    engine.check_integrity()
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    assert engine.slots.num_free_slots == engine.slots.num_slots
    assert not engine.scheduler.running and not engine.scheduler.waiting


def test_guard_fires_when_a_decode_is_handed_a_stranger_slot(model_factory):
    path, hf = model_factory("jamba")
    llm = LLM(path, block_size=BLOCK, max_num_seqs=2)
    engine = llm.engine
    engine.add_request([5, 6, 7], GREEDY, request_id="a")
    engine.add_request([8, 9], GREEDY, request_id="b")
    engine.step()  # both prefilled, both now decoding
    plan = engine.scheduler.schedule()
    decode_b = next(s for s in plan.seqs if s.request.request_id == "b")
    decode_b.slot = engine.slots.slot_of["a"]  # the bug class: a decode reading someone else's slot
    with pytest.raises(StateOwnershipError, match="request 'b' would read state slot"):
        engine.runner.execute(plan.seqs)


@pytest.mark.parametrize("name,layer", [
    ("jamba", "PagedAttention"), ("llama", "PagedAttention"), ("mistral_mqa_window", "PagedAttention"),
    ("qwen2_bias_tied", "PagedAttention"), ("qwen3_next", "NormedAttention"),
    ("qwen3_next_sparse_step_tied", "NormedAttention"), ("qwen3_next_dense_mqa", "NormedAttention"),
    ("lfm2", "NormedAttention"), ("lfm2_attn_first_bias_untied", "NormedAttention"),
    ("lfm2_mqa_kernel4", "NormedAttention"), ("zamba2_two_blocks_gqa", "PagedAttention")])
def test_attention_decodes_in_one_call_are_the_kernel_chain_bit_for_bit(name, layer, model_factory, monkeypatch):
    """An attention layer's all-decode step as one C++ call (engine/kernels/cpu_layers.cpp
    attention_decode, normed_attention_decode): at every decode step, from the same caches, its
    output and the K/V it writes are the bits forward's chain of kernels gives (no rotary, rotary,
    MQA with a sliding window the contexts pass, q/k/v biases; Qwen3-Next's normed q and k,
    partial rotary and output gate, with GQA, MHA with biases and MQA; LFM2's normed q and k;
    Zamba2's shared attention, which reads [h | embeddings] and writes h's width); and the
    tokens are transformers'."""
    from engine.kernels import cpu
    from engine.models.attention import NormedAttention, PagedAttention

    if not cpu.available():
        pytest.skip("no C++ compiler for the CPU kernels")
    path, hf = model_factory(name)
    compared = compare_each_one_call_with_the_chain(monkeypatch, {"PagedAttention": PagedAttention,
                                                                  "NormedAttention": NormedAttention}[layer],
                                                    lambda x, batch, cache: int(batch.decode_context_lens.max()))
    llm = LLM(path, max_num_seqs=4, block_size=BLOCK)
    prompts = prompts_of([3, 17, 26], llm.engine.spec.vocab_size, 5)
    for prompt, output in zip(prompts, llm.generate(prompts, GREEDY)):
        judge_greedy(hf, prompt, output.token_ids)
    assert compared and max(compared) > 26 + 1  # past mistral's window of 24


@pytest.mark.parametrize("name,fits", [("zamba2_two_blocks_gqa", True), ("zamba2", False)])
def test_zamba2_shared_attention_packs_its_block_once(name, fits, model_factory):
    """Without q/k/v adapters, a Zamba2 shared block's q, k and v are packed once into one GEMM
    that every use of the block reads, and each use decodes in one call; with adapters (each use
    projects its own way) none does."""
    from engine.models.families_zamba2 import SharedAttention

    path, _ = model_factory(name)
    model = LLM(path, max_num_seqs=2).engine.runner.model
    uses = [m for m in model.modules() if isinstance(m, SharedAttention)]
    assert len(uses) > len(model.shared) and all(use.fits_one_call() == fits for use in uses)
    if fits:
        for use in uses:
            assert use.qkv_fused is use._shared[0].qkv_fused
        assert len({id(use.qkv_fused) for use in uses}) == len(model.shared)


@pytest.mark.parametrize("name,fits", [("zamba2", True), ("zamba2_untied_linear_rope", True),
                                       ("zamba2_two_blocks_gqa", False)])
def test_zamba2_shared_mlp_in_one_call_is_the_chain(name, fits, model_factory, monkeypatch):
    """Zamba2's shared MLP at each hybrid use as one C++ call (cpu_layers.cpp adapter_gelu_mlp:
    the gate-up GEMM, the use's low-rank adapter, the exact GELU, the down GEMM): at every step,
    prefill and decode, its output is the chain of packed linears and torch's GELU within float32
    rounding (the two GELUs differ in the last bits, nothing else does); every call takes it but
    where the activation is not the exact GELU (tanh's, with biases: the chain runs); and the
    tokens are transformers'."""
    from engine.kernels import cpu
    from engine.models.families_zamba2 import SharedBlock

    if not cpu.available():
        pytest.skip("no C++ compiler for the CPU kernels")
    path, hf = model_factory(name)
    one_call, compared = SharedBlock.mlp, []

    def both(self, x, use):
        assert self._mlp_in_one_call(x, self.gate_up_adapters[str(use)]) == fits
        out = one_call(self, x, use)
        with monkeypatch.context() as m:
            m.setattr(SharedBlock, "_mlp_in_one_call", lambda *a: False)
            chain = one_call(self, x, use)
        torch.testing.assert_close(out, chain, rtol=1e-5, atol=1e-6)
        compared.append(x.shape[0])
        return out

    monkeypatch.setattr(SharedBlock, "mlp", both)
    llm = LLM(path, max_num_seqs=4, block_size=BLOCK)
    prompts = prompts_of([3, 17, 26], llm.engine.spec.vocab_size, 9)
    for prompt, output in zip(prompts, llm.generate(prompts, GREEDY)):
        judge_greedy(hf, prompt, output.token_ids)
    assert 3 in compared and max(compared) >= 17  # decode steps of three rows, and prefills


@pytest.mark.parametrize("name,fits", [("jamba", True), ("mamba", True), ("llama", True), ("mistral_mqa_window", True),
                                       ("qwen2_bias_tied", True), ("jamba_top1_bias", True),
                                       ("mamba2", True), ("mamba2_tied_limit", True), ("bamba", True),
                                       ("granitemoehybrid", True), ("granitemoehybrid_dense_nope", True),
                                       ("nemotron_h_dense", True), ("nemotron_h_latent", True),
                                       ("qwen3_next", True), ("qwen3_next_sparse_step_tied", True),
                                       ("qwen3_next_dense_mqa", True), ("lfm2", True),
                                       ("lfm2_attn_first_bias_untied", True), ("lfm2_mqa_kernel4", True),
                                       ("falcon_h1", False), ("falcon_h1_odd_tied", True), ("falcon_h1_nonorm", True),
                                       ("zamba2", True), ("zamba2_untied_linear_rope", True),
                                       ("zamba2_plain_gqa", True)])
def test_decoder_layers_in_one_call_are_the_layer_path_bit_for_bit(name, fits, model_factory, monkeypatch):
    """A decode step's whole layer stack as one C++ call (engine/decode_stack.py): at every
    decode step, from the same caches, the hidden states and every cache tensor it leaves are the
    bits of the layer-by-layer path (Mamba and Mamba2 with and without FFNs, projection biases, dt
    limits, MoE top-2 and top-1, MLPs, routed and shared experts, a residual multiplier,
    attention with and without rotary, a sliding window the contexts pass, q/k/v biases); where
    some layers cannot run in it (Nemotron-H's MoE, Zamba2's hybrid layers with attention adapters or
    tanh's GELU; without, they run in it: zamba2_plain_gqa) they take the layer
    path between the runs of layers that do, and where none can (Falcon-H1 with MLP biases) the
    layer path runs throughout; the tokens are
    transformers'. Nemotron-H's squared-ReLU MLP layers run in it, with biases; so do Qwen3-Next's
    Gated DeltaNet and gated attention layers, its folded (1 + w) norms, its MoE with a sigmoid-gated
    shared expert and its dense MLPs; LFM2's short-conv and normed attention layers; and Falcon-H1's
    layers, attention beside Mamba2 on one input, with their multipliers folded in (not with MLP
    biases, which the one-call MLP does not take)."""
    from engine.kernels import cpu

    if not cpu.available():
        pytest.skip("no C++ compiler for the CPU kernels")
    path, hf = model_factory(name)
    compared = compare_decoder_layers_with_the_layer_path(monkeypatch)
    llm = LLM(path, max_num_seqs=4, block_size=BLOCK)
    prompts = prompts_of([3, 17, 26], llm.engine.spec.vocab_size, 7)
    for prompt, output in zip(prompts, llm.generate(prompts, GREEDY)):
        judge_greedy(hf, prompt, output.token_ids)
    assert (3 in compared) == fits and all(rows <= 3 for rows in compared)


@pytest.mark.parametrize("name,hybrid_in_plan", [("zamba2_plain_gqa", True), ("zamba2", False),
                                                  ("zamba2_two_blocks_gqa", False)])
def test_zamba2_hybrid_layers_join_the_one_call_where_their_parts_fit(name, hybrid_in_plan, model_factory):
    """Zamba2's hybrid layers run inside the decode step's one call where their shared attention
    has no q/k/v adapters and their MLP the exact GELU (as in Zamba2 2.7B and 7B): the whole stack is
    then one call; with attention adapters or tanh's GELU each hybrid layer takes the layer path."""
    from engine.kernels import cpu
    from engine.decode_stack import build_plan
    from engine.kernels.decode_plan import ZAMBA2_HYBRID
    from engine.models.families_zamba2 import HybridLayer

    if not cpu.available():
        pytest.skip("no C++ compiler for the CPU kernels")
    path, _ = model_factory(name)
    engine = LLM(path, max_num_seqs=2).engine
    model = engine.runner.model
    segments = build_plan(model.layers, engine.cache.layers).segments
    hybrids = [i for i, layer in enumerate(model.layers) if isinstance(layer, HybridLayer)]
    if hybrid_in_plan:
        assert len(segments) == 1 and segments[0][1] is not None
        assert [i for i, entry in enumerate(segments[0][1].plans) if entry.mixer == ZAMBA2_HYBRID] == hybrids
        h = torch.zeros(2, engine.spec.hidden_size)
        for embeddings in (None, h[:1], h.t().contiguous().t()):  # missing, wrong rows, not contiguous
            with pytest.raises(ValueError, match="needs the step's embeddings"):
                segments[0][1].run(h, None, embeddings)
    else:
        assert [first for first, plan in segments if plan is None] == hybrids


FFN_ONE_CALLS = [("SparseMoE", n) for n in ("jamba", "jamba_top1_bias", "granitemoehybrid", "qwen3_next")] + [
    ("GatedMLP", n) for n in ("jamba", "llama", "granitemoehybrid")]


@pytest.mark.parametrize("ffn,name", FFN_ONE_CALLS)
def test_ffns_in_one_call_are_the_kernel_chain_bit_for_bit(ffn, name, model_factory, monkeypatch):
    """SparseMoE (router, routing, grouping, experts, combine) and GatedMLP (gate-up GEMM,
    SiLU-and-multiply, down GEMM) each as one C++ call (engine/kernels/cpu_layers.cpp), in
    prefill and decode: the output is the bits of forward's chain of kernels (top-2 and top-1,
    normalised or not, beside a shared expert); and the tokens are transformers'."""
    from engine.kernels import cpu
    from engine.models import layers

    if not cpu.available():
        pytest.skip("no C++ compiler for the CPU kernels")
    path, hf = model_factory(name)
    compared = compare_each_one_call_with_the_chain(monkeypatch, getattr(layers, ffn), lambda x: x.shape[0],
                                                    check="_runs_in_one_call", run="_in_one_call", cache_arg=None)
    llm = LLM(path, max_num_seqs=4, block_size=BLOCK)
    prompts = prompts_of([3, 17, 26], llm.engine.spec.vocab_size, 6)
    for prompt, output in zip(prompts, llm.generate(prompts, GREEDY)):
        judge_greedy(hf, prompt, output.token_ids)
    assert 3 in compared and max(compared) >= 26  # decode steps of all three, and a prefill
