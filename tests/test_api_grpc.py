"""gRPC against a live front door: the generated stubs, the Python clients, every status code."""

from __future__ import annotations

import asyncio
import threading

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos.splitserve.v1 import splitserve_pb2 as pb
from protos.splitserve.v1 import splitserve_pb2_grpc as pb_grpc
from router.backend import Unavailable
from router.client import AsyncSplitServeClient, SplitServeClient
from router.grpc_server import SERVICE_NAME, sampling_from_proto
from tests.test_api_support import (LONG, long_requests, MODEL_NAME, backend, idle_backend,  # noqa: F401
                                    running_requests, serving, server, text_model_path, wait_idle,
                                    wait_until)

GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def channel(server):
    with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}") as ch:
        yield ch


@pytest.fixture(scope="module")
def stub(channel):
    return pb_grpc.SplitServeStub(channel)


@pytest.fixture(scope="module")
def client(server):
    with SplitServeClient(f"127.0.0.1:{server.grpc_port}", auth_token="") as c:
        yield c


def generate(stub, prompt, **sampling):
    request = pb.GenerateRequest(sampling=pb.SamplingParams(**sampling))
    if isinstance(prompt, str):
        request.text = prompt
    else:
        request.token_ids.ids.extend(prompt)
    return list(stub.Generate(request, timeout=30))


def test_generate_streams_deltas_then_a_final_message(stub, idle_backend):
    responses = generate(stub, "def fibonacci(n):", max_tokens=8, **GREEDY)
    *deltas, final = responses
    assert deltas and all(not r.finished and r.token_ids for r in deltas)
    assert final.finished and not final.token_ids and not final.text
    assert final.finish_reason == pb.FINISH_REASON_LENGTH
    ids = [t for r in deltas for t in r.token_ids]
    prompt_ids = idle_backend.tokenizer.encode("def fibonacci(n):")
    assert len(ids) == final.usage.completion_tokens == 8
    assert final.usage.prompt_tokens == len(prompt_ids)
    assert final.usage.total_tokens == len(prompt_ids) + 8
    # the stream never ends on half a UTF-8 character, so it may hold back a trailing piece
    assert idle_backend.tokenizer.decode(ids).startswith("".join(r.text for r in deltas))
    assert 0 < final.timings.time_to_first_token_s <= final.timings.e2e_s
    assert final.timings.time_per_output_token_s > 0
    assert len({r.request_id for r in responses}) == 1 and responses[0].request_id
    # where the time went (engine.trace): the last message only, the prefill before the decode,
    # all within the request's time at the front door
    names = [s.name for s in final.spans]
    assert "prefill" in names and names[-1] == "decode" and not any(r.spans for r in deltas)
    prefill, decode = final.spans[names.index("prefill")], final.spans[-1]
    assert prefill.start_unix_nano < prefill.end_unix_nano <= decode.start_unix_nano < decode.end_unix_nano
    covered = (max(s.end_unix_nano for s in final.spans) - min(s.start_unix_nano for s in final.spans)) / 1e9
    assert 0 < covered <= final.timings.e2e_s + 0.005
    # the same prompt as token ids, greedy: the same tokens
    again = generate(stub, prompt_ids, max_tokens=8, **GREEDY)
    assert [t for r in again for t in r.token_ids] == ids


def test_explicit_zero_is_not_unset():
    assert sampling_from_proto(pb.SamplingParams()).temperature == 1.0
    assert sampling_from_proto(pb.SamplingParams(temperature=0.0)).temperature == 0.0
    assert sampling_from_proto(pb.SamplingParams(top_k=0, min_p=0.0)).top_k == 0
    with pytest.raises(Exception, match="max_tokens"):
        sampling_from_proto(pb.SamplingParams(max_tokens=0))


def test_stop_token_ids_and_stop_strings(stub, client, idle_backend):
    free = client.generate([5, 6, 7, 8], max_tokens=12, **GREEDY)
    stop_id = free.token_ids[4]
    first_at = free.token_ids.index(stop_id)
    stopped = client.generate([5, 6, 7, 8], max_tokens=12, stop_token_ids=[stop_id], **GREEDY)
    assert stopped.finish_reason == "stop" and stopped.token_ids == free.token_ids[:first_at + 1]
    text = client.generate("for i in", max_tokens=12, **GREEDY).text
    stop = text[3:5]
    cut = client.generate("for i in", max_tokens=12, stop=[stop], **GREEDY)
    assert cut.finish_reason == "stop" and cut.text == text[:text.find(stop)]


def test_logprobs_per_token(client, idle_backend):
    done = client.generate([5, 6, 7], max_tokens=3, logprobs=2, **GREEDY)
    assert [lp.token_id for lp in done.logprobs] == done.token_ids
    assert all(len(lp.top) == 2 and lp.logprob <= 0 for lp in done.logprobs)


def test_closing_the_stream_aborts_and_frees(client, idle_backend, long_requests):
    call = client.stream("def f(x):", max_tokens=LONG, **GREEDY)
    next(call), next(call)
    assert running_requests(idle_backend) == 1
    call.cancel()
    with pytest.raises(grpc.RpcError) as e:
        list(call)
    assert e.value.code() == grpc.StatusCode.CANCELLED
    wait_idle(idle_backend)


def test_abort_rpc_ends_the_stream_with_cancelled(client, idle_backend, long_requests):
    call = client.stream("def f(x):", request_id="abort-me", max_tokens=LONG, **GREEDY)
    assert next(call).request_id == "abort-me"
    assert client.abort("abort-me") is True
    with pytest.raises(grpc.RpcError) as e:
        list(call)
    assert e.value.code() == grpc.StatusCode.CANCELLED and "abort-me" in e.value.details()
    assert client.abort("abort-me") is False
    wait_idle(idle_backend)


def test_deadline_exceeded_aborts_the_request(client, idle_backend, long_requests):
    with pytest.raises(grpc.RpcError) as e:
        client.generate("def f(x):", max_tokens=LONG, timeout=0.5, **GREEDY)
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_idle(idle_backend)


@pytest.mark.parametrize("request_, field", [
    (pb.GenerateRequest(text="x", sampling=pb.SamplingParams(temperature=-1)), "sampling.temperature"),
    (pb.GenerateRequest(text="x", sampling=pb.SamplingParams(max_tokens=0)), "sampling.max_tokens"),
    (pb.GenerateRequest(text="x", sampling=pb.SamplingParams(top_p=0)), "sampling.top_p"),
    (pb.GenerateRequest(text="x", sampling=pb.SamplingParams(seed=2**63)), "sampling.seed"),
    (pb.GenerateRequest(text="x", sampling=pb.SamplingParams(stop=[""])), "sampling.stop"),
    (pb.GenerateRequest(text=""), "prompt"),
    (pb.GenerateRequest(), "prompt"),
    (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5, 100000])), "prompt"),
    (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5] * 1024)), "prompt"),
])
def test_invalid_argument_names_the_field(stub, idle_backend, request_, field):
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(request_, timeout=10))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details().startswith(f"{field}:"), e.value.details()
    assert dict(e.value.trailing_metadata())["invalid-field"] == field


def test_resource_exhausted_when_admission_is_full(backend, long_requests):
    with serving(backend, max_queued=1) as door, \
            SplitServeClient(f"127.0.0.1:{door.grpc_port}") as client:
        first = client.stream("def f(x):", max_tokens=LONG, **GREEDY)
        next(first)
        with pytest.raises(grpc.RpcError) as e:
            client.generate("x", max_tokens=2)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        refused = httpx.post(f"http://127.0.0.1:{door.http_port}/v1/completions",
                             json={"prompt": "x", "max_tokens": 2})
        assert refused.status_code == 429 and refused.json()["error"]["type"] == "rate_limit_error"
        assert client.status().requests_in_flight == 1
        first.cancel()
        wait_idle(backend)
        wait_until(lambda: client.status().requests_in_flight == 0, what="the front door to let go")
        assert client.generate("x", max_tokens=2, ignore_eos=True).usage.completion_tokens == 2


class NoDecodeWorkers:
    """A backend whose decode workers are all gone."""

    def __init__(self, inner):
        self.inner, self.info, self.tokenizer = inner, inner.info, inner.tokenizer

    def ready(self):
        return False

    async def stream(self, request_id, prompt, params, whole=True):
        raise Unavailable("no live decode worker")
        yield  # pragma: no cover

    async def abort(self, request_id):
        return False

    def status(self):
        return {"workers": [{"id": "decode-0", "kind": "decode", "node": "n1", "alive": False}]}


def test_unavailable_and_health_follow_readiness(backend):
    with serving(NoDecodeWorkers(backend)) as door, \
            SplitServeClient(f"127.0.0.1:{door.grpc_port}") as client:
        with pytest.raises(grpc.RpcError) as e:
            client.generate("x", max_tokens=2)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "decode" in e.value.details()
        assert client.health("") is True  # liveness: the server is up
        assert client.health(SERVICE_NAME) is False  # readiness: it cannot serve
        assert client.status().workers[0].alive is False
        base = f"http://127.0.0.1:{door.http_port}"
        assert httpx.get(f"{base}/health").status_code == 503  # readiness
        refused = httpx.post(f"{base}/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert refused.status_code == 503 and "decode" in refused.json()["error"]["message"]


def test_health_service_and_model_info(channel, client):
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", SERVICE_NAME):
        reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    info = client.model_info()
    assert info.model_name == MODEL_NAME and info.model_type == "jamba" and info.has_tokenizer
    assert info.vocab_size == 320 and list(info.layer_kinds) == ["mamba", "attention"] * 2


def test_status_lists_workers_with_cache_and_queues(client, backend):
    status = client.status()
    assert status.ready and status.model.model_name == MODEL_NAME
    expected = backend.status()["workers"]
    assert [w.id for w in status.workers] == [w["id"] for w in expected]
    for got, want in zip(status.workers, expected):
        assert got.kind == want["kind"] and got.node == want["node"] and got.alive
        assert got.kv_blocks_total == want["kv_blocks_total"] > 0
        assert got.state_slots_total == want["state_slots_total"] > 0


def test_async_client(server, idle_backend, long_requests):
    async def main():
        async with AsyncSplitServeClient(f"127.0.0.1:{server.grpc_port}") as client:
            done = await client.generate([5, 6, 7], max_tokens=4, **GREEDY)
            streamed = [r async for r in client.stream([5, 6, 7], max_tokens=4, **GREEDY)]
            call = client.stream("def f(x):", max_tokens=LONG, **GREEDY)
            await call.read()
            call.cancel()
            return done, streamed, await client.model_info(), await client.health(SERVICE_NAME)

    done, streamed, info, healthy = asyncio.run(main())
    assert done.token_ids == [t for r in streamed for t in r.token_ids] and len(done.token_ids) == 4
    assert streamed[-1].finished and done.finish_reason == "length"
    assert info.model_name == MODEL_NAME and healthy


def test_concurrent_streams_are_independent(client, idle_backend):
    alone = client.generate([9, 10, 11], max_tokens=6, **GREEDY).token_ids
    results = [None] * 4

    def run(i):
        results[i] = client.generate([9, 10, 11], max_tokens=6, **GREEDY).token_ids

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [alone] * 4


def test_prompt_logprobs_come_in_the_first_message(stub, idle_backend, model_factory):
    import torch

    from tests.oracle import hf_logits

    ids = [5, 9, 13, 200, 17, 42]
    first, *_ = generate(stub, ids, max_tokens=2, prompt_logprobs=1, **GREEDY)
    entries = list(first.prompt_logprobs)
    assert [e.token_id for e in entries] == ids and not entries[0].HasField("logprob")
    ref = torch.log_softmax(hf_logits(model_factory("jamba")[1], ids).double(), dim=-1)
    for i in range(1, len(ids)):
        assert abs(entries[i].logprob - float(ref[i - 1, ids[i]])) <= 1e-4
        assert entries[i].rank >= 1 and len(entries[i].top) == 1


def test_the_python_client_collects_prompt_logprobs(client, idle_backend):
    done = client.generate([5, 9, 13, 200], max_tokens=1, prompt_logprobs=0, temperature=0.0)
    assert [e.token_id for e in done.prompt_logprobs] == [5, 9, 13, 200]
    assert all(e.logprob <= 0 and e.rank >= 1 for e in done.prompt_logprobs[1:])


def test_prompt_logprobs_come_once_however_long_the_answer(client, idle_backend):
    """Whole final outputs repeat the prompt's logprobs; the stream sends them once."""
    done = client.generate([5, 9, 13, 200], max_tokens=5, prompt_logprobs=0, temperature=0.0, ignore_eos=True)
    assert len(done.token_ids) == 5
    assert [e.token_id for e in done.prompt_logprobs] == [5, 9, 13, 200]
