"""The Ray Serve application (router/serve_app.py) on the session's Ray cluster: the OpenAI client
and the gRPC client get what the CLI path (`splitserve serve`: launch + front door) gives, and a
redeploy with changed options lets a running stream finish."""

from __future__ import annotations

import threading

import grpc
import pytest
import ray

from router.client import SplitServeClient
from tests.conftest import free_port
from tests.test_api_support import MODEL_NAME, serving, wait_until

openai = pytest.importorskip("openai")
serve = pytest.importorskip("ray.serve")

GREEDY = dict(temperature=0.0, extra_body={"ignore_eos": True, "return_token_ids": True})
# As the CLI path's cluster in tests/conftest.py (make_backend), so greedy outputs are comparable.
APP_ARGS = {"prefill": 1, "decode": 1, "num_kv_blocks": 160, "max_num_seqs": 8, "block_size": 8,
            "auth_token": ""}


@pytest.fixture(scope="module")
def serve_ports(ray_nodes, cluster_backend):
    """Serve on free ports; on the way out Serve is shut down and nothing it started is left.
    (cluster_backend first, so its workers, the CLI path's, count as there before.)"""
    from router.serve_app import GRPC_SERVICER_FUNCTIONS

    http_port, grpc_port = free_port(), free_port()
    # HeadOnly: the test cluster's three nodes share one address, so one proxy per node would clash.
    serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": http_port},
                grpc_options={"port": grpc_port, "grpc_servicer_functions": GRPC_SERVICER_FUNCTIONS})
    before = _cluster_actors()
    try:
        yield http_port, grpc_port
    finally:
        serve.shutdown()  # also stops the routers, whose workers go with them
        wait_until(lambda: _cluster_actors() <= before, 30, "the Serve app's router and workers to stop")


def _cluster_actors(kinds=("ClusterRouter", "PrefillWorker", "DecodeWorker")) -> set[str]:
    from ray.util.state import list_actors

    return {a.actor_id for a in list_actors(filters=[("state", "=", "ALIVE")]) if a.class_name in kinds}


def _routers() -> set[str]:
    return _cluster_actors(("ClusterRouter",))


def _router_handle(actor_id: str):
    from ray.util.state import get_actor

    state = get_actor(actor_id)
    return ray.get_actor(state.name, namespace=state.ray_namespace)


@pytest.fixture(scope="module")
def deployed(serve_ports, api_model_path):
    _deploy(api_model_path)


def _deploy(api_model_path, **overrides):
    from router.serve_app import build

    app = build({"model": str(api_model_path), **APP_ARGS, **overrides})
    serve.run(app, name="splitserve", route_prefix="/")


def _openai(http_port):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{http_port}/v1", api_key="none", max_retries=0)


def _ask_everything(http_port, grpc_port, model):
    """Completions, chat, a streamed completion and a gRPC generation, greedy."""
    client = _openai(http_port)
    completion = client.completions.create(model=model, prompt="def f(x):", max_tokens=8, **GREEDY)
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=6, **GREEDY)
    pieces = client.completions.create(model=model, prompt="import os", max_tokens=8, stream=True, **GREEDY)
    streamed = "".join(chunk.choices[0].text for chunk in pieces if chunk.choices)
    with SplitServeClient(f"127.0.0.1:{grpc_port}") as grpc_client:
        done = grpc_client.generate([5, 6, 7, 8], max_tokens=8, temperature=0.0, ignore_eos=True)
        ready = grpc_client.health(SERVICE)
    return {"completion": (completion.choices[0].text, completion.choices[0].token_ids),
            "chat": chat.choices[0].message.content, "stream": streamed,
            "grpc": (list(done.token_ids), done.text, done.finish_reason), "healthy": ready}


SERVICE = "splitserve.v1.SplitServe"
STREAMED = 200
TOKEN = "serve-test-token"


def test_serve_app_answers_like_the_cli_path(ray_nodes, serve_ports, deployed, api_model_path, cluster_backend):
    http_port, grpc_port = serve_ports
    model = _openai(http_port).models.list().data[0].id
    assert model == api_model_path.name
    got = _ask_everything(http_port, grpc_port, model)
    with serving(cluster_backend) as door:
        want = _ask_everything(door.http_port, door.grpc_port, MODEL_NAME)
    assert got == want
    assert len(got["completion"][1]) == 8 and got["grpc"][2] == "length" and got["healthy"]


def test_redeploy_with_changed_options_lets_a_running_stream_finish(ray_nodes, serve_ports, deployed,
                                                                    api_model_path):
    http_port, _ = serve_ports
    client = _openai(http_port)
    model = client.models.list().data[0].id
    head = client.completions.create(model=model, prompt="x = 1", max_tokens=8, **GREEDY).choices[0]
    routers_before = _routers()
    # Slowed down (200 tokens at 0.3 s a step or more) to outlast starting the new router and
    # workers however fast the engine runs; back to full speed once they are up.
    old_router = _router_handle(next(iter(routers_before)))
    ray.get(old_router.inject_slow_steps.remote(0.3))
    stream = client.completions.create(model=model, prompt="x = 1", max_tokens=STREAMED, logprobs=5,
                                       stream=True, **GREEDY)
    chunks = []
    reader = threading.Thread(target=lambda: chunks.extend(c for c in stream if c.choices))
    reader.start()
    # Other options: a new router with new workers for the new replica, while the old replica
    # drains and its router finishes this stream.
    redeploy = threading.Thread(target=_deploy, args=(api_model_path,),
                                kwargs={"local_prefill_tokens": 4, "auth_token": TOKEN})
    redeploy.start()
    wait_until(lambda: len(_routers() - routers_before) == 1, 90, "the new deployment's router")
    assert reader.is_alive(), "the stream ended before the new deployment was up: nothing was tested"
    ray.get(old_router.inject_slow_steps.remote(0))
    reader.join(timeout=120)
    redeploy.join(timeout=120)
    ids = [t for c in chunks for t in (c.choices[0].token_ids or [])]
    assert len(ids) == STREAMED and ids[:8] == head.token_ids  # one stream: nothing twice, nothing missing
    assert chunks[-1].choices[0].finish_reason == "length"
    wait_until(lambda: not _routers() & routers_before, 30, "the old router to stop")
    # The new deployment checks a token, over HTTP and gRPC, as `splitserve serve --auth-token` does.
    with pytest.raises(openai.AuthenticationError):
        client.completions.create(model=model, prompt="x = 1", max_tokens=8, **GREEDY)
    authed = openai.OpenAI(base_url=f"http://127.0.0.1:{http_port}/v1", api_key=TOKEN, max_retries=0)
    after = authed.completions.create(model=model, prompt="x = 1", max_tokens=8, **GREEDY).choices[0]
    assert after.token_ids == head.token_ids  # the new deployment (prompt prefilled locally) agrees
    grpc_port = serve_ports[1]
    with SplitServeClient(f"127.0.0.1:{grpc_port}") as anonymous:
        with pytest.raises(grpc.RpcError) as refused:
            anonymous.generate([5, 6, 7], max_tokens=2, temperature=0.0)
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with SplitServeClient(f"127.0.0.1:{grpc_port}", auth_token=TOKEN) as client_with_token:
        assert len(client_with_token.generate([5, 6, 7], max_tokens=2, temperature=0.0, ignore_eos=True).token_ids) == 2
