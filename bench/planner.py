"""A DistServe-style P:D capacity planner: measured per-worker costs -> simulated SLO attainment.

1. Profile one worker (an engine with the threads one worker would get): prefill step time
   against prompt tokens (fit a + b*L + c*L^2: linear layers and the scan are linear, the
   attention scores quadratic) and decode step time against batch size (fit e + f*B).
2. Simulate a P:D cluster as the router runs it (bench.planner_sim): Poisson arrivals,
   each prompt to the prefill worker with the fewest queued tokens, batched up to the token
   budget, a hand-off delay, then continuous-batching decode steps on the decode worker with
   the fewest sequences.
3. Recommend the smallest P+D whose simulated SLO attainment reaches the target at the rate
   (DistServe's criterion), and say, per config, the highest rate that still meets it.
`bench plan --validate` then runs a real cluster and reports the prediction error.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass

from bench.metrics import SLO, compute_metrics
from bench.planner_sim import simulate
from bench.workloads import WorkloadConfig, generate_requests
from router.capacity import WorkerProfile


@dataclass
class PlanConfig:
    rate: float
    slo: SLO
    attainment_target: float = 0.9
    max_workers: int = 4
    num_requests: int = 200
    seeds: tuple[int, ...] = (0, 1, 2)

    def __post_init__(self):
        if not self.rate > 0 or math.isinf(self.rate):
            raise ValueError(f"rate: must be a positive finite request rate, got {self.rate!r}")
        if not 0 < self.attainment_target <= 1:
            raise ValueError(f"attainment_target: must be in (0, 1], got {self.attainment_target!r}")
        if self.max_workers < 2 or self.num_requests < 1 or not self.seeds:
            raise ValueError("max_workers >= 2, num_requests >= 1 and at least one seed are needed")
        if self.slo.empty:
            raise ValueError("slo: give at least one of TTFT / TPOT / E2E targets")


def lstsq(rows: list[list[float]], ys: list[float]) -> list[float]:
    """Non-negative-clipped least squares via the normal equations (tiny systems only)."""
    n = len(rows[0])
    ata = [[sum(r[i] * r[j] for r in rows) for j in range(n)] for i in range(n)]
    aty = [sum(r[i] * y for r, y in zip(rows, ys)) for i in range(n)]
    for i in range(n):  # Gauss-Jordan with partial pivoting
        pivot = max(range(i, n), key=lambda k: abs(ata[k][i]))
        ata[i], ata[pivot], aty[i], aty[pivot] = ata[pivot], ata[i], aty[pivot], aty[i]
        if abs(ata[i][i]) < 1e-300:
            continue
        for k in range(n):
            if k != i:
                f = ata[k][i] / ata[i][i]
                ata[k] = [a - f * b for a, b in zip(ata[k], ata[i])]
                aty[k] -= f * aty[i]
    return [max(0.0, aty[i] / ata[i][i]) if abs(ata[i][i]) > 1e-300 else 0.0 for i in range(n)]


def fit_profile(prefill_points: list[tuple[int, float]], decode_points: list[tuple[int, float]],
                handoff_s: float = 0.0, **limits) -> WorkerProfile:
    """prefill_points: (prompt tokens, step seconds); decode_points: (batch size, step seconds).

    Repeats of one x are reduced to their median first: on a shared machine single steps
    stall now and then, and one stall would otherwise tilt the whole least-squares fit.
    """
    prefill_points, decode_points = _medians(prefill_points), _medians(decode_points)
    a, b, c = lstsq([[1.0, n, n * n] for n, _ in prefill_points], [t for _, t in prefill_points])
    e, f = lstsq([[1.0, n] for n, _ in decode_points], [t for _, t in decode_points])
    return WorkerProfile(a, b, c, e, f, handoff_s, **limits)


def _medians(points: list[tuple[int, float]]) -> list[tuple[int, float]]:
    by_x: dict[int, list[float]] = {}
    for x, t in points:
        by_x.setdefault(x, []).append(t)
    out = []
    for x, ts in sorted(by_x.items()):
        ts.sort()
        mid = len(ts) // 2
        out.append((x, ts[mid] if len(ts) % 2 else (ts[mid - 1] + ts[mid]) / 2))
    return out


def measure_profile(model: str, threads: int = 1, prompt_lens=(64, 256, 512, 1024, 2048),
                    batch_sizes=(1, 8, 16, 32, 64), repeats: int = 3, handoff_s: float = 0.0,
                    max_num_batched_tokens: int = 2048) -> tuple[WorkerProfile, dict]:
    """Time a real engine step by step, with the thread count one worker gets."""
    import torch

    from engine import SamplingParams
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    budget = max(max_num_batched_tokens, max(prompt_lens))
    try:
        engine = LLMEngine(EngineConfig(model=model, max_num_batched_tokens=budget,
                                        max_num_seqs=max(max(batch_sizes), 1)))
        vocab = engine.spec.vocab_size
        one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        prefill_points = []
        engine.add_request([5] * 16, one)
        while engine.has_unfinished():  # warm-up
            engine.step()
        for n in prompt_lens:
            for r in range(repeats):
                engine.add_request([3 + (i * 7 + r) % (vocab - 3) for i in range(n)], one)
                t = time.perf_counter()
                while engine.has_unfinished():
                    engine.step()
                prefill_points.append((n, time.perf_counter() - t))
        decode_points = []
        steps = 8
        for size in batch_sizes:
            params = SamplingParams(max_tokens=steps + 2, temperature=0.0, ignore_eos=True)
            for i in range(size):
                engine.add_request([3 + (i * 13 + k) % (vocab - 3) for k in range(32)], params)
            engine.step()  # all prompts in one step; decodes from here on
            for _ in range(steps):
                t = time.perf_counter()
                engine.step()
                decode_points.append((size, time.perf_counter() - t))
            while engine.has_unfinished():
                engine.step()
    finally:
        torch.set_num_threads(before)
    profile = fit_profile(prefill_points, decode_points, handoff_s,
                          max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max(batch_sizes))
    return profile, {"prefill_points": prefill_points, "decode_points": decode_points, "threads": threads}


def predict(profile: WorkerProfile, workload: WorkloadConfig, num_prefill: int, num_decode: int,
            slo: SLO, seeds=(0,)) -> dict:
    """Simulated metrics (bench.metrics fields) of a P:D cluster, averaged over seeds."""
    runs = []
    for seed in seeds:
        requests = generate_requests(WorkloadConfig(**{**asdict(workload), "seed": seed}))
        records, duration = simulate(profile, requests, num_prefill, num_decode)
        runs.append(compute_metrics(records, duration, slo))
    keys = [k for k, v in runs[0].items() if isinstance(v, (int, float)) and not isinstance(v, bool)]
    return {k: sum(r[k] for r in runs) / len(runs) for k in keys}


def recommend(profile: WorkerProfile, workload: WorkloadConfig, cfg: PlanConfig) -> dict:
    """Every P:D with P + D <= max_workers, its simulated attainment, and the smallest that meets it."""
    workload = WorkloadConfig(**{**asdict(workload), "request_rate": cfg.rate,
                                 "num_requests": cfg.num_requests})
    candidates = []
    for total in range(2, cfg.max_workers + 1):
        for p in range(1, total):
            m = predict(profile, workload, p, total - p, cfg.slo, cfg.seeds)
            candidates.append({"prefill": p, "decode": total - p, "slo_attainment": m["slo_attainment"],
                               "mean_ttft_ms": m["mean_ttft_ms"], "mean_tpot_ms": m["mean_tpot_ms"],
                               "p90_ttft_ms": m["p90_ttft_ms"], "p90_tpot_ms": m["p90_tpot_ms"]})
    feasible = [c for c in candidates if c["slo_attainment"] >= cfg.attainment_target]
    best = min(feasible, key=lambda c: (c["prefill"] + c["decode"], -c["slo_attainment"]), default=None)
    return {"rate": cfg.rate, "attainment_target": cfg.attainment_target, "slo": cfg.slo.to_dict(),
            "candidates": candidates, "recommended": best}


def max_rate(profile: WorkerProfile, workload: WorkloadConfig, num_prefill: int, num_decode: int,
             slo: SLO, target: float, high: float = 64.0, iterations: int = 12, seeds=(0,)) -> float:
    """Highest request rate at which the simulated attainment still reaches `target` (bisection)."""
    def ok(rate):
        w = WorkloadConfig(**{**asdict(workload), "request_rate": rate})
        return predict(profile, w, num_prefill, num_decode, slo, seeds)["slo_attainment"] >= target

    low = 0.0
    if ok(high):
        return high
    for _ in range(iterations):
        mid = (low + high) / 2
        low, high = (mid, high) if ok(mid) else (low, mid)
    return low


def prediction_error(predicted: dict, measured: dict) -> dict:
    """Relative error (predicted - measured) / measured of the numbers an operator plans with."""
    keys = ("slo_attainment", "mean_ttft_ms", "median_ttft_ms", "p90_ttft_ms", "mean_tpot_ms",
            "median_tpot_ms", "p90_tpot_ms")
    out = {}
    for k in keys:
        p, m = predicted.get(k), measured.get(k)
        if p is None or m is None or not math.isfinite(m):
            continue
        out[k] = {"predicted": p, "measured": m,
                  "relative_error": (p - m) / m if m else (0.0 if p == m else math.inf)}
    return out
