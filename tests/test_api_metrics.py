"""Prometheus /metrics: latency histograms and per-worker gauges move when requests run."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

from router.client import SplitServeClient
from router.metrics import FrontDoorMetrics
from tests.test_api_support import (LONG, long_requests, backend, idle_backend, server, text_model_path,  # noqa: F401
                                    wait_until,
                                    wait_idle)


def scrape(door) -> dict:
    """{(sample name, frozenset(labels)): value}"""
    text = httpx.get(f"http://127.0.0.1:{door.http_port}/metrics", timeout=10).text
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: dict, name: str, **labels) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def rendered(status: dict) -> dict:
    """The front door's /metrics for `status`, as {(sample name, labels): value}."""
    text = FrontDoorMetrics(lambda: status).render().decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def worker_labels(backend) -> list[dict]:
    return [dict(worker=w["id"], kind=w["kind"], node=w["node"]) for w in backend.status()["workers"]]


def total(samples: dict, name: str, workers: list[dict]) -> float:
    return sum(value(samples, name, **w) for w in workers)


def test_latency_histograms_and_counters_move(server, idle_backend):
    before = scrape(server)
    with SplitServeClient(f"127.0.0.1:{server.grpc_port}") as client:
        client.generate([5, 6, 7], max_tokens=5, temperature=0.0, ignore_eos=True)
    httpx.post(f"http://127.0.0.1:{server.http_port}/v1/completions", timeout=10,
               json={"prompt": [5, 6], "max_tokens": 3, "temperature": 0.0, "ignore_eos": True})
    httpx.post(f"http://127.0.0.1:{server.http_port}/v1/completions", timeout=10,
               json={"prompt": [5, 6], "temperature": -1.0})
    after = scrape(server)
    grew = lambda name, **labels: value(after, name, **labels) - value(before, name, **labels)  # noqa: E731
    assert grew("splitserve_time_to_first_token_seconds_count") == 2
    assert grew("splitserve_e2e_request_latency_seconds_count") == 2
    assert grew("splitserve_time_per_output_token_seconds_count") == 2
    # one per token after each request's first message (tokens may arrive several at once)
    assert 0 < grew("splitserve_inter_token_latency_seconds_count") <= 4 + 2
    assert grew("splitserve_time_to_first_token_seconds_sum") > 0
    assert grew("splitserve_requests_total", protocol="grpc", outcome="length") == 1
    assert grew("splitserve_requests_total", protocol="http", outcome="length") == 1
    assert grew("splitserve_requests_total", protocol="http", outcome="invalid") == 1
    assert grew("splitserve_prompt_tokens_total") == 5
    assert grew("splitserve_generation_tokens_total") == 8


def test_worker_gauges_follow_a_running_request(server, idle_backend, long_requests):
    workers = worker_labels(idle_backend)
    status = idle_backend.status()["workers"]
    idle = scrape(server)
    assert total(idle, "splitserve_worker_alive", workers) == len(workers)
    assert total(idle, "splitserve_worker_requests_running", workers) == 0
    assert total(idle, "splitserve_worker_kv_blocks_used", workers) == 0
    assert total(idle, "splitserve_worker_kv_blocks_free", workers) == sum(w["kv_blocks_total"] for w in status)
    assert total(idle, "splitserve_worker_state_slots_used", workers) == 0
    assert all(("splitserve_worker_preemptions_total", frozenset(w.items())) in idle for w in workers)
    with SplitServeClient(f"127.0.0.1:{server.grpc_port}") as client:
        call = client.stream([5, 6, 7], max_tokens=LONG, temperature=0.0, ignore_eos=True)
        next(call)
        busy = scrape(server)
        call.cancel()
    assert total(busy, "splitserve_worker_requests_running", workers) == 1
    assert total(busy, "splitserve_worker_kv_blocks_used", workers) >= 1
    assert total(busy, "splitserve_worker_state_slots_used", workers) >= 1
    assert value(busy, "splitserve_frontdoor_requests_in_flight") == 1
    wait_idle(idle_backend)
    assert total(scrape(server), "splitserve_worker_state_slots_used", workers) == 0


def test_handoff_and_cluster_worker_metrics():
    status = {"workers": [
        {"id": "prefill-0", "kind": "prefill", "node": "n1", "alive": True, "kv_blocks_total": 10,
         "kv_blocks_free": 7, "state_slots_total": 4, "state_slots_free": 3, "waiting": 2,
         "running": 1, "preemptions": 5, "handoff_bytes": 4096, "handoff_count": 3,
         "handoff_failures": 1, "handoff_seconds_sum": 0.25, "prefix_cache_queried_tokens": 900,
         "prefix_cache_hit_tokens": 600, "prefix_cache_blocks": 40, "prefix_cache_checkpoints_used": 3,
         "prefix_cache_checkpoints_total": 8, "prefix_cache_checkpoint_bytes": 65536},
        {"id": "decode-0", "kind": "decode", "node": "n2", "alive": False}], "retries": 7}
    samples = rendered(status)
    p = dict(worker="prefill-0", kind="prefill", node="n1")
    assert value(samples, "splitserve_worker_kv_blocks_used", **p) == 3
    assert value(samples, "splitserve_worker_state_slots_used", **p) == 1
    assert value(samples, "splitserve_worker_requests_waiting", **p) == 2
    assert value(samples, "splitserve_worker_preemptions_total", **p) == 5
    assert value(samples, "splitserve_worker_handoff_bytes_total", **p) == 4096
    assert value(samples, "splitserve_worker_handoff_failures_total", **p) == 1
    assert value(samples, "splitserve_worker_handoff_seconds_count", **p) == 3
    assert value(samples, "splitserve_worker_handoff_seconds_sum", **p) == 0.25
    assert value(samples, "splitserve_worker_alive", worker="decode-0", kind="decode", node="n2") == 0
    assert value(samples, "splitserve_request_retries_total") == 7
    hits = value(samples, "splitserve_worker_prefix_cache_hit_tokens_total", **p)
    assert hits / value(samples, "splitserve_worker_prefix_cache_queried_tokens_total", **p) == 600 / 900
    assert value(samples, "splitserve_worker_prefix_cache_checkpoints_used", **p) == 3
    assert value(samples, "splitserve_worker_prefix_cache_checkpoint_bytes", **p) == 65536
    assert value(samples, "splitserve_worker_prefix_cache_blocks", **p) == 40


def test_speculative_decoding_counters_by_worker_and_as_vllm_names_them():
    from router.metrics import VllmWorkerAliases

    status = {"workers": [
        {"id": "decode-0", "kind": "decode", "node": "n1", "spec_drafts": 10, "spec_draft_tokens": 40,
         "spec_accepted_tokens": 25, "spec_accepted_per_position": [9, 7, 5, 4]},
        {"id": "decode-1", "kind": "decode", "node": "n2", "spec_drafts": 2, "spec_draft_tokens": 8,
         "spec_accepted_tokens": 1, "spec_accepted_per_position": [1, 0, 0, 0]},
        {"id": "prefill-0", "kind": "prefill", "node": "n1"}]}
    samples = rendered(status)
    d = dict(worker="decode-0", kind="decode", node="n1")
    assert value(samples, "splitserve_worker_spec_drafts_total", **d) == 10
    assert value(samples, "splitserve_worker_spec_draft_tokens_total", **d) == 40
    assert value(samples, "splitserve_worker_spec_accepted_tokens_total", **d) == 25
    assert value(samples, "splitserve_worker_spec_accepted_tokens_per_position_total", position="1", **d) == 7
    aliases = {(s.name, frozenset(s.labels.items())): s.value
               for f in VllmWorkerAliases(lambda: status, "m").collect() for s in f.samples}
    assert value(aliases, "vllm:spec_decode_num_drafts_total", model_name="m") == 12
    assert value(aliases, "vllm:spec_decode_num_draft_tokens_total", model_name="m") == 48
    assert value(aliases, "vllm:spec_decode_num_accepted_tokens_total", model_name="m") == 26
    assert value(aliases, "vllm:spec_decode_num_accepted_tokens_per_pos_total", model_name="m", position="0") == 10


def test_cache_tiers_by_worker_and_tier():
    status = {"workers": [
        {"id": "prefill-0", "kind": "prefill", "node": "n1", "tier_spills": 30, "tier_loaded_tokens": 4096,
         "tier_host_bytes": 1 << 20, "tier_host_entries": 3, "tier_host_hits": 5,
         "tier_disk_bytes": 1 << 24, "tier_disk_entries": 40, "tier_disk_hits": 9},
        {"id": "decode-0", "kind": "decode", "node": "n2"}]}
    samples = rendered(status)
    p = dict(worker="prefill-0", kind="prefill", node="n1")
    assert value(samples, "splitserve_worker_cache_tier_bytes", tier="host", **p) == 1 << 20
    assert value(samples, "splitserve_worker_cache_tier_entries", tier="disk", **p) == 40
    assert value(samples, "splitserve_worker_cache_tier_hits_total", tier="disk", **p) == 9
    assert value(samples, "splitserve_worker_cache_tier_loaded_tokens_total", **p) == 4096
    assert value(samples, "splitserve_worker_cache_tier_spills_total", **p) == 30
    assert not any("tier" in name and dict(labels).get("worker") == "decode-0" for name, labels in samples)


def test_prefix_fetches_by_worker_and_for_the_router():
    status = {"prefix_fetches": 4, "workers": [
        {"id": "prefill-0", "kind": "prefill", "node": "n1", "prefix_fetch_exported": 0, "prefix_fetch_imported": 3,
         "prefix_fetch_imported_tokens": 768, "prefix_fetch_refused": 1},
        {"id": "decode-0", "kind": "decode", "node": "n2", "prefix_fetch_exported": 3, "prefix_fetch_imported": 0,
         "prefix_fetch_imported_tokens": 0, "prefix_fetch_refused": 0},
        {"id": "decode-1", "kind": "decode", "node": "n2"}]}
    samples = rendered(status)
    p, d = dict(worker="prefill-0", kind="prefill", node="n1"), dict(worker="decode-0", kind="decode", node="n2")
    assert value(samples, "splitserve_prefix_fetches_total") == 4
    assert value(samples, "splitserve_worker_prefix_fetch_imported_total", **p) == 3
    assert value(samples, "splitserve_worker_prefix_fetch_imported_tokens_total", **p) == 768
    assert value(samples, "splitserve_worker_prefix_fetch_refused_total", **p) == 1
    assert value(samples, "splitserve_worker_prefix_fetch_exported_total", **d) == 3
    assert not any("fetch" in name and dict(labels).get("worker") == "decode-1" for name, labels in samples)


def test_a_failing_status_still_scrapes():
    def broken():
        raise RuntimeError("cluster gone")

    assert b"splitserve_time_to_first_token_seconds" in FrontDoorMetrics(broken).render()


def test_vllm_named_metrics_when_asked_for(backend, idle_backend, long_requests):
    """--metrics-compat vllm: the names vLLM's /metrics uses, which dashboards and benchmark
    clients read, beside splitserve's own, moving together."""
    from router.openai_protocol import COMPLETIONS_DEFAULT_MAX_TOKENS  # noqa: F401
    from tests.test_api_support import MODEL_NAME, serving

    with serving(backend, metrics_compat="vllm") as door:
        before = scrape(door)
        httpx.post(f"http://127.0.0.1:{door.http_port}/v1/completions", timeout=10,
                   json={"prompt": [5, 6], "max_tokens": 3, "temperature": 0.0, "ignore_eos": True})
        after = scrape(door)
        grew = lambda name, **labels: value(after, name, **labels) - value(before, name, **labels)  # noqa: E731
        model = dict(model_name=MODEL_NAME)
        assert grew("vllm:time_to_first_token_seconds_count", **model) == 1
        assert grew("vllm:e2e_request_latency_seconds_count", **model) == 1
        assert grew("vllm:prompt_tokens_total", **model) == 2 == grew("splitserve_prompt_tokens_total")
        assert grew("vllm:generation_tokens_total", **model) == 3
        assert grew("vllm:request_success_total", finished_reason="length", **model) == 1
        for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                     "vllm:gpu_cache_usage_perc", "vllm:num_preemptions_total"):
            assert (name, frozenset(model.items())) in after, name
        import threading

        body = {"prompt": [5, 6, 7], "max_tokens": LONG, "temperature": 0.0, "ignore_eos": True}
        running = threading.Thread(target=lambda: httpx.post(f"http://127.0.0.1:{door.http_port}/v1/completions",
                                                             json=body, timeout=60))
        running.start()
        wait_until(lambda: value(scrape(door), "vllm:num_requests_running", **model) >= 1, 10, "a running request")
        assert 0 < value(scrape(door), "vllm:kv_cache_usage_perc", **model) <= 1
        running.join(60)
    with serving(backend) as plain:  # off by default
        assert not any(name.startswith("vllm:") for name, _ in scrape(plain))


def test_an_unknown_compat_mode_is_refused():
    import pytest

    with pytest.raises(ValueError, match="metrics_compat: 'prometheus' not in none, vllm"):
        FrontDoorMetrics(lambda: {}, "prometheus")
