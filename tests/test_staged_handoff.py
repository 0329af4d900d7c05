"""Hand-offs through staging rows (engine.staging): the path a GPU cache takes over shm and gloo.

Staging is forced for CPU caches, so the same bookkeeping and copies run here: real
PrefillWorker and DecodeWorker objects (not Ray actors) over real transports, judged token by
token by transformers, and every staging row back in its pool afterwards.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from decode_worker.worker import DecodeWorker
from engine.output import Cumulative
from engine.sampling_params import SamplingParams
from engine.staging import FORCE_ENV, HOST_STAGING_REQUESTS, HandoffStaging, StagedSendPump, staging_device
from prefill_worker.worker import PrefillWorker
from tests.oracle import judge_greedy

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
OPTIONS = {"block_size": 4, "max_num_batched_tokens": 16, "max_num_seqs": 8, "num_kv_blocks": 96}
PROMPTS = [[5, 6, 7], list(range(3, 40)), [9], list(range(50, 67))]  # 37 tokens: chunked prefill


async def _serve(prefill: PrefillWorker, decode: DecodeWorker, prompts, params) -> dict[str, list[int]]:
    await prefill.connect("d0", await decode.accept("p0", prefill.handoff_ranks()))
    targets = {f"r{i}": await decode.reserve(f"r{i}", p, params, None, "p0") for i, p in enumerate(prompts)}
    outcomes = await asyncio.gather(*(prefill.prefill(rid, p, params, targets[rid])
                                      for rid, p in zip(targets, prompts)))
    assert all(o.handed_off for o in outcomes), outcomes
    outputs = {rid: Cumulative(p) for rid, p in zip(targets, prompts)}
    finished: dict[str, list[int]] = {}
    while len(finished) < len(prompts):
        for out in await decode.poll(10.0):
            if out.request_id not in outputs:  # an earlier request's abort
                continue
            whole = outputs[out.request_id].add(out)
            assert whole.error is None, whole.error
            if whole.finished:
                finished[out.request_id] = whole.token_ids
    return finished


@pytest.mark.parametrize("transport", ["shm", "gloo"])
@pytest.mark.parametrize("name", ["jamba", "qwen3_next", "llama", "mamba"])
def test_forced_staging_hands_off_exactly_and_frees_every_row(model_factory, monkeypatch, transport, name):
    path, hf = model_factory(name)
    monkeypatch.setenv(FORCE_ENV, "1")
    prefill = PrefillWorker("p0", str(path), OPTIONS, transport, transfer_timeout_s=20)
    decode = DecodeWorker("d0", str(path), OPTIONS, transport, transfer_timeout_s=20)
    try:
        assert prefill.staging is not None and decode.staging is not None
        for worker in (prefill, decode):  # the wire reads staging rows, not the engine's
            staged = {t.data_ptr() for t in worker.cache_tensors.tensors.values()}
            own = {t.data_ptr() for *_, t in worker.engine.cache.handoff_tensors()}
            assert not staged & own
        finished = asyncio.run(_serve(prefill, decode, PROMPTS, GREEDY))
        for i, prompt in enumerate(PROMPTS):
            assert len(finished[f"r{i}"]) == GREEDY.max_tokens
            judge_greedy(hf, prompt, finished[f"r{i}"])
        for worker in (prefill, decode):  # nothing held: every row back in the pool
            staging = worker.staging
            worker.thread.call(lambda engine: None).result(10)  # the loop has applied every result
            assert not staging.held and len(staging.free_regions) == HOST_STAGING_REQUESTS
    finally:
        prefill.shutdown()
        decode.shutdown()


def test_more_hand_offs_than_staging_rows_wait_for_them(model_factory, monkeypatch):
    """Staging for one request on the prefill side, two on the decode side, six requests in
    pairs: a send waits for the rows of the one before, a third reservation is refused
    (MemoryError, which the router waits on) until rows come back; nothing is lost."""
    path, hf = model_factory("jamba")
    monkeypatch.setenv(FORCE_ENV, "1")
    monkeypatch.setattr("engine.staging.HOST_STAGING_REQUESTS", 1)
    prefill = PrefillWorker("p0", str(path), OPTIONS, "shm", transfer_timeout_s=20)
    monkeypatch.setattr("engine.staging.HOST_STAGING_REQUESTS", 2)
    decode = DecodeWorker("d0", str(path), OPTIONS, "shm", transfer_timeout_s=20)
    deferred = []
    ship = prefill._ship

    def counting_ship(engine):
        ship(engine)
        deferred.append(len(prefill._deferred))

    prefill.thread.after_step = counting_ship
    prompts = [[7, 8, 9 + i] for i in range(6)]

    async def go():
        await prefill.connect("d0", await decode.accept("p0", prefill.handoff_ranks()))
        await decode.reserve("a", prompts[0], GREEDY, None, "p0")
        await decode.reserve("b", prompts[1], GREEDY, None, "p0")
        with pytest.raises(MemoryError, match="staging rows are all in use"):
            await decode.reserve("c", prompts[2], GREEDY, None, "p0")
        await decode.abort("a")
        await decode.abort("b")

    try:
        asyncio.run(go())
        done = []
        for pair in (prompts[:2], prompts[2:4], prompts[4:]):
            deadline = time.monotonic() + 10
            while decode.staging.held:  # the aborts' results free their rows after a step
                assert time.monotonic() < deadline, decode.staging.held
                time.sleep(0.01)
            done.append(asyncio.run(_serve(prefill, decode, pair, GREEDY)))
        for i, finished in enumerate(done):
            for j, prompt in enumerate(prompts[2 * i:2 * i + 2]):
                judge_greedy(hf, prompt, finished[f"r{j}"])
        assert not decode.staging.held and not prefill.staging.held
        assert max(deferred) >= 1  # a send did wait for staging rows
    finally:
        prefill.shutdown()
        decode.shutdown()


def test_where_staging_rows_live(model_factory, monkeypatch):
    from engine import LLM

    path, _ = model_factory("jamba")
    engine = LLM(path, **OPTIONS).engine
    monkeypatch.delenv(FORCE_ENV, raising=False)
    assert staging_device(engine, ("cpu",)) is None  # a CPU cache on a host wire: its own rows
    assert staging_device(engine, ("cuda",)) == torch.device("cuda")  # as a CPU cache on NCCL would
    monkeypatch.setenv(FORCE_ENV, "1")
    assert staging_device(engine, ("cpu",)) == torch.device("cpu")
    staging = HandoffStaging(engine, "cpu", requests=3)
    assert staging.cache.sizes.num_slots == 3
    x, y = staging.take("x", 2), staging.take("y", 3)
    assert x.slot != y.slot and x.blocks == list(range(x.blocks[0], x.blocks[0] + 2))  # a region: contiguous
    assert not set(x.blocks) & set(y.blocks)
    staging.give_back("x")
    assert "x" not in staging.held and len(staging.free_regions) == 2


class Copy:
    """Stands in for a CUDA event on the copy stream."""

    def __init__(self):
        self.done = threading.Event()

    def query(self) -> bool:
        return self.done.is_set()

    def synchronize(self) -> None:
        assert self.done.wait(10)


def test_a_region_returns_only_once_its_last_copy_ran(model_factory):
    """A hand-off given back while its asynchronous copy still runs (a failed send, a landing
    whose host -> device copy is queued) keeps its region out of the pool until the copy is
    done: a later request can never get rows a stale copy still writes or reads."""
    from engine import LLM

    path, _ = model_factory("jamba")
    staging = HandoffStaging(LLM(path, **OPTIONS).engine, "cpu", requests=2)
    a = staging.take("a", 2)
    staging._last_copy["a"] = copy = Copy()  # what _mark records on a GPU
    staging.give_back("a")
    assert staging.take("b", 2) is not None and staging.take("c", 2) is None  # a's region still drains
    copy.done.set()
    c = staging.take("c", 2)
    assert c is not None and c.region == a.region and c.slot == a.slot


def test_the_pump_hands_each_layer_to_the_wire_once_its_copy_landed():
    calls = []

    class Handoff:
        request_id = "r"

        def layer_done(self, layer):
            calls.append(("layer", layer))

        def finish(self, token):
            calls.append(("finish", token))

        def abort(self, why):
            calls.append(("abort", why))

    pump = StagedSendPump("p")
    try:
        copies = [Copy(), Copy(), Copy()]
        pump.submit(Handoff(), list(zip((0, 3, 5), copies)), 17)
        time.sleep(0.1)
        assert calls == []  # layer 0 is still copying
        copies[0].done.set()
        deadline = time.monotonic() + 5
        while calls != [("layer", 0)]:
            assert time.monotonic() < deadline, calls
            time.sleep(0.01)
        copies[2].done.set()  # out of order: layer 5 waits for layer 3 all the same
        time.sleep(0.1)
        assert calls == [("layer", 0)]
        copies[1].done.set()
        while len(calls) < 4:
            assert time.monotonic() < deadline, calls
            time.sleep(0.01)
        assert calls == [("layer", 0), ("layer", 3), ("layer", 5), ("finish", 17)]

        broken = Copy()
        broken.synchronize = lambda: (_ for _ in ()).throw(RuntimeError("device lost"))
        pump.submit(Handoff(), [(0, broken)], 1)
        while len(calls) < 5:
            assert time.monotonic() < deadline, calls
            time.sleep(0.01)
        assert calls[-1] == ("abort", "staging copy failed: device lost")
    finally:
        pump.close()
