"""The OpenAI-compatible HTTP API through the official `openai` client, and raw HTTP for errors."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from engine.tokenizer import Tokenizer
from router.chat_template import DEFAULT_CHAT_TEMPLATE, chat_prompt_ids
from tests.test_api_support import (LONG, long_requests, MODEL_NAME, backend, idle_backend,  # noqa: F401
                                    running_requests, server, text_model_path, wait_idle)

GREEDY = dict(temperature=0.0, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=f"http://127.0.0.1:{server.http_port}/v1", api_key="none",
                       max_retries=0, timeout=30) as c:
        yield c


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=f"http://127.0.0.1:{server.http_port}", timeout=30) as c:
        yield c


def test_models_and_health(client, http):
    (model,) = client.models.list().data
    assert model.id == MODEL_NAME and model.owned_by == "splitserve"
    assert client.models.retrieve(MODEL_NAME).id == MODEL_NAME
    assert http.get("/health").status_code == 200


def test_completion_with_text_and_token_id_prompts(client, idle_backend):
    ids = idle_backend.tokenizer.encode("def fibonacci(n):")
    by_text = client.completions.create(model=MODEL_NAME, prompt="def fibonacci(n):", max_tokens=6,
                                        temperature=0.0, extra_body={"ignore_eos": True,
                                                                     "return_token_ids": True})
    by_ids = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=6,
                                       temperature=0.0, extra_body={"ignore_eos": True,
                                                                    "return_token_ids": True})
    choice = by_text.choices[0]
    assert choice.finish_reason == "length" and choice.text == by_ids.choices[0].text
    assert choice.model_extra["token_ids"] == by_ids.choices[0].model_extra["token_ids"]
    assert by_text.usage.prompt_tokens == len(ids) and by_text.usage.completion_tokens == 6
    assert by_text.usage.total_tokens == len(ids) + 6
    assert by_text.model == MODEL_NAME and by_text.object == "text_completion"


def test_completion_default_max_tokens_and_logprobs(client, idle_backend):
    done = client.completions.create(model=MODEL_NAME, prompt=[5, 6, 7], logprobs=2, **GREEDY)
    assert done.usage.completion_tokens == 16  # OpenAI's default for completions
    lp = done.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 16
    assert all(v <= 0 for v in lp.token_logprobs)


def test_streamed_completion_adds_up(client, idle_backend):
    whole = client.completions.create(model=MODEL_NAME, prompt="for i in", max_tokens=10, **GREEDY)
    chunks = list(client.completions.create(model=MODEL_NAME, prompt="for i in", max_tokens=10,
                                            stream=True, **GREEDY))
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 10  # usage in the final chunk


def test_chat_uses_the_checkpoint_template(client, idle_backend, text_model_path):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
    done = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=5,
                                          **GREEDY)
    tok = Tokenizer(text_model_path)
    expected = tok.encode("<s><|system|>be brief<|user|>hi there<|assistant|>", add_special_tokens=False)
    assert done.usage.prompt_tokens == len(expected) == len(chat_prompt_ids(tok, messages))
    message = done.choices[0].message
    assert message.role == "assistant" and isinstance(message.content, str)
    assert done.choices[0].finish_reason == "length" and done.usage.completion_tokens == 5


def test_chat_default_template_when_checkpoint_has_none(text_model_path):
    tok = Tokenizer(text_model_path)
    tok.chat_template = None
    ids = chat_prompt_ids(tok, [{"role": "user", "content": [{"type": "text", "text": "hi"}]}])
    assert tok.decode(ids) == "user: hi\nassistant:"
    assert "messages" in DEFAULT_CHAT_TEMPLATE


def test_a_repeated_chat_reports_cached_prompt_tokens(client, idle_backend):
    """The cluster backend caches prefixes: the same conversation again is served from the
    checkpoint at its prompt's last block boundary, and usage says how many tokens that saved."""
    messages = [{"role": "system", "content": "You answer in Python. " * 3},
                {"role": "user", "content": "def fibonacci(n):"}]
    first = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=4, **GREEDY)
    again = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=4, **GREEDY)
    prompt = first.usage.prompt_tokens
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens == (prompt - 1) // 8 * 8 > 0  # block_size 8
    assert again.choices[0].message.content == first.choices[0].message.content


def test_streamed_chat_adds_up_and_reports_usage(client, idle_backend):
    messages = [{"role": "user", "content": "def f(x):"}]
    whole = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=8, **GREEDY)
    chunks = list(client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=8,
                                                 stream=True, stream_options={"include_usage": True},
                                                 **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8


def test_chat_logprobs(client, idle_backend):
    done = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "x"}],
                                          max_tokens=3, logprobs=True, top_logprobs=2, **GREEDY)
    content = done.choices[0].logprobs.content
    assert len(content) == 3 and all(len(c.top_logprobs) == 2 for c in content)


@pytest.mark.parametrize("kwargs, param", [
    (dict(prompt="x", temperature=-1), "temperature"),
    (dict(prompt="x", max_tokens=0), "max_tokens"),
    (dict(prompt="x", top_p=5), "top_p"),
    (dict(prompt=[5, 100000]), "prompt"),
    (dict(prompt=""), "prompt"),
    (dict(prompt="x", n=0), "n"),
    (dict(prompt="x", logprobs=50), "logprobs"),
    (dict(prompt="x", stop=[""]), "stop"),
])
def test_invalid_completion_is_a_400_naming_the_field(client, idle_backend, kwargs, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL_NAME, **kwargs)
    assert e.value.status_code == 400 and e.value.body["param"] == param
    assert e.value.body["type"] == "invalid_request_error" and param in e.value.body["message"]


def test_unknown_model_is_a_404(client):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-17", prompt="x", max_tokens=1)


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", b"{not json"),
    ("/v1/completions", b"[1, 2]"),
    ("/v1/completions", b"{}"),
    ("/v1/completions", json.dumps({"prompt": {"a": 1}}).encode()),
    ("/v1/completions", json.dumps({"prompt": [[1], {"a": 1}]}).encode()),
    ("/v1/completions", json.dumps({"prompt": "x", "stream": "yes"}).encode()),
    ("/v1/completions", json.dumps({"prompt": "x", "seed": "abc"}).encode()),
    ("/v1/completions", json.dumps({"prompt": "x", "stop": 5}).encode()),
    ("/v1/completions", json.dumps({"prompt": "x", "stream": True, "max_tokens": -3}).encode()),
    ("/v1/chat/completions", json.dumps({"messages": []}).encode()),
    ("/v1/chat/completions", json.dumps({"messages": "hi"}).encode()),
    ("/v1/chat/completions", json.dumps({"messages": [{"role": "wizard", "content": "x"}]}).encode()),
    ("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": 5}]}).encode()),
    ("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": "x"}],
                                         "top_logprobs": 2}).encode()),
    ("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": "x"}],
                                         "tools": [{"type": "function"}]}).encode()),
])
def test_bad_bodies_are_400_never_500(http, idle_backend, path, body):
    response = http.post(path, content=body, headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]


def test_oversized_body_is_a_413(http):
    response = http.post("/v1/completions", content=b"[" + b"1," * (9 << 20) + b"1]")
    assert response.status_code == 413 and response.json()["error"]["param"] == "body"


def test_unknown_route_is_an_openai_style_404(http):
    response = http.get("/v1/nothing")
    assert response.status_code == 404 and response.json()["error"]["message"]


def test_http_stream_disconnect_aborts(server, idle_backend, long_requests):
    url = f"http://127.0.0.1:{server.http_port}/v1/completions"
    body = {"model": MODEL_NAME, "prompt": "def f(x):", "max_tokens": LONG, "stream": True,
            "temperature": 0.0, "ignore_eos": True}
    with httpx.stream("POST", url, json=body, timeout=30) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
        assert running_requests(idle_backend) == 1
    wait_idle(idle_backend)


def test_http_disconnect_before_a_whole_answer_aborts(server, idle_backend, long_requests):
    url = f"http://127.0.0.1:{server.http_port}/v1/completions"
    body = {"model": MODEL_NAME, "prompt": "def f(x):", "max_tokens": LONG, "temperature": 0.0,
            "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url, json=body, timeout=httpx.Timeout(30, read=0.5))
    wait_idle(idle_backend)


# ---------------------------------------------------------------- scoring a prompt (lm-eval's loglikelihood)

def _reference_logprobs(model_factory, ids):
    import torch

    from tests.oracle import hf_logits

    _, hf = model_factory("jamba")  # the API model's weights (tests.test_api_support.make_api_model)
    return torch.log_softmax(hf_logits(hf, ids).double(), dim=-1)


@pytest.mark.parametrize("max_tokens", [0, 1])
def test_echo_with_logprobs_scores_the_prompt_as_transformers_does(http, idle_backend, model_factory, max_tokens):
    """What lm-eval's local-completions sends for loglikelihood: token ids, echo, logprobs 1."""
    ids = [5, 9, 13, 200, 17, 42, 8, 77, 300]
    body = {"model": MODEL_NAME, "prompt": ids, "echo": True, "logprobs": 1, "max_tokens": max_tokens,
            "temperature": 0.0}
    done = http.post("/v1/completions", json=body).json()
    choice, ref = done["choices"][0], _reference_logprobs(model_factory, ids)
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(ids) + max_tokens
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    for i in range(1, len(ids)):
        assert abs(lp["token_logprobs"][i] - float(ref[i - 1, ids[i]])) <= 1e-4
        assert len(lp["top_logprobs"][i]) == 1
        assert abs(max(lp["top_logprobs"][i].values()) - float(ref[i - 1].max())) <= 1e-4
    assert lp["text_offset"] == sorted(lp["text_offset"])
    assert choice["text"].startswith(idle_backend.tokenizer.decode(ids, skip_special_tokens=False))
    assert done["usage"]["completion_tokens"] == max_tokens and done["usage"]["prompt_tokens"] == len(ids)
    if max_tokens == 1:  # the generated token scored as any other: greedy, so the best there
        assert abs(lp["token_logprobs"][-1] - max(lp["top_logprobs"][-1].values())) <= 1e-6


def test_echo_of_a_text_prompt_and_its_stream(client, idle_backend):
    whole = client.completions.create(model=MODEL_NAME, prompt="def f(x):", echo=True, max_tokens=4,
                                      logprobs=0, **GREEDY)
    text = whole.choices[0].text
    assert text.startswith("def f(x):") and whole.usage.completion_tokens == 4
    chunks = list(client.completions.create(model=MODEL_NAME, prompt="def f(x):", echo=True, max_tokens=4,
                                            logprobs=0, stream=True, **GREEDY))
    assert "".join(c.choices[0].text for c in chunks) == text
    streamed = [v for c in chunks if c.choices[0].logprobs for v in c.choices[0].logprobs.token_logprobs]
    assert streamed == whole.choices[0].logprobs.token_logprobs


def test_vllm_prompt_logprobs_on_completions_and_chat(client, idle_backend, model_factory):
    ids = [5, 9, 13, 200, 17]
    done = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=2,
                                     extra_body={"prompt_logprobs": 2, "ignore_eos": True}, temperature=0.0)
    entries, ref = done.choices[0].model_extra["prompt_logprobs"], _reference_logprobs(model_factory, ids)
    assert entries[0] is None and len(entries) == len(ids)
    for i in range(1, len(ids)):
        own = entries[i][str(ids[i])]
        assert abs(own["logprob"] - float(ref[i - 1, ids[i]])) <= 1e-4 and own["rank"] >= 1
        assert len(entries[i]) in (2, 3)  # the prompt's own token and the top 2 (it may be one of them)
    chat = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=2, extra_body={"prompt_logprobs": 0}, temperature=0.0)
    entries = chat.model_extra["prompt_logprobs"]
    assert entries[0] is None and len(entries) == chat.usage.prompt_tokens
    assert all(len(e) == 1 for e in entries[1:])


def test_max_tokens_zero_needs_echo(http, idle_backend):
    response = http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": [5, 6], "max_tokens": 0})
    assert response.status_code == 400 and response.json()["error"]["param"] == "max_tokens"
    assert "echo" in response.json()["error"]["message"]


# ---------------------------------------------------------------- several prompts in one body

BATCH = ["def f(x):", [5, 9, 13, 200], "for i in range(", [7, 7, 7, 7, 7, 7]]


def test_a_batch_of_prompts_answers_each_as_its_own_request_would(client, idle_backend):
    """A choice per prompt, its index the prompt's, equal to that prompt sent alone; the usage is
    the sum of theirs."""
    batch = client.completions.create(model=MODEL_NAME, prompt=BATCH, max_tokens=6, logprobs=1,
                                      temperature=0.0, extra_body={"ignore_eos": True, "return_token_ids": True})
    alone = [client.completions.create(model=MODEL_NAME, prompt=p, max_tokens=6, logprobs=1, temperature=0.0,
                                       extra_body={"ignore_eos": True, "return_token_ids": True}) for p in BATCH]
    assert [c.index for c in batch.choices] == list(range(len(BATCH)))
    for choice, single in zip(batch.choices, alone):
        assert choice.text == single.choices[0].text and choice.finish_reason == "length"
        assert choice.model_extra["token_ids"] == single.choices[0].model_extra["token_ids"]
        assert choice.logprobs.token_logprobs == single.choices[0].logprobs.token_logprobs
        assert choice.logprobs.text_offset == single.choices[0].logprobs.text_offset  # each choice's own
    assert batch.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in alone)
    assert batch.usage.completion_tokens == 6 * len(BATCH)
    assert batch.usage.total_tokens == batch.usage.prompt_tokens + batch.usage.completion_tokens


def test_a_batch_scores_its_prompts_as_lm_eval_sends_them(http, idle_backend, model_factory):
    """lm-eval's loglikelihood with batch_size > 1: token-id prompts, echo, logprobs 1, max_tokens 1."""
    prompts = [[5, 9, 13, 200, 17], [42, 8, 77], [300, 2, 2, 2, 9, 11]]
    body = {"model": MODEL_NAME, "prompt": prompts, "echo": True, "logprobs": 1, "max_tokens": 1,
            "temperature": 0.0}
    choices = sorted(http.post("/v1/completions", json=body).json()["choices"], key=lambda c: c["index"])
    assert len(choices) == len(prompts)
    for ids, choice in zip(prompts, choices):
        ref, lp = _reference_logprobs(model_factory, ids), choice["logprobs"]
        assert len(lp["token_logprobs"]) == len(ids) + 1 and lp["token_logprobs"][0] is None
        for i in range(1, len(ids)):
            assert abs(lp["token_logprobs"][i] - float(ref[i - 1, ids[i]])) <= 1e-4


def test_a_streamed_batch_adds_up_per_choice(client, idle_backend):
    whole = client.completions.create(model=MODEL_NAME, prompt=BATCH, max_tokens=8, **GREEDY)
    chunks = list(client.completions.create(model=MODEL_NAME, prompt=BATCH, max_tokens=8, stream=True,
                                            stream_options={"include_usage": True}, **GREEDY))
    texts, finished = [""] * len(BATCH), {}
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices
        texts[choice.index] += choice.text
        if choice.finish_reason is not None:
            finished[choice.index] = choice.finish_reason
    assert texts == [c.text for c in whole.choices]
    assert finished == dict.fromkeys(range(len(BATCH)), "length")
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8 * len(BATCH)
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


@pytest.mark.parametrize("stream", [False, True])
def test_a_bad_prompt_in_a_batch_is_a_400_naming_it_and_runs_none(http, idle_backend, stream):
    too_long = [5] * 5000
    for prompts, field in (([[5, 6], {"a": 1}], "prompt[1]"), (["ok", too_long, [7, 8]], "prompt[1]"),
                           ([[5, 6], [10**9]], "prompt[1]")):
        body = {"model": MODEL_NAME, "prompt": prompts, "max_tokens": 4, "stream": stream}
        response = http.post("/v1/completions", json=body)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == field, response.text
    wait_idle(idle_backend)  # the batch's other requests were aborted, nothing is left running


def test_a_disconnect_aborts_every_request_of_a_batch(server, idle_backend, long_requests):
    url = f"http://127.0.0.1:{server.http_port}/v1/completions"
    body = {"model": MODEL_NAME, "prompt": ["def f(x):", [5, 6, 7]], "max_tokens": LONG, "stream": True,
            "temperature": 0.0, "ignore_eos": True}
    with httpx.stream("POST", url, json=body, timeout=30) as response:
        assert next(response.iter_lines()).startswith("data: ")
        assert running_requests(idle_backend) == 2
    wait_idle(idle_backend)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url, json={**body, "stream": False}, timeout=httpx.Timeout(30, read=0.5))
    wait_idle(idle_backend)


# ---------------------------------------------------------------- several samples of a prompt (n)

SAMPLED = dict(temperature=1.0, extra_body={"ignore_eos": True, "return_token_ids": True})


def test_n_samples_are_requests_with_the_seed_plus_their_index(client, idle_backend):
    """As vLLM: sample j of a seeded body draws with seed + j, so each is the request sent alone
    with that seed; prompt i's sample j is choice i * n + j; the prompt counts once in usage."""
    prompts = ["def f(x):", [5, 9, 13, 200]]
    several = client.completions.create(model=MODEL_NAME, prompt=prompts, n=3, seed=41, max_tokens=8, **SAMPLED)
    assert [c.index for c in several.choices] == list(range(6))
    texts = {}
    for i, prompt in enumerate(prompts):
        for j in range(3):
            alone = client.completions.create(model=MODEL_NAME, prompt=prompt, seed=41 + j, max_tokens=8, **SAMPLED)
            choice = several.choices[i * 3 + j]
            assert choice.model_extra["token_ids"] == alone.choices[0].model_extra["token_ids"], (i, j)
            texts.setdefault(i, set()).add(choice.text)
        assert len(texts[i]) > 1  # the samples of one prompt differ
    singles = [client.completions.create(model=MODEL_NAME, prompt=p, max_tokens=1, **GREEDY) for p in prompts]
    assert several.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles)
    assert several.usage.completion_tokens == 6 * 8


def test_chat_n_samples_whole_and_streamed(client, idle_backend):
    messages = [{"role": "user", "content": "hello"}]
    whole = client.chat.completions.create(model=MODEL_NAME, messages=messages, n=2, seed=5, max_tokens=6,
                                           **SAMPLED)
    assert [c.index for c in whole.choices] == [0, 1]
    assert whole.choices[0].message.content != whole.choices[1].message.content
    alone = client.chat.completions.create(model=MODEL_NAME, messages=messages, seed=6, max_tokens=6, **SAMPLED)
    assert whole.choices[1].message.content == alone.choices[0].message.content
    assert whole.usage.prompt_tokens == alone.usage.prompt_tokens and whole.usage.completion_tokens == 12
    chunks = list(client.chat.completions.create(model=MODEL_NAME, messages=messages, n=2, seed=5, max_tokens=6,
                                                 stream=True, stream_options={"include_usage": True}, **SAMPLED))
    roles, contents = {}, ["", ""]
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices
        if choice.delta.role:
            roles[choice.index] = choice.delta.role
        contents[choice.index] += choice.delta.content or ""
    assert roles == {0: "assistant", 1: "assistant"}
    assert contents == [c.message.content for c in whole.choices]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
