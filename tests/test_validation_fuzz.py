"""Request validation under arbitrary input (hypothesis; no cluster).

Whatever a caller sends, validation either accepts it, producing SamplingParams the engine
can use as they are, or raises InvalidRequest naming a field the caller sent (ModelNotFound
for another model's name) - never any other exception, which the servers would answer with
a 500, and never a message that echoes a huge value back.
"""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

from engine.prompts import fitting_prompt_ids
from engine.sampling_params import (MAX_LOGPROBS, MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS,
                                    MAX_STOP_TOKEN_IDS, InvalidRequest, SamplingParams)
from engine.tokenizer import Tokenizer
from protos.splitserve.v1 import splitserve_pb2 as pb
from router import openai_protocol as oa
from router.backend import ModelInfo
from router.grpc_server import _lenient, field_path, request_from_proto
from router.http_server import decode_body

FUZZ = settings(max_examples=200, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow])
SAMPLING = list(SamplingParams.__dataclass_fields__)
INFO = ModelInfo("tiny", "", "jamba", vocab_size=259, max_model_len=64, layer_kinds=[])
CHAT_TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"

# The edges validation has tripped on: NaN, inf, ints past float's range or int64, a lone
# surrogate (JSON's "\ud800" decodes to one), bools posing as numbers, numbers as strings.
EDGES = [0, 1, -1, 2, 0.5, -0.0, 1e9, 1.5, float("nan"), float("inf"), -float("inf"), 2**31, 2**63,
         2**64, 10**400, -10**400, "", "10", "x\ud800", True, False, None, [], {}, [1.5], [-1],
         ["x\ud800"], ["x" * 257], [""] * 17, {"a": 1}]
surrogates = st.text(st.characters(categories=["Cs", "Ll"]), min_size=1, max_size=6)
scalars = (st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12)
           | surrogates | st.sampled_from(EDGES))
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=6), inner, max_size=4), max_leaves=12)
long_strings = st.sampled_from(["x" * MAX_STOP_STRING_CHARS, "x" * (MAX_STOP_STRING_CHARS + 1)])
string_lists = st.lists(st.text(max_size=6) | long_strings, max_size=MAX_STOP_STRINGS + 2)
anything = st.sampled_from(EDGES) | json_values | st.lists(scalars, max_size=8) | string_lists
texts = st.text(max_size=80) | surrogates


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    """A byte-level tokenizer without merges (built in milliseconds) and a chat template."""
    folder = tmp_path_factory.mktemp("fuzz_tokenizer")
    specials = ["<pad>", "<s>", "</s>"]
    vocab = {t: i for i, t in enumerate(specials + sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(specials)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "chat_template": CHAT_TEMPLATE}))
    result = Tokenizer(folder)
    assert result.vocab_size == INFO.vocab_size
    return result


def assert_usable(p: SamplingParams) -> None:
    """What the engine takes for granted about accepted parameters."""
    assert type(p.max_tokens) is int and p.max_tokens >= 1
    for name, low, high in [("temperature", 0, 100), ("top_p", 0, 1), ("min_p", 0, 1),
                            ("presence_penalty", -2, 2), ("frequency_penalty", -2, 2),
                            ("repetition_penalty", 0, 10)]:
        value = getattr(p, name)
        assert type(value) is float and math.isfinite(value) and low <= value <= high, name
    assert p.top_p > 0 and p.repetition_penalty > 0
    assert type(p.top_k) is int and -1 <= p.top_k < 2**31
    assert p.seed is None or (type(p.seed) is int and 0 <= p.seed < 2**63)
    assert type(p.stop) is list and len(p.stop) <= MAX_STOP_STRINGS
    for s in p.stop:
        assert type(s) is str and 0 < len(s) <= MAX_STOP_STRING_CHARS
        s.encode("utf-8")
    assert type(p.stop_token_ids) is list and len(p.stop_token_ids) <= MAX_STOP_TOKEN_IDS
    assert all(type(t) is int and t >= 0 for t in p.stop_token_ids)
    assert type(p.ignore_eos) is bool and type(p.skip_special_tokens) is bool
    assert p.logprobs is None or (type(p.logprobs) is int and 0 <= p.logprobs <= MAX_LOGPROBS)


def assert_names(error: InvalidRequest, allowed) -> None:
    root = error.field.split("[")[0].split(".")[0]
    assert root in allowed, (error.field, allowed)
    assert str(error).startswith(f"{error.field}: ") and len(str(error)) < 400, str(error)


def check_one(name, value) -> None:
    try:
        params = SamplingParams(**{name: value})
    except InvalidRequest as e:
        assert e.field == name and len(str(e)) < 400, str(e)
    else:
        assert_usable(params)


@pytest.mark.parametrize("name", SAMPLING)
def test_one_sampling_field_at_the_edges(name):
    for value in EDGES:
        check_one(name, value)


@FUZZ
@given(name=st.sampled_from(SAMPLING), value=anything)
def test_one_sampling_field(name, value):
    check_one(name, value)


@FUZZ
@given(kwargs=st.dictionaries(st.sampled_from(SAMPLING), anything, max_size=6))
def test_several_sampling_fields(kwargs):
    try:
        params = SamplingParams(**kwargs)
    except InvalidRequest as e:
        assert_names(e, kwargs)
    else:
        assert_usable(params)


def check_parsed(parse, body, tokenizer) -> None:
    """parse(body) and then the front door's prompt check, as a server runs them."""
    sent = (set(body) | {"body", "prompt", "messages"}) if isinstance(body, dict) else {"body"}
    try:
        result = parse(body)
        for parsed in result if isinstance(result, list) else [result]:  # completions: a request a prompt
            prompt = parsed.prompt
            assert isinstance(prompt, str) or all(type(t) is int for t in prompt)
            assert_usable(parsed.params)
            assert isinstance(parsed.stream, bool) and isinstance(parsed.return_token_ids, bool)
            ids = fitting_prompt_ids(prompt, tokenizer, INFO.vocab_size, INFO.max_model_len,
                                     parsed.params.max_tokens)
            assert 0 < len(ids) and len(ids) + parsed.params.max_tokens <= INFO.max_model_len
    except InvalidRequest as e:
        assert_names(e, sent | {"max_tokens"})  # a default max_tokens can pass the context
    except oa.ModelNotFound:
        assert isinstance(body["model"], str) and body["model"] != INFO.model_name


# Bodies a client could plausibly send, then a few fields replaced by anything at all: a body
# with many bad fields is refused at the first, and the later checks would never run.
PLAUSIBLE = {"model": st.just(INFO.model_name), "max_tokens": st.integers(1, 80),
             "temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1), "top_k": st.integers(-1, 50),
             "min_p": st.floats(0, 1), "seed": st.integers(0, 2**63 - 1),
             "presence_penalty": st.floats(-2, 2), "frequency_penalty": st.floats(-2, 2),
             "repetition_penalty": st.floats(0.1, 2), "stop": st.lists(texts, max_size=3) | texts,
             "stop_token_ids": st.lists(st.integers(0, 300), max_size=3),
             "ignore_eos": st.booleans(), "skip_special_tokens": st.booleans(),
             "stream": st.booleans(), "stream_options": st.fixed_dictionaries(
                 {}, optional={"include_usage": st.booleans()}),
             "return_token_ids": st.booleans(), "n": st.integers(1, 3), "echo": st.just(False),
             "user": texts}
prompts = texts | st.lists(st.integers(0, 300), max_size=80)
prompts = prompts | st.lists(prompts, min_size=1, max_size=3)  # a batch
parts = st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": texts}), max_size=3)
messages = st.lists(st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "tool", "developer"]),
     "content": texts | parts}, optional={"name": texts}), min_size=1, max_size=4)
COMPLETION = {**PLAUSIBLE, "prompt": prompts, "logprobs": st.integers(0, 5)}
CHAT = {**PLAUSIBLE, "messages": messages, "max_completion_tokens": st.integers(1, 80),
        "logprobs": st.booleans(), "top_logprobs": st.integers(0, 5)}
EXTRA = ["best_of", "suffix", "logit_bias", "tools", "response_format", "frobnicate"]


def bodies(fields: dict):
    @st.composite
    def build(draw):
        body = draw(st.fixed_dictionaries({}, optional=fields))
        for key in draw(st.lists(st.sampled_from(sorted(fields) + EXTRA), max_size=3)):
            body[key] = draw(anything)
        return body
    return build()


completion_bodies, chat_bodies = bodies(COMPLETION), bodies(CHAT)


@FUZZ
@given(body=completion_bodies | anything)
def test_completion_bodies(tokenizer, body):
    check_parsed(lambda b: oa.parse_completion(b, INFO), body, tokenizer)


@FUZZ
@given(body=chat_bodies | anything)
def test_chat_bodies(tokenizer, body):
    check_parsed(lambda b: oa.parse_chat(b, INFO, tokenizer), body, tokenizer)


def mangled(raw: bytes, cut: int, junk: bytes) -> bytes:
    return raw[:cut] + junk + raw[cut:]


raw_bodies = (st.binary(max_size=200)
              | st.integers(1, 100_000).map(lambda n: b"[" * n + b"]" * n)
              | st.builds(lambda b: json.dumps(b).encode(), completion_bodies)
              | st.builds(mangled, st.builds(lambda b: json.dumps(b).encode(), completion_bodies),
                          st.integers(0, 200), st.binary(min_size=1, max_size=4)))


@FUZZ
@given(raw=raw_bodies)
def test_raw_http_bodies(tokenizer, raw):
    try:
        body = decode_body(raw)
    except InvalidRequest as e:
        assert e.field == "body" and len(str(e)) < 400
    else:
        check_parsed(lambda b: oa.parse_completion(b, INFO), body, tokenizer)


uint32, uint64 = st.integers(0, 2**32 - 1), st.integers(0, 2**64 - 1)
proto_sampling = st.fixed_dictionaries({}, optional={
    "max_tokens": uint32, "temperature": st.floats(), "top_k": st.integers(-2**31, 2**31 - 1),
    "top_p": st.floats(), "min_p": st.floats(), "seed": uint64, "presence_penalty": st.floats(),
    "frequency_penalty": st.floats(), "repetition_penalty": st.floats(),
    "stop": string_lists,
    "stop_token_ids": st.lists(uint32, max_size=8), "ignore_eos": st.booleans(),
    "logprobs": st.integers(0, 30) | uint32, "skip_special_tokens": st.booleans()})


@st.composite
def generate_requests(draw):
    request = pb.GenerateRequest(request_id=draw(st.text(max_size=300)),
                                 sampling=pb.SamplingParams(**draw(proto_sampling)))
    kind = draw(st.sampled_from(["text", "token_ids", "none"]))
    if kind == "text":
        request.text = draw(st.text(max_size=80))  # protobuf strings are valid UTF-8
    elif kind == "token_ids":
        request.token_ids.SetInParent()
        request.token_ids.ids.extend(draw(st.lists(st.integers(0, 400) | uint32, max_size=80)))
    return request


def check_proto(request, tokenizer) -> None:
    try:
        prompt, params = request_from_proto(request)
        assert_usable(params)
        fitting_prompt_ids(prompt, tokenizer, INFO.vocab_size, INFO.max_model_len, params.max_tokens)
    except InvalidRequest as e:
        path = field_path(e.field)
        assert path in ("request", "request_id", "prompt") or path.startswith("sampling."), path
        assert len(str(e)) < 400


@FUZZ
@given(request=generate_requests())
def test_grpc_requests(tokenizer, request):
    check_proto(request, tokenizer)


@FUZZ
@given(raw=st.binary(max_size=200) | st.builds(
    mangled, generate_requests().map(lambda r: r.SerializeToString()), st.integers(0, 200),
    st.binary(min_size=1, max_size=4)))
def test_grpc_bytes(tokenizer, raw):
    check_proto(_lenient(pb.GenerateRequest)(raw), tokenizer)  # decoding itself never raises
