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
    # The tokens' decode, but for a character the last tokens left incomplete: the stream holds its
    # bytes back (as vLLM's detokenizer does), where decode writes U+FFFD.
    whole = llm.tokenizer.decode(free.token_ids)
    assert whole.startswith(free.text) and not whole[len(free.text):].strip("\ufffd")
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


def test_delta_outputs_add_up_to_the_cumulative_ones(text_model):
    """output_kind="delta" (what a decode worker runs with): no output carries the prompt or
    anything sent before, and the new tokens, text and logprobs add up to what the cumulative
    engine returns, through a stop string held back and found, a length finish and an abort."""
    folder, _ = text_model
    with pytest.raises(ValueError, match="output_kind: 'sideways' not in"):
        LLM(folder, output_kind="sideways")
    free = LLM(folder).generate(["def fibonacci(n):"], SamplingParams(max_tokens=24, temperature=0.0,
                                                                      ignore_eos=True))[0]
    stop = free.text[6:8]
    requests = {"stop": ("def fibonacci(n):", dict(stop=[stop])), "length": ("for i in", {}),
                "aborted": ("naïve café", {})}
    finals, streams = {}, {}
    for kind in ("cumulative", "delta"):
        engine = LLM(folder, output_kind=kind).engine
        for rid, (prompt, extra) in requests.items():
            engine.add_request(prompt, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=2,
                                                      **extra), request_id=rid)
        steps = 0
        while engine.has_unfinished():
            for out in engine.step():
                if kind == "cumulative":
                    finals[out.request_id] = out
                    continue
                assert not (out.prompt_token_ids or out.token_ids or out.text or out.logprobs), out
                got = streams.setdefault(out.request_id, {"tokens": [], "text": "", "logprobs": [], "end": None})
                got["tokens"] += out.new_token_ids
                got["text"] += out.new_text
                got["logprobs"] += out.new_logprobs or []
                got["end"] = (out.finished, out.finish_reason)
            steps += 1
            if steps == 5:
                engine.abort("aborted")
    assert set(streams) == set(finals) == set(requests)
    assert finals["stop"].finish_reason == "stop" and finals["length"].finish_reason == "length"
    assert finals["aborted"].finish_reason == "abort" and 0 < len(finals["aborted"].token_ids) < 16
    for rid, final in finals.items():
        got = streams[rid]
        assert got["tokens"] == final.token_ids and got["text"] == final.text, rid
        assert got["logprobs"] == final.logprobs and len(final.logprobs) == len(final.token_ids), rid
        assert got["end"] == (True, final.finish_reason), rid


def test_local_backend_streams_whole_outputs_or_deltas_and_a_whole_final(text_model):
    """router.local_backend runs its engine on deltas and rebuilds what each caller asks for."""
    import asyncio

    from router.local_backend import LocalBackend

    folder, _ = text_model
    reference = LLM(folder).generate(["def fibonacci(n):"], SamplingParams(max_tokens=16, temperature=0.0,
                                                                           ignore_eos=True, logprobs=1))[0]
    stop = reference.text[6:8]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=1, stop=[stop])
    expected = LLM(folder).generate(["def fibonacci(n):"], params)[0]
    assert expected.finish_reason == "stop"
    backend = LocalBackend(folder)
    try:
        async def collect(request_id, whole):
            return [out async for out in backend.stream(request_id, "def fibonacci(n):", params, whole=whole)]

        async def main():
            return await asyncio.gather(collect("whole", True), collect("deltas", False))

        whole, deltas = asyncio.run(main())
    finally:
        backend.shutdown()
    for outputs in (whole, deltas):
        final = outputs[-1]
        assert (final.token_ids, final.text, final.finish_reason) == (expected.token_ids, expected.text, "stop")
        assert final.prompt_token_ids == expected.prompt_token_ids and final.logprobs == expected.logprobs
        assert [t for out in outputs for t in out.new_token_ids] == expected.token_ids
        assert "".join(out.new_text for out in outputs) == expected.text
    assert len(whole) == len(deltas) > 2
    for out in whole[:-1]:
        assert out.prompt_token_ids == expected.prompt_token_ids and len(out.logprobs) == len(out.token_ids) > 0
    for out in deltas[:-1]:
        assert not (out.prompt_token_ids or out.token_ids or out.text or out.logprobs), out
