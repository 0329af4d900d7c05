"""A request is validated once, at the front door: what it checked travels with the request
(PromptIds, StructuredOutput.grammar), and the router and the workers check only the bounds a
wrong router could break."""

from __future__ import annotations

import pickle

import pytest

import engine.structured as structured
from engine import demo_model_path
from engine.prompts import PromptIds, fitting_prompt_ids, prompt_token_ids
from engine.sampling_params import InvalidRequest
from engine.structured import StructuredOutput
from engine.tokenizer import Tokenizer


def test_the_front_doors_ids_pass_on_as_they_are():
    ids = fitting_prompt_ids([5, 6, 7], None, vocab_size=100, max_model_len=64, max_tokens=8)
    assert isinstance(ids, PromptIds) and ids == [5, 6, 7] and ids.vocab_size == 100
    assert prompt_token_ids(ids, None, 100) is ids  # the router's and the engine's check
    copy = pickle.loads(pickle.dumps(ids))  # as Ray carries it to a worker
    assert copy == ids and copy.vocab_size == 100 and prompt_token_ids(copy, None, 100) is copy


def test_checked_ids_still_meet_the_bounds_of_the_vocabulary_they_reach():
    with pytest.raises(InvalidRequest, match=r"prompt.*\[0, 100\)"):
        prompt_token_ids(PromptIds([5, 100], 100), None, 100)  # what a wrong router could send
    with pytest.raises(InvalidRequest, match=r"prompt.*\[0, 100\)"):
        prompt_token_ids(PromptIds([-1], 100), None, 100)
    # checked against a larger vocabulary than this one: checked again in full
    with pytest.raises(InvalidRequest, match=r"prompt.*integers in \[0, 50\).*got 70"):
        prompt_token_ids(PromptIds([3, 70], 100), None, 50)


def test_a_worker_builds_its_grammar_from_the_text_validated_at_the_front_door(monkeypatch):
    spec = StructuredOutput.json_schema({"type": "object", "properties": {"a": {"type": "integer"}}})
    assert spec.grammar  # validated on construction, at the front door
    arrived = pickle.loads(pickle.dumps(spec))
    assert arrived == spec and arrived.grammar == spec.grammar

    def validated_again(kind, text):
        raise AssertionError("the worker validated the spec again")

    monkeypatch.setattr(structured, "grammar_text", validated_again)
    tokenizer = Tokenizer(demo_model_path())
    compiler = structured.GrammarCompiler(tokenizer, tokenizer.vocab_size, [2])
    state = compiler.state(arrived)
    assert state is not None and not state.matcher.is_error()
