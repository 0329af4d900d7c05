"""Shared fixtures: tiny random HF checkpoints (no download) and the transformers oracle."""

from __future__ import annotations

import os
import socket

os.environ.setdefault("SPLITSERVE_DEBUG", "1")  # state-slot guard + NaN poisoning of freed slots
# Triton kernels run under the interpreter on CPU-only machines; it must be chosen before
# anything imports triton. scripts/gpu_check.py sets SPLITSERVE_TRITON_ON_GPU=1 to compile.
if os.environ.get("SPLITSERVE_TRITON_ON_GPU") != "1":
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from tests import oracle


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def model_factory(tmp_path_factory):
    """make(name) -> (path, hf_model) for a named tiny config in tests.oracle.CONFIGS."""
    cache: dict[str, tuple] = {}

    def make(name: str):
        if name not in cache:
            path = tmp_path_factory.mktemp(name)
            cache[name] = (path, oracle.save_tiny_model(name, path))
        return cache[name]

    return make


PREFILL_RES, DECODE_RES = "splitserve_prefill", "splitserve_decode"


@pytest.fixture(scope="session")
def ray_nodes():
    """One Ray cluster for the whole session: a head (no worker resources), a prefill-kind
    node and a decode-kind node, all on this machine (ray.cluster_utils)."""
    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster as RayTestCluster

    if ray.is_initialized():
        ray.shutdown()
    nodes = RayTestCluster(initialize_head=True, head_node_args={"num_cpus": 2})
    prefill_node = nodes.add_node(num_cpus=6, resources={PREFILL_RES: 6})
    decode_node = nodes.add_node(num_cpus=6, resources={DECODE_RES: 6})
    nodes.wait_for_nodes()
    ray.init(address=nodes.address, include_dashboard=False, log_to_driver=False)
    yield nodes, prefill_node.node_id, decode_node.node_id
    ray.shutdown()
    nodes.shutdown()


@pytest.fixture(scope="session")
def api_model_path(model_factory, tmp_path_factory):
    from tests.test_api_support import make_api_model

    return make_api_model(model_factory, tmp_path_factory.mktemp("api_model"))


@pytest.fixture(scope="session")
def cluster_backend(api_model_path, ray_nodes):
    """The API tests' server backend: a 1 prefill + 1 decode cluster on the session's Ray."""
    from tests.test_api_support import make_backend

    backend = make_backend(api_model_path, ray_nodes)
    yield backend
    backend.shutdown()


@pytest.fixture(scope="session", params=["jamba", "mamba", "llama", *oracle.RECURRENT_FAMILIES])
def family_model(request, model_factory):
    """One representative tiny model per family: (family, path, hf_model)."""
    path, hf = model_factory(request.param)
    return request.param, path, hf


def record_calls(monkeypatch, owner, name: str) -> list[tuple]:
    """Wrap owner.<name> for the test: each call's positional arguments are appended to the
    returned list, and the call goes through unchanged."""
    calls: list[tuple] = []
    original = getattr(owner, name)
    monkeypatch.setattr(owner, name, lambda *args, **kw: calls.append(args) or original(*args, **kw))
    return calls


def free_port() -> int:
    """A port no IPv4 socket holds now, for a server that binds every address (gRPC binds [::]).
    Asked of the wildcard address: a port free on 127.0.0.1 alone may be held on the node's own
    address (a Ray worker's), and a Serve proxy failed to bind one such port in a full run."""
    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))
        return s.getsockname()[1]
