"""`splitserve bench plan`: profile one worker, recommend P:D, optionally validate on a real cluster."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path


def add_plan_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threads-per-worker", type=int, default=1, help="torch threads of one worker")
    p.add_argument("--rate", type=float, required=True, help="target request rate (req/s)")
    p.add_argument("--slo-ttft-ms", type=float, default=None)
    p.add_argument("--slo-tpot-ms", type=float, default=None)
    p.add_argument("--attainment", type=float, default=0.9, help="fraction of requests meeting the SLOs")
    p.add_argument("--max-workers", type=int, default=4)
    p.add_argument("--workload", default="prefill-heavy")
    p.add_argument("--num-prompts", type=int, default=32, help="requests per simulated / validation run")
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--burstiness", type=float, default=1.0)
    p.add_argument("--handoff-ms", type=float, default=5.0, help="hand-off time per request")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--validate", default=None, metavar="P:D",
                   help="run this split for real (cpus per worker = threads per worker) and report "
                        "the prediction error")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write the JSON report here")


def run_plan(args) -> int:
    from bench.cli import _model_dir
    from bench.metrics import SLO, dump_json, summary_line
    from bench.planner import PlanConfig, max_rate, measure_profile, recommend
    from bench.workloads import WorkloadConfig

    slo = SLO(None if args.slo_ttft_ms is None else args.slo_ttft_ms / 1000,
              None if args.slo_tpot_ms is None else args.slo_tpot_ms / 1000)
    plan_cfg = PlanConfig(args.rate, slo, args.attainment, args.max_workers, num_requests=max(args.num_prompts, 100))
    with _model_dir(args) as model:
        config = json.loads((Path(model) / "config.json").read_text())
        workload = WorkloadConfig(args.workload, args.num_prompts, args.input_len, args.output_len,
                                  vocab_size=config["vocab_size"], first_token_id=3,
                                  max_model_len=min(config.get("max_position_embeddings") or 8192, 8192),
                                  request_rate=args.rate, burstiness=args.burstiness, seed=args.seed)
        print(f"profiling one worker ({args.threads_per_worker} threads) ...", file=sys.stderr, flush=True)
        profile, raw = measure_profile(model, args.threads_per_worker, handoff_s=args.handoff_ms / 1000,
                                       max_num_batched_tokens=args.max_num_batched_tokens)
        report = {"profile": asdict(profile), "profile_points": raw, "workload": asdict(workload)}
        report["plan"] = recommend(profile, workload, plan_cfg)
        report["max_rate"] = {
            f"{p}P{d}D": max_rate(profile, workload, p, d, slo, args.attainment)
            for p, d in ((1, 1), (2, 1), (1, 2), (2, 2)) if p + d <= args.max_workers}
        _print_plan(report)
        if args.validate:
            report["validation"] = _validate(args, model, profile, workload, slo)
            v = report["validation"]
            print(summary_line(f"measured {args.validate}", v["measured"]))
            for key, e in v["error"].items():
                print(f"  {key:<16} predicted {e['predicted']:10.2f}  measured {e['measured']:10.2f}  "
                      f"error {e['relative_error'] * 100:+6.1f}%")
    if args.out:
        dump_json(report, args.out)
    return 0


def _print_plan(report: dict) -> None:
    p = report["profile"]
    print(f"profile: prefill {p['prefill_base_s'] * 1e3:.2f} ms + {p['prefill_per_token_s'] * 1e6:.1f} us/token"
          f" + {p['prefill_per_token2_s'] * 1e9:.3f} ns/token^2; decode step {p['decode_base_s'] * 1e3:.2f} ms"
          f" + {p['decode_per_seq_s'] * 1e3:.3f} ms/seq")
    plan = report["plan"]
    print(f"at {plan['rate']:g} req/s, target {plan['attainment_target'] * 100:.0f}% within {plan['slo']}:")
    for c in plan["candidates"]:
        print(f"  {c['prefill']}P{c['decode']}D  attainment {c['slo_attainment'] * 100:5.1f}%  "
              f"TTFT mean {c['mean_ttft_ms']:8.1f} ms  TPOT mean {c['mean_tpot_ms']:6.2f} ms")
    best = plan["recommended"]
    print("recommended: " + (f"{best['prefill']}P{best['decode']}D" if best else
                             "none within --max-workers"))
    for name, rate in report["max_rate"].items():
        workers = sum(int(x) for x in name.replace("P", " ").replace("D", "").split())
        print(f"  {name}: max rate {rate:.2f} req/s ({rate / workers:.2f} per worker)")


def _validate(args, model, profile, workload, slo) -> dict:
    from bench.planner import predict, prediction_error
    from bench.runner import RunConfig, handoff_totals, open_target, run_benchmark
    from bench.serving import parse_split
    from bench.workloads import generate_requests

    p, d = parse_split(args.validate)
    requests = generate_requests(workload)
    with open_target("cluster", model, prefill=p, decode=d, cpus_per_worker=float(args.threads_per_worker),
                     max_num_batched_tokens=args.max_num_batched_tokens) as target:
        before = handoff_totals(target.backend)
        result = run_benchmark(target, requests, RunConfig(f"validate-{p}P{d}D", slo=slo))
        after = handoff_totals(target.backend)
    predicted = predict(profile, workload, p, d, slo, seeds=(workload.seed,))
    count = after["count"] - before["count"]
    return {"split": args.validate, "measured": result["metrics"], "predicted": predicted,
            "error": prediction_error(predicted, result["metrics"]),
            "measured_handoff_ms": (after["seconds"] - before["seconds"]) / count * 1000 if count else None}
