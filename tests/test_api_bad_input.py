"""Bad input on both front doors: refused with the field named, nothing leaked, still serving.

Every case is a /v1/completions (or chat) body and the gRPC GenerateRequest saying the same,
where the protocol can say it (gRPC's typed fields cannot hold a negative max_tokens or a
string temperature; HTTP has no request_id). HTTP answers 400 with OpenAI's error body whose
`param` names the field; gRPC INVALID_ARGUMENT whose message starts with the field's path.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import grpc
import httpx
import pytest

from protos.splitserve.v1 import splitserve_pb2 as pb
from protos.splitserve.v1 import splitserve_pb2_grpc as pb_grpc
from engine.sampling_params import InvalidRequest
from router.grpc_server import field_path
from tests.test_api_support import (MODEL_NAME, backend, idle_backend, server,  # noqa: F401
                                    serving, wait_idle)

NAN, INF = float("nan"), float("inf")
CONTEXT = 1024  # the API model's max_model_len (checked below)
EMOJI = "\N{SLIGHTLY SMILING FACE}"  # several byte-level tokens each
GENERATE = "/splitserve.v1.SplitServe/Generate"
OK = {"temperature": 0.0, "ignore_eos": True}  # the good request, greedy


@dataclass
class Case:
    field: str  # OpenAI's name; gRPC's path is router.grpc_server.field_path(field)
    http: dict | bytes | None = None  # a body for /v1/completions, or raw bytes
    rpc: pb.GenerateRequest | bytes | None = None  # a gRPC request, or raw bytes
    chat: bool = False  # the body goes to /v1/chat/completions
    status: int = 400
    code: grpc.StatusCode = grpc.StatusCode.INVALID_ARGUMENT


def body(**fields) -> dict:
    return {"model": MODEL_NAME, "prompt": "x", "max_tokens": 2, **fields}


def chat(**fields) -> dict:
    return {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            **fields}


def gen(prompt: str | list[int] = "x", request_id: str = "", **sampling) -> pb.GenerateRequest:
    request = pb.GenerateRequest(request_id=request_id,
                                 sampling=pb.SamplingParams(**{"max_tokens": 2, **sampling}))
    if isinstance(prompt, str):
        request.text = prompt
    else:
        request.token_ids.SetInParent()  # set even when empty
        request.token_ids.ids.extend(prompt)
    return request


def both(field, value, **extra) -> Case:
    """`field` set to `value` in both protocols."""
    return Case(field, body(**{field: value}), gen(**{field: value}), **extra)


def http_only(field, value) -> Case:
    return Case(field, body(**{field: value}))


def chat_only(field, **fields) -> Case:
    return Case(field, chat(**fields), chat=True)


def message(part: str, **fields) -> Case:
    """One chat message made of `fields`; the error names messages[0].<part>."""
    return chat_only(f"messages[0].{part}", messages=[fields])


CASES = {
    # the prompt
    "empty-prompt": Case("prompt", body(prompt=""), gen("")),
    "empty-token-ids": Case("prompt", body(prompt=[]), gen([])),
    "no-prompt": Case("prompt", {"model": MODEL_NAME}, pb.GenerateRequest()),
    "prompt-past-context": Case("prompt", body(prompt=[5] * CONTEXT), gen([5] * CONTEXT)),
    "text-prompt-past-context": Case("prompt", body(prompt=EMOJI * CONTEXT), gen(EMOJI * CONTEXT)),
    "token-id-past-vocab": Case("prompt", body(prompt=[5, 100000]), gen([5, 2**32 - 1])),
    "token-id-negative": http_only("prompt", [5, -1]),
    "token-id-not-integer": http_only("prompt", [5, 1.5]),
    "prompt-number": http_only("prompt", 5),
    "prompt-object": http_only("prompt", {"text": "x"}),
    "prompt-lone-surrogate": http_only("prompt", "x\ud800"),
    "prompt-batch-with-an-empty-one": Case("prompt[1]", body(prompt=["a", ""])),
    "prompt-batch-with-one-past-context": Case("prompt[2]", body(prompt=[[5], "b", [5] * CONTEXT])),
    "prompt-batch-with-a-number": Case("prompt[0]", body(prompt=[5, [6]])),
    # sampling, both protocols
    "temperature-negative": both("temperature", -1.0),
    "temperature-nan": both("temperature", NAN),
    "temperature-inf": both("temperature", INF),
    "temperature-absurd": both("temperature", 1e9),
    "top-p-zero": both("top_p", 0.0),
    "top-p-negative": both("top_p", -0.1),
    "top-p-above-one": both("top_p", 1.5),
    "top-p-nan": both("top_p", NAN),
    "top-k-below-minus-one": both("top_k", -2),
    "min-p-above-one": both("min_p", 1.5),
    "max-tokens-zero": both("max_tokens", 0),
    "max-tokens-past-context": both("max_tokens", CONTEXT),
    "max-tokens-past-context-streamed": Case("max_tokens", body(max_tokens=CONTEXT, stream=True)),
    "max-tokens-absurd": Case("max_tokens", body(max_tokens=10**30), gen(max_tokens=2**32 - 1)),
    "seed-out-of-range": both("seed", 2**63),
    "presence-penalty-high": both("presence_penalty", 2.5),
    "frequency-penalty-low": both("frequency_penalty", -2.5),
    "repetition-penalty-zero": both("repetition_penalty", 0.0),
    "repetition-penalty-negative": both("repetition_penalty", -1.0),
    "too-many-stop-strings": both("stop", [f"s{i}" for i in range(17)]),
    "stop-string-too-long": both("stop", ["x" * 257]),
    "stop-string-empty": both("stop", [""]),
    "logprobs-huge": both("logprobs", 1000),
    # sampling, only JSON can say it
    "temperature-string": http_only("temperature", "0.5"),
    "temperature-bool": http_only("temperature", True),
    "temperature-huge-integer": http_only("temperature", 10**400),
    "top-k-not-integer": http_only("top_k", 1.5),
    "top-k-absurd": http_only("top_k", 2**40),
    "max-tokens-negative": http_only("max_tokens", -1),
    "max-tokens-not-integer": http_only("max_tokens", 1.5),
    "max-tokens-string": http_only("max_tokens", "10"),
    "n-zero": http_only("n", 0),
    "n-above-the-limit": http_only("n", 129),
    "n-string": http_only("n", "2"),
    "n-chat-zero": chat_only("n", n=0),
    "seed-negative": http_only("seed", -1),
    "seed-string": http_only("seed", "abc"),
    "stop-number": http_only("stop", 5),
    "stop-token-ids-negative": http_only("stop_token_ids", [-1]),
    "logprobs-negative": http_only("logprobs", -1),
    "ignore-eos-string": http_only("ignore_eos", "yes"),
    "skip-special-tokens-string": http_only("skip_special_tokens", "no"),
    "stream-string": http_only("stream", "yes"),
    "stream-options-not-object": http_only("stream_options", True),
    "echo-string": http_only("echo", "yes"),
    "suffix-unsupported": http_only("suffix", "x"),
    "prompt-logprobs-negative": http_only("prompt_logprobs", -1),
    "prompt-logprobs-string": http_only("prompt_logprobs", "2"),
    "model-not-string": http_only("model", 5),
    "unknown-model": Case("model", body(model="gpt-17"), status=404),
    # chat
    "messages-not-list": chat_only("messages", messages="hi"),
    "messages-empty": chat_only("messages", messages=[]),
    "message-not-object": chat_only("messages[0]", messages=["hi"]),
    "message-role-unknown": message("role", role="wizard", content="x"),
    "message-role-missing": message("role", content="x"),
    "message-content-missing": message("content", role="user"),
    "message-content-number": message("content", role="user", content=5),
    "message-content-image": message("content[0]", role="user",
                                     content=[{"type": "image_url", "image_url": {"url": "x"}}]),
    "messages-past-context": chat_only("messages", messages=[{"role": "user",
                                                              "content": EMOJI * CONTEXT}]),
    "top-logprobs-negative": chat_only("top_logprobs", logprobs=True, top_logprobs=-1),
    "top-logprobs-huge": chat_only("top_logprobs", logprobs=True, top_logprobs=100),
    "max-completion-tokens-zero": chat_only("max_completion_tokens", max_tokens=None,
                                            max_completion_tokens=0),
    # the bytes themselves
    "malformed": Case("body", b'{"prompt": "x",', b"\xff\xff\xff"),
    "not-utf8": Case("body", b'{"prompt": "\xff\xfe"}', b"\x12\x02\xff\xfe"),  # 0x12: text
    "not-an-object": Case("body", b"[1, 2]"),
    "empty-body": Case("body", b""),
    "nested-too-deeply": Case("body", b"[" * 100_000 + b"]" * 100_000),
    "integer-literal-too-long": Case("body", b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}"),
    "request-id-too-long": Case("request_id", rpc=gen(request_id="r" * 1000)),
    "oversized": Case("body", b'{"prompt": "' + b"a" * (17 << 20) + b'"}',
                      gen("a" * (5 << 20)), status=413, code=grpc.StatusCode.RESOURCE_EXHAUSTED),
}
GRPC_FIELD = {"body": "request"}  # a message that does not decode is the gRPC `request`

PARAMS = [pytest.param(case, protocol, id=f"{protocol}-{name}")
          for name, case in CASES.items() for protocol in ("http", "grpc")
          if (case.http if protocol == "http" else case.rpc) is not None]


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=f"http://127.0.0.1:{server.http_port}", timeout=30) as c:
        yield c


@pytest.fixture(scope="module")
def channel(server):
    with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}") as ch:
        yield ch


def http_generate(http, good_body, path="/v1/completions") -> list[int]:
    response = http.post(path, json={**good_body, "return_token_ids": True})
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["token_ids"]


def grpc_generate(channel, request, raw: bool = False) -> list[int]:
    serialize = None if raw else pb.GenerateRequest.SerializeToString
    call = channel.unary_stream(GENERATE, request_serializer=serialize,
                                response_deserializer=pb.GenerateResponse.FromString)
    return [t for r in call(request, timeout=30) for t in r.token_ids]


@pytest.fixture(scope="module", autouse=True)
def before(backend, http, channel):
    """What a good request gets before any bad one was sent."""
    assert backend.info.max_model_len == CONTEXT
    ids = http_generate(http, body(prompt=[5, 6, 7], max_tokens=6, **OK))
    assert len(ids) == 6 and grpc_generate(channel, gen([5, 6, 7], max_tokens=6, **OK)) == ids
    return ids


def check_http(http, case: Case) -> None:
    path = "/v1/chat/completions" if case.chat else "/v1/completions"
    raw = case.http if isinstance(case.http, bytes) else json.dumps(case.http).encode()
    response = http.post(path, content=raw, headers={"content-type": "application/json"})
    assert response.status_code == case.status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert error["param"] == case.field and case.field in error["message"], error


def check_grpc(channel, case: Case) -> None:
    with pytest.raises(grpc.RpcError) as e:
        grpc_generate(channel, case.rpc, raw=isinstance(case.rpc, bytes))
    assert e.value.code() == case.code, e.value.details()
    if case.code == grpc.StatusCode.INVALID_ARGUMENT:
        path = GRPC_FIELD.get(case.field) or field_path(case.field)
        assert e.value.details().startswith(f"{path}:"), e.value.details()
        assert dict(e.value.trailing_metadata())["invalid-field"] == path


@pytest.mark.parametrize("case, protocol", PARAMS)
def test_bad_input_is_refused_naming_the_field(http, channel, idle_backend, case, protocol):
    if protocol == "http":
        check_http(http, case)
    else:
        check_grpc(channel, case)


def test_unknown_fields_are_ignored(http, channel, idle_backend, before):
    """As vLLM does (extra="allow"): clients send fields of newer OpenAI versions."""
    assert http_generate(http, body(prompt=[5, 6, 7], max_tokens=6, frobnicate={"x": 1},
                                    user="me", **OK)) == before
    # proto3 keeps an unknown field (here number 99, a varint) and reads the rest as usual
    raw = gen([5, 6, 7], max_tokens=6, **OK).SerializeToString() + b"\x98\x06\x01"
    assert grpc_generate(channel, raw, raw=True) == before


def test_other_requests_are_refused_naming_the_field(channel):
    """Abort and the info calls decode leniently too: bad bytes are the caller's mistake."""
    for method in ("Abort", "GetStatus", "GetModelInfo"):
        call = channel.unary_unary(f"/splitserve.v1.SplitServe/{method}")
        with pytest.raises(grpc.RpcError) as e:
            call(b"\xff\xff\xff", timeout=10)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert e.value.details().startswith("request:"), e.value.details()
    with pytest.raises(grpc.RpcError) as e:
        pb_grpc.SplitServeStub(channel).Abort(pb.AbortRequest(), timeout=10)
    assert e.value.details().startswith("request_id:")


def test_bad_input_leaves_a_running_request_alone(http, channel, idle_backend, before):
    call = pb_grpc.SplitServeStub(channel).Generate(gen([5, 6, 7], max_tokens=40, **OK), timeout=30)
    ids = list(next(call).token_ids)
    for name in ("temperature-nan", "malformed", "prompt-past-context", "max-tokens-past-context"):
        check_http(http, CASES[name])
        check_grpc(channel, CASES[name])
    ids += [t for r in call for t in r.token_ids]
    assert len(ids) == 40 and ids[:6] == before


class WorkersRefuse:
    """The backend, but a Ray worker refuses every request (as a decode worker does when
    prompt + max_tokens needs more KV blocks than its whole cache)."""

    def __init__(self, inner):
        self.info, self.tokenizer, self.status = inner.info, inner.tokenizer, inner.status

    def ready(self):
        return True

    async def stream(self, request_id, prompt, params, whole=True):
        import ray

        await ray.remote(_refuse).remote()
        yield  # pragma: no cover

    async def abort(self, request_id):
        return False


def _refuse():
    raise InvalidRequest("max_tokens", "needs 300 KV blocks; the cache has 160")


def test_a_workers_refusal_keeps_its_field_and_message(backend):
    """InvalidRequest crosses Ray as itself (not as an unpicklable error: a 500 or a retry),
    and the caller gets its message, not the worker's traceback."""
    expected = "max_tokens: needs 300 KV blocks; the cache has 160"
    with serving(WorkersRefuse(backend)) as door:
        with httpx.Client(base_url=f"http://127.0.0.1:{door.http_port}", timeout=30) as http:
            response = http.post("/v1/completions", json=body())
        assert response.status_code == 400, response.text
        assert response.json()["error"]["message"] == expected
        with grpc.insecure_channel(f"127.0.0.1:{door.grpc_port}") as channel, \
                pytest.raises(grpc.RpcError) as e:
            grpc_generate(channel, gen())
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert e.value.details() == f"sampling.{expected}"


def test_still_serves_the_same_after_bad_input(http, channel, backend, before):
    """Last: every case above has been thrown at the server, which must answer as before."""
    assert http_generate(http, body(prompt=[5, 6, 7], max_tokens=6, **OK)) == before
    assert grpc_generate(channel, gen([5, 6, 7], max_tokens=6, **OK)) == before
    chat_ids = http_generate(http, chat(max_tokens=3, **OK), "/v1/chat/completions")
    assert len(chat_ids) == 3
    wait_idle(backend)
    assert http.get("/health").status_code == 200
