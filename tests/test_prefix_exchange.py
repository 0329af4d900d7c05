"""Prefix-cache entries exported by one engine and imported by another (engine.prefix_exchange):
the importer's request starts from the entry and its outputs are the uncached ones, judged by
transformers; an entry from a cache unlike the importer's is refused, naming why."""

from __future__ import annotations

import dataclasses
import random

import pytest

from engine import LLM, SamplingParams
from engine.prefix_cache import block_hashes
from tests.oracle import assert_same_tokens, judge_greedy

BLOCK = 4
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def tokens(rng, n, vocab):
    return [rng.randrange(3, vocab) for _ in range(n)]


def importer(path, block_size=BLOCK):
    return LLM(path, block_size=block_size, enable_prefix_caching=True, host_cache_bytes=1 << 26)


@pytest.mark.parametrize("family", ["jamba", "qwen3_next", "mamba", "llama"])
def test_an_imported_prefix_serves_as_its_own_would(family, model_factory):
    path, hf = model_factory(family)
    rng = random.Random(41)
    vocab = hf.config.vocab_size
    source = LLM(path, block_size=BLOCK, enable_prefix_caching=True)
    target = importer(path)
    plain = LLM(path, block_size=BLOCK)
    system = tokens(rng, 22, vocab)
    source.generate([system], GREEDY)  # its last boundary short of the end, 20, is checkpointed
    exported = source.engine.export_prefix(block_hashes(system + [1, 2, 3], BLOCK, []))
    assert exported is not None and exported.tier == "pool" and exported.entry.end == 20
    # what the router weighs a fetch by: the entry's size, and the importer's prefill rate
    before = target.engine.stats()
    assert exported.entry.nbytes == 5 * before["prefix_entry_block_bytes"] + before["prefix_entry_state_bytes"]
    assert before["prefill_tokens_per_s"] == 0.0 < source.engine.stats()["prefill_tokens_per_s"]
    assert target.engine.import_prefix(exported) == 20
    assert target.engine.import_prefix(exported) == 0  # held already
    prompt = system[:20] + tokens(rng, 5, vocab)
    out = target.generate([prompt], GREEDY)[0]
    assert out.num_cached_tokens == 20
    assert_same_tokens(hf, prompt, out.token_ids, plain.generate([prompt], GREEDY)[0].token_ids)
    judge_greedy(hf, prompt, out.token_ids)
    stats = target.engine.stats()
    assert stats["prefix_fetch_imported"] == 1 and stats["prefix_fetch_imported_tokens"] == 20
    assert stats["tier_host_hits"] == 1
    assert source.engine.stats()["prefix_fetch_exported"] == 1
    target.engine.check_integrity()
    source.engine.check_integrity()


def test_a_prefix_is_exported_from_the_source_tiers_too(model_factory, tmp_path):
    path, hf = model_factory("jamba")
    rng = random.Random(43)
    vocab = hf.config.vocab_size
    # a pool of 12 blocks: the second prompt evicts the first, whose entry goes to host memory
    source = LLM(path, block_size=BLOCK, enable_prefix_caching=True, num_kv_blocks=12, prefix_checkpoints=2,
                 host_cache_bytes=1 << 26)
    first, second = tokens(rng, 30, vocab), tokens(rng, 30, vocab)
    source.generate([first], GREEDY)
    source.generate([second], GREEDY)
    exported = source.engine.export_prefix(block_hashes(first, BLOCK, []))
    assert exported is not None and exported.tier == "host" and exported.entry.end == 28
    # its own tensors, not views of the host tier's arena (which Ray would ship whole)
    assert all(t.untyped_storage().nbytes() == t.numel() * t.element_size() for t in exported.entry.tensors.values())
    target = importer(path)
    assert target.engine.import_prefix(exported) == 28
    prompt = first[:28] + tokens(rng, 3, vocab)
    out = target.generate([prompt], GREEDY)[0]
    assert out.num_cached_tokens == 28
    judge_greedy(hf, prompt, out.token_ids)
    assert source.engine.export_prefix(block_hashes(tokens(rng, 30, vocab), BLOCK, [])) is None


def test_entries_from_a_cache_unlike_this_one_are_refused(model_factory, caplog):
    path, hf = model_factory("jamba")
    rng = random.Random(47)
    source = LLM(path, block_size=BLOCK, enable_prefix_caching=True)
    prompt = tokens(rng, 13, hf.config.vocab_size)
    source.generate([prompt], GREEDY)
    exported = source.engine.export_prefix(block_hashes(prompt, BLOCK, []))
    assert exported.entry.end == 12
    target = importer(path)
    name = next(n for n in exported.entry.tensors if n.startswith("kv:"))
    damaged = {**exported.entry.tensors, name: exported.entry.tensors[name][:, :1]}
    bad = [
        (dataclasses.replace(exported, fingerprint="0" * 24), "unlike this one"),
        (dataclasses.replace(exported, entry=dataclasses.replace(exported.entry, end=16)), "do not cover 16"),
        (dataclasses.replace(exported, entry=dataclasses.replace(exported.entry, tensors=damaged)), name),
        (dataclasses.replace(exported, entry=dataclasses.replace(
            exported.entry, tensors={k: v for k, v in exported.entry.tensors.items() if k != name})), "tensors"),
    ]
    for broken, why in bad:
        caplog.clear()
        assert target.engine.import_prefix(broken) == 0
        assert why in caplog.text
    assert LLM(path, block_size=BLOCK, enable_prefix_caching=True).engine.import_prefix(exported) == 0
    assert "no host tier" in caplog.text
    # another block size is another cache (its fingerprint differs)
    assert importer(path, block_size=8).engine.import_prefix(exported) == 0
    assert target.engine.stats()["prefix_fetch_refused"] == len(bad)
    assert target.engine.import_prefix(exported) == 12  # the intact entry still goes in
    out = target.generate([prompt], GREEDY)[0]
    assert out.num_cached_tokens == 12
    judge_greedy(hf, prompt, out.token_ids)
