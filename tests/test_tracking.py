"""The router's view of a split attempt: the decode worker's outputs joined with the prefill
worker's report, which can come in after the decode worker's last token."""

from __future__ import annotations

import asyncio

from engine.output import RequestOutput
from engine.sampling_params import SamplingParams
from prefill_worker.worker import PrefillOutcome
from router.tracking import PrefillFirst, Tracked

PROMPT = [5, 6, 7]


def decode_output(token: int, finished: bool) -> RequestOutput:
    """What a decode worker ships for one token (a delta: no prompt, no tokens so far)."""
    return RequestOutput("r", [], [], "", finished, "length" if finished else None,
                         new_token_ids=[token], new_text=f"<{token}>")


def split_attempt(**params) -> Tracked:
    tracked = Tracked("r", PROMPT, SamplingParams(max_tokens=2, **params))
    tracked.split = True
    tracked.prefill_outcome = asyncio.get_running_loop().create_future()
    return tracked


async def delivered_after_report(tracked: Tracked, out: RequestOutput, report) -> RequestOutput:
    """Deliver `out`, making the prefill worker's report arrive only while it is waited for."""
    pending = asyncio.ensure_future(tracked.delivered(out))
    for _ in range(5):
        await asyncio.sleep(0)
    assert not pending.done(), "the output went out before the prefill worker's report"
    tracked.prefill_outcome.set_result(report)
    return await pending


def test_the_last_output_carries_the_prefill_workers_cached_tokens_when_its_report_is_late():
    async def run():
        tracked = split_attempt()
        first = await tracked.delivered(decode_output(11, False))  # not waiting for the report
        assert first.token_ids == [11] and first.num_cached_tokens == 0
        last = await delivered_after_report(tracked, decode_output(12, True),
                                            PrefillOutcome("r", True, num_cached_tokens=96))
        assert last.finished and last.token_ids == [11, 12] and last.num_cached_tokens == 96

    asyncio.run(run())


def test_the_first_token_waits_for_its_logprob_from_the_prefill_worker():
    async def run():
        tracked = split_attempt(logprobs=1)
        logprob = {11: -0.5, 3: -1.5}
        first = await delivered_after_report(tracked, decode_output(11, False),
                                             PrefillOutcome("r", True, first_logprob=logprob,
                                                            num_cached_tokens=8))
        assert first.logprobs == [logprob] and first.num_cached_tokens == 8

    asyncio.run(run())


def test_a_prefill_that_did_not_hand_off_leaves_the_decode_workers_count():
    async def run():
        tracked = split_attempt()
        last = await delivered_after_report(tracked, decode_output(12, True), None)
        assert last.finished and last.num_cached_tokens == 0

    asyncio.run(run())


def early_first(token: int, logprob: dict | None = None) -> PrefillFirst:
    """The prefill worker's copy of the first token, sent as it is sampled."""
    return PrefillFirst(RequestOutput("r", [], [], "", False, None, new_token_ids=[token], new_text=f"<{token}>",
                                      new_logprobs=[logprob] if logprob is not None else None,
                                      num_cached_tokens=8))


def test_the_prefill_workers_first_token_goes_out_at_once_and_the_decode_workers_copy_adds_nothing():
    async def run():
        tracked = split_attempt(logprobs=1)
        logprob = {11: -0.5}
        first = await tracked.delivered(early_first(11, logprob))  # no wait for the prefill report
        assert first.token_ids == [11] and first.text == "<11>" and first.logprobs == [logprob]
        assert first.num_cached_tokens == 8 and not tracked.prefill_outcome.done()
        assert await tracked.delivered(decode_output(11, False)) is None  # the hand-off's repeat
        last = await delivered_after_report(tracked, decode_output(12, True), PrefillOutcome("r", True))
        assert last.token_ids == [11, 12] and last.text == "<11><12>"

    asyncio.run(run())


def test_a_first_token_the_decode_worker_delivered_first_is_not_repeated_by_the_prefill_workers():
    async def run():
        tracked = split_attempt()
        first = await tracked.delivered(decode_output(11, False))
        assert first.token_ids == [11]
        assert await tracked.delivered(early_first(11)) is None
        second = await tracked.delivered(decode_output(12, False))
        assert second.token_ids == [11, 12]

    asyncio.run(run())


def test_a_hand_off_lost_after_the_early_first_token_is_retried_from_it():
    async def run():
        tracked = split_attempt()
        await tracked.delivered(early_first(11))
        lost = RequestOutput("r", [], [], "", True, "error", error="state hand-off failed: timed out")
        failure = tracked.classify(lost)
        assert failure is not None and failure.retryable  # the decode side never decoded
        assert tracked.resume().output_token_ids == (11,)  # the retry goes on from the delivered token

    asyncio.run(run())


def test_the_routers_spans_of_one_request_share_one_clock_conversion():
    async def run():
        tracked = split_attempt()
        tracked.prefill_outcome.set_result(PrefillOutcome("r", True))
        await tracked.delivered(early_first(11))
        last = await tracked.delivered(decode_output(12, True))
        spans = {s.name: s for s in last.spans if s.where == "router"}
        assert spans["first token"].start_ns == spans["request"].start_ns  # both from arrival

    for _ in range(20):  # a fresh conversion per span disagreed by some nanoseconds most times
        asyncio.run(run())
