"""Drive a serving backend with a workload and time every streamed chunk.

Targets (anything with `async stream(request_id, BenchRequest)` yielding tokens per chunk):
- `BackendTarget`: an in-process Backend: router.local_backend.LocalBackend (the colocated
  engine on its own thread) or a launched router.cluster.Cluster (offline mode);
- `GrpcTarget`: a running `splitserve serve`, through router.client (online mode).
Requests start at their workload arrival offsets (Poisson / gamma, see bench.workloads),
at most `max_concurrency` at once; every request is greedy with ignore_eos, so it produces
exactly its output length and runs are comparable across backends.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import asdict, dataclass, field
from collections.abc import AsyncIterator

from engine.trace import Span
from bench.metrics import SLO, RequestRecord, compute_metrics, records_to_dicts
from bench.workloads import BenchRequest, describe

TARGET_KINDS = ("llm", "cluster", "server")


@dataclass
class RunConfig:
    label: str = "run"
    max_concurrency: int | None = None  # None: no cap
    warmup_requests: int = 1  # short untimed requests first (first-call allocations, Ray paths)
    progress: bool = True
    request_timeout_s: float = 600.0
    slo: SLO = field(default_factory=SLO)

    def __post_init__(self):
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency: must be >= 1 or None, got {self.max_concurrency!r}")
        if self.warmup_requests < 0:
            raise ValueError(f"warmup_requests: must be >= 0, got {self.warmup_requests!r}")
        if not self.request_timeout_s > 0:
            raise ValueError(f"request_timeout_s: must be positive, got {self.request_timeout_s!r}")
        if not isinstance(self.slo, SLO):
            raise ValueError("slo: must be a bench.metrics.SLO")


class BackendTarget:
    """An in-process router.backend.Backend (LocalBackend or Cluster)."""

    def __init__(self, backend):
        self.backend = backend
        self.spans: dict[str, list] = {}  # request id -> its final output's spans (engine.trace)

    async def stream(self, request_id: str, request: BenchRequest) -> AsyncIterator[int]:
        from engine import SamplingParams

        params = SamplingParams(max_tokens=request.output_len, temperature=0.0, ignore_eos=True)
        async for out in self.backend.stream(request_id, list(request.prompt_token_ids), params, whole=False):
            if out.error:
                raise RuntimeError(out.error)
            if out.finished:
                self.spans[request_id] = list(out.spans)
            yield len(out.new_token_ids)


class GrpcTarget:
    """A running server, over the project's async gRPC client (one channel per run)."""

    def __init__(self, server: str, auth_token: str | None = None):
        self.server = server
        self.auth_token = auth_token
        self._client = None
        self.spans: dict[str, list] = {}  # request id -> the final message's spans (engine.trace)

    async def stream(self, request_id: str, request: BenchRequest) -> AsyncIterator[int]:
        from router.client import AsyncSplitServeClient

        if self._client is None:  # grpc.aio channels belong to the loop that made them
            self._client = AsyncSplitServeClient(self.server, auth_token=self.auth_token)
        call = self._client.stream(list(request.prompt_token_ids), request_id=request_id,
                                   max_tokens=request.output_len, temperature=0.0, ignore_eos=True)
        async for message in call:
            if message.finished:
                self.spans[request_id] = [Span(s.name, s.start_unix_nano, s.end_unix_nano, s.where)
                                          for s in message.spans]
            yield len(message.token_ids)

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.close()
            self._client = None


async def _one(target, request_id: str, request: BenchRequest, timeout_s: float) -> RequestRecord:
    record = RequestRecord(request.prompt_len, time.perf_counter())

    async def consume():
        async for n in target.stream(request_id, request):
            if n:
                record.chunk_times.append(time.perf_counter())
                record.chunk_tokens.append(n)

    try:
        await asyncio.wait_for(consume(), timeout_s)
        record.success = record.output_len > 0
        if record.output_len != request.output_len:
            record.error = f"expected {request.output_len} tokens, got {record.output_len}"
    except Exception as e:  # one failed request is a data point, not the end of the run
        record.error = f"{type(e).__name__}: {e}"
    return record


async def run_async(target, requests: list[BenchRequest], cfg: RunConfig) -> tuple[list[RequestRecord], float]:
    for i in range(cfg.warmup_requests):
        warm = BenchRequest(list(requests[0].prompt_token_ids[:16]), 2, 0.0)
        await _one(target, f"{cfg.label}-warmup-{i}-{time.monotonic_ns()}", warm, cfg.request_timeout_s)
    gate = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
    bar = _progress_bar(len(requests), cfg.label, cfg.progress)
    tag = time.monotonic_ns()  # request ids unique across runs on one server
    t0 = time.perf_counter()

    async def scheduled(i: int, request: BenchRequest) -> RequestRecord:
        delay = t0 + request.arrival_s - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        async with gate if gate is not None else contextlib.nullcontext():
            record = await _one(target, f"{cfg.label}-{tag}-{i}", request, cfg.request_timeout_s)
        bar.update(1)
        return record

    try:
        records = await asyncio.gather(*(scheduled(i, r) for i, r in enumerate(requests)))
    finally:
        bar.close()
    return list(records), time.perf_counter() - t0


class _NoBar:
    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


def _progress_bar(total: int, label: str, enabled: bool):
    if not enabled:
        return _NoBar()
    try:
        from tqdm import tqdm
    except ImportError:  # tqdm comes with the `bench` extra; the run works without it
        return _NoBar()
    return tqdm(total=total, desc=label, unit="req", leave=False)


def run_benchmark(target, requests: list[BenchRequest], cfg: RunConfig) -> dict:
    """One timed run: the JSON-ready result (config, workload, metrics, per-request timings)."""
    if not requests:
        raise ValueError("requests: the workload is empty")

    async def main():
        try:
            return await run_async(target, requests, cfg)
        finally:
            if hasattr(target, "aclose"):
                await target.aclose()

    records, duration = asyncio.run(main())
    return {
        "label": cfg.label,
        "run": {k: v for k, v in asdict(cfg).items() if k != "slo"},
        "workload": describe(requests),
        "metrics": compute_metrics(records, duration, cfg.slo),
        "requests": records_to_dicts(records),
    }


@contextlib.contextmanager
def open_target(kind: str, model: str | None = None, *, server: str = "127.0.0.1:50051",
                prefill: int = 1, decode: int = 1, local_prefill_tokens: int = 0,
                cpus_per_worker: float = 1.0, auth_token: str | None = None, **engine_options):
    """A ready target of `kind` ("llm", "cluster", "server"); whatever it started is stopped after."""
    if kind == "server":
        yield GrpcTarget(server, auth_token)
        return
    if model is None:
        from engine import demo_model_path

        model = str(demo_model_path())
    if kind == "llm":
        from router.local_backend import LocalBackend

        backend = LocalBackend(model, **engine_options)
    elif kind == "cluster":
        from router.cluster import launch

        backend = launch(model, prefill=prefill, decode=decode, address=None,
                         local_prefill_tokens=local_prefill_tokens, cpus_per_worker=cpus_per_worker,
                         **engine_options)
    else:
        raise ValueError(f"kind: {kind!r} not in {TARGET_KINDS}")
    try:
        yield BackendTarget(backend)
    finally:
        backend.shutdown()


def handoff_totals(cluster) -> dict:
    """Hand-off counters summed over a cluster's prefill workers (fresh from the workers)."""
    totals = {"count": 0, "failures": 0, "bytes": 0, "seconds": 0.0}
    for worker in cluster.status()["workers"]:
        if worker.get("kind") == "prefill":
            totals["count"] += worker.get("handoff_count", 0)
            totals["failures"] += worker.get("handoff_failures", 0)
            totals["bytes"] += worker.get("handoff_bytes", 0)
            totals["seconds"] += worker.get("handoff_seconds_sum", 0.0)
    return totals


def run_engine_offline(llm, requests: list[BenchRequest]) -> tuple[list[RequestRecord], float]:
    """engine.LLM's own loop (all requests queued at t=0, stepped on this thread), stamped.

    The same work as `LLM.generate(prompts, params)`, plus a timestamp per step, so the
    offline comparison against transformers measures the engine without any serving layer.
    bench roofline and bench compare build `llm` with output_kind="delta", as the workers run
    the engine: each step's outputs carry that step's tokens, not copies of everything so far.
    """
    from engine import SamplingParams

    engine = llm.engine
    records: dict[str, RequestRecord] = {}
    order = []
    t0 = time.perf_counter()
    for r in requests:
        params = SamplingParams(max_tokens=r.output_len, temperature=0.0, ignore_eos=True)
        request_id = engine.add_request(list(r.prompt_token_ids), params)
        records[request_id] = RequestRecord(r.prompt_len, t0)
        order.append(request_id)
    while engine.has_unfinished():
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            record = records[out.request_id]
            if out.new_token_ids:
                record.chunk_times.append(now)
                record.chunk_tokens.append(len(out.new_token_ids))
            if out.finished:
                record.success = out.error is None
                record.error = out.error
    return [records[i] for i in order], time.perf_counter() - t0
