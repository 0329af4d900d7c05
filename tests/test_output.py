"""engine.output's text state over long outputs: GrowingText against a plain string, and a
tracker whose text settles as it grows still finds stop strings and adds its deltas up."""

from __future__ import annotations

import random

import pytest

from engine.output import GrowingText, OutputTracker
from engine.request import Request
from engine.sampling_params import SamplingParams


def test_growing_text_matches_a_plain_string_even_when_asked_behind_what_settled():
    rng = random.Random(0)
    text, plain = GrowingText(), ""
    for step in range(3000):
        piece = "".join(rng.choice("abcxyz") for _ in range(rng.randint(0, 9)))
        text.add(piece)
        plain += piece
        if step % 7 == 0:
            text.settle(rng.randint(0, len(plain)))
        begin = rng.randint(0, len(plain))  # sometimes before what settled: joined, still right
        assert text.slice(begin, begin + 12) == plain[begin:begin + 12]
        assert text.find("xyz", begin) == plain.find("xyz", begin)
        if step % 50 == 0:
            end = rng.randint(max(0, len(plain) - 20), len(plain))
            text.cut(end)
            plain = plain[:end]
        assert len(text) == len(plain)
    assert text.whole() == plain


class _PieceTokenizer:
    """Token i decodes to the piece f"{i:05d}|": every stretch of text occurs once."""

    def stream(self, skip_special_tokens):
        return self

    def step(self, token_id):
        return f"{token_id:05d}|"


@pytest.mark.parametrize("deltas", [False, True])
def test_a_long_output_settles_its_text_and_still_stops_on_a_string_across_pieces(deltas):
    stop = "04999|05"  # starts inside token 4999's piece, ends in token 5000's: 30k characters in
    request = Request("long", [1, 2, 3], SamplingParams(max_tokens=8000, ignore_eos=True, stop=[stop]))
    tracker = OutputTracker(request, _PieceTokenizer(), [2], 100_000, deltas=deltas)
    streamed, last = "", None
    for token_id in range(8000):
        tracker.append(token_id, None)
        last = tracker.output()
        streamed += last.new_text
        if request.finished:
            break
        # The live string stays short however long the text grows: what is behind it settled.
        assert len(tracker._text._tail) <= GrowingText.SETTLE_AT + len(stop) + 6
    expected = "".join(f"{i:05d}|" for i in range(5000))[:4999 * 6]
    assert last.finish_reason == "stop" and len(request.output_token_ids) == 5001
    assert streamed == expected
    assert last.text == ("" if deltas else expected)


@pytest.mark.parametrize("prompt_len,max_tokens,max_model_len,delivered,stop_at,expected", [
    (3, 10, 8, 0, None, (5, "length")),    # the context fills first: prompt + outputs = max_model_len
    (3, 4, 100, 0, None, (4, "length")),   # max_tokens first
    (3, 10, 8, 0, 2, (2, "stop")),          # a stop token before either
    (3, 4, 100, 2, None, (4, "length")),   # resumed with 2 outputs delivered: 2 more
    (6, 10, 8, 1, None, (2, "length")),    # resumed, the context's last slot
])
def test_the_tracker_stops_at_the_first_of_stop_token_max_tokens_and_max_model_len(
        prompt_len, max_tokens, max_model_len, delivered, stop_at, expected):
    request = Request("r", list(range(10, 10 + prompt_len)), SamplingParams(max_tokens=max_tokens, stop_token_ids=[99]))
    request.output_token_ids = [50 + i for i in range(delivered)]
    tracker = OutputTracker(request, None, [2], max_model_len, deltas=True)
    out = None
    for i in range(delivered, 20):
        tracker.append(99 if i + 1 == stop_at else 3, None)
        out = tracker.output()
        assert out.new_token_ids == [request.output_token_ids[-1]]
        if out.finished:
            break
    assert (len(request.output_token_ids), out.finish_reason) == expected
