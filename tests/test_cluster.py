"""The disaggregated cluster on a 3-node Ray cluster (ray.cluster_utils) on this machine.

Its workers cache prefixes, so every test here also checks that caching changes no output."""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from engine import LLM, SamplingParams
from tests.oracle import assert_same_tokens, judge_greedy

ray = pytest.importorskip("ray")

from tests.conftest import DECODE_RES, PREFILL_RES, free_port

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def cluster(ray_nodes, model_factory):
    from router.cluster import launch

    path, hf = model_factory("jamba")
    handle = launch(path, prefill=2, decode=2, address=ray_nodes[0].address,
                    prefill_resource=PREFILL_RES, decode_resource=DECODE_RES,
                    block_size=4, num_kv_blocks=400, max_num_seqs=32, transfer_timeout_s=15.0,
                    enable_prefix_caching=True)
    yield handle, path, hf, ray_nodes
    handle.shutdown()


def idle(cluster) -> bool:
    status = cluster.status()["workers"]
    return all(w["alive"] and not w["running"] and not w["waiting"]
               and w["kv_blocks_free"] == w["kv_blocks_total"]
               and w["state_slots_free"] == w["state_slots_total"] for w in status)


def wait_idle(cluster, timeout=15.0):
    deadline = time.monotonic() + timeout
    while not idle(cluster):
        assert time.monotonic() < deadline, f"workers still hold requests: {cluster.status()}"
        time.sleep(0.1)


def test_workers_land_on_their_node_kinds(cluster):
    handle, _, _, (_, prefill_node, decode_node) = cluster
    kinds = {w["id"]: (w["kind"], w["node"]) for w in handle.status()["workers"]}
    assert sorted(kinds) == ["decode-0", "decode-1", "prefill-0", "prefill-1"]
    for kind, node in kinds.values():
        assert node == (prefill_node if kind == "prefill" else decode_node)
    assert handle.workers.transport == "gloo"  # different nodes: the cross-node transport


def test_64_concurrent_requests_match_transformers_and_colocated(cluster):
    handle, path, hf, _ = cluster
    rng = random.Random(64)
    lengths = [1, 1, 2, 3, 4, 5, 8, 9] + [rng.randint(1, 60) for _ in range(56)]
    prompts = [[rng.randrange(3, 300) for _ in range(n)] for n in lengths]
    outs = handle.generate(prompts, GREEDY)
    local = LLM(path, block_size=4).generate(prompts, GREEDY)
    for prompt, out, ref in zip(prompts, outs, local):
        assert out.error is None and out.finish_reason == "length", out.error
        judge_greedy(hf, prompt, out.token_ids)
        assert_same_tokens(hf, prompt, out.token_ids, ref.token_ids)
    handoffs = sum(w.get("handoff_count", 0) for w in handle.status()["workers"])
    assert handoffs >= 64
    wait_idle(handle)


def test_max_tokens_one_and_cancellation_free_everything(cluster):
    handle, path, hf, _ = cluster
    outs = handle.generate([[5, 6, 7], [9]], SamplingParams(max_tokens=1, temperature=0.0))
    assert [len(o.token_ids) for o in outs] == [1, 1]
    judge_greedy(hf, [5, 6, 7], outs[0].token_ids)

    async def cancel_midway(n_tokens):
        got = 0
        agen = handle.stream(f"cancel-{n_tokens}", [4] * 20, SamplingParams(max_tokens=500, ignore_eos=True))
        async for out in agen:
            got += len(out.new_token_ids)
            if got >= n_tokens:
                break
        await agen.aclose()
        return got

    async def cancel_before_any_token():
        task = asyncio.ensure_future(_drain(handle.stream("cancel-early", [3] * 40, GREEDY)))
        await asyncio.sleep(0.01)
        task.cancel()

    async def main():
        await asyncio.gather(cancel_midway(1), cancel_midway(5), cancel_before_any_token())

    asyncio.run(main())
    wait_idle(handle)


def test_a_stream_without_whole_outputs_sends_what_is_new_then_a_whole_final(cluster):
    """whole=False (what the API front door asks for): a step's output does not carry the
    prompt and everything so far; the tokens and logprobs add up to the whole=True stream's."""
    handle, _, _, _ = cluster
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=1)
    prompt = list(range(240, 270))  # no other test's prefix: the workers cache prefixes

    async def collect(request_id, whole):
        return [out async for out in handle.stream(request_id, prompt, params, whole=whole)]

    async def main():
        return await asyncio.gather(collect("whole", True), collect("deltas", False))

    whole, deltas = asyncio.run(main())
    final = whole[-1]
    assert final.finished and deltas[-1].finished and len(deltas) > 2
    assert all(out.prompt_token_ids == prompt and len(out.token_ids) == len(out.logprobs) > 0 for out in whole)
    for out in deltas[:-1]:
        assert not (out.prompt_token_ids or out.token_ids or out.text or out.logprobs), out
    tokens = [t for out in deltas for t in out.new_token_ids]
    logprobs = [entry["token"] for out in deltas for entry in out.new_logprobs or []]
    assert tokens == deltas[-1].token_ids == final.token_ids and len(tokens) == 12
    assert deltas[-1].prompt_token_ids == final.prompt_token_ids
    assert logprobs == pytest.approx([entry["token"] for entry in final.logprobs], abs=1e-4)
    assert [entry["token"] for entry in deltas[-1].logprobs] == logprobs
    # The final output says where the time went, as each process measured it (engine.trace).
    spans = {(s.where.split("-")[0], s.name.split(" on ")[0].split(" to ")[0]): s for s in final.spans}
    assert set(spans) == {("router", "request"), ("router", "reserve"), ("router", "prefill call"), ("router", "first token"),
                          ("prefill", "queued"), ("prefill", "prefill"), ("prefill", "hand-off"),
                          ("decode", "awaiting hand-off"), ("decode", "decode")}, spans
    request = spans["router", "request"]
    assert all(request.start_ns <= s.start_ns <= s.end_ns <= request.end_ns + 5_000_000 for s in final.spans)
    prefill, handoff, awaiting = spans["prefill", "prefill"], spans["prefill", "hand-off"], spans["decode", "awaiting hand-off"]
    # The reservation runs beside the prefill; the hand-off goes once both are done, and lands after.
    assert prefill.start_ns <= prefill.end_ns <= handoff.start_ns
    assert awaiting.start_ns <= handoff.start_ns <= awaiting.end_ns
    # The router's first token follows the prefill's (each process converts its clock to the
    # wall clock itself: the same slack as above).
    assert prefill.end_ns <= spans["router", "first token"].end_ns + 5_000_000
    wait_idle(handle)


async def _drain(agen):
    async for _ in agen:
        pass


def test_conditional_disaggregation_prefills_short_prompts_on_the_decoder(cluster):
    handle, path, hf, _ = cluster

    def handoffs():
        time.sleep(0.6)  # let the router's stats refresh
        return sum(w.get("handoff_count", 0) for w in handle.status()["workers"])

    before = handoffs()
    handle.config.local_prefill_tokens = 8
    try:
        prompts = [[5] * 3, [6] * 8, [7] * 9, [8] * 30]
        outs = handle.generate(prompts, GREEDY)
    finally:
        handle.config.local_prefill_tokens = 0
    for prompt, out in zip(prompts, outs):
        assert out.error is None, out.error
        judge_greedy(hf, prompt, out.token_ids)
    assert handoffs() - before == 2  # only the 9- and 30-token prompts were split
    wait_idle(handle)


def test_packed_pair_shares_a_node_and_uses_shared_memory(cluster):
    from router.cluster import launch

    handle, path, hf, (nodes, _, _) = cluster
    packed = launch(path, prefill=1, decode=1, address=nodes.address, pack_pairs=True,
                    prefill_resource=None, decode_resource=None,
                    block_size=4, num_kv_blocks=200, max_num_seqs=8)
    try:
        workers = packed.status()["workers"]
        assert len({w["node"] for w in workers}) == 1
        assert packed.workers.transport == "shm"
        prompts = [[9, 8, 7], [1], [4] * 17]
        for prompt, out in zip(prompts, packed.generate(prompts, GREEDY)):
            judge_greedy(hf, prompt, out.token_ids)
    finally:
        packed.shutdown()


def test_decode_workers_speculate_across_the_split(cluster):
    """ngram speculation on the decode side of a pair: the outputs are the plain decode's, and
    the decode worker reports its drafts (the prefill worker has none)."""
    from router.cluster import launch

    handle, path, hf, (nodes, _, _) = cluster
    speculating = launch(path, prefill=1, decode=1, address=nodes.address, pack_pairs=True,
                         prefill_resource=None, decode_resource=None, block_size=4, num_kv_blocks=200,
                         max_num_seqs=8, speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                                             "adaptive": False})
    try:
        prompts = [[9, 8, 7] * 5, [1], [4] * 17, [5, 6, 7, 8] * 4]
        params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
        local = LLM(path, block_size=4).generate(prompts, params)
        for prompt, out, ref in zip(prompts, speculating.generate(prompts, params), local):
            assert out.error is None, out.error
            assert_same_tokens(hf, prompt, out.token_ids, ref.token_ids)
        workers = {w["kind"]: w for w in speculating.status()["workers"]}
        assert 0 < workers["decode"]["spec_accepted_tokens"] < workers["decode"]["spec_draft_tokens"]
        assert "spec_drafts" not in workers["prefill"]
    finally:
        speculating.shutdown()


def test_an_mtp_head_speculates_across_nodes(cluster, tmp_path):
    """method 'mtp' on a pair on separate nodes (the gloo transport): the head's KV and g are
    one more layer of the hand-off, the handshake agrees on it, and the outputs are the plain
    decode's. (What the decode side drafts from them is checked in tests/test_mtp.py.)"""
    from router.cluster import launch
    from tests.mtp_oracle import save_mtp_model

    _, _, _, (nodes, _, _) = cluster
    hf, _ = save_mtp_model(tmp_path)
    speculating = launch(str(tmp_path), prefill=1, decode=1, address=nodes.address,
                         prefill_resource=PREFILL_RES, decode_resource=DECODE_RES, block_size=4, num_kv_blocks=200,
                         max_num_seqs=8, speculative_config={"method": "mtp", "num_speculative_tokens": 2,
                                                             "adaptive": False})
    try:
        prompts = [[9, 8, 7] * 5, [1], [4] * 17]
        params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
        local = LLM(str(tmp_path), block_size=4).generate(prompts, params)
        for prompt, out, ref in zip(prompts, speculating.generate(prompts, params), local):
            assert out.error is None, out.error
            assert_same_tokens(hf, prompt, out.token_ids, ref.token_ids)
        workers = {w["kind"]: w for w in speculating.status()["workers"]}
        assert workers["decode"]["spec_draft_tokens"] > 0
    finally:
        speculating.shutdown()


def test_splitserve_serve_serves_and_stops_cleanly_on_ctrl_c(cluster, tmp_path):
    import os
    import signal
    import subprocess
    import sys

    from ray._private import state  # the GCS view; the state API needs the dashboard

    from router.client import SplitServeClient

    handle, path, hf, (nodes, _, _) = cluster

    def alive_actors():
        return {actor_id for actor_id, info in state.actors().items() if info["State"] == "ALIVE"}

    before = alive_actors()
    grpc_port, http_port = free_port(), free_port()
    env = {**os.environ, "SPLITSERVE_AUTH_TOKEN": ""}
    proc = subprocess.Popen(
        [sys.executable, "-m", "router.cli", "serve", "--model", str(path), "--address", nodes.address,
         "--grpc-port", str(grpc_port), "--http-port", str(http_port), "--num-kv-blocks", "100",
         "--block-size", "4"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        with SplitServeClient(f"127.0.0.1:{grpc_port}", auth_token="") as client:
            deadline = time.monotonic() + 90
            while True:
                try:
                    if client.health(timeout=2):
                        break
                except Exception:
                    pass
                assert proc.poll() is None, proc.stdout.read()
                assert time.monotonic() < deadline, "server did not become healthy"
                time.sleep(0.5)
            done = client.generate([5, 6, 7], max_tokens=6, temperature=0.0, ignore_eos=True)
        judge_greedy(hf, [5, 6, 7], list(done.token_ids))
        assert len(alive_actors() - before) == 2  # its prefill and decode workers
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    deadline = time.monotonic() + 20
    while alive_actors() - before:
        assert time.monotonic() < deadline, "serve left actors behind"
        time.sleep(0.5)


def test_stalled_handoff_is_retried_and_workers_keep_serving(cluster):
    """A hand-off that starts and never finishes times out on both sides, frees its rows, and
    the router runs the request again: the caller sees a normal, correct answer."""
    handle, path, hf, _ = cluster
    retries_before = handle.retries
    for p in handle.workers.prefill:
        ray.get(p.handle.inject_stalled_handoffs.remote(1))
    prompts = [[7, 7, 7], [8, 8, 8]]
    try:
        outs = handle.generate(prompts, GREEDY)
    finally:
        for p in handle.workers.prefill:  # no leftover fault for later tests
            ray.get(p.handle.inject_stalled_handoffs.remote(0))
    for prompt, out in zip(prompts, outs):
        assert out.error is None and out.finish_reason == "length", out
        judge_greedy(hf, prompt, out.token_ids)
    assert handle.retries - retries_before >= 1
    wait_idle(handle)
    deadline = time.monotonic() + 30  # the router reconnects channels a dead hand-off broke
    while handle._run(handle.workers.repair_channels()):
        assert time.monotonic() < deadline, "prefill -> decode channels were not repaired"
        time.sleep(0.2)
    # Enough requests that every prefill -> decode pair carries some: no channel stays broken.
    prompts = [[7, 7, 7 + i] for i in range(8)]
    for prompt, healthy in zip(prompts, handle.generate(prompts, GREEDY)):
        assert healthy.error is None, healthy.error
        judge_greedy(hf, prompt, healthy.token_ids)
    failures = sum(w.get("handoff_failures", 0) for w in handle.status()["workers"])
    assert failures >= 1


def test_a_retry_after_a_broken_channel_waits_for_the_pair_to_be_repaired(cluster):
    """Every prefill -> decode channel breaks at once (as a timed-out hand-off breaks its
    wire): the router pairs the workers again before it retries, so the retries do not all
    fail on the same broken channel within a few milliseconds (a CI failure of the stall test)."""
    handle, path, hf, _ = cluster
    handle._run(handle.workers.repair_channels())  # start from healthy channels
    for p in handle.workers.prefill:
        ray.get(p.handle.inject_broken_channels.remote())
    prompts = [[9, 9, 9 + i] for i in range(4)]
    for prompt, out in zip(prompts, handle.generate(prompts, GREEDY)):
        assert out.error is None and out.finish_reason == "length", out
        judge_greedy(hf, prompt, out.token_ids)
    assert handle._run(handle.workers.repair_channels()) == 0


def worker_stats(handle, key):
    time.sleep(0.6)  # let the router's stats refresh
    return {w["id"]: w.get(key, 0) for w in handle.status()["workers"]}


def test_prefix_caching_finds_the_worker_that_holds_the_prefix(cluster):
    """A shared system prompt goes to one prefill worker, which checkpoints where the second
    request leaves it and serves the rest from there; the next turn of a chat prefills on the
    decode worker that answered the previous one, from its checkpoint, with no hand-off."""
    handle, path, hf, _ = cluster
    rng = random.Random(40)
    system = [rng.randrange(3, 300) for _ in range(40)]
    prompts = [system + [rng.randrange(3, 300) for _ in range(5 + i)] for i in range(5)]
    hits_before = worker_stats(handle, "prefix_cache_hit_tokens")
    outs = [handle.generate([p], GREEDY)[0] for p in prompts]
    local = LLM(path, block_size=4).generate(prompts, GREEDY)
    for prompt, out, ref in zip(prompts, outs, local):
        assert out.error is None, out.error
        judge_greedy(hf, prompt, out.token_ids)
        assert_same_tokens(hf, prompt, out.token_ids, ref.token_ids)
    assert [o.num_cached_tokens for o in outs[2:]] == [40, 40, 40]
    gained = {w: n - hits_before[w] for w, n in worker_stats(handle, "prefix_cache_hit_tokens").items()}
    assert sorted(gained[w] for w in ("prefill-0", "prefill-1")) == [0, 120]

    turn1 = [rng.randrange(3, 300) for _ in range(30)]
    first = handle.generate([turn1], GREEDY)[0]
    turn2 = turn1 + first.token_ids + [rng.randrange(3, 300) for _ in range(2)]
    handoffs_before = sum(worker_stats(handle, "handoff_count").values())
    handle.config.local_prefill_tokens = 8
    try:
        second = handle.generate([turn2], GREEDY)[0]
    finally:
        handle.config.local_prefill_tokens = 0
    judge_greedy(hf, turn2, second.token_ids)
    assert second.num_cached_tokens == 36  # 39 tokens computed by turn 1: its last boundary
    assert sum(worker_stats(handle, "handoff_count").values()) == handoffs_before
    wait_idle(handle)


def test_a_prefill_worker_fetches_the_longer_prefix_another_worker_holds(cluster):
    """prefix_fetch_tokens: a chat's next turn goes to the prefill worker that holds its prompt;
    the decode worker (on the other node) that answered holds the prompt and the answer, and the
    prefill worker imports that instead of recomputing it. A request sent past a busy prefill
    worker fetches the prefix that worker holds. Outputs are exact either way."""
    from router.cluster import launch

    _, path, hf, (nodes, _, _) = cluster
    fetching = launch(path, prefill=2, decode=1, address=nodes.address, prefill_resource=PREFILL_RES,
                      decode_resource=DECODE_RES, block_size=4, num_kv_blocks=200, max_num_seqs=8,
                      enable_prefix_caching=True, host_cache_bytes=1 << 22, prefix_fetch_tokens=4,
                      prefix_fetch_overhead_ms=0.0)  # a tiny model recomputes a few dozen tokens in ~1 ms
    local = LLM(path, block_size=4)

    def served(prompt):
        out = fetching.generate([prompt], GREEDY)[0]
        assert out.error is None, out.error
        assert_same_tokens(hf, prompt, out.token_ids, local.generate([prompt], GREEDY)[0].token_ids)
        time.sleep(0.6)  # the router's next stats reports: the workers' cache events
        fetching.status()
        return out

    def counts(name):
        return {w["id"]: w.get(name, 0) for w in fetching.status()["workers"]}

    try:
        rng = random.Random(53)
        turn1 = [rng.randrange(3, 300) for _ in range(22)]
        first = served(turn1)
        second = served(turn1 + first.token_ids + [rng.randrange(3, 300) for _ in range(3)])
        # turn 1's decode computed 31 tokens: its checkpoint at 28 came from the decode worker
        assert second.num_cached_tokens == 28
        assert counts("prefix_fetch_exported")["decode-0"] == 1
        assert sum(counts("prefix_fetch_imported").values()) == 1 and fetching.status()["prefix_fetches"] == 1

        system = [rng.randrange(3, 300) for _ in range(26)]
        served(system)  # its prefill worker checkpoints its last boundary short of the end, 24
        holder = next(w for w in fetching.workers.prefill
                      if w.prefixes.reported_blocks(fetching._block_hashes(system)) == 6)
        holder.queued_tokens += 10_000  # busy: the next request goes to the other prefill worker
        try:
            third = served(system[:24] + [rng.randrange(3, 300) for _ in range(5)])
        finally:
            holder.queued_tokens -= 10_000
        assert third.num_cached_tokens == 24
        assert counts("prefix_fetch_exported")[holder.name] == 1
        assert sum(counts("prefix_fetch_imported").values()) == 2 and fetching.status()["prefix_fetches"] == 2
    finally:
        fetching.shutdown()


def test_cache_tiers_serve_evicted_chats_and_the_router_sees_every_tier(cluster, tmp_path):
    """A 1P+1D pair with a small pool, a host tier and a disk tier: chats that come back after
    the pool evicted them are served from the tiers, exactly; the router's index, built from
    the workers' cache events alone, shows entries in each tier, and status shows the tiers."""
    from router.cluster import launch

    _, path, hf, (nodes, _, _) = cluster
    tiered = launch(path, prefill=1, decode=1, address=nodes.address, pack_pairs=True,
                    prefill_resource=None, decode_resource=None, block_size=4, num_kv_blocks=60, max_num_seqs=4,
                    enable_prefix_caching=True, prefix_checkpoints=2, host_cache_bytes=1 << 17,
                    disk_cache_dir=str(tmp_path), disk_cache_bytes=1 << 24)
    try:
        rng = random.Random(52)
        systems = [[rng.randrange(3, 300) for _ in range(36)] for _ in range(6)]
        prompts = [s + [rng.randrange(3, 300) for _ in range(3)] for s in systems]
        prompts += [s + [rng.randrange(3, 300) for _ in range(3)] for s in systems]  # the same chats again
        outs = [tiered.generate([p], GREEDY)[0] for p in prompts]
        local = LLM(path, block_size=4).generate(prompts, GREEDY)
        for prompt, out, ref in zip(prompts, outs, local):
            assert out.error is None, out.error
            assert_same_tokens(hf, prompt, out.token_ids, ref.token_ids)
        time.sleep(0.6)  # the router's next stats report
        status = {w["id"]: w for w in tiered.status()["workers"]}
        prefill = status["prefill-0"]
        assert prefill["tier_host_hits"] + prefill["tier_disk_hits"] > 0, prefill
        assert sum(o.num_cached_tokens for o in outs[6:]) >= 6 * 32
        index = tiered.workers.prefill[0].prefixes.held
        assert {"pool", "host", "disk"} <= set().union(*index.values()), index
        # The prefill worker dies right after the first step of a chat's next turn, whose prefix
        # its cache holds: the retry is served exactly, and the worker Ray restarts reports its
        # disk tier (warm: the files outlive it; its pool and host memory died with it) and, of
        # the rest, only what its new life ran.
        from tests.test_reliability import arm_crash, collect, the_one_that_died

        again = systems[0] + prompts[6][36:] + outs[6].token_ids + [7, 8, 9]
        before = arm_crash(tiered.workers.prefill, "killed-after-a-load")
        _, final = asyncio.run(collect(tiered, "killed-after-a-load", again, GREEDY))
        assert final.error is None, final.error
        assert_same_tokens(hf, again, final.token_ids, LLM(path, block_size=4).generate([again], GREEDY)[0].token_ids)
        the_one_that_died(tiered, tiered.workers.prefill, before)
        time.sleep(0.6)  # its first report: a snapshot
        tiered.status()
        index = tiered.workers.prefill[0].prefixes.held
        served = set(tiered._block_hashes(again + final.token_ids))  # all the new life has run
        assert any("disk" in tiers for tiers in index.values()), index
        assert all(key in served for key, tiers in index.items() if tiers - {"disk"}), index
    finally:
        tiered.shutdown()
