"""The prefix cache's lower tiers (engine.tiered_cache): what the pool evicts moves to host
memory and to disk, whole, and comes back as a pool hit; outputs stay those of no caching."""

from __future__ import annotations

import errno
import random

import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.disk_tier import DiskTier
from engine.host_arena import ALIGNMENT, HostArena
from engine.host_tier import Entry, HostTier, TierConfig

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
# A pool too small for the working set: 2 checkpoint rows, 30 blocks of 4 tokens.
SMALL_POOL = dict(block_size=4, enable_prefix_caching=True, num_kv_blocks=30, prefix_checkpoints=2, max_num_seqs=2)


def chat_trace(path, seed: int = 1, chats: int = 6, turns: int = 3) -> tuple[list, list]:
    """(prompts, their outputs without caching): chats taking turns, each turn's prompt the
    chat's last prompt, its answer and a new message; turn after turn, one chat after another,
    so the chats between evict a chat's prefix from the small pool."""
    rng = random.Random(seed)
    llm = LLM(str(path), block_size=4)
    history = [[rng.randrange(3, 300) for _ in range(30)] for _ in range(chats)]
    prompts, outputs = [], []
    for _ in range(turns):
        for chat in range(chats):
            prompt = history[chat] + [rng.randrange(3, 300) for _ in range(5)]
            [out] = llm.generate([prompt], GREEDY)
            prompts.append(prompt)
            outputs.append(out.token_ids)
            history[chat] = prompt + out.token_ids
    return prompts, outputs


def one_by_one(llm: LLM, prompts) -> list[list[int]]:
    """Each prompt after the one before finished: every later turn finds its chat's prefix
    evicted from the small pool by the chats between."""
    outs = [out.token_ids for prompt in prompts for out in llm.generate([prompt], GREEDY)]
    if llm.engine.tiers is not None:
        llm.engine.tiers.flush()  # the disk tier's queued writes
    llm.engine.check_integrity()
    assert llm.engine.blocks.num_available_blocks == llm.engine.blocks.num_blocks
    return outs


@pytest.mark.parametrize("name", ["jamba", "qwen3_next", "llama", "mamba"])
def test_tiers_turn_evictions_into_hits_and_keep_the_outputs(name, model_factory, tmp_path):
    path, _ = model_factory(name)
    prompts, expected = chat_trace(path)
    pool_only = LLM(str(path), **SMALL_POOL)
    assert one_by_one(pool_only, prompts) == expected
    for tiers in (dict(host_cache_bytes=1 << 22), dict(disk_cache_dir=str(tmp_path / name), disk_cache_bytes=1 << 24),
                  dict(host_cache_bytes=1 << 16, disk_cache_dir=str(tmp_path / f"{name}-both"),
                       disk_cache_bytes=1 << 24)):
        llm = LLM(str(path), **SMALL_POOL, **tiers)
        assert one_by_one(llm, prompts) == expected, tiers
        stats = llm.engine.stats()
        assert stats["tier_spills"] > 0 and stats["tier_host_hits"] + stats["tier_disk_hits"] >= 6, stats
        assert stats["prefix_cache_hit_tokens"] > pool_only.engine.stats()["prefix_cache_hit_tokens"] + 200
        assert stats["tier_host_hits" if "disk_cache_dir" not in tiers else "tier_disk_hits"] > 0, stats
    # the small host tier pushed its entries down to disk
    assert stats["tier_disk_entries"] > 0 and 0 < stats["tier_host_bytes"] <= 1 << 16, stats


def test_requests_that_share_an_evicted_prefix_load_it_once(model_factory):
    """Two requests waiting at once whose prefix only a tier holds: the first admission loads
    it into the pool, the second finds it there as a pool hit."""
    path, _ = model_factory("jamba")
    prompts, expected = chat_trace(path, 5)
    llm = LLM(str(path), **SMALL_POOL, host_cache_bytes=1 << 22)
    one_by_one(llm, prompts[:6])  # the first turns; then each later chat's prefix is in the tier
    twins = [prompts[6], prompts[6]]
    assert [out.token_ids for out in llm.generate(twins, GREEDY)] == [expected[6]] * 2
    stats = llm.engine.stats()
    assert stats["tier_host_hits"] == 1, stats
    assert stats["prefix_cache_hit_tokens"] >= 2 * stats["tier_loaded_tokens"], stats
    llm.engine.check_integrity()


def test_the_disk_tier_is_warm_across_a_restart_and_cold_for_another_layout(model_factory, tmp_path):
    path, _ = model_factory("jamba")
    prompts, expected = chat_trace(path, 2)
    disk = dict(disk_cache_dir=str(tmp_path), disk_cache_bytes=1 << 24)
    one_by_one(LLM(str(path), **SMALL_POOL, **disk), prompts[:6])  # fills the disk, then goes away
    restarted = LLM(str(path), **SMALL_POOL, **disk)
    assert one_by_one(restarted, prompts[6:12]) == expected[6:12]
    assert restarted.engine.stats()["tier_disk_hits"] >= 5
    # another block size is another layout: its folder is its own, the old entries never read
    other = LLM(str(path), **{**SMALL_POOL, "block_size": 8}, **disk)
    assert one_by_one(other, prompts[6:12]) == expected[6:12]
    assert other.engine.stats()["tier_disk_hits"] == 0
    assert len([d for d in tmp_path.iterdir() if d.is_dir()]) == 2


def test_the_disk_tier_finds_what_a_worker_sharing_its_folder_wrote_once_it_lists_again(tmp_path, monkeypatch):
    """A lookup for a prefix never written makes no file system call (the folder's listing
    answers); this worker's own writes are known at once, another's once the listing is
    LISTING_S old."""
    from engine import disk_tier

    monkeypatch.setattr(disk_tier, "LISTING_S", 60.0)  # no listing again until the test says
    shapes = {"kv:x": ((4,), torch.float32)}
    mine, theirs = DiskTier(str(tmp_path), 1 << 20, "layout"), DiskTier(str(tmp_path), 1 << 20, "layout")

    def entry(key: int) -> Entry:
        return Entry([bytes([key])], 4, {"kv:x": torch.full((1, 4), float(key))})

    assert not mine.may_hold(bytes([1]), 4)  # listed now: empty
    mine.put(entry(1))
    mine.flush()
    theirs.put(entry(2))
    theirs.flush()
    assert mine.may_hold(bytes([1]), 4) and not mine.may_hold(bytes([2]), 4)
    assert mine.get(bytes([2]), 4, [bytes([2])], shapes) is None  # not listed yet: not looked for
    monkeypatch.setattr(disk_tier, "LISTING_S", 0.0)
    got = mine.get(bytes([2]), 4, [bytes([2])], shapes)
    assert got is not None and torch.equal(got.tensors["kv:x"], entry(2).tensors["kv:x"])
    # a listed file another worker removed since: a miss, not a damaged entry
    monkeypatch.setattr(disk_tier, "LISTING_S", 60.0)
    theirs.path(bytes([2]), 4).unlink()
    assert mine.may_hold(bytes([2]), 4) and mine.get(bytes([2]), 4, [bytes([2])], shapes) is None
    assert mine.removed_bad == 0


def test_the_disk_tier_counts_its_bytes_without_listing_the_folder_for_each_write_or_report(tmp_path, monkeypatch):
    """stats() and the writer's room check read totals kept by this worker's own writes and
    removals (a listing, a stat per file, at most every USAGE_S); a write over budget frees
    HEADROOM below it, so the next writes list nothing."""
    from engine import disk_tier

    monkeypatch.setattr(disk_tier, "USAGE_S", 60.0)
    listings = []
    real_files = DiskTier.files
    monkeypatch.setattr(DiskTier, "files", lambda self: listings.append(1) or real_files(self))

    def entry(key: int) -> Entry:
        return Entry([bytes([key])], 4, {"kv:x": torch.full((1, 256), float(key))})

    probe = DiskTier(str(tmp_path / "probe"), 1 << 20, "layout")
    probe.put(entry(0))
    probe.flush()
    size = probe.usage()[0]  # one entry file's bytes, all alike here
    tier = DiskTier(str(tmp_path), 10 * size, "layout")
    listings.clear()
    for key in range(10):
        tier.put(entry(key))
        tier.flush()
    assert tier.usage() == (10 * size, 10) and len(listings) == 1  # the first write's room check alone
    on_disk = [f for f in (tmp_path / "layout").iterdir() if not f.name.startswith(".")]
    assert sum(f.stat().st_size for f in on_disk) == 10 * size
    tier.put(entry(10))  # over budget: one listing, and room for this write and the next
    tier.flush()
    assert tier.usage() == (9 * size, 9) and len(listings) == 2
    left = sorted(disk_tier.key_of(f)[0] for f in (tmp_path / "layout").glob("*.safetensors"))
    assert left == [bytes([k]) for k in range(2, 11)]  # the two oldest went
    tier.put(entry(11))
    tier.flush()
    assert tier.usage() == (10 * size, 10) and len(listings) == 2
    assert len(list((tmp_path / "layout").glob("*.safetensors"))) == 10


def entry_files(tmp_path):
    return sorted(f for d in tmp_path.iterdir() if d.is_dir() for f in d.glob("*.safetensors"))


@pytest.mark.parametrize("damage", ["truncate", "flip", "garbage", "other_chain"])
def test_a_damaged_disk_entry_is_refused_removed_and_recomputed(damage, model_factory, tmp_path):
    path, _ = model_factory("jamba")
    prompts, expected = chat_trace(path, 3)
    disk = dict(disk_cache_dir=str(tmp_path), disk_cache_bytes=1 << 24)
    one_by_one(LLM(str(path), **SMALL_POOL, **disk), prompts[:6])
    files = entry_files(tmp_path)
    assert len(files) > 1
    good = files[0].read_bytes()
    for file in files[1:]:
        data = bytearray(file.read_bytes())
        if damage == "truncate":
            data = data[:len(data) // 2]
        elif damage == "flip":
            data[-5] ^= 0xFF  # in the tensor bytes: only the checksum notices
        elif damage == "garbage":
            data = bytearray(b"not a safetensors file")
        else:  # a whole, valid entry under another chain's name
            data = bytearray(good)
        file.write_bytes(bytes(data))
    llm = LLM(str(path), **SMALL_POOL, **disk)
    assert one_by_one(llm, prompts[6:12]) == expected[6:12]
    stats = llm.engine.stats()
    assert stats["tier_disk_removed_bad"] >= 1, stats
    gone = [file for file in files[1:] if not file.exists()]
    assert len(gone) == stats["tier_disk_removed_bad"]


@pytest.mark.parametrize("damaged", [False, True])
def test_requests_that_queue_find_their_disk_entries_read_ahead(damaged, model_factory, tmp_path):
    """Six chats' next turns at once on one slot: the five that queue have their disk entries
    read and verified on the reader thread meanwhile; a damaged file is still refused, removed
    and recomputed, on the engine's thread."""
    path, _ = model_factory("jamba")
    prompts, expected = chat_trace(path, 2)
    disk = dict(disk_cache_dir=str(tmp_path), disk_cache_bytes=1 << 24)
    one_by_one(LLM(str(path), **SMALL_POOL, **disk), prompts[:6])
    files = entry_files(tmp_path)
    if damaged:
        for file in files:
            data = bytearray(file.read_bytes())
            data[-5] ^= 0xFF
            file.write_bytes(bytes(data))
    llm = LLM(str(path), **{**SMALL_POOL, "max_num_seqs": 1}, **disk)
    assert [out.token_ids for out in llm.generate(prompts[6:12], GREEDY)] == expected[6:12]
    llm.engine.check_integrity()
    stats = llm.engine.stats()
    if damaged:
        assert stats["tier_disk_hits"] == stats["tier_disk_read_ahead"] == 0, stats
        assert stats["tier_disk_removed_bad"] >= 5, stats
    else:
        assert stats["tier_disk_hits"] >= 5 and stats["tier_disk_read_ahead"] >= 4, stats


def test_a_full_disk_and_a_crashed_write_lose_entries_not_requests(model_factory, tmp_path, monkeypatch):
    import engine.disk_tier as tiered

    path, _ = model_factory("jamba")
    prompts, expected = chat_trace(path, 4)
    folder = tmp_path / "cache"
    disk = dict(disk_cache_dir=str(folder), disk_cache_bytes=1 << 24)

    def full(tensors, filename, metadata=None):
        open(filename, "wb").write(b"half an entr")  # what a write that ran out of room leaves
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(tiered, "save_file", full)
    llm = LLM(str(path), **SMALL_POOL, **disk)
    assert one_by_one(llm, prompts) == expected
    stats = llm.engine.stats()
    assert stats["tier_disk_write_errors"] > 0 and stats["tier_disk_entries"] == 0, stats
    assert not list(folder.rglob(".tmp-*"))  # the half-written files were removed
    monkeypatch.undo()
    # A crash mid-write leaves a temporary file: never read as an entry, removed at the next start.
    [layout_dir] = [d for d in folder.iterdir() if d.is_dir()]
    (layout_dir / ".tmp-999-40-00.safetensors").write_bytes(b"half")
    LLM(str(path), **SMALL_POOL, **disk)
    assert not list(folder.rglob(".tmp-*"))


def test_the_host_tier_keeps_its_budget_and_evicts_the_least_useful():
    unit = 64  # the arena's alignment: an entry of `end` tokens below takes `end` units

    def entry(key: int, end: int, used: float) -> Entry:
        return Entry([bytes([key])], end, {"kv:x": torch.full((end, unit), key, dtype=torch.uint8)}, last_used=used)

    tier = HostTier(budget=100 * unit, below=True)
    assert tier.put(entry(1, 40, 1.0)) == [] and tier.put(entry(2, 40, 2.0)) == []
    pushed = tier.put(entry(3, 40, 3.0))  # 120 units: the oldest of equal length goes down
    assert [e.keys for e in pushed] == [[bytes([1])]] and tier.nbytes == 80 * unit
    assert torch.equal(pushed[0].tensors["kv:x"], entry(1, 40, 0).tensors["kv:x"])  # its own copy
    assert tier.put(entry(4, 20, 4.0)) == [] and tier.nbytes == 100 * unit
    assert [e.keys for e in tier.put(entry(5, 200, 5.0))] == [[bytes([5])]]  # larger than the tier
    # Over budget again: the short prefix goes before older long ones (it saves less compute),
    # then the oldest.
    assert [e.keys for e in tier.put(entry(6, 40, 6.0))] == [[bytes([4])], [bytes([2])]]
    assert tier.nbytes == 80 * unit and tier.take(bytes([3])) is not None and tier.nbytes == 40 * unit
    # what is held was copied in, byte for byte, and the arena's free bytes are its budget's rest
    assert torch.equal(tier.entries[bytes([6])].tensors["kv:x"], entry(6, 40, 0).tensors["kv:x"])
    assert tier.arena.free_bytes == 60 * unit
    # 60 units free, but as two runs (40 and 20): 6 goes to make one run long enough
    assert [e.keys for e in tier.put(entry(7, 60, 7.0))] == [[bytes([6])]]
    # the incoming entry is a candidate too: shorter and older than all held, it goes straight down
    assert [e.keys for e in tier.put(entry(8, 50, 0.5))] == [[bytes([8])]] and list(tier.entries) == [bytes([7])]


def test_the_host_tier_evicts_until_a_free_run_is_long_enough():
    """Free bytes enough but in two runs: the tier evicts until one run takes the entry."""
    unit = 64

    def entry(key: int, end: int, used: float) -> Entry:
        return Entry([bytes([key])], end, {"kv:x": torch.full((end, unit), key, dtype=torch.uint8)}, last_used=used)

    tier = HostTier(budget=100 * unit)  # nothing below: what it pushes out is dropped
    for key, used in ((1, 1.0), (2, 2.0), (3, 3.0), (4, 4.0)):
        tier.put(entry(key, 25, used))
    tier.take(bytes([1]))
    tier.take(bytes([3]))  # 50 units free, as two runs of 25
    assert tier.put(entry(5, 40, 5.0)) == [] and tier.arena.free_bytes == 35 * unit
    assert sorted(tier.entries) == [bytes([4]), bytes([5])]  # 2 went: the oldest
    assert torch.equal(tier.entries[bytes([4])].tensors["kv:x"], entry(4, 25, 0).tensors["kv:x"])


def test_the_arena_hands_out_aligned_runs_and_merges_what_comes_back():
    arena = HostArena(10 * ALIGNMENT)
    a, b, c = arena.allocate(1), arena.allocate(3 * ALIGNMENT), arena.allocate(2 * ALIGNMENT + 1)
    assert (a, b, c) == (0, ALIGNMENT, 4 * ALIGNMENT) and arena.allocate(4 * ALIGNMENT) is None
    arena.release(b, 3 * ALIGNMENT)
    assert arena.allocate(4 * ALIGNMENT) is None  # 3 + 3 units free, not in one run
    arena.release(c, 2 * ALIGNMENT + 1)  # merges with the run before and the one after
    assert arena.allocate(9 * ALIGNMENT) == ALIGNMENT and arena.free_bytes == 0
    with pytest.raises(ValueError, match="released twice"):
        arena.release(a, 1) or arena.release(a, 1)
    views = arena.views(0, {"a": ((3,), torch.float16), "b": ((2, 2), torch.float32)})
    assert views["b"].data_ptr() - views["a"].data_ptr() == ALIGNMENT and views["b"].shape == (2, 2)


@pytest.mark.parametrize("options, names", [
    (dict(host_cache_bytes=1 << 20), "need enable_prefix_caching"),
    (dict(enable_prefix_caching=True, disk_cache_dir="/tmp/x"), "disk_cache_dir and disk_cache_bytes"),
    (dict(enable_prefix_caching=True, disk_cache_bytes=10), "disk_cache_dir and disk_cache_bytes"),
    (dict(enable_prefix_caching=True, host_cache_bytes=-1), "host_cache_bytes"),
])
def test_bad_tier_settings_are_refused_naming_them(options, names):
    with pytest.raises(ValueError, match=names):
        EngineConfig("engine/demo_model", **options)
    assert TierConfig().enabled is False


def held_now(engine) -> dict[bytes, set[str]]:
    """What the engine's pool and tiers hold, usable for a hit, by key."""
    held: dict[bytes, set[str]] = {}
    for key, _ in engine.prefix_cache.usable():
        held.setdefault(key, set()).add("pool")
    for tier, key, _ in engine.tiers.held():
        held.setdefault(key, set()).add(tier)
    return held


@pytest.mark.parametrize("limit", [16384, 5])
def test_the_cache_events_rebuild_exactly_what_the_worker_holds(limit, model_factory, tmp_path):
    """The router's index, fed only the drained events (engine.cache_events), equals what the
    pool and the tiers hold after every request, under eviction pressure; with a tiny event
    buffer it overflows, and the reset's snapshot makes it exact again. A restarted worker's
    first report is a snapshot of its disk."""
    from engine.cache_events import CacheEvents
    from router.prefix_routing import PrefixIndex

    path, _ = model_factory("jamba")
    prompts, _ = chat_trace(path, 6)
    tiers = dict(host_cache_bytes=1 << 17, disk_cache_dir=str(tmp_path), disk_cache_bytes=1 << 24)
    llm = LLM(str(path), **SMALL_POOL, **tiers)
    llm.engine.cache_events = events = CacheEvents(llm.engine._usable_prefixes, limit=limit)
    llm.engine.prefix_cache.events = events
    llm.engine.tiers.attach_events(events)
    index, resets = PrefixIndex(64), 0
    for prompt in prompts:
        llm.generate([prompt], GREEDY)
        llm.engine.tiers.flush()
        report = llm.engine.drain_cache_events()
        resets += report["reset"]
        index.apply(report)
        assert index.held == held_now(llm.engine)
    assert {"pool", "host", "disk"} <= set().union(*index.held.values())
    assert resets == 1 if limit > 100 else resets > 1  # the first report; then overflows
    restarted = LLM(str(path), **SMALL_POOL, **tiers)
    report = restarted.engine.drain_cache_events()
    assert report["reset"] and {key for _, tier, key, _ in report["events"] if tier == "disk"} == \
        {key for key, tiers in held_now(restarted.engine).items() if "disk" in tiers} != set()
