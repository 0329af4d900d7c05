"""Prefix-cache bookkeeping: hash chains, holds, eviction order, checkpoints. No model, no torch."""

from __future__ import annotations

import pytest

from engine.block_manager import BlockManager, OutOfBlocks
from engine.prefix_cache import PrefixCache, block_hashes
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.state_slots import StateSlotAllocator

SIZE = 4


def cache_with(num_blocks=16, checkpoints=4, needs_state=True):
    blocks = BlockManager(num_blocks, SIZE)
    return blocks, PrefixCache(blocks, checkpoints, needs_state)


def run_request(blocks, cache, request_id, tokens, checkpoint_at=()):
    """What the engine does for a request that computed `tokens`: index, checkpoint, finish."""
    table = blocks.allocate(request_id, len(tokens))
    hashes = block_hashes(tokens, SIZE, [])
    cache.insert(hashes, table)
    rows = [cache.take_checkpoint_row(hashes[end // SIZE - 1]) for end in checkpoint_at]
    blocks.free(request_id)
    return hashes, rows


def test_a_block_key_covers_every_token_before_it():
    a = block_hashes(list(range(12)), SIZE, [])
    b = block_hashes([99] + list(range(1, 12)), SIZE, [])
    assert len(a) == 3 and a[0] != b[0] and a[1] != b[1] and a[2] != b[2]
    assert block_hashes(list(range(13)), SIZE, a[:1]) == a  # extending known hashes agrees
    assert block_hashes(list(range(3)), SIZE, []) == []  # no full block, no key


def test_a_hybrid_hits_only_where_a_checkpoint_is_and_never_the_whole_sequence():
    blocks, cache = cache_with()
    tokens = list(range(16))
    hashes, rows = run_request(blocks, cache, "a", tokens, checkpoint_at=[8])
    assert rows[0] is not None
    hit = cache.lookup(hashes, 17)
    assert (hit.num_tokens, hit.checkpoint, hit.num_matched_tokens) == (8, rows[0], 16)
    assert hit.blocks == blocks_of(cache, hashes[:2])
    row16 = cache.take_checkpoint_row(hashes[3])
    assert cache.lookup(hashes, 16).num_tokens == 8  # 16 would leave nothing to compute
    assert cache.lookup(hashes, 17).checkpoint == row16
    blocks.check_integrity(), cache.check_integrity()


def test_attention_only_models_hit_at_any_block_boundary():
    blocks, cache = cache_with(checkpoints=0, needs_state=False)
    hashes, _ = run_request(blocks, cache, "a", list(range(16)))
    hit = cache.lookup(hashes, 16)
    assert hit.num_tokens == 12 and hit.checkpoint is None and len(hit.blocks) == 3


def blocks_of(cache, hashes):
    return [cache.nodes[h].block for h in hashes]


def test_cached_blocks_are_given_back_leaf_first_and_never_while_a_table_holds_them():
    blocks, cache = cache_with(num_blocks=6)
    hashes, _ = run_request(blocks, cache, "a", list(range(16)), checkpoint_at=[8])
    assert blocks.num_free_blocks == 2 and blocks.num_available_blocks == 6
    blocks.share("b", blocks_of(cache, hashes[:2]))  # a request reusing the first two
    assert len(blocks.evictable) == 2
    with pytest.raises(OutOfBlocks):
        blocks.allocate("c", 5 * SIZE)
    table = blocks.allocate("c", 4 * SIZE)  # evicts the two unshared leaves, never b's blocks
    assert len(table) == 4 and set(cache.nodes) == set(hashes[:2])
    assert cache.lookup(hashes, 17).num_tokens == 8  # the checkpointed part survived
    blocks.free("b"), blocks.free("c")
    blocks.check_integrity(), cache.check_integrity()


def test_blocks_past_the_last_checkpoint_go_before_checkpointed_ones():
    blocks, cache = cache_with(num_blocks=8)
    old, _ = run_request(blocks, cache, "old", [1] * 8, checkpoint_at=[8])  # older, checkpointed
    new, _ = run_request(blocks, cache, "new", [2] * 8)  # newer, no checkpoint: useless to a hybrid
    blocks.allocate("c", 6 * SIZE)
    assert set(cache.nodes) == set(old)
    blocks.check_integrity(), cache.check_integrity()


def test_evicting_a_block_drops_what_is_chained_after_it():
    blocks, cache = cache_with(num_blocks=8)
    hashes, _ = run_request(blocks, cache, "a", list(range(16)), checkpoint_at=[16])
    cache._remove(hashes[1])
    assert set(cache.nodes) == {hashes[0]} and cache.num_checkpoints_used == 0
    assert blocks.num_free_blocks == 7
    blocks.check_integrity(), cache.check_integrity()


def test_checkpoints_are_evicted_by_recency_plus_prefix_length():
    blocks, cache = cache_with(num_blocks=32, checkpoints=2)
    long_old, _ = run_request(blocks, cache, "a", [1] * 32, checkpoint_at=[32])
    short_new, _ = run_request(blocks, cache, "b", [2] * 8, checkpoint_at=[8])
    cache.lookup(short_new, 9)  # b used last, but a saves four times the compute
    hashes, rows = run_request(blocks, cache, "c", [3] * 12, checkpoint_at=[12])
    assert rows[0] is not None
    assert cache.has_checkpoint(long_old[-1]) and not cache.has_checkpoint(short_new[-1])
    cache.check_integrity()


def test_the_scheduler_shares_the_hit_plans_the_restore_and_stops_at_save_points():
    blocks, cache = cache_with(num_blocks=12)
    slots = StateSlotAllocator(2)
    scheduler = Scheduler(blocks, slots, max_num_batched_tokens=64, prefix_cache=cache)
    system = list(range(10))
    hashes, rows = run_request(blocks, cache, "old", system + [50, 51], checkpoint_at=[4])
    request = Request("r", system + [60, 61, 62, 63, 64, 65], SamplingParams(max_tokens=1))
    scheduler.add(request)
    out = scheduler.schedule()
    (seq,) = out.seqs
    assert request.num_computed_tokens == 4 and request.num_cached_tokens == 4
    assert seq.block_table[:1] == blocks_of(cache, hashes[:1])
    assert out.restores == [(rows[0], seq.slot, "r")]
    # The request leaves the cached chain after 8 tokens (a branch point with no checkpoint)
    # and its prompt's last boundary short of its end is 12: the step runs in three passes.
    assert request.save_points == [8, 12]
    assert (seq.num_new_tokens, seq.num_later_tokens) == (4, 8)
    request.num_computed_tokens += 4
    second = seq.then()
    assert (second.num_new_tokens, second.num_later_tokens, second.slot) == (4, 4, seq.slot)
    request.num_computed_tokens += 4
    third = second.then()
    assert (third.num_new_tokens, third.num_later_tokens) == (4, 0) and third.then() is None
    blocks.check_integrity(), slots.check_integrity(), cache.check_integrity()


def test_admission_does_not_count_the_hits_own_cached_blocks_twice():
    blocks, cache = cache_with(num_blocks=4, needs_state=False, checkpoints=0)
    run_request(blocks, cache, "old", list(range(12)))
    scheduler = Scheduler(blocks, StateSlotAllocator(2), 64, prefix_cache=cache)
    # 3 cached (evictable) + 1 free: 20 tokens need 5 blocks, of which the hit supplies 2.
    waiting = Request("r", list(range(8)) + [70] * 12, SamplingParams(max_tokens=1))
    scheduler.add(waiting)
    assert scheduler.schedule().seqs == [] and waiting.status is RequestStatus.WAITING
    assert waiting.num_computed_tokens == 0
    blocks.check_integrity(), cache.check_integrity()


def test_the_router_sends_a_prompt_where_its_prefix_likely_is():
    from types import SimpleNamespace

    from router.prefix_routing import PrefixIndex
    from router.workers import WorkerRef, WorkerSet

    workers = WorkerSet(SimpleNamespace(transport="shm"))
    workers.model_facts = {"block_size": SIZE}
    workers.prefill = [WorkerRef(f"prefill-{i}", "prefill", None, prefixes=PrefixIndex(64)) for i in range(2)]
    system = block_hashes(list(range(40)), SIZE, [])  # 10 blocks
    first, charge = workers.pick_prefill(44, system)
    assert charge == 44 and first.queued_tokens == 44
    first.queued_tokens -= charge  # its prefill finished
    again, charge = workers.pick_prefill(44, system)
    assert again is first and charge == 4  # 40 tokens likely cached there
    other = workers.prefill[1] if first is workers.prefill[0] else workers.prefill[0]
    first.queued_tokens += 100  # with a long queue there, the saving is not worth the wait
    assert workers.pick_prefill(44, system)[0] is other

    workers.decode = [WorkerRef(f"decode-{i}", "decode", None, prefixes=PrefixIndex(64),
                                stats={"state_slots_free": 4, "kv_blocks_free": 100 - i}) for i in range(2)]
    chat = block_hashes(list(range(36)), SIZE, [])
    workers.decode[1].prefixes.add(chat)  # it answered the previous turn
    chosen, cached = workers.pick_decode(39, chat, local_limit=8)
    assert chosen is workers.decode[1] and cached == 36
    chosen, cached = workers.pick_decode(39, chat, local_limit=0)  # no local prefill: room decides
    assert chosen is workers.decode[0]
    index = PrefixIndex(3)
    index.add(chat[:5])
    assert len(index) == 3 and index.matched_blocks(chat) == 0  # the oldest keys went first


def test_the_router_index_follows_the_workers_reports_and_guesses_only_the_gap():
    from router.prefix_routing import PrefixIndex

    chat = block_hashes(list(range(36)), SIZE, [])  # 9 blocks
    index = PrefixIndex(64)
    index.apply({"reset": True, "events": [("+", "pool", chat[3], 16), ("+", "disk", chat[7], 32)]})
    assert index.matched_blocks(chat) == 8  # the longest usable prefix, whatever is before it
    assert index.tiers_of(chat[7]) == {"disk"}
    index.apply({"reset": False, "events": [("+", "host", chat[7], 32), ("-", "disk", chat[7], 32)]})
    assert index.tiers_of(chat[7]) == {"host"}
    index.apply({"reset": False, "events": [("-", "host", chat[7], 32)]})
    assert index.matched_blocks(chat) == 4 and chat[7] not in index.held
    index.add(chat)  # sent there: a guess until the worker has reported on it
    assert index.matched_blocks(chat) == 9
    index.apply({"reset": False, "events": []})  # may have been in flight during this report
    assert index.matched_blocks(chat) == 9
    index.apply({"reset": False, "events": []})  # the worker reported it does not hold it
    assert index.matched_blocks(chat) == 4
    index.apply({"reset": True, "events": []})  # a restart, or a report that overflowed
    assert index.matched_blocks(chat) == 0 and len(index) == 0


def test_the_router_fetches_a_prefix_only_a_report_shows_and_only_where_it_pays():
    from router.prefix_fetch import plan_fetch
    from router.prefix_routing import PrefixIndex
    from router.workers import WorkerRef

    chat = block_hashes(list(range(40)), SIZE, [])  # 10 blocks

    def worker(name, kind, node="a"):  # every one with a host tier: where entries are staged and land
        return WorkerRef(name, kind, None, node_id=node, prefixes=PrefixIndex(64), stats={"tier_host_bytes": 0})

    target = worker("prefill-0", "prefill")
    other = worker("prefill-1", "prefill", node="b")
    decode = worker("decode-0", "decode")
    workers = [target, other, decode]
    other.prefixes.add(chat)  # only sent there: not reported, so not fetched from
    assert plan_fetch(workers, target, chat, 0, SIZE, 8) is None
    decode.prefixes.apply({"reset": True, "events": [("+", "pool", chat[7], 32)]})
    plan = plan_fetch(workers, target, chat, 16, SIZE, 8)
    assert plan.source is decode and plan.tokens == 32 and plan.hashes == chat[:8]
    assert plan_fetch(workers, target, chat, 28, SIZE, 8) is None  # saves 4 tokens: recomputed
    assert plan_fetch(workers, target, chat, 16, SIZE, 0) is None  # fetching off
    other.prefixes.apply({"reset": True, "events": [("+", "host", chat[7], 32)]})
    assert plan_fetch(workers, target, chat, 0, SIZE, 8).source is decode  # as long, on the target's node
    other.node_id = "a"
    assert plan_fetch(workers, target, chat, 0, SIZE, 8).source is other  # then a prefill worker
    other.draining, decode.alive = True, False
    assert plan_fetch(workers, target, chat, 0, SIZE, 8) is None
    other.draining, decode.alive = False, True
    del other.stats["tier_host_bytes"]  # no host tier to stage the entry in: not a source
    assert plan_fetch(workers, target, chat, 0, SIZE, 8).source is decode
    del target.stats["tier_host_bytes"]  # no host tier to take the entry
    assert plan_fetch(workers, target, chat, 0, SIZE, 8) is None
    assert plan_fetch([target], target, chat, 0, SIZE, 8) is None


def test_a_fetch_goes_ahead_only_where_moving_the_entry_beats_recomputing_it():
    """The entry's bytes over the link plus the fixed cost against the target's measured
    prefill rate: a heavy checkpoint or a fast prefill makes a short prefix cheaper to recompute."""
    from router.prefix_fetch import plan_fetch
    from router.prefix_routing import PrefixIndex
    from router.workers import WorkerRef

    chat = block_hashes(list(range(40)), SIZE, [])  # 10 blocks
    target = WorkerRef("prefill-0", "prefill", None, node_id="a", prefixes=PrefixIndex(64),
                       stats={"tier_host_bytes": 0})
    source = WorkerRef("decode-0", "decode", None, node_id="b", prefixes=PrefixIndex(64),
                       stats={"tier_host_bytes": 0})
    source.prefixes.apply({"reset": True, "events": [("+", "pool", chat[7], 32)]})  # 32 tokens: 8 blocks
    link, overhead = 1e9, 0.002  # bytes/s, s

    def plan(rate: float, block_bytes: int, state_bytes: int, link_bytes_per_s: float = link):
        target.stats.update(prefill_tokens_per_s=rate, prefix_entry_block_bytes=block_bytes,
                            prefix_entry_state_bytes=state_bytes)
        return plan_fetch([target, source], target, chat, 0, SIZE, 8, link_bytes_per_s, overhead)

    # 32 tokens at 1,000 tokens/s: 32 ms to recompute; 8 blocks of 1 MB and a 10 MB checkpoint
    # take 18 ms + 2 ms to move
    assert plan(1_000, 1 << 20, 10 << 20) is not None
    assert plan(2_000, 1 << 20, 10 << 20) is None  # 16 ms to recompute: not worth 20
    assert plan(1_000, 1 << 20, 40 << 20) is None  # a 40 MB checkpoint: 50 ms to move
    assert plan(1_000, 1 << 20, 40 << 20, link_bytes_per_s=4e9) is not None  # a faster link: 14.5 ms
    assert plan(0.0, 1 << 20, 40 << 20) is not None  # no rate measured yet: the token floor alone
    target.stats.pop("prefix_entry_block_bytes"), target.stats.pop("prefix_entry_state_bytes")
    target.stats["prefill_tokens_per_s"] = 1e9
    assert plan_fetch([target, source], target, chat, 0, SIZE, 8, link, overhead) is not None  # sizes unknown


@pytest.mark.parametrize("num_blocks, ahead", [(100, 1), (4096, 64)])
def test_a_large_pool_evicts_ahead_so_one_block_allocations_do_not_each_scan_the_index(num_blocks, ahead):
    blocks = BlockManager(num_blocks, SIZE)
    cache = PrefixCache(blocks, 0, needs_state=False)
    for chain in range(num_blocks // 4):  # the pool full of cached chains of 4 blocks
        tokens = [chain * 1000 + i for i in range(4 * SIZE)]
        cache.insert(block_hashes(tokens, SIZE, []), blocks.allocate(f"r{chain}", 4 * SIZE))
        blocks.free(f"r{chain}")
    calls = []
    evict = blocks.evictor
    blocks.evictor = lambda count: calls.append(count) or evict(count)
    for i in range(ahead):
        blocks.allocate(f"d{i}", SIZE)
    assert len(calls) == 1 and blocks.num_free_blocks == 0 and len(cache.nodes) == num_blocks - ahead
    blocks.allocate("next", SIZE)
    assert len(calls) == 2
    cache.check_integrity()


def test_serve_flags_reach_the_workers_engine_options():
    from router.cli import build_parser, serve_options

    args = build_parser().parse_args(["serve", "--enable-prefix-caching", "--prefix-checkpoints", "16",
                                      "--local-prefill-tokens", "128", "--prefix-fetch-tokens", "64",
                                      "--prefix-fetch-gbps", "100", "--prefix-fetch-overhead-ms", "1.5"])
    launch_options, _ = serve_options(args)
    assert (launch_options["prefix_fetch_gbps"], launch_options["prefix_fetch_overhead_ms"]) == (100.0, 1.5)
    assert launch_options["enable_prefix_caching"] is True and launch_options["prefix_checkpoints"] == 16
    assert launch_options["local_prefill_tokens"] == 128 and launch_options["prefix_fetch_tokens"] == 64
    plain, _ = serve_options(build_parser().parse_args(["serve"]))
    assert "enable_prefix_caching" not in plain
