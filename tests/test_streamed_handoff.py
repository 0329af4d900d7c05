"""A prompt prefilled in several chunks streams its hand-off (prefill_worker, stream_prefill):
KV rows leave as chunks finish them and the rest with the recurrent state after the last
chunk; the decode worker's tokens are judged by transformers. A prompt done in one chunk is
sent whole as before, and an abort mid-stream frees both sides. Real workers, no Ray."""

from __future__ import annotations

import asyncio
import time

import pytest

import kvtransfer.stream_channel
from decode_worker.worker import DecodeWorker
from engine.sampling_params import SamplingParams
from prefill_worker.worker import PrefillWorker
from tests.oracle import judge_greedy

GREEDY = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
BUDGET = 16  # tokens per step: a 61-token prompt runs in four chunks


def workers(path, transport: str, **options) -> tuple[PrefillWorker, DecodeWorker]:
    options = {"block_size": 4, "max_num_batched_tokens": BUDGET, "num_kv_blocks": 96, **options}
    return (PrefillWorker("p0", str(path), options, transport, transfer_timeout_s=20),
            DecodeWorker("d0", str(path), options, transport, transfer_timeout_s=20))


def streams_seen(monkeypatch) -> dict:
    """request -> (tokens computed before its last chunk, block rows gone before it) at the
    moment its last chunk finished, for every hand-off that streamed."""
    seen, finish = {}, PrefillWorker._finish_stream

    def record(self, engine, handoff):
        job = self._streaming[handoff.request_id]
        seen[handoff.request_id] = (job.ready_tokens, getattr(job, "rows_copied", None) or getattr(job, "rows_queued", 0))
        finish(self, engine, handoff)

    monkeypatch.setattr(PrefillWorker, "_finish_stream", record)
    return seen


async def decode_all(decode: DecodeWorker, rids: set[str], failed: dict | None = None) -> dict[str, list[int]]:
    """Tokens of `rids` until each finished; an error output of another request goes to `failed`."""
    tokens, done = {rid: [] for rid in rids}, set()
    while done != rids:
        for out in await decode.poll(10.0):
            if out.request_id not in rids:
                assert failed is not None and out.finished and out.error, out
                failed[out.request_id] = out.error
                continue
            tokens[out.request_id] += out.new_token_ids
            if out.finished:
                assert out.error is None, out.error
                done.add(out.request_id)
    return tokens


@pytest.mark.parametrize("transport", ["shm", "gloo"])
@pytest.mark.parametrize("family", ["jamba", "qwen3_next", "mamba2", "llama"])
def test_chunked_prompts_stream_their_hand_off_and_decode_exactly(model_factory, monkeypatch, transport, family):
    monkeypatch.setattr(kvtransfer.stream_channel, "MIN_PART_BYTES", 1)  # tiny model: a part per chunk
    seen = streams_seen(monkeypatch)
    path, hf = model_factory(family)
    prefill, decode = workers(path, transport)
    prompts = {"long": [(7 * i) % 90 + 3 for i in range(61)], "mid": list(range(5, 28)), "short": [9, 4, 11, 2, 8]}

    async def go():
        await prefill.connect("d0", await decode.accept("p0", prefill.handoff_ranks()))
        targets = {rid: await decode.reserve(rid, prompt, GREEDY, None, "p0") for rid, prompt in prompts.items()}
        outcomes = await asyncio.gather(*(prefill.prefill(rid, prompt, GREEDY, targets[rid])
                                          for rid, prompt in prompts.items()))
        return outcomes, await decode_all(decode, set(prompts))

    try:
        outcomes, tokens = asyncio.run(go())
        assert all(o.handed_off and o.error is None for o in outcomes), outcomes
        for rid, prompt in prompts.items():
            judge_greedy(hf, prompt, tokens[rid])
        if family == "mamba2":  # no attention: all of it is state, final after the last chunk
            assert seen == {}
        else:
            assert set(seen) == {"long", "mid"}  # "short" ran in one chunk: sent whole after it
            computed, rows_gone = seen["long"]
            assert computed >= 48 and rows_gone >= 12, seen  # three chunks' rows left before the last ran
        prefill.thread.call(lambda engine: None).result(10)
        assert not prefill.engine.requests and not prefill._streaming
        assert prefill.engine.blocks.num_available_blocks == prefill.engine.blocks.num_blocks
    finally:
        prefill.shutdown()
        decode.shutdown()


@pytest.mark.parametrize("transport", ["shm", "gloo"])
def test_an_abort_mid_stream_frees_both_sides_and_the_pair_serves_on(model_factory, monkeypatch, transport):
    monkeypatch.setattr(kvtransfer.stream_channel, "MIN_PART_BYTES", 1)
    path, hf = model_factory("jamba")
    prefill, decode = workers(path, transport, max_num_batched_tokens=4, max_model_len=512)
    long_prompt, prompt = [(5 * i) % 80 + 2 for i in range(240)], list(range(3, 20))

    async def go():
        await prefill.connect("d0", await decode.accept("p0", prefill.handoff_ranks()))
        target = await decode.reserve("cut", long_prompt, GREEDY, None, "p0")
        cut = asyncio.ensure_future(prefill.prefill("cut", long_prompt, GREEDY, target))
        deadline = time.monotonic() + 20
        while "cut" not in prefill._streaming or prefill._streaming["cut"].ready_tokens < 16:
            assert time.monotonic() < deadline and not cut.done()
            await asyncio.sleep(0.01)
        await prefill.abort("cut")
        cut_outcome = await cut
        while "cut" in decode.receiver.pending():
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        target = await decode.reserve("next", prompt, GREEDY, None, "p0")
        outcome = await prefill.prefill("next", prompt, GREEDY, target)
        failed = {}
        return cut_outcome, outcome, await decode_all(decode, {"next"}, failed), failed

    try:
        cut_outcome, outcome, tokens, failed = asyncio.run(go())
        assert not cut_outcome.handed_off and cut_outcome.error
        assert set(failed) <= {"cut"}  # the decode side reports the cut hand-off, if the router's abort has not
        assert outcome.handed_off, outcome
        judge_greedy(hf, prompt, tokens["next"])
        for worker in (prefill, decode):
            worker.thread.call(lambda engine: None).result(10)
            assert not worker.engine.requests
            assert worker.engine.blocks.num_available_blocks == worker.engine.blocks.num_blocks
    finally:
        prefill.shutdown()
        decode.shutdown()
