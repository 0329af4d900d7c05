"""`splitserve bench elastic`: the autoscaler against the best fixed split when the traffic shifts.

The workload: `num_prompts` decode-heavy requests (prompts of input_len / 8 tokens, answers of
output_len), then as many prefill-heavy ones (prompts of input_len, answers of output_len / 8),
arriving at one rate throughout. Side by side on the same requests:
- fixed: the split `bench plan` recommends for the first half (the smallest P:D whose simulated
  SLO attainment reaches the target at the rate, within the worker budget): what an operator
  who sized the cluster for the morning's traffic runs all day;
- autoscaled (signals): starts at that split; router.autoscaler's policy changes the pools from
  SLO, queue and occupancy readings;
- autoscaled (signals + capacity model): the same, with the planner's model sizing its steps.
Reported for each half and the whole run: SLO attainment, goodput, worker-seconds (what the
pools cost) and goodput per worker; plus a plot of the worker counts over time.

By default the cluster is simulated (bench.planner_sim) from a profile of one worker measured
here (`--threads-per-worker` torch threads), so every worker counts as a machine of its own and
the runs take seconds. `--cluster` runs the same three on real local Ray clusters, one after the
other, with the router's own autoscaler; on a box with fewer cores than workers the workers
share them, so more workers there do not add compute.
"""

from __future__ import annotations

import threading
import time
from dataclasses import asdict, replace

from bench.metrics import SLO, compute_metrics
from bench.workloads import WorkloadConfig, generate_requests
from router.autoscaler import AutoscaleConfig, Autoscaler, Signals
from router.capacity import CapacityModel

RUNS = ("fixed", "autoscaled (signals)", "autoscaled (signals + capacity model)")


def shifting_workload(num_prompts: int, input_len: int, output_len: int, rate: float, vocab_size: int,
                      max_model_len: int, seed: int = 0) -> tuple[list, float]:
    """(requests, the time the second half starts): decode-heavy, then prefill-heavy."""
    base = WorkloadConfig("decode-heavy", num_prompts, input_len, output_len, vocab_size=vocab_size,
                          max_model_len=max_model_len, request_rate=rate, seed=seed)
    first = generate_requests(base)
    second = generate_requests(replace(base, kind="prefill-heavy", seed=seed + 1))
    shift = first[-1].arrival_s + 1.0 / rate
    return first + [replace(r, arrival_s=r.arrival_s + shift) for r in second], shift


def best_fixed_split(profile, first_half: WorkloadConfig, rate: float, slo: SLO, target: float,
                     max_workers: int) -> dict:
    """The planner's pick for the first half (or, if no split reaches the target, the best one)."""
    from bench.planner import PlanConfig, recommend

    plan = recommend(profile, first_half, PlanConfig(rate, slo, target, max_workers,
                                                     num_requests=first_half.num_requests))
    return plan["recommended"] or max(plan["candidates"], key=lambda c: c["slo_attainment"])


def simulated_signals(sim, now: float, since: float, max_num_seqs: int) -> Signals:
    """What the router would read at `now` from the simulated cluster, as the live one does."""
    finished, sim.finished = sim.finished, []
    arrived, sim.arrived = sim.arrived, []
    decode = sim.serving("decode")

    def p90(values):
        values = sorted(values)
        return values[int(0.9 * (len(values) - 1))] if values else None

    running = sum(d.load for d in sim.decodes)
    return Signals(len(sim.serving("prefill")), len(decode),
                   queued_prompt_tokens=sum(w.queued_tokens for w in sim.prefills),
                   ttft_p90_s=p90([r.first - r.arrival for r in finished]),
                   tpot_p90_s=p90([(r.finish - r.first) / (r.output_len - 1) for r in finished if r.output_len > 1]),
                   decode_slot_occupancy=running / (max_num_seqs * max(1, len(decode))),
                   prompt_tokens_per_s=sum(r.prompt_len for r in arrived) / max(now - since, 1e-9),
                   mean_prompt_len=sum(r.prompt_len for r in arrived) / len(arrived) if arrived else 0.0,
                   decode_running=running)


def run_simulated(profile, requests, split: dict, config: AutoscaleConfig | None, startup_s: float) -> dict:
    from bench.planner_sim import ClusterSim

    sim = ClusterSim(profile, split["prefill"], split["decode"])
    scaler = Autoscaler(config) if config is not None else None
    last = [0.0]

    def control(sim, now):
        for d in scaler.decide(simulated_signals(sim, now, last[0], profile.max_num_seqs)):
            for _ in range(abs(d.delta)):
                (sim.grow(d.kind, now, startup_s) if d.delta > 0 else sim.shrink(d.kind, now))
        last[0] = now

    records, duration = sim.run(requests, control if scaler else None, config.interval_s if config else None)
    return {"records": records, "duration_s": duration, "timeline": sim.timeline,
            "worker_seconds": sim.worker_seconds,
            "decisions": scaler.status()["decisions"] if scaler else []}


def run_on_cluster(model: str, requests, split: dict, config: AutoscaleConfig | None,
                   cpus_per_worker: float, engine_options: dict) -> dict:
    """One real run on a local Ray cluster; the worker counts are sampled every 0.25 s."""
    import asyncio

    from bench.runner import BackendTarget, RunConfig, run_async
    from router.cluster import launch
    from router.scaling import counts

    cluster = launch(model, prefill=split["prefill"], decode=split["decode"], address=None,
                     cpus_per_worker=cpus_per_worker, autoscale=config, **engine_options)
    timeline, stop = [], threading.Event()
    try:
        t0 = time.perf_counter()

        def sample():
            while not stop.is_set():
                now = counts(cluster.workers)
                timeline.append((time.perf_counter() - t0, now["prefill"], now["decode"]))
                stop.wait(0.25)

        watcher = threading.Thread(target=sample, daemon=True)
        watcher.start()
        records, duration = asyncio.run(run_async(BackendTarget(cluster), requests,
                                                  RunConfig("elastic", warmup_requests=1, progress=False)))
        decisions = cluster.autoscaler.status()["decisions"] if cluster.autoscaler else []
    finally:
        stop.set()
        cluster.shutdown()
    start = min(r.start for r in records)
    for r in records:  # times relative to the first send, as the simulated records are
        r.chunk_times = [t - start for t in r.chunk_times]
        r.start -= start
    worker_seconds = sum((b[0] - a[0]) * (a[1] + a[2]) for a, b in zip(timeline, timeline[1:]))
    return {"records": records, "duration_s": duration, "timeline": timeline,
            "worker_seconds": worker_seconds, "decisions": decisions}


def summarize(run: dict, num_first: int, slo: SLO) -> dict:
    """SLO attainment and goodput per half and overall; each half's goodput over its own span."""
    out = {"duration_s": run["duration_s"]}
    halves = {"first half": run["records"][:num_first], "second half": run["records"][num_first:],
              "whole run": run["records"]}
    for name, records in halves.items():
        span = max(t for r in records for t in (r.chunk_times or [r.start])) - min(r.start for r in records)
        m = compute_metrics(records, max(span, 1e-9), slo)
        out[name] = {"slo_attainment": m["slo_attainment"], "goodput": m["goodput"],
                     "p90_ttft_ms": m["p90_ttft_ms"], "p90_tpot_ms": m["p90_tpot_ms"]}
    out["worker_seconds"] = run["worker_seconds"]
    good = out["whole run"]["slo_attainment"] * len(run["records"])
    out["goodput_per_worker"] = good / max(run["worker_seconds"], 1e-9)  # good requests per worker-second
    out["max_workers"] = {"prefill": max(p for _, p, _ in run["timeline"]),
                          "decode": max(d for _, _, d in run["timeline"])}
    return out


def run_elastic(model: str, num_prompts: int = 200, input_len: int = 1024, output_len: int = 256,
                rate: float = 2.0, slo: SLO | None = None, attainment: float = 0.9,
                max_workers: int = 4, bounds: tuple[int, int] = (4, 4), threads: int = 1,
                startup_s: float = 5.0, interval_s: float = 2.0, cluster: bool = False,
                profile=None, seed: int = 0, engine_options: dict | None = None) -> dict:
    """The three runs on one shifting workload; returns the JSON-ready report."""
    import json
    from pathlib import Path

    from bench.planner import measure_profile

    slo = slo or SLO(ttft=1.0, tpot=0.1)
    config = json.loads((Path(model) / "config.json").read_text())
    vocab, max_len = config["vocab_size"], min(config.get("max_position_embeddings") or 8192, 8192)
    requests, shift = shifting_workload(num_prompts, input_len, output_len, rate, vocab, max_len, seed)
    if profile is None:
        lens = {max(1, input_len // 8), max(1, input_len // 2), input_len, 2 * input_len}
        profile, _ = measure_profile(model, threads, prompt_lens=sorted({min(n, max_len - 1) for n in lens}),
                                     repeats=2)
    first = WorkloadConfig("decode-heavy", num_prompts, input_len, output_len, vocab_size=vocab,
                           max_model_len=max_len, request_rate=rate, seed=seed)
    split = best_fixed_split(profile, first, rate, slo, attainment, max_workers)
    base = AutoscaleConfig(prefill=(1, bounds[0]), decode=(1, bounds[1]), slo_ttft_s=slo.ttft or 1e9,
                           slo_tpot_s=slo.tpot or 1e9, interval_s=interval_s)
    configs = {RUNS[0]: None, RUNS[1]: base, RUNS[2]: replace(base, capacity=CapacityModel(profile))}
    runs = {}
    for name, cfg in configs.items():
        if cluster:
            runs[name] = run_on_cluster(model, requests, split, cfg, float(threads), dict(engine_options or {}))
        else:
            runs[name] = run_simulated(profile, requests, split, cfg, startup_s)
    return {"mode": "cluster" if cluster else "simulated", "profile": asdict(profile),
            "slo": slo.to_dict(), "rate": rate, "shift_s": shift, "num_prompts_per_half": num_prompts,
            "input_len": input_len, "output_len": output_len, "fixed_split": split,
            "bounds": {"prefill": [1, bounds[0]], "decode": [1, bounds[1]]},
            "runs": {name: {**summarize(run, num_prompts, slo), "timeline": run["timeline"],
                            "decisions": run["decisions"]} for name, run in runs.items()}}


def format_report(report: dict) -> str:
    split = report["fixed_split"]
    lines = [f"{report['mode']}: {report['num_prompts_per_half']} decode-heavy then as many prefill-heavy "
             f"requests at {report['rate']:g} req/s (shift at {report['shift_s']:.0f} s), SLO {report['slo']}",
             f"fixed split (the planner's pick for the first half): {split['prefill']}P{split['decode']}D; "
             f"autoscaled bounds prefill 1:{report['bounds']['prefill'][1]}, decode 1:{report['bounds']['decode'][1]}",
             f"{'run':<40} {'half':<12} {'SLO att.':>8} {'goodput':>8} {'TTFT p90':>9} {'TPOT p90':>9}"]
    for name, run in report["runs"].items():
        for half in ("first half", "second half", "whole run"):
            h = run[half]
            lines.append(f"{name:<40} {half:<12} {h['slo_attainment'] * 100:7.1f}% {h['goodput']:8.2f} "
                         f"{h['p90_ttft_ms']:8.0f}ms {h['p90_tpot_ms']:8.1f}ms")
        lines.append(f"{'':<40} worker-seconds {run['worker_seconds']:.0f}, goodput per worker-second "
                     f"{run['goodput_per_worker']:.3f}, most workers {run['max_workers']['prefill']}P"
                     f"{run['max_workers']['decode']}D")
    fixed = report["runs"][RUNS[0]]["second half"]["goodput"]
    for name in RUNS[1:]:
        lines.append(f"{name}: second-half goodput {report['runs'][name]['second half']['goodput'] / max(fixed, 1e-9):.2f}x"
                     f" the fixed split's")
    return "\n".join(lines)


def plot_worker_counts(report: dict, path) -> str:
    """Worker counts over time per run (prefill above, decode below), the shift marked."""
    from bench.plots import _pyplot

    plt = _pyplot()
    fig, axes = plt.subplots(2, 1, figsize=(8, 5), sharex=True)
    for name, run in report["runs"].items():
        times = [t for t, _, _ in run["timeline"]] + [max(run["duration_s"], run["timeline"][-1][0])]
        for ax, column in zip(axes, (1, 2)):
            values = [row[column] for row in run["timeline"]]
            ax.step(times, values + values[-1:], where="post", label=name)
    from matplotlib.ticker import MaxNLocator

    for ax, label in zip(axes, ("prefill workers", "decode workers")):
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        ax.axvline(report["shift_s"], color="gray", linestyle="--", linewidth=1)
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    axes[1].set_xlabel("seconds (dashed: decode-heavy -> prefill-heavy)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)

