"""Prometheus metrics of one front door: request latencies, and worker state read at scrape time.

Each front door has its own CollectorRegistry (tests run several in one process). Worker
gauges come from backend.status() when /metrics is scraped, never from a cached copy, so they
cannot go stale when a worker dies.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, SummaryMetricFamily

log = logging.getLogger(__name__)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5,
                   0.75, 1.0, 2.5, 5.0, 10.0)
E2E_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
WORKER_LABELS = ["worker", "kind", "node"]
# A worker's prefix fetch stats (engine.prefix_exchange), each a counter named after it
PREFIX_FETCH_COUNTERS = (
    ("prefix_fetch_exported", "Cached prefixes this worker exported for another (router/prefix_fetch.py)"),
    ("prefix_fetch_imported", "Cached prefixes this worker imported from another"),
    ("prefix_fetch_imported_tokens", "Prompt tokens the prefixes this worker imported cover"),
    ("prefix_fetch_refused", "Imports refused: a cache unlike this worker's, or no host tier"),
)


METRICS_COMPAT = ("none", "vllm")


class Both:
    """One observation into splitserve's metric and its vLLM-named alias (--metrics-compat vllm)."""

    def __init__(self, *metrics):
        self.metrics = metrics

    def observe(self, value: float) -> None:
        for m in self.metrics:
            m.observe(value)

    def inc(self, value: float = 1.0) -> None:
        for m in self.metrics:
            m.inc(value)


class FrontDoorMetrics:
    def __init__(self, status: Callable[[], dict], compat: str = "none", model_name: str = ""):
        if compat not in METRICS_COMPAT:
            raise ValueError(f"metrics_compat: {compat!r} not in {', '.join(METRICS_COMPAT)}")
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram("splitserve_time_to_first_token_seconds",
                              "Admission to first token, at the front door", buckets=LATENCY_BUCKETS,
                              registry=r)
        self.itl = Histogram("splitserve_inter_token_latency_seconds",
                             "Gap between streamed tokens after the first (ITL)", buckets=LATENCY_BUCKETS,
                             registry=r)
        self.tpot = Histogram("splitserve_time_per_output_token_seconds",
                              "Per request: (e2e - ttft) / (output tokens - 1)", buckets=LATENCY_BUCKETS,
                              registry=r)
        self.e2e = Histogram("splitserve_e2e_request_latency_seconds", "Admission to last token",
                             buckets=E2E_BUCKETS, registry=r)
        self.requests = Counter("splitserve_requests", "Requests by protocol and outcome "
                                "(stop, length, abort, error, cancelled, invalid, overloaded, "
                                "unavailable)", ["protocol", "outcome"], registry=r)
        self.prompt_tokens = Counter("splitserve_prompt_tokens", "Prompt tokens of finished requests",
                                     registry=r)
        self.generation_tokens = Counter("splitserve_generation_tokens", "Generated tokens",
                                         registry=r)
        self.in_flight = Gauge("splitserve_frontdoor_requests_in_flight",
                               "Requests admitted by the front door and not yet finished", registry=r)
        r.register(WorkerStatusCollector(status))
        self.finished = None
        if compat == "vllm":
            self._vllm_aliases(r, status, model_name)

    def _vllm_aliases(self, r, status, model_name: str) -> None:
        """The names vLLM's /metrics uses, which dashboards and benchmark clients read, with its
        model_name label; each observed with its splitserve twin (docs/api.md#metrics)."""
        def alias(kind, name, doc, **kw):
            return kind(name, doc, ["model_name"], registry=r, **kw).labels(model_name)

        self.ttft = Both(self.ttft, alias(Histogram, "vllm:time_to_first_token_seconds", "Time to first token",
                                          buckets=LATENCY_BUCKETS))
        self.itl = Both(self.itl, alias(Histogram, "vllm:inter_token_latency_seconds", "Inter-token latency",
                                        buckets=LATENCY_BUCKETS))
        self.tpot = Both(self.tpot, alias(Histogram, "vllm:time_per_output_token_seconds",
                                          "Time per output token", buckets=LATENCY_BUCKETS))
        self.e2e = Both(self.e2e, alias(Histogram, "vllm:e2e_request_latency_seconds", "End-to-end latency",
                                        buckets=E2E_BUCKETS))
        self.prompt_tokens = Both(self.prompt_tokens, alias(Counter, "vllm:prompt_tokens", "Prompt tokens"))
        self.generation_tokens = Both(self.generation_tokens,
                                      alias(Counter, "vllm:generation_tokens", "Generation tokens"))
        self.finished = Counter("vllm:request_success", "Finished requests by reason",
                                ["model_name", "finished_reason"], registry=r)
        self.model_name = model_name
        r.register(VllmWorkerAliases(status, model_name))

    def count_finished(self, reason: str) -> None:
        if self.finished is not None and reason in ("stop", "length", "abort"):
            self.finished.labels(self.model_name, reason).inc()

    def render(self) -> bytes:
        """The exposition text; calls backend.status(), so run it off the event loop."""
        return generate_latest(self.registry)


class WorkerStatusCollector:
    """Per-worker gauges and counters from backend.status(), read at scrape time."""

    def __init__(self, status: Callable[[], dict]):
        self._status = status

    def describe(self):
        return []  # nothing to check at registration: the workers are only known at scrape time

    def collect(self):
        try:
            status = self._status()
        except Exception:  # a scrape must still answer while the cluster is in trouble
            log.exception("backend.status() failed during a metrics scrape")
            status = {}
        workers = status.get("workers", [])
        if "retries" in status:
            retries = CounterMetricFamily("splitserve_request_retries",
                                          "Request attempts run again after a worker died or a hand-off broke")
            retries.add_metric([], status["retries"])
            yield retries
        if "prefix_fetches" in status:
            fetches = CounterMetricFamily("splitserve_prefix_fetches",
                                          "Cached prefixes the router asked one worker to export to another")
            fetches.add_metric([], status["prefix_fetches"])
            yield fetches
        if "autoscaler" in status:
            decisions = CounterMetricFamily("splitserve_autoscaler_decisions",
                                            "Pool size changes the autoscaler made, by kind, direction and reason",
                                            labels=["kind", "direction", "reason"])
            for d in status["autoscaler"]["decisions"]:
                decisions.add_metric([d["kind"], d["direction"], d["reason"]], d["count"])
            yield decisions
        gauge = lambda name, doc: GaugeMetricFamily(name, doc, labels=WORKER_LABELS)  # noqa: E731
        counter = lambda name, doc: CounterMetricFamily(name, doc, labels=WORKER_LABELS)  # noqa: E731
        alive = gauge("splitserve_worker_alive", "1 while the worker answers")
        waiting = gauge("splitserve_worker_requests_waiting", "Requests queued on the worker")
        running = gauge("splitserve_worker_requests_running", "Requests running on the worker")
        blocks_used = gauge("splitserve_worker_kv_blocks_used", "Attention KV blocks in use")
        blocks_free = gauge("splitserve_worker_kv_blocks_free", "Attention KV blocks free")
        slots_used = gauge("splitserve_worker_state_slots_used", "recurrent-state slots in use")
        slots_free = gauge("splitserve_worker_state_slots_free", "recurrent-state slots free")
        preemptions = counter("splitserve_worker_preemptions", "Requests preempted (recomputed)")
        handoff_bytes = counter("splitserve_worker_handoff_bytes", "KV and state bytes handed off")
        handoff_failures = counter("splitserve_worker_handoff_failures", "Failed hand-offs")
        cache_queried = counter("splitserve_worker_prefix_cache_queried_tokens",
                                "Prompt tokens looked up in the prefix cache")
        cache_hits = counter("splitserve_worker_prefix_cache_hit_tokens",
                             "Prompt tokens the prefix cache supplied (hit rate: hits / queried)")
        cache_blocks = gauge("splitserve_worker_prefix_cache_blocks", "KV blocks the prefix cache indexes")
        checkpoints_used = gauge("splitserve_worker_prefix_cache_checkpoints_used",
                                 "Recurrent-state checkpoints the prefix cache holds")
        checkpoints_total = gauge("splitserve_worker_prefix_cache_checkpoints_total",
                                  "Recurrent-state checkpoint rows (bounded, carved from the cache)")
        checkpoint_bytes = gauge("splitserve_worker_prefix_cache_checkpoint_bytes",
                                 "Bytes reserved for recurrent-state checkpoints")
        spec_drafts = counter("splitserve_worker_spec_drafts", "Speculative proposals verified")
        spec_draft_tokens = counter("splitserve_worker_spec_draft_tokens", "Draft tokens verified")
        spec_accepted = counter("splitserve_worker_spec_accepted_tokens",
                                "Draft tokens the target kept (acceptance: accepted / draft tokens)")
        spec_per_position = CounterMetricFamily("splitserve_worker_spec_accepted_tokens_per_position",
                                                "Draft tokens kept, by position in the proposal",
                                                labels=[*WORKER_LABELS, "position"])
        tier_labels = [*WORKER_LABELS, "tier"]
        tier_bytes = GaugeMetricFamily("splitserve_worker_cache_tier_bytes",
                                       "Bytes of prefix-cache entries a lower tier holds", labels=tier_labels)
        tier_entries = GaugeMetricFamily("splitserve_worker_cache_tier_entries",
                                         "Prefix-cache entries a lower tier holds", labels=tier_labels)
        tier_hits = CounterMetricFamily("splitserve_worker_cache_tier_hits",
                                        "Prefix-cache entries loaded back from a lower tier", labels=tier_labels)
        tier_loaded = counter("splitserve_worker_cache_tier_loaded_tokens",
                              "Prompt tokens whose KV and state a lower tier supplied")
        tier_spills = counter("splitserve_worker_cache_tier_spills",
                              "Prefix-cache entries the pool evicted into a lower tier")
        fetches = {stat: counter(f"splitserve_worker_{stat}", text) for stat, text in PREFIX_FETCH_COUNTERS}
        handoff_latency = SummaryMetricFamily("splitserve_worker_handoff_seconds",
                                              "Hand-off latency (count and sum)", labels=WORKER_LABELS)
        for w in workers:
            labels = [str(w.get("id", "?")), str(w.get("kind", "?")), str(w.get("node", "?"))]
            alive.add_metric(labels, 1.0 if w.get("alive", True) else 0.0)
            waiting.add_metric(labels, w.get("waiting", 0))
            running.add_metric(labels, w.get("running", 0))
            if "kv_blocks_total" in w:
                blocks_used.add_metric(labels, w["kv_blocks_total"] - w.get("kv_blocks_free", 0))
                blocks_free.add_metric(labels, w.get("kv_blocks_free", 0))
            if "state_slots_total" in w:
                slots_used.add_metric(labels, w["state_slots_total"] - w.get("state_slots_free", 0))
                slots_free.add_metric(labels, w.get("state_slots_free", 0))
            preemptions.add_metric(labels, w.get("preemptions", 0))
            if "prefix_cache_queried_tokens" in w:
                cache_queried.add_metric(labels, w["prefix_cache_queried_tokens"])
                cache_hits.add_metric(labels, w.get("prefix_cache_hit_tokens", 0))
                cache_blocks.add_metric(labels, w.get("prefix_cache_blocks", 0))
                checkpoints_used.add_metric(labels, w.get("prefix_cache_checkpoints_used", 0))
                checkpoints_total.add_metric(labels, w.get("prefix_cache_checkpoints_total", 0))
                checkpoint_bytes.add_metric(labels, w.get("prefix_cache_checkpoint_bytes", 0))
            if "tier_spills" in w:
                tier_spills.add_metric(labels, w["tier_spills"])
                tier_loaded.add_metric(labels, w.get("tier_loaded_tokens", 0))
                for tier in ("host", "disk"):
                    if f"tier_{tier}_bytes" in w:
                        tier_bytes.add_metric([*labels, tier], w[f"tier_{tier}_bytes"])
                        tier_entries.add_metric([*labels, tier], w.get(f"tier_{tier}_entries", 0))
                        tier_hits.add_metric([*labels, tier], w.get(f"tier_{tier}_hits", 0))
            if "prefix_fetch_exported" in w:
                for stat, family in fetches.items():
                    family.add_metric(labels, w.get(stat, 0))
            if "spec_drafts" in w:
                spec_drafts.add_metric(labels, w["spec_drafts"])
                spec_draft_tokens.add_metric(labels, w.get("spec_draft_tokens", 0))
                spec_accepted.add_metric(labels, w.get("spec_accepted_tokens", 0))
                for position, count in enumerate(w.get("spec_accepted_per_position", [])):
                    spec_per_position.add_metric([*labels, str(position)], count)
            if "handoff_bytes" in w or "handoff_count" in w:
                handoff_bytes.add_metric(labels, w.get("handoff_bytes", 0))
                handoff_failures.add_metric(labels, w.get("handoff_failures", 0))
                handoff_latency.add_metric(labels, count_value=w.get("handoff_count", 0),
                                           sum_value=w.get("handoff_seconds_sum", 0.0))
        yield from (alive, waiting, running, blocks_used, blocks_free, slots_used, slots_free,
                    preemptions, handoff_bytes, handoff_failures, handoff_latency, cache_queried, cache_hits,
                    cache_blocks, checkpoints_used, checkpoints_total, checkpoint_bytes,
                    spec_drafts, spec_draft_tokens, spec_accepted, spec_per_position,
                    tier_bytes, tier_entries, tier_hits, tier_loaded, tier_spills, *fetches.values())


class VllmWorkerAliases:
    """vLLM's scheduler gauges over the whole cluster, from backend.status() at scrape time:
    requests running and waiting on every worker, and the decode workers' KV cache in use."""

    def __init__(self, status: Callable[[], dict], model_name: str):
        self._status, self._model = status, model_name

    def describe(self):
        return []

    def collect(self):
        try:
            workers = self._status().get("workers", [])
        except Exception:
            log.exception("backend.status() failed during a metrics scrape")
            workers = []
        decode = [w for w in workers if w.get("kind") != "prefill" and w.get("kv_blocks_total")]
        total = sum(w["kv_blocks_total"] for w in decode)
        used = total - sum(w.get("kv_blocks_free", 0) for w in decode)
        for name, doc, value in (
                ("vllm:num_requests_running", "Requests running", sum(w.get("running", 0) for w in workers)),
                ("vllm:num_requests_waiting", "Requests waiting", sum(w.get("waiting", 0) for w in workers)),
                ("vllm:kv_cache_usage_perc", "KV cache in use (1 = full)", used / total if total else 0.0),
                ("vllm:gpu_cache_usage_perc", "KV cache in use (1 = full; vLLM's older name)",
                 used / total if total else 0.0)):
            family = GaugeMetricFamily(name, doc, labels=["model_name"])
            family.add_metric([self._model], value)
            yield family
        preempted = CounterMetricFamily("vllm:num_preemptions", "Requests preempted", labels=["model_name"])
        preempted.add_metric([self._model], sum(w.get("preemptions", 0) for w in workers))
        yield preempted
        speculating = [w for w in workers if "spec_drafts" in w]
        if speculating:  # vLLM's speculative-decoding counters, which its benchmark client reads
            for name, key, doc in (("vllm:spec_decode_num_drafts", "spec_drafts", "Speculative proposals"),
                                   ("vllm:spec_decode_num_draft_tokens", "spec_draft_tokens", "Draft tokens"),
                                   ("vllm:spec_decode_num_accepted_tokens", "spec_accepted_tokens",
                                    "Draft tokens accepted")):
                family = CounterMetricFamily(name, doc, labels=["model_name"])
                family.add_metric([self._model], sum(w.get(key, 0) for w in speculating))
                yield family
            per_position = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                               "Draft tokens accepted, by position",
                                               labels=["model_name", "position"])
            width = max(len(w.get("spec_accepted_per_position", [])) for w in speculating)
            totals = [0] * width
            for w in speculating:
                for position, count in enumerate(w.get("spec_accepted_per_position", [])):
                    totals[position] += count
            for position, count in enumerate(totals):
                per_position.add_metric([self._model, str(position)], count)
            yield per_position
