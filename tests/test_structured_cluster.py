"""Structured outputs on a 1 prefill + 1 decode cluster (shm and gloo), after a forced retry,
and through the official openai client and gRPC; bad specs are refused before any work."""

from __future__ import annotations

import asyncio
import json

import grpc
import jsonschema
import pytest

from protos.splitserve.v1 import splitserve_pb2 as pb
from protos.splitserve.v1 import splitserve_pb2_grpc as pb_grpc
from tests.test_api_support import MODEL_NAME, serving, wait_idle
from tests.test_structured import BOUNDED, PROMPT, SCHEMA, SEEDS, check, constrained

ray = pytest.importorskip("ray")
openai = pytest.importorskip("openai")

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["city", "days"],
    "properties": {"city": {"enum": ["Paris", "Oslo"]}, "days": {"type": "integer", "minimum": 1, "maximum": 7}}}}}


def run_specs(cluster):
    specs = [(spec, seed) for spec in BOUNDED.values() for seed in SEEDS]
    outs = cluster.generate([PROMPT] * len(specs), [constrained(spec, seed) for spec, seed in specs])
    for (spec, seed), out in zip(specs, outs):
        assert out.error is None and out.finish_reason == "stop", (spec.kind, seed, out)
        check(spec, out.text)
    return outs


@pytest.fixture(scope="module")
def gloo_cluster(api_model_path, ray_nodes):
    from router.cluster import launch

    cluster = launch(api_model_path, prefill=1, decode=1, transport="gloo", address=ray_nodes[0].address,
                     num_kv_blocks=160, max_num_seqs=24, block_size=8)
    yield cluster
    cluster.shutdown()


def test_constrained_outputs_are_valid_over_shm(cluster_backend, llm_outputs):
    outs = run_specs(cluster_backend)
    assert [o.token_ids for o in outs] == llm_outputs  # and exactly the colocated engine's tokens
    wait_idle(cluster_backend)


def test_constrained_outputs_are_valid_over_gloo_and_after_a_retry(gloo_cluster, llm_outputs):
    assert [o.token_ids for o in run_specs(gloo_cluster)] == llm_outputs
    params = constrained(BOUNDED["json_schema"], 11)
    whole = gloo_cluster.generate([PROMPT], params)[0]
    decode = gloo_cluster.workers.decode
    ray.get([w.handle.inject_crash.remote("retried", 3) for w in decode])  # dies at its 4th delivery
    retries = gloo_cluster.retries

    async def stream():
        seen = []
        async for out in gloo_cluster.stream("retried", PROMPT, params):
            seen.append(out)
        return seen

    seen = asyncio.run(stream())
    final = seen[-1]
    assert gloo_cluster.retries == retries + 1
    assert final.error is None and final.finish_reason == "stop", final
    assert [t for o in seen for t in o.new_token_ids] == final.token_ids == whole.token_ids
    jsonschema.validate(json.loads(final.text), SCHEMA)


@pytest.fixture(scope="module")
def llm_outputs(api_model_path):
    from engine import LLM

    llm = LLM(api_model_path, num_kv_blocks=160, max_num_seqs=24, block_size=8)
    specs = [(spec, seed) for spec in BOUNDED.values() for seed in SEEDS]
    ids = llm.engine.tokenize(PROMPT)
    return [o.token_ids for o in llm.generate([ids] * len(specs), [constrained(s, seed) for s, seed in specs])]


@pytest.fixture(scope="module")
def door(cluster_backend):
    with serving(cluster_backend) as d:
        yield d


def test_openai_client_response_format_and_tools(door):
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{door.http_port}/v1", api_key="none")
    fmt = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA}}
    for seed in SEEDS:
        chat = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}],
                                              response_format=fmt, seed=seed, max_tokens=120)
        jsonschema.validate(json.loads(chat.choices[0].message.content), SCHEMA)
        assert chat.choices[0].finish_reason == "stop"
    done = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=30, seed=1,
                                     extra_body={"response_format": {"type": "json_object"}})
    assert done.choices[0].finish_reason == "length" or isinstance(json.loads(done.choices[0].text), dict)
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        chat = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "w?"}],
                                              tools=[WEATHER], tool_choice=choice, seed=3, max_tokens=150,
                                              parallel_tool_calls=False)
        message = chat.choices[0].message
        assert chat.choices[0].finish_reason == "tool_calls" and message.content is None
        (call,) = message.tool_calls
        assert call.function.name == "get_weather" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "x"}],
                                       response_format={"type": "json_schema", "json_schema": {
                                           "name": "bad", "schema": {"type": "objectx"}}})
    assert e.value.body["param"] == "response_format.json_schema.schema" and "objectx" in e.value.body["message"]


def test_grpc_structured_output_and_tools(door, cluster_backend):
    with grpc.insecure_channel(f"127.0.0.1:{door.grpc_port}") as channel:
        stub = pb_grpc.SplitServeStub(channel)
        sampling = pb.SamplingParams(max_tokens=120, temperature=1.0, seed=2,
                                     structured_output=pb.StructuredOutput(json_schema=json.dumps(SCHEMA)))
        replies = list(stub.Generate(pb.GenerateRequest(text=PROMPT, sampling=sampling)))
        jsonschema.validate(json.loads("".join(r.text for r in replies)), SCHEMA)
        assert replies[-1].finish_reason == pb.FINISH_REASON_STOP
        tool = pb.Tool(name="get_weather", parameters_json=json.dumps(WEATHER["function"]["parameters"]))
        request = pb.GenerateRequest(text=PROMPT, sampling=pb.SamplingParams(seed=4, max_tokens=150), tools=[tool],
                                     tool_choice=pb.ToolChoice(function="get_weather"))
        last = list(stub.Generate(request))[-1]
        assert last.finish_reason == pb.FINISH_REASON_TOOL_CALLS and last.tool_calls[0].name == "get_weather"
        jsonschema.validate(json.loads(last.tool_calls[0].arguments), WEATHER["function"]["parameters"])
        bad = pb.SamplingParams(structured_output=pb.StructuredOutput(regex="[a-"))
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(pb.GenerateRequest(text=PROMPT, sampling=bad)))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert e.value.details().startswith("sampling.structured_output: invalid regex")
    wait_idle(cluster_backend)
