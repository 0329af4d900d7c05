"""Starting and stopping the front door: ports, a taken port, graceful stop with requests in flight."""

from __future__ import annotations

import threading

import grpc
import httpx
import pytest

from router.client import SplitServeClient
from router.frontdoor import FrontDoorConfig, start_frontdoor
from tests.test_api_support import (LONG, long_requests, backend, running_requests, serving,  # noqa: F401
                                    text_model_path, wait_idle, wait_until)


def test_stop_aborts_what_is_in_flight_and_wait_returns(backend, long_requests):
    door = start_frontdoor(backend, FrontDoorConfig(grpc_port=0, http_port=0, auth_token="",
                                                    grace_s=0.3))
    assert door.grpc_port and door.http_port and not door.wait(timeout=0)
    client = SplitServeClient(f"127.0.0.1:{door.grpc_port}")
    call = client.stream([5, 6, 7], max_tokens=LONG, temperature=0.0, ignore_eos=True)
    next(call)
    http_stream = httpx.stream("POST", f"http://127.0.0.1:{door.http_port}/v1/completions", timeout=30,
                               json={"prompt": [5, 6], "max_tokens": LONG, "stream": True,
                                     "ignore_eos": True})
    response = http_stream.__enter__()
    assert next(response.iter_lines()).startswith("data: ")
    # a first token comes from the prefill worker: the request may still be on its way to decode
    wait_until(lambda: running_requests(backend) == 2, timeout=5, what="both requests running")
    waiter = threading.Thread(target=door.wait)
    waiter.start()
    door.stop()
    waiter.join(timeout=10)
    assert not waiter.is_alive() and door.wait(timeout=0)
    wait_idle(backend)
    with pytest.raises(grpc.RpcError):
        list(call)
    http_stream.__exit__(None, None, None)
    client.close()
    door.stop()  # a second stop is harmless


def test_a_taken_port_fails_the_start(backend):
    with serving(backend) as door:
        for ports in (dict(grpc_port=door.grpc_port, http_port=0),
                      dict(grpc_port=0, http_port=door.http_port)):
            with pytest.raises((OSError, RuntimeError)):
                start_frontdoor(backend, FrontDoorConfig(auth_token="", **ports))


def test_one_server_alone(backend):
    with serving(backend, http_port=None) as door:
        assert door.http_port is None
        with SplitServeClient(f"127.0.0.1:{door.grpc_port}") as client:
            assert client.health()
    with serving(backend, grpc_port=None) as door:
        assert door.grpc_port is None
        assert httpx.get(f"http://127.0.0.1:{door.http_port}/health").status_code == 200
