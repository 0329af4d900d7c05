"""The prefill asked for together with its reservation (prefill_worker.PendingTarget): the prefill
runs at once and its hand-off waits for the grant only when its rows are ready; a refused
reservation fails the hand-off and frees the rows. Real worker objects over shm, no Ray."""

from __future__ import annotations

import asyncio

from decode_worker.worker import DecodeWorker
from engine.output import Cumulative, RequestOutput
from engine.sampling_params import SamplingParams
from prefill_worker.worker import PendingTarget, PrefillOutcome, PrefillWorker
from tests.oracle import judge_greedy

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
OPTIONS = {"block_size": 4, "max_num_batched_tokens": 16, "num_kv_blocks": 64}


def worker_pair(path) -> tuple[PrefillWorker, DecodeWorker]:
    """Real workers over shm, in this process (no Ray)."""
    return (PrefillWorker("p0", str(path), OPTIONS, "shm", transfer_timeout_s=20),
            DecodeWorker("d0", str(path), OPTIONS, "shm", transfer_timeout_s=20))


def test_a_hand_off_waits_for_a_late_grant_and_a_refusal_frees_everything(model_factory):
    path, hf = model_factory("jamba")
    prefill, decode = worker_pair(path)
    prompt = list(range(7, 30))

    async def go():
        await prefill.connect("d0", await decode.accept("p0", prefill.handoff_ranks()))
        loop = asyncio.get_running_loop()
        granted, refused = loop.create_future(), loop.create_future()
        late = asyncio.ensure_future(prefill.prefill("late", prompt, GREEDY, PendingTarget(granted)))
        gone = asyncio.ensure_future(prefill.prefill("gone", prompt[:9], GREEDY, PendingTarget(refused)))
        while prefill.engine.requests and not prefill._deferred:  # a prefill is done, its grant not yet
            await asyncio.sleep(0.01)
        assert not late.done() and not gone.done()
        refused.set_exception(MemoryError("decode worker d0 has no room"))
        failed = await gone
        granted.set_result(await decode.reserve("late", prompt, GREEDY, None, "p0"))
        outcome = await late
        tokens, finished = Cumulative(prompt), False
        while not finished:
            for out in await decode.poll(10.0):
                if out.request_id == "late":
                    finished = tokens.add(out).finished
        return failed, outcome, tokens.token_ids

    try:
        failed, outcome, tokens = asyncio.run(go())
        assert not failed.handed_off and "no reservation: MemoryError: decode worker d0 has no room" in failed.error
        assert outcome.handed_off and outcome.error is None
        judge_greedy(hf, prompt, tokens)
        prefill.thread.call(lambda engine: None).result(10)
        assert not prefill.engine.requests and not prefill._deferred and not prefill._targets
        assert prefill.engine.blocks.num_available_blocks == prefill.engine.blocks.num_blocks  # nothing held
    finally:
        prefill.shutdown()
        decode.shutdown()


def test_the_first_token_streams_before_the_outcome_and_decode_outputs_stream_as_produced(model_factory):
    """prefill_stream yields the first token as it is sampled, then the outcome; the decode
    worker's `outputs` stream carries the rest (the router reads both, pushed by Ray)."""
    path, hf = model_factory("jamba")
    prefill, decode = worker_pair(path)
    prompt = list(range(7, 30))

    async def go():
        await prefill.connect("d0", await decode.accept("p0", prefill.handoff_ranks()))
        target = await decode.reserve("r", prompt, GREEDY, None, "p0")
        items = [item async for item in prefill.prefill_stream("r", prompt, GREEDY, target)]
        tokens, finished = [], False
        stream = decode.outputs()
        while not finished:
            for out in await asyncio.wait_for(anext(stream), 10):
                tokens += out.new_token_ids
                finished = out.finished
        await stream.aclose()
        return items, tokens

    try:
        items, tokens = asyncio.run(go())
        first, outcome = items
        assert isinstance(first, RequestOutput) and not first.finished and first.prompt_token_ids == []
        assert first.new_token_ids == tokens[:1] and first.first_token_time is not None
        assert isinstance(outcome, PrefillOutcome) and outcome.handed_off and outcome.error is None
        judge_greedy(hf, prompt, tokens)  # the decode worker's stream repeats the first, then the rest
        assert len(tokens) == GREEDY.max_tokens
    finally:
        prefill.shutdown()
        decode.shutdown()
