"""Structured outputs in the engine: every constrained output is valid, exactly across the split.

A tiny random model never writes valid JSON by itself (checked below), so a valid output at
temperature 1.0 is the grammar's doing. Specs whose every path is bounded (maxLength, ranges,
enums) must finish inside max_tokens; unbounded ones (any JSON object) may be cut: "length".
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from engine import LLM, InvalidRequest, SamplingParams
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.request import Resume
from engine.structured import StructuredOutput, apply_grammar_masks
from tests.test_handoff_engine import run_disaggregated

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["id", "ok", "tag"],
          "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99},
                         "ok": {"type": "boolean"}, "tag": {"enum": ["red", "green"]},
                         "xs": {"type": "array", "maxItems": 2, "items": {"type": "string", "maxLength": 2}}}}
REGEX = r"[a-z]{2,5}-[0-9]{1,3}"
CHOICES = ["yes", "no", "maybe so"]
LARK = 'start: "(" NUM ("+" NUM){0,2} ")"\nNUM: /[0-9]{1,2}/'
LARK_AS_REGEX = r"\([0-9]{1,2}(\+[0-9]{1,2}){0,2}\)"
SEEDS = range(4)
PROMPT = "def main():"


def check(spec: StructuredOutput, text: str) -> None:
    """The output matches its spec, judged without llguidance."""
    if spec.kind == "json_schema":
        jsonschema.validate(json.loads(text), json.loads(spec.spec))
    elif spec.kind == "json_object":
        assert isinstance(json.loads(text), dict)
    elif spec.kind == "regex":
        assert re.fullmatch(spec.spec, text), text
    elif spec.kind == "choice":
        assert text in json.loads(spec.spec)
    else:
        assert re.fullmatch(LARK_AS_REGEX, text), text


BOUNDED = {"json_schema": StructuredOutput.json_schema(SCHEMA), "regex": StructuredOutput("regex", REGEX),
           "choice": StructuredOutput.choice(CHOICES), "grammar": StructuredOutput("grammar", LARK)}


def constrained(spec, seed, max_tokens=120, **kw):
    return SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed, structured_output=spec, **kw)


@pytest.fixture(scope="module")
def llm(api_model_path):
    return LLM(api_model_path, num_kv_blocks=400, max_num_seqs=32, block_size=4)


@pytest.mark.parametrize("bad, words", [
    (lambda: StructuredOutput.json_schema({"type": "objectx"}), "objectx"),
    (lambda: StructuredOutput("json_schema", "{not json"), "not valid JSON"),
    (lambda: StructuredOutput("regex", "[a-"), "unclosed character class"),
    (lambda: StructuredOutput("grammar", "start: undefined_rule"), "undefined_rule"),
    (lambda: StructuredOutput.choice([]), "non-empty list"),
    (lambda: StructuredOutput("xml"), "kind"),
])
def test_a_bad_spec_is_refused_when_built_naming_the_field(bad, words):
    with pytest.raises(InvalidRequest) as e:
        bad()
    assert e.value.field == "structured_output" and words in e.value.message


def test_every_constrained_output_is_valid_offline(llm):
    free = llm.generate([PROMPT] * len(SEEDS), [SamplingParams(max_tokens=40, seed=s) for s in SEEDS])
    for out in free:  # the model alone: no valid JSON
        with pytest.raises(ValueError):
            json.loads(out.text)
    specs = [(spec, seed) for spec in BOUNDED.values() for seed in SEEDS]
    outs = llm.generate([PROMPT] * len(specs), [constrained(spec, seed) for spec, seed in specs])
    for (spec, seed), out in zip(specs, outs):
        assert out.finish_reason == "stop" and len(out.token_ids) < 120, (spec.kind, seed, out.text)
        check(spec, out.text)
    assert len({o.text for o in outs[: len(SEEDS)]}) > 1  # seeds really differ


def test_any_json_object_is_valid_or_cut_by_length(llm):
    spec = StructuredOutput("json_object")
    # 16 seeds: with its tiny random model, an object the sampler closes within 30 tokens is rare
    outs = llm.generate([PROMPT] * 16, [constrained(spec, seed, max_tokens=30) for seed in range(16)])
    assert any(o.finish_reason == "stop" for o in outs)
    for out in outs:
        if out.finish_reason == "stop":
            check(spec, out.text)
        else:
            assert out.finish_reason == "length" and len(out.token_ids) == 30 and out.text.startswith("{")


def test_a_finished_grammar_stops_and_max_tokens_cutting_it_is_length(llm):
    spec = BOUNDED["json_schema"]
    whole = llm.generate([PROMPT], constrained(spec, 3, ignore_eos=True))[0]
    assert whole.finish_reason == "stop" and len(whole.token_ids) < 120  # not waiting for max_tokens
    check(spec, whole.text)
    cut = llm.generate([PROMPT], constrained(spec, 3, max_tokens=len(whole.token_ids) - 2))[0]
    assert cut.finish_reason == "length" and cut.token_ids == whole.token_ids[:-2]
    with pytest.raises(ValueError):
        json.loads(cut.text)


def test_masks_leave_free_rows_bit_for_bit(llm):
    grammar = llm.engine.grammars.state(BOUNDED["json_schema"])
    grammar.consume(llm.tokenizer.encode('{"', add_special_tokens=False)[0])
    logits = torch.randn(3, llm.engine.spec.vocab_size)
    before = logits.clone()
    out = apply_grammar_masks(logits, [None, grammar, None])
    assert torch.equal(out[0], before[0]) and torch.equal(out[2], before[2])
    assert torch.equal(logits, before)  # the caller's logits are not written
    allowed = torch.isfinite(out[1])
    assert 0 < int(allowed.sum()) < logits.shape[1]
    for token in range(logits.shape[1]):  # exactly the tokens the matcher would accept
        assert bool(allowed[token]) == (grammar.matcher.validate_tokens([token]) == 1), token
        if allowed[token]:
            assert out[1, token] == before[1, token]


def test_free_requests_are_unchanged_by_constrained_neighbours(llm):
    free = [SamplingParams(max_tokens=24, temperature=1.0, seed=40 + i, ignore_eos=True) for i in range(3)]
    free.append(SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    alone = llm.generate([PROMPT] * len(free), free)
    mixed_params = [p for pair in zip(free, [constrained(s, i) for i, s in enumerate(BOUNDED.values())])
                    for p in pair]
    mixed = llm.generate([PROMPT] * len(mixed_params), mixed_params)  # one batch, rows interleaved
    assert [o.token_ids for o in mixed[0::2]] == [o.token_ids for o in alone]
    for spec, out in zip(BOUNDED.values(), mixed[1::2]):
        check(spec, out.text)


def test_split_and_resume_continue_the_grammar_exactly(llm, api_model_path, kind="json_schema"):
    """P samples token 0 under the grammar, D continues from the state after it; a request
    resumed from k delivered tokens rebuilds the state by replaying them: same tokens as colocated."""
    ids = llm.engine.tokenize(PROMPT)
    prompts = [ids, ids[:3]]
    params = constrained(BOUNDED[kind], 7)
    colocated = llm.generate(prompts, params)
    split = run_disaggregated(api_model_path, prompts, params)
    assert [o.token_ids for o in split] == [o.token_ids for o in colocated]
    for out in split:
        assert out.finish_reason == "stop"
        check(BOUNDED[kind], out.text)
    engine = LLMEngine(EngineConfig(str(api_model_path), block_size=4))
    for prompt, whole in zip(prompts, colocated):
        k = len(whole.token_ids) // 2
        engine.add_request(prompt, params, request_id="r", resume=Resume(tuple(whole.token_ids[:k])))
        final = None
        while final is None:
            final = next((o for o in engine.step() if o.finished), None)
        assert final.token_ids == whole.token_ids and final.finish_reason == "stop"
        check(BOUNDED[kind], final.text)


def test_a_resume_that_breaks_the_grammar_is_refused(api_model_path, llm):
    engine = LLMEngine(EngineConfig(str(api_model_path), block_size=4))
    bad = tuple(llm.tokenizer.encode("zz", add_special_tokens=False))
    with pytest.raises(InvalidRequest) as e:
        engine.add_request(PROMPT, constrained(BOUNDED["json_schema"], 0), resume=Resume(bad))
    assert e.value.field == "resume" and not engine.requests
