"""Elastic pools on the session's Ray test cluster: workers added and removed under load, a
drain whose deadline forces a hand-over, and a rolling restart, with every stream whole. The
decode workers speculate (n-gram drafts in every step), so each of these also holds with
speculation on: a worker that joins speculates with the same setting, and a stream handed over
resumes drafting from what its caller has."""

from __future__ import annotations

import asyncio
import contextlib
import random
import threading
import time

import pytest
import ray

from engine import LLM, SamplingParams
from tests.oracle import assert_same_tokens, judge_greedy

ray = pytest.importorskip("ray")

from tests.conftest import DECODE_RES, PREFILL_RES
from tests.test_cluster import wait_idle

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
SPECULATIVE = {"method": "ngram", "num_speculative_tokens": 3, "adaptive": False}


@pytest.fixture(scope="module")
def elastic(ray_nodes, model_factory):
    from router.cluster import launch

    path, hf = model_factory("jamba")
    handle = launch(path, prefill=1, decode=1, address=ray_nodes[0].address, prefill_resource=PREFILL_RES,
                    decode_resource=DECODE_RES, block_size=4, num_kv_blocks=300, max_num_seqs=16,
                    transfer_timeout_s=15.0, speculative_config=SPECULATIVE)
    yield handle, path, hf
    handle.shutdown()


def names(handle) -> set[str]:
    return {w["id"] for w in handle.status()["workers"]}


def drafted(handle) -> dict[str, int]:
    """Draft tokens each serving decode worker has verified so far."""
    return {w["id"]: w.get("spec_draft_tokens", 0) for w in handle.status()["workers"] if w["kind"] == "decode"}


class Load:
    """Requests sent one batch after another from a thread until stopped; all kept."""

    def __init__(self, handle, vocab: int, seed: int):
        self.handle, self.rng = handle, random.Random(seed)
        self.vocab, self.results = vocab, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run)

    def _run(self):
        while not self._stop.is_set():
            prompts = [[self.rng.randrange(3, self.vocab) for _ in range(self.rng.randint(1, 30))] for _ in range(4)]
            self.results += zip(prompts, self.handle.generate(prompts, GREEDY))

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(timeout=120)

    def check(self, hf, path):
        assert self.results, "no request ran"
        prompts = [p for p, _ in self.results]
        local = LLM(path, block_size=4).generate(prompts, GREEDY)
        for (prompt, out), ref in zip(self.results, local):
            assert out.error is None and out.finish_reason == "length", out.error
            assert_same_tokens(hf, prompt, out.token_ids, ref.token_ids)


def test_scale_each_kind_up_and_down_under_load(elastic):
    handle, path, hf = elastic
    before = names(handle)
    with Load(handle, 300, 1) as load:
        time.sleep(1.0)
        assert handle.scale(prefill=2, decode=3) == {"prefill": 2, "decode": 3}
        grown = names(handle)
        time.sleep(2.0)
        assert handle.scale(prefill=1, decode=1) == {"prefill": 1, "decode": 1}
    load.check(hf, path)
    assert len(grown) == 5 and before < grown
    assert names(handle) == before  # the newest went first
    assert sum(drafted(handle).values()) > 0  # the outputs above were verified drafts too
    with pytest.raises(ValueError, match="at least one"):
        handle.scale(decode=0)
    wait_idle(handle)


def test_a_drain_deadline_hands_streams_over_without_a_gap(elastic):
    from router import scaling

    handle, path, hf = elastic
    handle.scale(decode=2)
    drafts_before = drafted(handle)
    prompt = [7, 8, 9, 10]
    params = SamplingParams(max_tokens=300, temperature=0.0, ignore_eos=True)
    result, retries = [], handle.retries
    runner = threading.Thread(target=lambda: result.extend(handle.generate([prompt], params)))
    runner.start()
    deadline = time.monotonic() + 30
    while not handle.workers.owner:
        assert time.monotonic() < deadline, "the request was never placed"
        time.sleep(0.01)
    (holder, _), = handle.workers.owner.values()
    # Slowed, so that however fast the engine is the stream is still running at the deadline.
    ray.get(holder.handle.inject_slow_steps.remote(0.02))
    try:
        time.sleep(0.5)  # some tokens out already
        handle._run(scaling.drain(handle.workers, holder, handle._hand_over, timeout_s=0.2))
        runner.join(timeout=120)
    finally:
        with contextlib.suppress(Exception):  # removed by the drain, unless it failed
            ray.get(holder.handle.inject_slow_steps.remote(0), timeout=10)
    (out,) = result
    assert out.error is None and len(out.token_ids) == 300
    assert handle.retries - retries == 1  # handed over once, resumed from what was delivered
    judge_greedy(hf, prompt, out.token_ids)
    assert holder.name not in names(handle) and len(handle.workers.decode) == 1
    survivor = handle.workers.decode[0].name
    assert drafted(handle)[survivor] > drafts_before.get(survivor, 0)  # the resumed stream drafted
    wait_idle(handle)


def test_scale_over_grpc_and_the_command_line_behind_the_token(elastic, capsys):
    import grpc

    from router.cli import main
    from router.client import SplitServeClient
    from tests.test_api_support import serving

    handle, _, _ = elastic
    with serving(handle, auth_token="admin-secret") as door:
        address = f"127.0.0.1:{door.grpc_port}"
        with SplitServeClient(address, auth_token="wrong") as intruder:
            with pytest.raises(grpc.RpcError) as refused:
                intruder.scale(decode=2)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with SplitServeClient(address, auth_token="admin-secret") as admin:
            with pytest.raises(grpc.RpcError) as bad:
                admin.scale(prefill=0)
            assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "at least one" in bad.value.details()
            counts = admin.scale(decode=2)
            assert (counts.prefill, counts.decode) == (1, 2)
            handle.config.placement.ready_timeout_s = 2.0  # the test cluster's decode node has 6 slots
            try:
                with pytest.raises(grpc.RpcError) as full:
                    admin.scale(decode=9)
            finally:
                handle.config.placement.ready_timeout_s = 120.0
            assert full.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "could not place" in full.value.details()
            assert len(handle.workers.decode) == 2  # nothing started, nothing lost
        assert main(["scale", "--server", address, "--auth-token", "admin-secret", "--decode", "1",
                     "--drain-timeout", "5"]) == 0
        assert "prefill workers: 1, decode workers: 1" in capsys.readouterr().out
    assert len(handle.workers.decode) == 1
    wait_idle(handle)


def test_a_backend_without_pools_refuses_to_scale():
    from router.serving import ServingCore

    class NoPools:
        def status(self):
            return {}

    with pytest.raises(NotImplementedError, match="no worker pools"):
        asyncio.run(ServingCore(NoPools(), 1).resize("scale", decode=2))


def test_the_autoscaler_grows_decode_under_load_and_shrinks_it_after(elastic, monkeypatch):
    from router import scaling
    from router.autoscaler import AutoscaleConfig

    handle, path, hf = elastic
    remove = scaling._remove

    async def slow_remove(workers, worker):  # so the autoscaler is stopped mid-drain below
        await asyncio.sleep(1.5)
        await remove(workers, worker)

    monkeypatch.setattr(scaling, "_remove", slow_remove)
    # A TPOT SLO no step meets: any load is decode pressure; once it stops, decode is idle.
    config = AutoscaleConfig(prefill=(1, 1), decode=(1, 2), slo_ttft_s=60.0, slo_tpot_s=0.001, interval_s=0.4,
                             up_intervals=2, down_intervals=3, cooldown_intervals=1)
    handle.start_autoscaler(config)

    def wait_for_decode(count):
        deadline = time.monotonic() + 90
        while len(scaling.serving(handle.workers, "decode")) != count:
            assert time.monotonic() < deadline, handle.status().get("autoscaler")
            time.sleep(0.1)

    try:
        with Load(handle, 300, 5) as load:
            wait_for_decode(2)
            time.sleep(1.0)
        wait_for_decode(1)
        decisions = {(d["kind"], d["direction"], d["reason"]) for d in handle.status()["autoscaler"]["decisions"]}
    finally:
        handle.stop_autoscaler()  # while the shrink still drains a worker
        handle.autoscaler = None
    deadline = time.monotonic() + 30
    while len(handle.workers.decode) != 1:  # the drain outlives the autoscaler and removes it
        assert time.monotonic() < deadline, [(w.name, w.draining) for w in handle.workers.decode]
        time.sleep(0.1)
    load.check(hf, path)
    assert decisions == {("decode", "up", "tpot_slo"), ("decode", "down", "idle")}
    wait_idle(handle)


def test_a_rolling_restart_of_several_workers_needs_no_spare_room(elastic, monkeypatch):
    """Under load, every worker is replaced and no request fails. With two decode workers, each
    is drained before its successor starts, so the restart never needs room for a third; the one
    prefill worker, the last of its kind, gets its successor first. The restart changes the
    block size (4 -> 8), so while it runs the new prefill worker hands off to old decode
    workers with the other block size."""
    import ray

    from router import scaling

    handle, path, hf = elastic
    handle.scale(decode=2)
    grow, drain, seen, grown, drains = handle.workers.grow, scaling.drain, [], [], []

    async def counting_grow(num_prefill, num_decode, *args):
        seen.append((len(scaling.serving(handle.workers, "prefill")) + num_prefill,
                     len(scaling.serving(handle.workers, "decode")) + num_decode))
        result = await grow(num_prefill, num_decode, *args)
        grown.append(len(load.results))
        return result

    async def timed_drain(workers, worker, *args):
        drains.append((worker.kind, "start", len(load.results)))
        await drain(workers, worker, *args)
        drains.append((worker.kind, "end", len(load.results)))

    handle.workers.grow = counting_grow
    monkeypatch.setattr(scaling, "drain", timed_drain)
    try:
        with Load(handle, 300, 7) as load:
            before = names(handle)
            assert handle.restart_workers({"block_size": 8}, drain_timeout_s=10) == {"prefill": 1, "decode": 2}
    finally:
        handle.workers.grow = grow
    load.check(hf, path)
    assert seen == [(2, 2), (1, 2), (1, 2)]  # prefill surges to 2; decode never goes above 2
    assert not names(handle) & before
    # From the first decode worker's drain until its successor joins, the one prefill worker has
    # blocks of 8 and the other, old decode worker (blocks of 4) takes every new request: a
    # second batch finished in that window was sent, prefilled and decoded across the two sizes.
    assert [(kind, phase) for kind, phase, _ in drains] == [("prefill", "start"), ("prefill", "end"), ("decode", "start"),
                                                           ("decode", "end"), ("decode", "start"), ("decode", "end")]
    assert grown[1] - drains[2][2] >= 8, (drains, grown)
    layouts = ray.get([w.handle.layout.remote() for w in handle.workers.prefill + handle.workers.decode if not w.draining])
    assert {layout["block_size"] for layout in layouts} == {8} and handle.workers.model_facts["block_size"] == 8
    handle.scale(decode=1)
    wait_idle(handle)


def test_capacity_is_checked_before_anything_is_placed():
    from router.placement import PlacementConfig, PlacementError, check_capacity

    config = PlacementConfig(cpus_per_worker=1.0, prefill_resource=None, decode_resource=None)
    check_capacity(config, 0, 2, {"CPU": 2.0}, 4)
    with pytest.raises(PlacementError, match=r"need 3 CPU \(free: 2\).*--cpus-per-worker 0.66 \(now 1\)"):
        check_capacity(config, 0, 3, {"CPU": 2.0}, 5)
    gpu = PlacementConfig(cpus_per_worker=0.5, gpus_per_worker=1.0, prefill_resource=None, decode_resource=None)
    with pytest.raises(PlacementError, match=r"1 GPU \(free: 0\).*--gpus-per-worker"):
        check_capacity(gpu, 1, 0, {"CPU": 8.0}, 3)


def test_scaling_past_a_fixed_ray_answers_at_once_and_changes_nothing(elastic, monkeypatch):
    """On a Ray that `splitserve serve` started itself nothing will ever free room: scale
    refuses before placing anything (it once waited two minutes), naming what is short."""
    from router.placement import PlacementError

    handle, _, _ = elastic
    monkeypatch.setattr(handle.workers, "_started_ray", True)
    before = {k: len(getattr(handle.workers, k)) for k in ("prefill", "decode")}
    started = time.monotonic()
    with pytest.raises(PlacementError, match=r"decode worker\(s\) more need .*splitserve_decode \(free"):
        handle.scale(decode=50)
    assert time.monotonic() - started < 5
    assert {k: len(getattr(handle.workers, k)) for k in ("prefill", "decode")} == before
