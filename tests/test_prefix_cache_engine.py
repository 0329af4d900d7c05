"""Prefix caching is exact: on every family, cached runs give the uncached answer and
transformers' judge, across hits at block boundaries, partial hits, eviction, preemption,
chunked prefill and requests that share a prefix in one batch."""

from __future__ import annotations

import random

import pytest

from engine import LLM, SamplingParams
from tests.oracle import assert_same_tokens, judge_greedy

BLOCK = 4
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def tokens(rng, n, vocab):
    return [rng.randrange(3, vocab) for _ in range(n)]


def check(hf, llm, plain, prompts, params=GREEDY):
    outs = llm.generate(prompts, params)
    refs = plain.generate(prompts, params)
    for prompt, out, ref in zip(prompts, outs, refs):
        assert_same_tokens(hf, prompt, out.token_ids, ref.token_ids)
        judge_greedy(hf, prompt, out.token_ids)
    llm.engine.check_integrity()
    return outs


def test_hits_are_exact_on_every_family(family_model):
    family, path, hf = family_model
    vocab = hf.config.vocab_size
    rng = random.Random(19)
    llm = LLM(path, block_size=BLOCK, enable_prefix_caching=True)
    plain = LLM(path, block_size=BLOCK)

    # A chat: turn 2's prompt is turn 1's prompt + answer + a new message. The answer's last
    # block boundary (27 tokens computed: 24) has a checkpoint from the decode.
    turn1 = tokens(rng, 18, vocab)
    (out1,) = check(hf, llm, plain, [turn1])
    assert out1.num_cached_tokens == 0
    turn2 = turn1 + out1.token_ids + tokens(rng, 3, vocab)
    (out2,) = check(hf, llm, plain, [turn2])
    assert out2.num_cached_tokens == 24

    # The same prompt again, 16 tokens (block-aligned): hits its last boundary short of the end.
    aligned = tokens(rng, 16, vocab)
    check(hf, llm, plain, [aligned])
    assert check(hf, llm, plain, [aligned])[0].num_cached_tokens == 12

    # A shared 13-token system prompt: the second request leaves the cached chain after 12
    # tokens and checkpoints there; the third (and a partial block after it) hit 12.
    system = tokens(rng, 13, vocab)
    check(hf, llm, plain, [system + tokens(rng, 5, vocab)])
    check(hf, llm, plain, [system + tokens(rng, 7, vocab)])
    third = check(hf, llm, plain, [system + tokens(rng, 2, vocab), system[:12] + tokens(rng, 9, vocab)])
    assert [o.num_cached_tokens for o in third] == [12, 12]

    # Requests sharing a prefix admitted in the same step, then again once it is cached.
    shared = tokens(rng, 9, vocab)
    batch = [shared + tokens(rng, n, vocab) for n in (1, 4, 6)]
    check(hf, llm, plain, batch)
    again = check(hf, llm, plain, [p + [5] for p in batch])
    assert all(o.num_cached_tokens >= 8 for o in again)
    stats = llm.engine.stats()
    assert 0 < stats["prefix_cache_hit_tokens"] < stats["prefix_cache_queried_tokens"]


def test_eviction_preemption_and_chunks_stay_exact(family_model):
    """A cache too small for what is offered: blocks and checkpoints are evicted while requests
    share prefixes, some are preempted, and prefills run in 6-token chunks."""
    family, path, hf = family_model
    vocab = hf.config.vocab_size
    rng = random.Random(23)
    systems = [tokens(rng, n, vocab) for n in (9, 14, 6)]
    prompts = [rng.choice(systems) + tokens(rng, rng.randint(1, 8), vocab) for _ in range(24)]
    params = [SamplingParams(max_tokens=rng.randint(1, 9), temperature=0.0, ignore_eos=True)
              for _ in prompts]
    small = LLM(path, block_size=BLOCK, enable_prefix_caching=True, num_kv_blocks=12,
                max_num_seqs=4, max_num_batched_tokens=6, prefix_checkpoints=3)
    solo = LLM(path, block_size=BLOCK, max_num_seqs=1)
    outs = []
    for i in range(0, len(prompts), 6):  # in waves, so later waves can hit earlier ones
        outs += small.generate(prompts[i:i + 6], params[i:i + 6])
    for prompt, p, out in zip(prompts, params, outs):
        assert len(out.token_ids) == p.max_tokens
        assert_same_tokens(hf, prompt, out.token_ids, solo.generate([prompt], p)[0].token_ids)
    engine = small.engine
    engine.check_integrity()
    assert engine.scheduler.num_preemptions > 0
    assert engine.prefix_cache.hit_tokens > 0
    assert engine.blocks.num_free_blocks + len(engine.blocks.evictable) == engine.blocks.num_blocks
    assert engine.slots.num_free_slots == engine.slots.num_slots
    if engine.prefix_cache.needs_state:
        assert engine.prefix_cache.num_checkpoints_used <= 3
    engine.prefix_cache.clear()
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    engine.check_integrity()


def test_checkpoints_are_carved_out_of_the_cache_budget(model_factory):
    path, _ = model_factory("jamba")
    per_slot = LLM(path, block_size=BLOCK).engine.cache.sizes.bytes_per_slot
    budget = 1 << 22
    off = LLM(path, block_size=BLOCK, cache_memory_bytes=budget).engine
    on = LLM(path, block_size=BLOCK, cache_memory_bytes=budget, enable_prefix_caching=True,
             prefix_checkpoints=8).engine
    assert on.stats()["prefix_cache_checkpoint_bytes"] == 8 * per_slot
    freed = (off.blocks.num_blocks - on.blocks.num_blocks) * on.cache.sizes.bytes_per_block
    assert 8 * per_slot <= freed < 8 * per_slot + on.cache.sizes.bytes_per_block
    assert off.stats()["prefix_cache_checkpoint_bytes"] == 0
    for bad in (dict(prefix_checkpoints=0), dict(prefix_checkpoints=True), dict(enable_prefix_caching="yes")):
        with pytest.raises(ValueError, match=next(iter(bad))):
            LLM(path, **bad)


def test_a_preempted_request_resumes_from_its_own_cached_prefix(family_model):
    """Preempted mid-decode (as the scheduler does when blocks run out), a request is recomputed
    from the checkpoint its own decode left at its last block boundary, not from zero."""
    from engine.scheduler import SchedulerOutput

    family, path, hf = family_model
    prompt = tokens(random.Random(29), 14, hf.config.vocab_size)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    engine = LLM(path, block_size=BLOCK, enable_prefix_caching=True).engine
    request_id = engine.add_request(prompt, params)
    for _ in range(5):  # the prefill, then 4 decodes: 18 tokens computed, a checkpoint at 16
        engine.step()
    request = engine.requests[request_id]
    assert request.num_computed_tokens == 18
    engine.scheduler._preempt(request, SchedulerOutput())
    engine.step()  # re-admitted: 19 tokens, 16 of them from the cache
    assert engine.prefix_cache.hit_tokens == 16 and request.num_computed_tokens == 19
    final = None
    while final is None:
        final = next((o for o in engine.step() if o.finished), None)
    plain = LLM(path, block_size=BLOCK).generate([prompt], params)[0]
    assert_same_tokens(hf, prompt, final.token_ids, plain.token_ids)
    judge_greedy(hf, prompt, final.token_ids)
    engine.check_integrity()
