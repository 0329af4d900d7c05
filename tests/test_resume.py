"""Resuming a request elsewhere after a failure: the continuation equals the uninterrupted run.

The router resumes a request on a live worker with the tokens the caller already has; the
engine recomputes prompt + those tokens and must then produce exactly the tokens, text and
deltas the first worker would have produced: greedy, seeded sampling and penalties alike.
"""

from __future__ import annotations

import pytest

from engine import InvalidRequest, SamplingParams
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.request import Resume
from tests.test_handoff_engine import copy_state

PROMPT = [5, 9, 2, 33, 41, 7, 12]
N = 12
CASES = {
    "greedy": SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True),
    "seeded": SamplingParams(max_tokens=N, temperature=1.0, seed=77, ignore_eos=True),
    "penalties": SamplingParams(max_tokens=N, temperature=0.9, seed=5, ignore_eos=True, top_k=20,
                                presence_penalty=0.6, frequency_penalty=0.4, repetition_penalty=1.3),
    "logprobs": SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True, logprobs=2),
    # A stop string holds text back while it might still be starting: the caller lags the tokens.
    "holdback": SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True, stop=["never-seen-stop"]),
}


def streamed(engine: LLMEngine, request_id: str):
    """Run to completion; (final output, concatenated text deltas, concatenated token deltas,
    {tokens received: text chars received} as the caller saw them)."""
    text, tokens, final, seen = "", [], None, {}
    while final is None:
        for out in engine.step():
            if out.request_id == request_id:
                text += out.new_text
                tokens += out.new_token_ids
                seen[len(tokens)] = len(text)
                final = out if out.finished else None
    return final, text, tokens, seen


@pytest.fixture(scope="module")
def full_runs(api_model_path):
    engine = LLMEngine(EngineConfig(str(api_model_path), block_size=4))
    runs = {}
    for name, params in CASES.items():
        engine.add_request(PROMPT, params, request_id=name)
        runs[name] = streamed(engine, name)
    return runs


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("cut", [1, 5, N - 1])
def test_resumed_request_continues_exactly(api_model_path, full_runs, case, cut):
    final, text, tokens, seen = full_runs[case]
    assert final.token_ids == tokens and len(tokens) == N
    sent_chars = seen[cut]  # what the caller had when its worker died
    engine = LLMEngine(EngineConfig(str(api_model_path), block_size=4))
    engine.add_request(PROMPT, CASES[case], request_id="again", resume=Resume(tuple(tokens[:cut]), sent_chars))
    again, more_text, more_tokens, _ = streamed(engine, "again")
    assert again.token_ids == final.token_ids
    assert tokens[:cut] + more_tokens == tokens
    assert again.text == final.text and text[:sent_chars] + more_text == text
    assert again.finish_reason == final.finish_reason == "length"
    if case == "logprobs":  # the resumed worker reports only its own tokens' logprobs
        assert [e["token"] for e in again.logprobs] == pytest.approx(
            [e["token"] for e in final.logprobs[cut:]], abs=1e-5)
    engine.check_integrity()
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


@pytest.mark.parametrize("case", ["greedy", "seeded"])
def test_resumed_request_continues_exactly_when_disaggregated(api_model_path, full_runs, case):
    """Resume through the prefill/decode split: the prefill worker recomputes prompt + done
    tokens and draws the next one; the decode worker continues from there."""
    final, _, tokens, _ = full_runs[case]
    params, cut = CASES[case], 4
    resume = Resume(tuple(tokens[:cut]))
    prefill = LLMEngine(EngineConfig(str(api_model_path), block_size=4, mode="prefill"))
    decode = LLMEngine(EngineConfig(str(api_model_path), block_size=4, mode="decode"))
    reservation = decode.reserve_for_handoff(PROMPT, params, "r", resume)
    prefill.add_request(PROMPT, params, request_id="r", resume=resume)
    handoffs = []
    while not handoffs:
        prefill.step()
        handoffs = prefill.take_handoffs()
    (h,) = handoffs
    assert h.num_tokens == len(PROMPT) + cut
    copy_state(prefill, decode, h, reservation)
    prefill.finish_handoff("r")
    out = decode.accept_handoff("r", h.first_token, h.first_logprob)
    while not out.finished:
        out = next((o for o in decode.step() if o.request_id == "r"), out)
    assert out.token_ids == final.token_ids
    for engine in (prefill, decode):
        engine.check_integrity()
        assert engine.slots.num_free_slots == engine.slots.num_slots


def test_resume_with_nothing_left_to_generate_is_refused(api_model_path):
    engine = LLMEngine(EngineConfig(str(api_model_path), block_size=4))
    with pytest.raises(InvalidRequest, match="resume"):
        engine.add_request(PROMPT, SamplingParams(max_tokens=3), resume=Resume((1, 2, 3)))
    with pytest.raises(InvalidRequest):
        engine.add_request(PROMPT, SamplingParams(max_tokens=9), resume=Resume((1, 10**9)))
    assert not engine.requests
