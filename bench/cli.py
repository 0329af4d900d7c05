"""`splitserve bench serve|offline|compare|plan|roofline|structured|prefix|spec|elastic` (`bench transfer`: bench.transfer)."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
import tempfile
from pathlib import Path

from bench.workloads import WORKLOAD_KINDS

BENCHMARKS = ("serve", "offline", "compare", "plan", "roofline")


def _workload_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workload")
    g.add_argument("--workload", choices=WORKLOAD_KINDS, default="fixed")
    g.add_argument("--num-prompts", type=int, default=64)
    g.add_argument("--input-len", type=int, default=128)
    g.add_argument("--output-len", type=int, default=128)
    g.add_argument("--range-ratio", type=float, default=0.5, help="random: +- this fraction")
    g.add_argument("--request-rate", type=float, default=math.inf, help="req/s (inf: all at once)")
    g.add_argument("--burstiness", type=float, default=1.0, help="gamma shape; 1 = Poisson")
    g.add_argument("--max-concurrency", type=int, default=None)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--trace", default=None, metavar="PATH",
                   help="write every request's spans as OpenTelemetry JSON (OTLP) here (docs/tracing.md)")
    g.add_argument("--slo-ttft-ms", type=float, default=None)
    g.add_argument("--slo-tpot-ms", type=float, default=None)
    g.add_argument("--slo-e2el-ms", type=float, default=None)
    g.add_argument("--out", default=None, help="write the JSON result here")
    g.add_argument("--plot", default=None, help="write latency CDFs to this PNG")
    g.add_argument("--no-progress", action="store_true")


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF-format folder (default: the bundled demo model)")
    from bench.checkpoints import BENCH_CHECKPOINTS

    p.add_argument("--tiny", choices=BENCH_CHECKPOINTS, default=None,
                   help="build a tiny random checkpoint (bench.checkpoints) instead of --model")


@contextlib.contextmanager
def _model_dir(args):
    if args.tiny is None:
        if args.model is None:
            from engine import demo_model_path

            yield str(demo_model_path())
        else:
            yield args.model
        return
    from bench.checkpoints import build_checkpoint

    with tempfile.TemporaryDirectory(prefix="splitserve-tiny-") as tmp:
        build_checkpoint(args.tiny, tmp)
        yield tmp


def _slo(args):
    from bench.metrics import SLO

    ms = [getattr(args, f"slo_{k}_ms") for k in ("ttft", "tpot", "e2el")]
    return SLO(*(None if v is None else v / 1000.0 for v in ms))


def _requests(args, vocab_size: int, max_model_len: int):
    from bench.workloads import WorkloadConfig, generate_requests

    first = 3 if vocab_size > 3 else 0
    return generate_requests(WorkloadConfig(
        args.workload, args.num_prompts, args.input_len, args.output_len, args.range_ratio, vocab_size,
        first, max_model_len, args.request_rate, args.burstiness, args.seed))


def _write_trace(args, target, service: str = "splitserve") -> None:
    if args.trace:
        from engine.trace import otlp_json

        Path(args.trace).write_text(json.dumps(otlp_json(target.spans, service)))
        print(f"spans of {len(target.spans)} requests: {args.trace}")


def _finish(args, result: dict) -> int:
    from bench.metrics import dump_json, summary_line

    print(summary_line(result["label"], result["metrics"]))
    if args.out:
        dump_json(result, args.out)
    else:
        from bench.metrics import jsonable

        print(json.dumps(jsonable(result["metrics"]), indent=2))
    if args.plot:
        from bench.plots import plot_latency_cdfs

        plot_latency_cdfs({result["label"]: result}, Path(args.plot))
    failed = result["metrics"]["failed"]
    return 1 if failed else 0


def cmd_serve(args) -> int:
    from bench.runner import RunConfig, open_target, run_benchmark
    from router.client import SplitServeClient

    with SplitServeClient(args.server, auth_token=args.auth_token) as client:
        info = client.model_info(timeout=30)
    requests = _requests(args, info.vocab_size, info.max_model_len)
    with open_target("server", server=args.server, auth_token=args.auth_token) as target:
        result = run_benchmark(target, requests, RunConfig("server", args.max_concurrency,
                                                           progress=not args.no_progress, slo=_slo(args)))
        _write_trace(args, target)
    result["server"] = args.server
    return _finish(args, result)


def cmd_offline(args) -> int:
    from bench.runner import RunConfig, open_target, run_benchmark

    with _model_dir(args) as model:
        config = json.loads((Path(model) / "config.json").read_text())
        max_len = min(config.get("max_position_embeddings") or 8192, 8192)
        requests = _requests(args, config["vocab_size"], max_len)
        options = {"max_num_batched_tokens": args.max_num_batched_tokens}
        if args.backend == "cluster":
            options.update(prefill=args.prefill, decode=args.decode, cpus_per_worker=args.cpus_per_worker,
                           local_prefill_tokens=args.local_prefill_tokens)
            label = f"{args.prefill}P{args.decode}D"
        else:
            label = "colocated"
        with open_target(args.backend, model, **options) as target:
            result = run_benchmark(target, requests, RunConfig(label, args.max_concurrency,
                                                               progress=not args.no_progress, slo=_slo(args)))
            _write_trace(args, target, label)
    return _finish(args, result)


def cmd_compare(args) -> int:
    from bench.compare import config_from_args, run_compare

    results = run_compare(config_from_args(args))
    for name, t in results["targets"].items():
        print(f"{name}: {t['value']:.2f} (target {t['target']}) {'met' if t['met'] else 'MISSED'}")
    print(f"results: {Path(args.out) / 'compare.json'}")
    return 0


def cmd_plan(args) -> int:
    from bench.plan_cli import run_plan

    return run_plan(args)


def cmd_roofline(args) -> int:
    from bench.roofline import run_roofline

    with _model_dir(args) as model:
        return run_roofline(model, args.tiny or args.model or "demo model", args)


def cmd_structured(args) -> int:
    from bench.structured import format_rows, run_structured

    with _model_dir(args) as model:
        rows = run_structured(model, args.num_prompts, args.max_tokens)
    print(format_rows(rows))
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=2))
    return 0


def cmd_prefix(args) -> int:
    from bench.prefix import format_rows, run_prefix, run_prefix_cluster

    with _model_dir(args) as model:
        if args.fetch:
            from bench.fetch import format_rows as format_fetch, run_fetch

            rows = run_fetch(model, seed=args.seed)
            print(format_fetch(rows))
            if args.out:
                Path(args.out).write_text(json.dumps(rows, indent=2))
            return 0
        if args.tiers:
            from bench.tiers import format_rows as format_tiers, run_tiers

            rows = run_tiers(model, args.sessions, args.turns, args.message_len, args.answer_len,
                             disk_dir=args.disk_cache_dir, seed=args.seed)
            print(format_tiers(rows))
            if args.out:
                Path(args.out).write_text(json.dumps(rows, indent=2))
            return 0
        if args.cluster:
            rows = run_prefix_cluster(model, args.sessions, args.turns, args.message_len, args.answer_len,
                                      args.local_prefill_tokens, args.seed)
        else:
            rows = run_prefix(model, args.sessions, args.turns, args.system_len, args.message_len,
                              args.answer_len, args.waves, args.no_reuse_len, args.seed)
    print(format_rows(rows))
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=2))
    return 0


def cmd_spec(args) -> int:
    from bench.spec import draft_prefill_cost, format_rows, mtp_handoff_bytes, run_spec

    batches = tuple(int(b) for b in args.batches.split(","))
    with _model_dir(args) as model:
        if args.mtp_handoff:
            print(json.dumps(mtp_handoff_bytes(model), indent=2))
            return 0
        if args.draft_cost:
            cost = draft_prefill_cost(model, args.draft_cost, args.prompt_len, args.num_speculative_tokens, args.seed)
            print(json.dumps(cost, indent=2))
            return 0
        rows = run_spec(model, batches, args.max_tokens, args.num_speculative_tokens, args.rounds, args.seed)
    print(format_rows(rows))
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=2))
    return 0


def cmd_quant(args) -> int:
    from bench.quant import OPTIONS, format_rows, run_quant

    options = [o for o in args.options.split(",") if o]
    unknown = [o for o in options if o not in OPTIONS]
    if unknown:
        raise SystemExit(f"--options: unknown {unknown} (known: {', '.join(OPTIONS)})")
    with _model_dir(args) as model:
        rows = run_quant(model, options, args.steps, args.num_prompts, tuple(int(n) for n in args.seq_lens.split(",")),
                         args.budget_mib, args.ppl_tokens, args.batch, args.rounds, args.seed)
    print(format_rows(rows))
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=2))
    return 0


def cmd_elastic(args) -> int:
    from bench.elastic import format_report, plot_worker_counts, run_elastic
    from bench.metrics import dump_json

    profile = None
    if args.profile:
        from router.capacity import CapacityModel

        profile = CapacityModel.from_file(args.profile).profile
    with _model_dir(args) as model:
        report = run_elastic(model, args.num_prompts, args.input_len, args.output_len, args.rate, _slo(args),
                             args.attainment, args.max_workers, (args.max_prefill, args.max_decode),
                             args.threads_per_worker, args.startup_s, args.interval_s, args.cluster, profile,
                             args.seed)
    print(format_report(report))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        print("plot:", plot_worker_counts(report, out / "elastic_workers.png"))
        dump_json(report, out / "elastic.json")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="splitserve bench", description="serving benchmarks")
    sub = parser.add_subparsers(dest="what", required=True)

    serve = sub.add_parser("serve", help="online: against a running `splitserve serve` (gRPC)")
    serve.add_argument("--server", default="127.0.0.1:50051")
    serve.add_argument("--auth-token", default=None)
    _workload_args(serve)
    serve.set_defaults(func=cmd_serve)

    offline = sub.add_parser("offline", help="in-process: the colocated engine or a launched cluster")
    _model_args(offline)
    offline.add_argument("--backend", choices=["llm", "cluster"], default="llm")
    offline.add_argument("--prefill", type=int, default=1)
    offline.add_argument("--decode", type=int, default=1)
    offline.add_argument("--cpus-per-worker", type=float, default=1.0)
    offline.add_argument("--local-prefill-tokens", type=int, default=0,
                         help="cluster: prompts this short skip the split (conditional disaggregation)")
    offline.add_argument("--max-num-batched-tokens", type=int, default=2048)
    _workload_args(offline)
    offline.set_defaults(func=cmd_offline)

    from bench.compare import add_arguments

    compare = sub.add_parser("compare", help="HF vs colocated vs disaggregated, one run, plots")
    add_arguments(compare)
    compare.set_defaults(func=cmd_compare)

    from bench.plan_cli import add_plan_arguments

    plan = sub.add_parser("plan", help="profile a worker, simulate P:D splits, recommend one")
    _model_args(plan)
    add_plan_arguments(plan)
    plan.set_defaults(func=cmd_plan)

    from bench.roofline import add_roofline_arguments

    roofline = sub.add_parser("roofline", help="model FLOP utilisation vs this box's own GEMM peak")
    _model_args(roofline)
    add_roofline_arguments(roofline)
    roofline.set_defaults(func=cmd_roofline)

    structured = sub.add_parser("structured", help="throughput cost of a JSON schema vs free sampling")
    _model_args(structured)
    structured.add_argument("--num-prompts", type=int, default=16)
    structured.add_argument("--max-tokens", type=int, default=96)
    structured.add_argument("--out", default=None, help="write the JSON rows here")
    structured.set_defaults(func=cmd_structured)

    from bench.prefix import add_prefix_arguments

    prefix = sub.add_parser("prefix", help="prefix caching on vs off: multi-turn, shared system prompt, no reuse")
    _model_args(prefix)
    add_prefix_arguments(prefix)
    prefix.set_defaults(func=cmd_prefix)

    from bench.spec import add_spec_arguments

    spec = sub.add_parser("spec", help="speculative decoding (n-gram, always and adaptive) vs plain decoding")
    _model_args(spec)
    add_spec_arguments(spec)
    spec.set_defaults(func=cmd_spec)

    from bench.quant import add_quant_arguments

    quant = sub.add_parser("quant", help="cache formats (half-width recurrent state) vs float32: bytes, "
                                         "sequences that fit, drift, perplexity, decode speed")
    _model_args(quant)
    add_quant_arguments(quant)
    quant.set_defaults(func=cmd_quant)

    elastic = sub.add_parser("elastic", help="autoscaler vs the best fixed split when decode-heavy traffic "
                                             "turns prefill-heavy half-way")
    _model_args(elastic)
    elastic.add_argument("--num-prompts", type=int, default=200, help="requests in each half")
    elastic.add_argument("--input-len", type=int, default=1024, help="prefill-heavy prompts; decode-heavy get 1/8")
    elastic.add_argument("--output-len", type=int, default=256, help="decode-heavy answers; prefill-heavy get 1/8")
    elastic.add_argument("--rate", type=float, default=2.0, help="request rate (req/s), both halves")
    elastic.add_argument("--slo-ttft-ms", type=float, default=1000.0)
    elastic.add_argument("--slo-tpot-ms", type=float, default=100.0)
    elastic.add_argument("--slo-e2el-ms", type=float, default=None)
    elastic.add_argument("--attainment", type=float, default=0.9, help="target the fixed split is planned for")
    elastic.add_argument("--max-workers", type=int, default=4, help="P + D budget of the fixed split")
    elastic.add_argument("--max-prefill", type=int, default=4, help="autoscaler bound")
    elastic.add_argument("--max-decode", type=int, default=4, help="autoscaler bound")
    elastic.add_argument("--threads-per-worker", type=int, default=1)
    elastic.add_argument("--startup-s", type=float, default=5.0, help="simulated: seconds a new worker takes to start")
    elastic.add_argument("--interval-s", type=float, default=2.0, help="autoscaler reading interval")
    elastic.add_argument("--profile", default=None, help="a `bench plan --out` report: skip profiling")
    elastic.add_argument("--cluster", action="store_true", help="real local Ray clusters instead of the simulation")
    elastic.add_argument("--seed", type=int, default=0)
    elastic.add_argument("--out", default=None, help="directory for elastic.json and elastic_workers.png")
    elastic.set_defaults(func=cmd_elastic)
    return parser


def main(argv: list[str] | None = None) -> int:
    # OMP_WAIT_POLICY is left to the caller: PASSIVE saved an oversubscribed box from spinning
    # threads (4x) but doubled every wall time on a quiet one (docs/benchmarks.md).
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as e:
        print(f"splitserve bench: error: {e}", file=sys.stderr)
        return 2
