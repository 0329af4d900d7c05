"""Prompt logprobs (SamplingParams.prompt_logprobs): each prompt token's logprob given the
tokens before it, its rank and the top n, equal to transformers' log-softmax on the same
checkpoint; through chunked prefill, the prefix cache, and every kind of final head."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from tests.oracle import hf_logits

TOLERANCE = 1e-4


def reference(hf, prompt: list[int]) -> torch.Tensor:
    return torch.log_softmax(hf_logits(hf, prompt).double(), dim=-1)


def assert_matches(entries, prompt, ref, top: int) -> None:
    assert len(entries) == len(prompt) and entries[0] is None
    for i in range(1, len(prompt)):
        row, entry = ref[i - 1], entries[i]
        assert abs(entry["token"] - float(row[prompt[i]])) <= TOLERANCE, (i, entry["token"], float(row[prompt[i]]))
        assert entry["rank"] == int((row > row[prompt[i]] + TOLERANCE).sum()) + 1 or \
            abs(float(row.sort(descending=True).values[entry["rank"] - 1]) - entry["token"]) <= TOLERANCE
        assert len(entry["top"]) == top
        best = row.topk(top)
        for (token_id, value), want in zip(entry["top"], best.values):
            assert abs(value - float(want)) <= TOLERANCE and abs(float(row[token_id]) - value) <= TOLERANCE


@pytest.mark.parametrize("name", ["jamba", "qwen3_next", "llama", "zamba2", "falcon_h1", "granitemoehybrid", "lfm2"])
def test_prompt_logprobs_equal_transformers_through_chunked_prefill(model_factory, name):
    path, hf = model_factory(name)
    llm = LLM(path, block_size=4, max_num_batched_tokens=8, num_kv_blocks=96)
    prompts = [list(range(5, 28)), [7, 3], [9]]  # 23 tokens: three chunks and a bit
    params = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=3)
    outs = llm.generate(prompts, params)
    for prompt, out in zip(prompts, outs):
        assert out.error is None
        assert_matches(out.prompt_logprobs, prompt, reference(hf, prompt), 3)


def test_tensor_parallel_ranks_score_the_prompt_too(model_factory):
    """Every rank runs the LM head's gathers over the scored rows; rank 0 keeps the entries."""
    path, hf = model_factory("jamba")
    llm = LLM(path, block_size=4, max_num_batched_tokens=8, num_kv_blocks=96, tensor_parallel_size=2)
    try:
        prompts = [list(range(5, 28)), [7, 3]]
        outs = llm.generate(prompts, SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=3))
        for prompt, out in zip(prompts, outs):
            assert out.error is None
            assert_matches(out.prompt_logprobs, prompt, reference(hf, prompt), 3)
    finally:
        llm.engine.close()


def test_a_prefix_cache_hit_still_scores_every_prompt_token(model_factory):
    path, hf = model_factory("jamba")
    llm = LLM(path, block_size=4, num_kv_blocks=96, enable_prefix_caching=True)
    prompt = list(range(5, 30))
    llm.generate([prompt], SamplingParams(max_tokens=3, temperature=0.0))  # caches the prefix
    out = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0))[0]
    assert_matches(out.prompt_logprobs, prompt, reference(hf, prompt), 0)
    again = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0))[0]
    assert again.num_cached_tokens > 0 and again.prompt_logprobs is None  # others still hit


def test_only_the_first_delta_carries_them_and_resumed_requests_get_none(model_factory):
    from engine.request import Resume

    path, _ = model_factory("jamba")
    llm = LLM(path, num_kv_blocks=64, output_kind="delta")
    engine = llm.engine
    rid = engine.add_request([5, 6, 7, 8], SamplingParams(max_tokens=4, temperature=0.0, prompt_logprobs=1))
    seen = []
    while engine.has_unfinished():
        seen += [o for o in engine.step() if o.request_id == rid]
    assert seen[0].prompt_logprobs is not None and all(o.prompt_logprobs is None for o in seen[1:])
    resumed = engine.add_request([5, 6, 7, 8], SamplingParams(max_tokens=4, temperature=0.0, prompt_logprobs=1),
                                 resume=Resume((9,), 0))
    assert engine.requests[resumed].prompt_logprobs is None  # its caller has them from the first attempt


def test_out_of_range_prompt_logprobs_are_refused_naming_the_field():
    from engine.sampling_params import InvalidRequest

    for bad in (-1, 10**6, 1.5, True):
        with pytest.raises(InvalidRequest, match="prompt_logprobs"):
            SamplingParams(prompt_logprobs=bad)
