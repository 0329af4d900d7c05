"""Sampler and stop rules: each checked against a direct computation, not asserted."""

from __future__ import annotations

import math

import pytest
import torch

from engine import LLM, InvalidRequest, SamplingParams
from engine.sampler import Sampler
from tests.oracle import hf_logits

V = 50


def run(sampler, logits, params, outputs=None, prompts=None):
    n = logits.shape[0]
    return sampler(logits, params, prompts or [[1]] * n, outputs or [[]] * n)


def test_greedy_and_degenerate_filters_equal_argmax():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, V, generator=g)
    best = logits.argmax(-1).tolist()
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, top_k=1),
              SamplingParams(temperature=1.3, top_p=1e-6), SamplingParams(temperature=2.0, min_p=1.0),
              SamplingParams(temperature=0.0, top_k=5), SamplingParams(temperature=0.5, top_k=1, top_p=0.5)]
    assert run(Sampler(V), logits, params).token_ids == best


def test_top_k_top_p_min_p_only_draw_allowed_tokens():
    logits = torch.linspace(-3, 3, V).repeat(3, 1)
    probs = torch.softmax(logits[0], -1)
    order = probs.argsort(descending=True).tolist()
    cum = probs[order].cumsum(0)
    top_p_set = set(order[: int((cum < 0.6).sum()) + 1])
    min_p_set = {i for i in range(V) if probs[i] >= 0.2 * probs.max()}
    sampler = Sampler(V)
    seen = [set(), set(), set()]
    for _ in range(300):
        out = run(sampler, logits, [SamplingParams(top_k=3), SamplingParams(top_p=0.6),
                                    SamplingParams(min_p=0.2)]).token_ids
        for i, t in enumerate(out):
            seen[i].add(t)
    assert seen[0] <= set(order[:3]) and len(seen[0]) == 3
    assert seen[1] <= top_p_set and len(seen[1]) > 1
    assert seen[2] <= min_p_set and len(seen[2]) > 1


def test_sampling_frequencies_follow_temperature():
    logits = torch.tensor([[0.0, math.log(3.0)]])
    sampler = Sampler(2)
    for temperature, expected in ((1.0, 0.75), (2.0, math.sqrt(3) / (1 + math.sqrt(3)))):
        hits = sum(run(sampler, logits, [SamplingParams(temperature=temperature)]).token_ids[0]
                   for _ in range(4000))
        assert abs(hits / 4000 - expected) < 0.03, (temperature, hits / 4000)


def test_seed_gives_the_same_tokens_whatever_the_batch_or_sampler():
    """A seeded request's i-th draw depends on (seed, i) only: not on its batch neighbours,
    nor on which sampler (worker) draws it, so a hand-off or a resume continues the sequence."""
    g = torch.Generator().manual_seed(1)
    rows = torch.randn(5, V, generator=g)
    seeded = SamplingParams(temperature=1.0, seed=1234)
    alone = Sampler(V)
    solo, done = [], []
    for _ in range(8):
        solo.append(run(alone, rows[0:1], [seeded], outputs=[list(done)]).token_ids[0])
        done.append(solo[-1])
    mixed = []
    for step in range(8):
        crowd = Sampler(V)  # a fresh sampler each step: as if every token came from another worker
        params = [SamplingParams(temperature=1.0)] * step + [seeded] + [SamplingParams(temperature=0.9)] * 2
        batch = torch.cat([rows[1:2]] * step + [rows[0:1]] + [rows[2:4]])
        outputs = [[7] * j for j in range(step)] + [solo[:step]] + [[], [3]]
        mixed.append(run(crowd, batch, params, prompts=[[1]] * len(params), outputs=outputs).token_ids[step])
    assert solo == mixed
    assert len(set(solo)) > 1  # it really sampled
    other = [run(alone, rows[0:1], [SamplingParams(temperature=1.0, seed=1235)], outputs=[solo[:i]]).token_ids[0]
             for i in range(8)]
    assert other != solo


def test_penalties_match_their_definitions():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(1, V, generator=g) * 3
    prompt, output = [3, 4], [4, 7, 7, 7]
    p = SamplingParams(temperature=0.0, repetition_penalty=1.7, frequency_penalty=0.4,
                       presence_penalty=0.3)
    expected = logits[0].clone()
    for t in {3, 4, 7}:
        expected[t] = expected[t] / 1.7 if expected[t] > 0 else expected[t] * 1.7
    for t, count in ((4, 1), (7, 3)):
        expected[t] -= 0.4 * count + 0.3
    got = Sampler(V)._apply_penalties(logits, [p], [prompt], [output])
    torch.testing.assert_close(got[0], expected)


def test_a_greedy_batch_with_a_penalty_is_judged_with_it(model_factory):
    """Greedy rows with and without a repetition penalty in one batch: the penalised row's tokens
    are the argmax of transformers' logits after the penalty (prompt and outputs so far seen, as
    transformers' RepetitionPenaltyLogitsProcessor applies it), the other row's the plain argmax;
    so a batch is not sampled as plain argmax because most of its rows are."""
    from tests.oracle import TIE_TOLERANCE

    path, hf = model_factory("jamba")
    prompt = [5, 9, 11, 40, 9, 5]
    plain = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    penalised = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, repetition_penalty=3.0)
    free, out = (o.token_ids for o in LLM(path).generate([prompt, prompt], [plain, penalised]))
    assert out != free, "the penalty must change this output, or the test shows nothing"
    logits = hf_logits(hf, prompt + out)
    for i, token in enumerate(out):
        row = logits[len(prompt) - 1 + i].clone()
        seen = torch.tensor(sorted(set(prompt + out[:i])))
        row[seen] = torch.where(row[seen] > 0, row[seen] / 3.0, row[seen] * 3.0)
        best = int(row.argmax())
        assert token == best or float(row[best] - row[token]) <= TIE_TOLERANCE, (i, token, best)


def test_logprobs_are_the_models_log_softmax(model_factory):
    path, hf = model_factory("jamba")
    llm = LLM(path)
    prompt = [5, 9, 11, 40]
    out = llm.generate([prompt], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True,
                                                logprobs=3))[0]
    reference = torch.log_softmax(hf_logits(hf, prompt + out.token_ids), -1)
    for i, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        row = reference[len(prompt) - 1 + i]
        assert abs(entry["token"] - float(row[token])) < 1e-4
        assert [t for t, _ in entry["top"]] == row.topk(3).indices.tolist()


def test_eos_stop_token_and_max_tokens(model_factory):
    path, hf = model_factory("llama")
    llm = LLM(path)
    prompt = [7, 8, 9]
    free = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0]
    stop_at = free.token_ids[3]
    out = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0,
                                                stop_token_ids=[stop_at]))[0]
    first = free.token_ids.index(stop_at)
    assert out.token_ids == free.token_ids[: first + 1] and out.finish_reason == "stop"
    llm.engine.eos_token_ids = [stop_at]  # the same token as EOS stops too, unless ignored
    out = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0))[0]
    assert out.token_ids == free.token_ids[: first + 1] and out.finish_reason == "stop"
    out = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0]
    assert out.token_ids == free.token_ids and out.finish_reason == "length"


@pytest.mark.parametrize("field,value,message", [
    ("max_tokens", 0, "max_tokens: must be >= 1"),
    ("max_tokens", 2.5, "max_tokens: must be an integer"),
    ("temperature", -0.1, "temperature: must be in"),
    ("temperature", float("nan"), "temperature: must be finite"),
    ("top_p", 0.0, "top_p: must be in"),
    ("top_p", 1.5, "top_p: must be in"),
    ("top_k", -2, "top_k: must be"),
    ("min_p", 2.0, "min_p: must be in"),
    ("logprobs", 100, "logprobs: must be in"),
    ("stop", [""], "stop: stop strings must not be empty"),
    ("stop", ["x"] * 17, "stop: at most 16"),
    ("temperature", "hot", "temperature: must be a number"),
])
def test_bad_sampling_params_name_the_field(field, value, message):
    with pytest.raises(InvalidRequest, match=message) as info:
        SamplingParams(**{field: value})
    assert info.value.field == field
