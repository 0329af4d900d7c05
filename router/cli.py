"""splitserve: disaggregated prefill/decode serving of hybrid (attention + recurrent) models.

Start with `splitserve serve` (a local Ray, one prefill and one decode worker, gRPC on 50051 and
OpenAI HTTP on 8000), then `splitserve generate "def main():"` or any OpenAI client. Each
command has its own --help; docs/api.md and docs/deploy.md have the rest.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from router.frontdoor import FrontDoorConfig


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions as written, and every option's default after its help (unless it says it)."""

    def _get_help_string(self, action):
        text = action.help or ""
        default = action.default
        if "default" in text or default is None or default is False or default == argparse.SUPPRESS or \
                not action.option_strings or default == []:
            return text
        return f"{text} (default: %(default)s)" if text else "(default: %(default)s)"


def _cmd_run(args) -> int:
    """Generate in-process with engine.LLM (no cluster): the quickest way to see the model work."""
    from engine import LLM, SamplingParams

    llm = LLM(args.model, **({"revision": args.revision} if args.revision else {}))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, seed=args.seed)
    for prompt in [" ".join(args.prompt)]:  # the words of one prompt, quoted or not
        if args.stream:
            engine = llm.engine
            engine.add_request(prompt, params)
            sys.stdout.write(prompt)
            while engine.has_unfinished():
                for out in engine.step():
                    sys.stdout.write(out.new_text)
                    sys.stdout.flush()
            sys.stdout.write("\n")
        else:
            out = llm.generate([prompt], params)[0]
            print(prompt + out.text)
            print(f"[{len(out.token_ids)} tokens, finish_reason={out.finish_reason}]", file=sys.stderr)
    return 0


def _cmd_serve(args) -> int:
    """Start (or join) a Ray cluster, place the workers, serve gRPC and HTTP until Ctrl-C."""
    import logging
    import signal
    import threading

    from router.cluster import launch
    from router.frontdoor import start_frontdoor

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log = logging.getLogger("splitserve")
    launch_options, door_config = serve_options(args)
    cluster = launch(args.model, **launch_options)
    door = None
    try:
        door = start_frontdoor(cluster, door_config)
        scheme = "https" if args.tls_cert else "http"
        log.info("serving %s with %d prefill + %d decode workers over %s", cluster.info.model_path,
                 args.prefill, args.decode, cluster.workers.transport)
        log.info("gRPC on %s:%s, OpenAI HTTP on %s://%s:%s/v1", args.host, door.grpc_port, scheme,
                 args.host, door.http_port)
        def stop(signum, _frame):
            log.info("%s: stopping", signal.Signals(signum).name)
            threading.Thread(target=door.stop, daemon=True).start()

        # Installed explicitly: a process started with SIGINT ignored (a background job of a
        # non-interactive shell) would otherwise never see Ctrl-C.
        signal.signal(signal.SIGINT, stop)
        signal.signal(signal.SIGTERM, stop)
        door.wait()
    except KeyboardInterrupt:
        log.info("stopping")
    finally:
        if door is not None:
            door.stop()
        cluster.shutdown()
    return 0


def serve_options(args) -> tuple[dict, FrontDoorConfig]:
    """`serve` options -> (keyword arguments of router.cluster.launch besides the model, the
    front door's config). The Ray Serve application (router/serve_app.py) takes the same."""
    from router.frontdoor import FrontDoorConfig

    door_config = FrontDoorConfig(grpc_port=args.grpc_port, http_port=args.http_port, host=args.host,
                                  auth_token=args.auth_token, tls_cert=args.tls_cert,
                                  tls_key=args.tls_key, max_queued=args.max_queued,
                                  metrics_compat=args.metrics_compat)
    engine_options = {k: v for k, v in (("block_size", args.block_size), ("max_num_seqs", args.max_num_seqs),
                                        ("num_kv_blocks", args.num_kv_blocks),
                                        ("max_model_len", args.max_model_len),
                                        ("revision", args.revision),
                                        ("dtype", args.dtype),
                                        ("mamba_state_dtype", args.mamba_state_dtype),
                                        ("kv_cache_dtype", args.kv_cache_dtype),
                                        ("gpu_memory_utilization", args.gpu_memory_utilization),
                                        ("prefix_checkpoints", args.prefix_checkpoints),
                                        ("host_cache_bytes", args.host_cache_bytes),
                                        ("disk_cache_dir", args.disk_cache_dir),
                                        ("disk_cache_bytes", args.disk_cache_bytes)) if v is not None}
    if args.enable_prefix_caching:
        engine_options["enable_prefix_caching"] = True
    if args.speculative_config is not None:
        engine_options["speculative_config"] = args.speculative_config
    launch_options = dict(prefill=args.prefill, decode=args.decode, prefill_tp=args.prefill_tp,
                          decode_tp=args.decode_tp, transport=args.transport,
                          address=args.address, local_prefill_tokens=args.local_prefill_tokens,
                          prefix_fetch_tokens=args.prefix_fetch_tokens, prefix_fetch_gbps=args.prefix_fetch_gbps,
                          prefix_fetch_overhead_ms=args.prefix_fetch_overhead_ms,
                          max_queued=args.max_queued, cpus_per_worker=args.cpus_per_worker,
                          gpus_per_worker=args.gpus_per_worker,
                          prefill_resource=None if args.prefill_resource == "none" else args.prefill_resource,
                          decode_resource=None if args.decode_resource == "none" else args.decode_resource,
                          pack_pairs=args.pack_pairs, max_retries=args.max_retries,
                          transfer_timeout_s=args.transfer_timeout, prefill_block_size=args.prefill_block_size,
                          decode_block_size=args.decode_block_size, **engine_options)
    if args.autoscale:
        from router.autoscaler import AutoscaleConfig
        from router.capacity import CapacityModel

        capacity = CapacityModel.from_file(args.autoscale_profile) if args.autoscale_profile else None
        launch_options["autoscale"] = AutoscaleConfig.parse(args.autoscale, slo_ttft_s=args.slo_ttft_ms / 1000,
                                                            slo_tpot_s=args.slo_tpot_ms / 1000, capacity=capacity)
    return launch_options, door_config


BENCHMARKS = {
    "serve": "online: a workload against a running `splitserve serve`",
    "offline": "in-process: the colocated engine or a launched cluster",
    "compare": "transformers vs engine.LLM vs disaggregated splits, side by side, with plots",
    "plan": "DistServe-style P:D planner, optionally checked against a real cluster",
    "transfer": "the KV/state hand-off alone against memcpy",
    "roofline": "model FLOP utilisation against this machine's GEMM rate, next to transformers",
    "structured": "throughput of JSON-schema-constrained vs free sampling, side by side",
    "prefix": "prefix caching on vs off: multi-turn chat, shared system prompt, no reuse",
    "spec": "speculative decoding (n-gram) vs plain decoding: decode tokens/s, TPOT, acceptance",
    "elastic": "autoscaler vs the best fixed P:D split on traffic that shifts from decode- to prefill-heavy",
    "quant": "cache formats (half-width recurrent state) vs float32: bytes, sequences that fit, drift, speed",
}


def _cmd_bench(args, rest: list[str]) -> int:
    if args.what is None:
        asked = bool({"-h", "--help"} & set(rest))
        lines = ["usage: splitserve bench WHAT [options]   (`splitserve bench WHAT --help` for each)", ""]
        lines += [f"  {what:<9} {doc}" for what, doc in BENCHMARKS.items()]
        print("\n".join(lines), file=sys.stdout if asked else sys.stderr)
        return 0 if asked else 2
    if args.what == "transfer":
        from bench.transfer import main as bench_transfer

        return bench_transfer(rest)
    from bench.cli import main as bench_main

    return bench_main([args.what, *rest])


def json_object(text: str) -> dict:
    """An argparse type: a JSON object (argparse turns the ValueError into a usage error)."""
    import json

    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {type(value).__name__}")
    return value


def add_serve_arguments(serve: argparse.ArgumentParser) -> None:
    """The options of `splitserve serve`, shared with the Ray Serve application builder."""
    serve.add_argument("--model", default=None, help="HF-format folder or Hugging Face Hub id (default: the bundled demo model)")
    serve.add_argument("--revision", default=None, help="Hub id only: branch, tag or commit (default: main)")
    serve.add_argument("--prefill", type=int, default=1, help="prefill workers")
    serve.add_argument("--decode", type=int, default=1, help="decode workers")
    serve.add_argument("--prefill-tp", type=int, default=1,
                       help="tensor-parallel ranks per prefill worker (CPU ranks; docs/tensor-parallel.md)")
    serve.add_argument("--decode-tp", type=int, default=1, help="tensor-parallel ranks per decode worker")
    serve.add_argument("--transport", default="auto", choices=["auto", "shm", "gloo", "nccl"],
                       help="hand-off transport (auto: nccl when each worker holds whole GPUs, else shm on one node, "
                            "gloo across nodes; shm and gloo stage GPU caches through host memory)")
    serve.add_argument("--address", default=None, help="join a running Ray cluster ('auto' or host:port)")
    serve.add_argument("--grpc-port", type=int, default=50051, help="gRPC port (splitserve.v1.SplitServe, health, reflection)")
    serve.add_argument(
        "--http-port",
        type=int,
        default=8000,
        help="OpenAI-compatible HTTP port (/v1/completions, /v1/chat/completions, /metrics)",
    )
    serve.add_argument("--host", default="127.0.0.1", help="bind address; 0.0.0.0 listens on all interfaces")
    serve.add_argument("--auth-token", default=None, help="require this bearer token (or $SPLITSERVE_AUTH_TOKEN)")
    serve.add_argument("--tls-cert", default=None, help="PEM certificate: serve gRPC and HTTP over TLS (with --tls-key)")
    serve.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    serve.add_argument("--max-queued", type=int, default=256, help="requests in flight before 429 / RESOURCE_EXHAUSTED")
    serve.add_argument("--metrics-compat", default="none", choices=["none", "vllm"],
                       help="vllm: /metrics also serves vLLM's metric names (vllm:num_requests_running, "
                            "vllm:time_to_first_token_seconds, ...) for dashboards and benchmark clients")
    serve.add_argument("--local-prefill-tokens", type=int, default=0,
                       help="prompts with at most this many tokens not cached prefill on the decode "
                            "worker (conditional disaggregation)")
    serve.add_argument("--prefix-fetch-tokens", type=int, default=256,
                       help="with prefix caching and a host tier: a prefill worker fetches a cached prefix "
                            "another worker holds when it covers at least this many more prompt tokens "
                            "than its own (0: never; docs/prefix-caching.md)")
    serve.add_argument("--prefix-fetch-gbps", type=float, default=10.0,
                       help="the link a fetched prefix crosses, in Gb/s: a fetch goes ahead only where the "
                            "entry's bytes over it, plus --prefix-fetch-overhead-ms, take less time than the "
                            "prefill worker recomputing those tokens at its measured rate")
    serve.add_argument("--prefix-fetch-overhead-ms", type=float, default=3.0,
                       help="the fixed cost of one prefix fetch (export, serialization, import)")
    serve.add_argument("--enable-prefix-caching", action="store_true",
                       help="reuse the KV blocks and recurrent state of repeated prefixes; the router "
                            "sends each request where its prefix likely is (docs/prefix-caching.md)")
    serve.add_argument("--speculative-config", type=json_object, default=None,
                       help='speculative decoding on the decode workers, as vLLM takes it: JSON such as '
                            '\'{"method": "ngram", "num_speculative_tokens": 4}\' (docs/speculative.md)')
    serve.add_argument("--prefix-checkpoints", type=int, default=None,
                       help="recurrent-state checkpoint rows per worker (default: --max-num-seqs)")
    serve.add_argument("--host-cache-bytes", type=int, default=None,
                       help="with --enable-prefix-caching: host memory per worker for the prefixes its pool "
                            "evicts (KV and state checkpoint together), taken when the worker starts and "
                            "page-locked on a GPU (docs/prefix-caching.md)")
    serve.add_argument("--disk-cache-dir", default=None,
                       help="with --enable-prefix-caching: a directory for the prefixes the host tier (or the "
                            "pool) evicts; kept across restarts")
    serve.add_argument("--disk-cache-bytes", type=int, default=None,
                       help="the disk tier's budget per worker (with --disk-cache-dir)")
    serve.add_argument("--cpus-per-worker", type=float, default=1.0,
                       help="CPUs Ray reserves for each worker (each TP rank); lower it to fit more workers on a node")
    serve.add_argument("--gpus-per-worker", type=float, default=0.0,
                       help="GPUs per worker (each TP rank); 0: CPU workers; whole numbers let --transport auto pick nccl")
    serve.add_argument("--prefill-resource", default="auto",
                       help="custom Ray resource pinning prefill workers (auto: splitserve_prefill if "
                            "some node offers it; none: no pinning)")
    serve.add_argument("--decode-resource", default="auto",
                       help="custom Ray resource pinning decode workers (auto: splitserve_decode if "
                            "some node offers it; none: no pinning)")
    serve.add_argument("--pack-pairs", action="store_true", help="put prefill i and decode i on one node")
    serve.add_argument("--max-retries", type=int, default=3,
                       help="times a request runs again after its worker died or its hand-off broke")
    serve.add_argument("--transfer-timeout", type=float, default=30.0,
                       help="seconds from reservation until an unfinished hand-off is failed (and retried)")
    serve.add_argument("--autoscale", default=None, metavar="prefill=MIN:MAX,decode=MIN:MAX",
                       help="change the pool sizes from live load and the SLOs below (router/autoscaler.py)")
    serve.add_argument("--slo-ttft-ms", type=float, default=1000.0, help="--autoscale: time-to-first-token SLO")
    serve.add_argument("--slo-tpot-ms", type=float, default=100.0, help="--autoscale: time-per-output-token SLO")
    serve.add_argument("--autoscale-profile", default=None, metavar="JSON",
                       help="--autoscale: size steps with this worker profile (`splitserve bench plan --out`)")
    serve.add_argument("--block-size", type=int, default=None, help="tokens per KV block (default: the engine's, 16)")
    serve.add_argument("--prefill-block-size", type=int, default=None,
                       help="prefill workers' block size, when it differs from --block-size (hand-offs re-block)")
    serve.add_argument("--decode-block-size", type=int, default=None,
                       help="decode workers' block size, when it differs from --block-size")
    serve.add_argument("--max-num-seqs", type=int, default=None,
                       help="sequences a worker runs at once = its recurrent-state slots (default: 64)")
    serve.add_argument("--num-kv-blocks", type=int, default=None,
                       help="KV blocks per worker, overriding the count from the cache size (default: from it)")
    serve.add_argument("--max-model-len", type=int, default=None,
                       help="longest prompt + output (default: the model's, at most 8192)")
    serve.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"],
                       help="weights, activations and KV cache (auto: bfloat16 on GPU workers, float32 on CPU "
                            "ones); recurrent state: --mamba-state-dtype")
    serve.add_argument("--mamba-state-dtype", default=None, choices=["float32", "bfloat16", "float16"],
                       help="what the cache stores recurrent state in (default float32); half width halves its "
                            "bytes per sequence, rounded stochastically on each write, computed in float32 "
                            "(engine/state_format.py; costs measured by `splitserve bench quant`)")
    serve.add_argument("--kv-cache-dtype", default=None, choices=["auto", "fp8_e4m3", "fp8_e5m2"],
                       help="what the cache stores attention K/V in (default auto: --dtype); FP8 keeps a quarter of "
                            "float32's bytes, scaled per layer by the checkpoint's k_scale/v_scale or 1.0 "
                            "(engine/kv_format.py)")
    serve.add_argument("--gpu-memory-utilization", type=float, default=None, metavar="FRACTION",
                       help="GPU workers: size the cache from this share of each GPU's memory, after the "
                            "weights and the largest step (default: a fixed 1 GiB cache)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="splitserve", description=__doc__, formatter_class=HelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    subparser = sub.add_parser

    def add_parser(name, **kw):  # every command's help shows its options' defaults
        kw.setdefault("formatter_class", HelpFormatter)
        kw.setdefault("description", kw.get("help"))
        return subparser(name, **kw)

    sub.add_parser = add_parser
    run = sub.add_parser("run", help="generate in-process from a model folder (default: bundled demo), no "
                                     "server: the quickest way to see the model work")
    run.add_argument("prompt", nargs="+", help="the prompt (several words form one prompt)")
    run.add_argument("--model", default=None,
                     help="HF-format folder or Hugging Face Hub id (default: the bundled demo model)")
    run.add_argument("--revision", default=None, help="Hub id only: branch, tag or commit (default: main)")
    run.add_argument("--max-tokens", type=int, default=64, help="tokens to generate at most")
    run.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    run.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: the smallest set of tokens with this much probability")
    run.add_argument("--seed", type=int, default=None, help="same seed, same tokens, whatever the batch (default: random)")
    run.add_argument("--stream", action="store_true", help="print the text as it is generated")
    run.set_defaults(func=_cmd_run)

    serve = sub.add_parser("serve", help="serve a model on a local or existing Ray cluster (gRPC and OpenAI "
                                         "HTTP) until Ctrl-C")
    add_serve_arguments(serve)
    serve.set_defaults(func=_cmd_serve)

    try:  # client subcommands (generate, status) live with the gRPC client
        from router.client_cli import add_client_commands
    except ImportError:
        pass
    else:
        add_client_commands(sub)

    bench = sub.add_parser("bench", help=f"benchmarks: {', '.join(BENCHMARKS)} (`splitserve bench` lists "
                                         "them, `splitserve bench WHAT --help` explains one)", add_help=False)
    bench.add_argument("what", nargs="?", choices=list(BENCHMARKS))
    bench.set_defaults(func=_cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if args.command == "bench":
        return args.func(args, rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"splitserve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
