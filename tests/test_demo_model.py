"""The bundled demo checkpoint: complete, small, and served exactly as transformers runs it."""

from __future__ import annotations

import json

import pytest

from engine import LLM, SamplingParams, demo_model_path
from tests.oracle import judge_greedy

REQUIRED = {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "generation_config.json", "README.md"}


def test_folder_is_complete_and_small():
    folder = demo_model_path()
    names = {p.name for p in folder.iterdir()}
    assert REQUIRED <= names, REQUIRED - names
    assert sum(p.stat().st_size for p in folder.iterdir()) <= 20 * 1024 * 1024
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "jamba"
    kinds = {i % config["attn_layer_period"] == config["attn_layer_offset"]
             for i in range(config["num_hidden_layers"])}
    assert kinds == {True, False}, "the demo must be hybrid: attention and Mamba layers"


@pytest.fixture(scope="module")
def hf_demo():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = demo_model_path()
    return AutoModelForCausalLM.from_pretrained(folder).eval(), AutoTokenizer.from_pretrained(folder)


def test_default_llm_serves_the_demo_exactly_as_transformers(hf_demo):
    hf, hf_tok = hf_demo
    llm = LLM()  # no model: the bundled demo
    prompt = "def fibonacci(n):\n"
    ids = llm.tokenizer.encode(prompt)
    assert ids == hf_tok(prompt)["input_ids"]
    out = llm.generate([prompt], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))[0]
    judge_greedy(hf, ids, out.token_ids)
    assert out.text == hf_tok.decode(out.token_ids)
