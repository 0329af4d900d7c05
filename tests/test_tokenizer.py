"""Text in and out: tokenizer.json, stop strings, and UTF-8-safe streaming."""

from __future__ import annotations

import json
import shutil

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from engine import LLM, SamplingParams
from engine.tokenizer import Tokenizer as OurTokenizer

TEXT = ["def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n",
        "naïve café — 東京 🙂 ünïcödé ✓ " * 3, "for i in range(10):\n    print(i)\n"]


def make_tokenizer(folder, vocab_size=300):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TEXT * 20, trainer)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}))


@pytest.fixture(scope="module")
def text_model(model_factory, tmp_path_factory):
    path, hf = model_factory("jamba")
    folder = tmp_path_factory.mktemp("text_model")
    shutil.copytree(path, folder, dirs_exist_ok=True)
    make_tokenizer(folder)
    return folder, hf


def test_streaming_deltas_never_split_a_character(tmp_path):
    make_tokenizer(tmp_path)
    tok = OurTokenizer(tmp_path)
    text = "东京 🙂 naïve ✓ emoji 🙂🙂 end"
    ids = tok.encode(text)
    stream = tok.stream()
    deltas = [stream.step(i) for i in ids]
    assert "".join(deltas) == tok.decode(ids) == text
    for d in deltas:
        d.encode("utf-8")  # a lone surrogate or replacement would show up here
        assert "\ufffd" not in d
    assert len(ids) > len(text.encode("utf-8")) / 4  # byte-level pieces really split characters


def test_special_tokens_from_tokenizer_config(tmp_path):
    make_tokenizer(tmp_path)
    tok = OurTokenizer(tmp_path)
    assert tok.eos_token == "</s>" and tok.eos_token_id == 2 and tok.bos_token_id == 1


def test_text_prompt_and_stop_string_is_not_returned(text_model):
    folder, hf = text_model
    llm = LLM(folder)
    prompt = "def fibonacci(n):"
    free = llm.generate([prompt], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))[0]
    assert free.text == llm.tokenizer.decode(free.token_ids)
    assert free.token_ids and len(free.text) >= 4
    stop = free.text[3:5]
    out = llm.generate([prompt], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True,
                                                stop=[stop]))[0]
    assert out.finish_reason == "stop"
    assert out.text == free.text[: free.text.find(stop)]
    assert stop not in out.text


def test_streamed_text_adds_up_and_holds_back_possible_stop(text_model):
    folder, hf = text_model
    llm = LLM(folder)
    engine = llm.engine
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, stop=["zzzz-never"])
    engine.add_request("for i in", params, request_id="s")
    pieces, final = [], None
    while engine.has_unfinished():
        for out in engine.step():
            pieces.append(out.new_text)
            final = out
    assert "".join(pieces) == final.text
    assert final.finished and final.finish_reason == "length"
