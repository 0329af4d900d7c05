"""Shared pieces of the API tests (tests/test_api_*.py): a live front door over a tiny model.

make_backend() is the one place that decides what the servers run over; swap it for the
cluster backend to run every API test against the cluster.
"""

from __future__ import annotations

import json
import shutil
import time
from contextlib import contextmanager

import pytest

from router.frontdoor import FrontDoorConfig, start_frontdoor
from router.local_backend import LocalBackend
from tests.test_tokenizer import make_tokenizer

MODEL_NAME = "tiny-jamba"
LONG = 900  # max_tokens for requests meant to be cut short (with `long_requests`: seconds of work)
STEP_DELAY_S = 0.002  # each engine step under `long_requests`: a LONG request takes 1.8 s or more
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
                 "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")


def make_api_model(model_factory, folder, name: str = "jamba"):
    """A tiny random model (the Jamba by default) with a tokenizer.json and a chat template."""
    path, _ = model_factory(name)
    shutil.copytree(path, folder, dirs_exist_ok=True)
    make_tokenizer(folder)
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "chat_template": CHAT_TEMPLATE}))
    return folder


def make_backend(model_path, ray_nodes=None):
    """The cluster (1 prefill + 1 decode worker on the session's Ray test cluster) when a
    Ray cluster is given, else one engine in-process."""
    if ray_nodes is None:
        return LocalBackend(model_path, model_name=MODEL_NAME, num_kv_blocks=160, max_num_seqs=8)
    from router.cluster import launch

    cluster = launch(model_path, prefill=1, decode=1, address=ray_nodes[0].address,
                     num_kv_blocks=160, max_num_seqs=8, block_size=8, enable_prefix_caching=True)
    cluster.info.model_name = MODEL_NAME
    return cluster


def backend_is_idle(backend) -> bool:
    """On every worker nothing queued or running, and every KV block and state slot free again."""
    for w in backend.status()["workers"]:
        if w.get("waiting") or w.get("running"):
            return False
        if w.get("kv_blocks_free") != w.get("kv_blocks_total"):
            return False
        if w.get("state_slots_free") != w.get("state_slots_total"):
            return False
    engine = getattr(backend, "engine", None)  # LocalBackend: also no request left in the engine
    return engine is None or not engine.requests


def running_requests(backend) -> int:
    return sum(w.get("running", 0) for w in backend.status()["workers"])


def wait_until(condition, timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def wait_idle(backend, timeout: float = 30.0) -> None:
    # 30 s, not 10: in one full CI run the cluster was not idle 10 s after a front door stop
    # aborted two long requests (not reproduced alone or with the other API tests, where it
    # takes seconds); a failure now lists what each worker still holds.
    try:
        wait_until(lambda: backend_is_idle(backend), timeout, "the backend to free every request")
    except AssertionError as e:  # say what is still held, and where
        held = [{k: w.get(k) for k in ("id", "waiting", "running", "kv_blocks_free", "kv_blocks_total",
                                       "state_slots_free", "state_slots_total")} for w in backend.status()["workers"]]
        raise AssertionError(f"{e}: {held}") from None


@contextmanager
def serving(backend, **config):
    """A front door on free ports of 127.0.0.1 over `backend`; stopped on exit."""
    config.setdefault("grpc_port", 0)
    config.setdefault("http_port", 0)
    config.setdefault("auth_token", "")  # never pick up SPLITSERVE_AUTH_TOKEN from the environment
    config.setdefault("grace_s", 1.0)
    config.setdefault("health_poll_s", 0.1)
    door = start_frontdoor(backend, FrontDoorConfig(**config))
    try:
        yield door
    finally:
        door.stop()


@pytest.fixture(scope="module")
def text_model_path(api_model_path):
    return api_model_path


@pytest.fixture(scope="module")
def backend(cluster_backend):
    """What the API tests run against: the disaggregated cluster behind `splitserve serve`."""
    return cluster_backend


@pytest.fixture(scope="module")
def server(backend):
    with serving(backend) as door:
        yield door


def slow_steps(backend, seconds: float) -> None:
    """Every engine step of `backend` at least `seconds` longer (0: as fast as it goes)."""
    if isinstance(backend, LocalBackend):
        backend._loop.step_delay_s = seconds
        return
    import ray

    ray.get([w.handle.inject_slow_steps.remote(seconds) for w in backend.workers.prefill + backend.workers.decode],
            timeout=30)


@pytest.fixture
def long_requests(backend):
    """For a test whose LONG request must still be running when it is cut short: on a fast box
    900 tokens took under 0.5 s, and a 0.5 s deadline found the request done. The steps are
    slowed by STEP_DELAY_S while the test runs, so how long a LONG request takes has a floor."""
    slow_steps(backend, STEP_DELAY_S)
    yield
    slow_steps(backend, 0.0)


@pytest.fixture
def idle_backend(backend):
    """The module's backend, checked to have freed everything after the test."""
    yield backend
    wait_idle(backend)
