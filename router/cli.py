"""The `splitserve` command."""

from __future__ import annotations

import argparse
import sys


def _cmd_run(args) -> int:
    """Generate in-process with engine.LLM (no cluster): the quickest way to see the model work."""
    from engine import LLM, SamplingParams

    llm = LLM(args.model)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, seed=args.seed)
    for prompt in args.prompt:
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


def _cmd_bench(args, rest: list[str]) -> int:
    if args.what == "transfer":
        from kvtransfer.bench import main as bench_transfer

        return bench_transfer(rest)
    print(f"unknown benchmark {args.what!r}", file=sys.stderr)
    return 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="splitserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="generate in-process from a model folder (default: bundled demo)")
    run.add_argument("prompt", nargs="+")
    run.add_argument("--model", default=None, help="HF-format folder (default: the bundled demo model)")
    run.add_argument("--max-tokens", type=int, default=64)
    run.add_argument("--temperature", type=float, default=0.0)
    run.add_argument("--top-p", type=float, default=1.0)
    run.add_argument("--seed", type=int, default=None)
    run.add_argument("--stream", action="store_true")
    run.set_defaults(func=_cmd_run)

    try:  # client subcommands (generate, status) live with the gRPC client
        from router.client_cli import add_client_commands
    except ImportError:
        pass
    else:
        add_client_commands(sub)

    bench = sub.add_parser("bench", help="benchmarks (`bench transfer --help`)")
    bench.add_argument("what", choices=["transfer"])
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
