"""Prefix-cache entries of a tensor-parallel engine (engine.entry_rows.RankRows): an entry holds
every rank's shard, put together in the un-sharded layout. So the tiers of an engine sharded
over two ranks turn evictions into hits with the outputs of no caching, and what it spills to
disk or stages for another worker reads the same for an engine of another tensor-parallel size."""

from __future__ import annotations

import random

import pytest
import torch

from engine import LLM
from engine.prefix_cache import block_hashes
from tests.oracle import assert_same_tokens, judge_greedy
from tests.test_prefix_exchange import Move
from tests.test_tiered_cache import GREEDY, SMALL_POOL, chat_trace, one_by_one


def test_the_tiers_of_two_ranks_keep_both_shards_and_their_disk_serves_one_rank(model_factory, tmp_path):
    path, hf = model_factory("jamba")
    prompts, expected = chat_trace(path)  # one rank, no caching
    disk = dict(disk_cache_dir=str(tmp_path), disk_cache_bytes=1 << 24)
    # a small host tier pushes entries down to disk: both tiers spill and load on two ranks
    two = LLM(str(path), **SMALL_POOL, tensor_parallel_size=2, host_cache_bytes=1 << 18, **disk)
    try:
        outs = one_by_one(two, prompts)
        stats = two.engine.stats()
        fingerprint = two.engine.cache_fingerprint
    finally:
        two.engine.close()
    for prompt, ours, reference in zip(prompts, outs, expected):
        assert_same_tokens(hf, prompt, ours, reference)
    assert stats["tier_host_hits"] > 0 and stats["tier_disk_hits"] > 0, stats
    assert stats["tier_host_hits"] + stats["tier_disk_hits"] >= 6, stats
    # The disk holds un-sharded entries: one rank takes them as its own.
    one = LLM(str(path), **SMALL_POOL, **disk)
    assert one.engine.cache_fingerprint == fingerprint
    for prompt, ours, reference in zip(prompts[6:12], one_by_one(one, prompts[6:12]), expected[6:12]):
        assert_same_tokens(hf, prompt, ours, reference)
    assert one.engine.stats()["tier_disk_hits"] >= 5


@pytest.mark.parametrize("family", ["jamba", "llama", "mamba"])  # KV and state; KV only; state only
def test_prefixes_move_between_engines_of_one_and_two_ranks(family, model_factory):
    path, hf = model_factory(family)
    rng = random.Random(43)
    one = LLM(str(path), block_size=4, enable_prefix_caching=True, host_cache_bytes=1 << 22)
    two = LLM(str(path), block_size=4, enable_prefix_caching=True, host_cache_bytes=1 << 22, tensor_parallel_size=2)
    try:
        # One prefix computed by each: what two ranks' shards put together give is one rank's
        # entry, up to the order of the float sums.
        system = [rng.randrange(3, 300) for _ in range(22)]
        hashes = block_hashes(system + [1, 2, 3], 4, [])
        for llm in (one, two):
            llm.generate([system], GREEDY)
        mine, theirs = (llm.engine.exchange.stage(hashes, "compare") for llm in (one, two))
        assert mine.end == theirs.end == 20 and mine.specs == theirs.specs
        ours, their = (llm.engine.exchange.staged_tensors(s) for llm, s in ((one, mine), (two, theirs)))
        for name, tensor in ours.items():
            assert torch.allclose(their[name], tensor, rtol=1e-4, atol=1e-5), name
        for llm in (one, two):
            llm.engine.exchange.unstage("compare")
        for source, target in ((two, one), (one, two)):
            system = [rng.randrange(3, 300) for _ in range(22)]  # a prefix neither holds
            source.generate([system], GREEDY)  # its last boundary short of the end, 20, is checkpointed
            hashes = block_hashes(system + [1, 2, 3], 4, [])
            staged = source.engine.exchange.stage(hashes, "kept")  # held to compare with below
            sent = {name: t.clone() for name, t in source.engine.exchange.staged_tensors(staged).items()}
            source.engine.exchange.unstage("kept")
            _, taken = Move(source, target)(hashes)
            assert taken == 20
            prompt = system[:20] + [rng.randrange(3, 300) for _ in range(5)]
            out = target.generate([prompt], GREEDY)[0]
            assert out.num_cached_tokens == 20 and target.engine.stats()["tier_host_hits"] == 1
            judge_greedy(hf, prompt, out.token_ids)
            target.engine.check_integrity()
            # loaded into the target's pool (on every rank) and staged again: the same bytes
            again = target.engine.exchange.stage(hashes, "again")
            assert again.tier == "pool" and again.end == 20
            back = target.engine.exchange.staged_tensors(again)
            assert all(torch.equal(back[name], t) for name, t in sent.items())
            target.engine.exchange.unstage("again")
    finally:
        two.engine.close()
