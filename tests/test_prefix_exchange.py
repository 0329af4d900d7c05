"""Prefix-cache entries moved from one engine's host tier to another's (engine.prefix_exchange,
worker_base.prefix_wire): staged in whole rows, sent over shared memory or Gloo into rows the
importer reserved, adopted there; the importer's request starts from the entry and its outputs
are the uncached ones, judged by transformers. An entry from a cache unlike the importer's is
refused before a byte moves, naming why, and a move that fails gives both sides' rows back."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from engine import LLM, SamplingParams
from engine.host_tier import ROW_BYTES
from engine.prefix_cache import block_hashes
from kvtransfer.config import TransferConfig
from kvtransfer.messages import HandoffTarget
from tests.oracle import assert_same_tokens, judge_greedy
from worker_base.prefix_wire import PrefixWire

BLOCK = 4
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
HOST = 1 << 22


def tokens(rng, n, vocab):
    return [rng.randrange(3, vocab) for _ in range(n)]


def with_host_tier(path, block_size=BLOCK, **options):
    return LLM(path, block_size=block_size, enable_prefix_caching=True, host_cache_bytes=HOST, **options)


class Move:
    """One engine's entries moved into another's host tier, over a transport (`kind`) or, for
    the engine-side tests, by copying the rows here."""

    def __init__(self, source: LLM, target: LLM, kind: str | None = None):
        self.source, self.target, self.kind = source.engine, target.engine, kind
        self.count = 0
        if kind is not None:
            config = TransferConfig(timeout_s=10)
            self.sending = PrefixWire("source", self.source.tiers.host.rows(), config)
            self.receiving = PrefixWire("target", self.target.tiers.host.rows(), config)
            _, receiver = self.receiving.receiver(kind)
            self.sending.sender(kind).connect(self.receiving.name, receiver.accept(self.sending.name))

    def __call__(self, hashes: list[bytes]):
        """(what the source staged, the tokens the target took) for the chain `hashes`."""
        self.count += 1
        fetch_id = f"fetch-{self.count}"
        staged = self.source.exchange.stage(hashes, fetch_id)
        if staged is None:
            return None, 0
        offset = self.target.exchange.make_room(staged)
        if offset is None:
            self.source.exchange.unstage(fetch_id)
            return staged, 0
        first = offset // ROW_BYTES
        dst_rows = list(range(first, first + len(staged.rows)))
        if self.kind is None:
            rows = self.target.tiers.host.rows()
            rows[dst_rows] = self.source.tiers.host.rows()[staged.rows]
        else:
            _, receiver = self.receiving.receiver(self.kind)
            receiver.expect(HandoffTarget(fetch_id, self.receiving.name, tuple(dst_rows), None))
            self.sending.send(fetch_id, self.receiving.name, self.kind, staged.rows, dst_rows)
            assert receiver.wait_for([fetch_id], 10)[fetch_id].ok
        self.source.exchange.unstage(fetch_id)
        return staged, self.target.exchange.adopt(staged, offset)

    def close(self):
        if self.kind is not None:
            self.sending.close()
            self.receiving.close()


def free_bytes(llm: LLM) -> int:
    return llm.engine.tiers.host.arena.free_bytes


@pytest.mark.parametrize("family, kind", [("jamba", "shm"), ("qwen3_next", "gloo"), ("mamba", "shm"),
                                          ("llama", "gloo"), ("jamba", "gloo")])
def test_a_fetched_prefix_serves_as_its_own_would(family, kind, model_factory):
    path, hf = model_factory(family)
    rng = random.Random(41)
    vocab = hf.config.vocab_size
    source, target, plain = with_host_tier(path), with_host_tier(path), LLM(path, block_size=BLOCK)
    move = Move(source, target, kind)
    try:
        system = tokens(rng, 22, vocab)
        source.generate([system], GREEDY)  # its last boundary short of the end, 20, is checkpointed
        hashes = block_hashes(system + [1, 2, 3], BLOCK, [])
        source_free, target_free = free_bytes(source), free_bytes(target)
        staged, taken = move(hashes)
        assert staged.tier == "pool" and staged.end == 20 and taken == 20
        # what the router weighs a fetch by: the entry's size, and the importer's prefill rate
        before = target.engine.stats()
        assert staged.nbytes == 5 * before["prefix_entry_block_bytes"] + before["prefix_entry_state_bytes"]
        assert before["prefill_tokens_per_s"] == 0.0 < source.engine.stats()["prefill_tokens_per_s"]
        assert free_bytes(source) == source_free  # its staged rows are back
        assert free_bytes(target) == target_free - len(staged.rows) * ROW_BYTES  # the entry holds them
        assert move(hashes)[1] == 0  # held already
        prompt = system[:20] + tokens(rng, 5, vocab)
        out = target.generate([prompt], GREEDY)[0]
        assert out.num_cached_tokens == 20
        assert_same_tokens(hf, prompt, out.token_ids, plain.generate([prompt], GREEDY)[0].token_ids)
        judge_greedy(hf, prompt, out.token_ids)
        stats = target.engine.stats()
        assert stats["prefix_fetch_imported"] == 1 and stats["prefix_fetch_imported_tokens"] == 20
        assert stats["tier_host_hits"] == 1
        assert source.engine.stats()["prefix_fetch_exported"] == 2
        target.engine.check_integrity()
        source.engine.check_integrity()
    finally:
        move.close()


def test_a_prefix_is_staged_from_the_source_tiers_too(model_factory):
    path, hf = model_factory("jamba")
    rng = random.Random(43)
    vocab = hf.config.vocab_size
    # a pool of 12 blocks: the second prompt evicts the first, whose entry goes to host memory
    source = with_host_tier(path, num_kv_blocks=12, prefix_checkpoints=2)
    first, second = tokens(rng, 30, vocab), tokens(rng, 30, vocab)
    source.generate([first], GREEDY)
    source.generate([second], GREEDY)
    target = with_host_tier(path)
    staged, taken = Move(source, target)(block_hashes(first, BLOCK, []))
    assert staged.tier == "host" and taken == 28
    prompt = first[:28] + tokens(rng, 3, vocab)
    out = target.generate([prompt], GREEDY)[0]
    assert out.num_cached_tokens == 28
    judge_greedy(hf, prompt, out.token_ids)
    assert Move(source, target)(block_hashes(tokens(rng, 30, vocab), BLOCK, [])) == (None, 0)
    # no host tier to stage in: nothing to fetch from this worker
    bare = LLM(path, block_size=BLOCK, enable_prefix_caching=True)
    bare.generate([first], GREEDY)
    assert bare.engine.exchange.stage(block_hashes(first, BLOCK, []), "f") is None


def test_entries_from_a_cache_unlike_this_one_are_refused(model_factory, caplog):
    path, hf = model_factory("jamba")
    rng = random.Random(47)
    source = with_host_tier(path)
    prompt = tokens(rng, 13, hf.config.vocab_size)
    source.generate([prompt], GREEDY)
    staged = source.engine.exchange.stage(block_hashes(prompt, BLOCK, []), "f")
    assert staged.end == 12
    target = with_host_tier(path)
    free = free_bytes(target)
    name = next(n for n in staged.specs if n.startswith("kv:"))
    shape, dtype = staged.specs[name]
    bad = [
        (dataclasses.replace(staged, fingerprint="0" * 24), "unlike this one"),
        (dataclasses.replace(staged, end=16), "do not cover 16"),
        (dataclasses.replace(staged, specs={**staged.specs, name: ((shape[0], 1, *shape[2:]), dtype)}), name),
        (dataclasses.replace(staged, specs={**staged.specs, name: (shape, torch.float16)}), name),
        (dataclasses.replace(staged, specs={k: v for k, v in staged.specs.items() if k != name}), "tensors"),
        (dataclasses.replace(staged, rows=staged.rows + [0]), "rows do not hold"),
    ]
    for broken, why in bad:
        caplog.clear()
        assert target.engine.exchange.make_room(broken) is None
        assert why in caplog.text
    assert free_bytes(target) == free  # nothing reserved for what was refused
    assert LLM(path, block_size=BLOCK, enable_prefix_caching=True).engine.exchange.make_room(staged) is None
    assert "no host tier" in caplog.text
    # another block size is another cache (its fingerprint differs)
    assert with_host_tier(path, block_size=8).engine.exchange.make_room(staged) is None
    assert target.engine.stats()["prefix_fetch_refused"] == len(bad)
    source.engine.exchange.unstage("f")
    _, taken = Move(source, target)(block_hashes(prompt, BLOCK, []))
    assert taken == 12  # the intact entry still goes in
    out = target.generate([prompt], GREEDY)[0]
    assert out.num_cached_tokens == 12
    judge_greedy(hf, prompt, out.token_ids)


def test_a_move_that_fails_gives_both_sides_rows_back(model_factory):
    """The receiver's rows are released only once its failure is reported (the transport no
    longer writes them), the source's when its send is over; the target then serves the prompt
    by computing it."""
    path, hf = model_factory("jamba")
    rng = random.Random(53)
    source, target = with_host_tier(path), with_host_tier(path)
    move = Move(source, target, "gloo")
    try:
        prompt = tokens(rng, 17, hf.config.vocab_size)
        source.generate([prompt], GREEDY)
        source_free, target_free = free_bytes(source), free_bytes(target)
        staged = source.engine.exchange.stage(block_hashes(prompt, BLOCK, []), "doomed")
        offset = target.engine.exchange.make_room(staged)
        first = offset // ROW_BYTES
        _, receiver = move.receiving.receiver("gloo")
        receiver.expect(HandoffTarget("doomed", move.receiving.name, tuple(range(first, first + len(staged.rows))),
                                      None), timeout_s=0.3)  # the source never sends
        result = receiver.wait_for(["doomed"], 10)["doomed"]
        assert not result.ok and "doomed" in result.error
        target.engine.exchange.drop(offset, staged.nbytes)
        source.engine.exchange.unstage("doomed")
        assert (free_bytes(source), free_bytes(target)) == (source_free, target_free)
        out = target.generate([prompt], GREEDY)[0]
        assert out.num_cached_tokens == 0
        judge_greedy(hf, prompt, out.token_ids)
    finally:
        move.close()


def test_a_worker_whose_arena_cannot_be_shared_takes_fetches_over_gloo(model_factory, monkeypatch, caplog):
    import kvtransfer.shm

    def no_room(cache):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(kvtransfer.shm, "share_cache_storage", no_room)
    path, _ = model_factory("llama")
    target = with_host_tier(path)
    wire = PrefixWire("target", target.engine.tiers.host.rows(), TransferConfig(timeout_s=5))
    try:
        kind, receiver = wire.receiver("shm")
        assert kind == "gloo" and wire.receiver("shm") == ("gloo", receiver)
        assert "No space left on device" in wire.shm_refused and "Gloo instead" in caplog.text
    finally:
        wire.close()


def test_a_source_releases_what_no_importer_came_for_and_says_when_it_has_no_channel(model_factory):
    import asyncio

    from worker_base.prefix_wire import StagedRows

    path, hf = model_factory("jamba")
    source = with_host_tier(path)
    prompt = tokens(random.Random(59), 17, hf.config.vocab_size)
    source.generate([prompt], GREEDY)
    hashes = block_hashes(prompt, BLOCK, [])

    class Worker:  # what StagedRows uses of a worker actor
        name, engine = "source", source.engine
        prefix_wire = PrefixWire("source", source.engine.tiers.host.rows(), TransferConfig(timeout_s=5))

        async def on_engine(self, fn):
            return fn(self.engine)

    worker = Worker()
    staged_rows = StagedRows(worker, timeout_s=0.0)
    free = free_bytes(source)

    async def scenario():
        staged = await staged_rows.stage(hashes, "never-fetched")
        assert staged is not None and free_bytes(source) == free - len(staged.rows) * ROW_BYTES
        assert await staged_rows.send("never-fetched", "nobody", "gloo", staged.rows) == "not connected"
        assert await staged_rows.send("unknown", "nobody", "gloo", staged.rows) == "nothing staged for it"
        again = await staged_rows.stage(hashes, "next")  # past the timeout: the first is released
        assert source.engine.exchange.staged_rows("never-fetched") is None
        assert free_bytes(source) == free - len(again.rows) * ROW_BYTES
        await staged_rows.release("next")

    try:
        asyncio.run(scenario())
        assert free_bytes(source) == free
    finally:
        worker.prefix_wire.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_prefix_moves_between_gpu_engines_host_tiers(model_factory):
    """On a GPU: the source's stage gathers its pool's rows into its page-locked host tier (a
    copy queued on its stream, waited for before the rows go out), Gloo moves the rows (shared
    memory would move a page-locked buffer), and the importer loads the entry into its pool."""
    path, hf = model_factory("jamba")
    rng = random.Random(61)
    source, target = (with_host_tier(path, device="cuda") for _ in range(2))
    assert source.engine.tiers.host.arena.pinned
    move = Move(source, target, "gloo")
    try:
        system = tokens(rng, 22, hf.config.vocab_size)
        source.generate([system], GREEDY)
        staged, taken = move(block_hashes(system + [1, 2, 3], BLOCK, []))
        assert staged.tier == "pool" and taken == 20
        prompt = system[:20] + tokens(rng, 5, hf.config.vocab_size)
        out = target.generate([prompt], GREEDY)[0]
        assert out.num_cached_tokens == 20 and target.engine.stats()["tier_host_hits"] == 1
        judge_greedy(hf, prompt, out.token_ids)
    finally:
        move.close()
