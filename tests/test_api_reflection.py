"""A generic client that knows nothing of splitserve's stubs: everything from server reflection."""

from __future__ import annotations

import grpc
import pytest
from google.protobuf import descriptor_pool, json_format, message_factory
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from tests.test_api_support import backend, idle_backend, server, text_model_path  # noqa: F401

SERVICE = "splitserve.v1.SplitServe"


@pytest.fixture(scope="module")
def reflected(server):
    with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
        database = ProtoReflectionDescriptorDatabase(channel)
        yield channel, database, descriptor_pool.DescriptorPool(database)


def test_reflection_lists_the_services(reflected):
    _, database, _ = reflected
    services = set(database.get_services())
    assert {SERVICE, "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= services


def _method(channel, pool, name):
    method = pool.FindServiceByName(SERVICE).FindMethodByName(name)
    request_cls = message_factory.GetMessageClass(method.input_type)
    response_cls = message_factory.GetMessageClass(method.output_type)
    path = f"/{SERVICE}/{name}"
    kind = channel.unary_stream if method.server_streaming else channel.unary_unary
    call = kind(path, request_serializer=request_cls.SerializeToString,
                response_deserializer=response_cls.FromString)
    return request_cls, call


def test_generic_generate_from_reflected_descriptors(reflected, idle_backend):
    channel, _, pool = reflected
    request_cls, generate = _method(channel, pool, "Generate")
    request = json_format.ParseDict({"tokenIds": {"ids": [5, 6, 7]},
                                     "sampling": {"maxTokens": 4, "temperature": 0, "ignoreEos": True}},
                                    request_cls())
    replies = [json_format.MessageToDict(r) for r in generate(request, timeout=10)]
    assert replies[-1]["finished"] is True and replies[-1]["finishReason"] == "FINISH_REASON_LENGTH"
    assert replies[-1]["usage"]["completionTokens"] == 4
    assert sum(len(r.get("tokenIds", [])) for r in replies[:-1]) == 4


def test_generic_unary_calls(reflected):
    channel, _, pool = reflected
    request_cls, model_info = _method(channel, pool, "GetModelInfo")
    info = json_format.MessageToDict(model_info(request_cls(), timeout=5))
    assert info["modelType"] == "jamba" and info["hasTokenizer"] is True
    request_cls, status = _method(channel, pool, "GetStatus")
    assert json_format.MessageToDict(status(request_cls(), timeout=5))["workers"][0]["kind"] == "prefill"
