"""`splitserve generate`, `status`, `scale` and `restart-workers`: the gRPC client from the command line."""

from __future__ import annotations

import sys

from router.client import DEFAULT_SERVER


def _connection_args(parser) -> None:
    parser.add_argument("--server", default=DEFAULT_SERVER, help=f"host:port (default {DEFAULT_SERVER})")
    parser.add_argument("--auth-token", default=None,
                        help="bearer token (default: $SPLITSERVE_AUTH_TOKEN)")
    parser.add_argument("--tls-ca", default=None, help="PEM file of the CA (or self-signed cert) to "
                        "trust; turns TLS on")
    parser.add_argument("--timeout", type=float, default=None, help="deadline in seconds")


def _client(args):
    from router.client import SplitServeClient

    return SplitServeClient(args.server, auth_token=args.auth_token, tls_ca=args.tls_ca,
                            timeout=args.timeout)


def _rpc_error(e) -> int:
    print(f"splitserve: error: {e.code().name}: {e.details()}", file=sys.stderr)
    return 1


def _parse_prompt(args) -> str | list[int]:
    if not args.token_ids:
        return args.prompt
    try:
        return [int(t) for t in args.prompt.replace(",", " ").split()]
    except ValueError:
        raise ValueError(f"--token-ids: {args.prompt!r} is not a list of integers") from None


def _sampling(args) -> dict:
    names = ("max_tokens", "temperature", "top_p", "top_k", "seed")
    sampling = {n: getattr(args, n) for n in names if getattr(args, n) is not None}
    if args.ignore_eos:
        sampling["ignore_eos"] = True
    if args.stop:
        sampling["stop"] = args.stop
    return sampling


def cmd_generate(args) -> int:
    import grpc

    from router.client import CompletionBuilder

    prompt = _parse_prompt(args)
    try:
        with _client(args) as client:
            builder = CompletionBuilder()
            for response in client.stream(prompt, **_sampling(args)):
                builder.add(response)
                if args.stream and response.text:
                    sys.stdout.write(response.text)
                    sys.stdout.flush()
    except grpc.RpcError as e:
        return _rpc_error(e)
    done = builder.build()
    if args.stream and done.text:
        sys.stdout.write("\n")
    else:  # a model without tokenizer.json answers in token ids only
        print(done.text if done.text else " ".join(map(str, done.token_ids)))
    t = done.timings
    print(f"[{done.usage.completion_tokens} tokens, finish_reason={done.finish_reason}, "
          f"ttft={t.time_to_first_token_s * 1000:.1f} ms, tpot={t.time_per_output_token_s * 1000:.1f} ms, "
          f"e2e={t.e2e_s * 1000:.1f} ms]", file=sys.stderr)
    return 0


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows)


def _used(total: int, free: int) -> str:
    if not total:
        return "-"
    used = total - free
    return f"{used}/{total} ({100 * used / total:.0f}%)"


def _acceptance(accepted: int, drafted: int) -> str:
    """Speculative decoding's acceptance: draft tokens kept of those verified."""
    return f"{accepted}/{drafted} ({100 * accepted / drafted:.0f}%)" if drafted else "-"


def _tiers(w) -> str:
    """The prefix cache's lower tiers: "host 1.2 (4) disk 30.5 (9)", MB held and entries loaded back."""
    parts = [f"{tier} {getattr(w, f'tier_{tier}_bytes') / 1e6:.1f} ({getattr(w, f'tier_{tier}_hits')})"
             for tier in ("host", "disk") if getattr(w, f"tier_{tier}_bytes") or getattr(w, f"tier_{tier}_hits")]
    return " ".join(parts) or "-"


def format_status(status) -> str:
    m = status.model
    lines = [f"model {m.model_name} ({m.model_type}, max_model_len {m.max_model_len})   "
             f"ready: {'yes' if status.ready else 'NO'}   "
             f"in flight: {status.requests_in_flight}/{status.max_queued}", ""]
    rows = [["WORKER", "KIND", "NODE", "ALIVE", "KV BLOCKS USED", "STATE SLOTS USED", "WAITING",
             "RUNNING", "PREEMPTED", "HANDOFFS (fail)", "HANDOFF MB", "SPEC ACCEPTED", "TIERS MB (hits)"]]
    nodes: dict[str, list] = {}
    for w in status.workers:
        rows.append([w.id, w.kind, w.node, "yes" if w.alive else "NO",
                     _used(w.kv_blocks_total, w.kv_blocks_free),
                     _used(w.state_slots_total, w.state_slots_free), str(w.waiting), str(w.running),
                     str(w.preemptions), f"{w.handoff_count} ({w.handoff_failures})" if w.handoff_count
                     or w.handoff_failures else "-",
                     f"{w.handoff_bytes / 1e6:.1f}" if w.handoff_bytes else "-",
                     _acceptance(w.spec_accepted_tokens, w.spec_draft_tokens), _tiers(w)])
        nodes.setdefault(w.node, []).append(w)
    lines.append(_table(rows) if status.workers else "no workers")
    if nodes:
        lines += ["", _table([["NODE", "WORKERS", "ALIVE", "WAITING", "RUNNING"]] + [
            [node, str(len(ws)), str(sum(w.alive for w in ws)), str(sum(w.waiting for w in ws)),
             str(sum(w.running for w in ws))] for node, ws in sorted(nodes.items())])]
    return "\n".join(lines)


def cmd_status(args) -> int:
    import grpc

    try:
        with _client(args) as client:
            status = client.status()
    except grpc.RpcError as e:
        return _rpc_error(e)
    print(format_status(status))
    return 0


def cmd_scale(args) -> int:
    import grpc

    try:
        with _client(args) as client:
            if args.command == "restart-workers":
                counts = client.restart_workers(args.drain_timeout)
            else:
                counts = client.scale(args.prefill, args.decode, args.drain_timeout)
    except grpc.RpcError as e:
        return _rpc_error(e)
    print(f"prefill workers: {counts.prefill}, decode workers: {counts.decode}")
    return 0


def add_client_commands(subparsers) -> None:
    gen = subparsers.add_parser("generate", help="generate through a running server (gRPC)")
    gen.add_argument("prompt", help="the prompt text (or token ids with --token-ids)")
    gen.add_argument("--token-ids", action="store_true", help="the prompt is token ids: '5,6,7'")
    gen.add_argument("--max-tokens", type=int, default=64, help="tokens to generate at most")
    gen.add_argument("--temperature", type=float, default=0.0, help="0: greedy, as `run`")
    gen.add_argument("--top-p", type=float, default=None, help="nucleus sampling (default: the server's, 1.0)")
    gen.add_argument("--top-k", type=int, default=None, help="sample among the k most likely (default: off)")
    gen.add_argument("--seed", type=int, default=None, help="same seed, same tokens (default: random)")
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence tokens")
    gen.add_argument("--stream", action="store_true", help="print text as it arrives")
    _connection_args(gen)
    gen.set_defaults(func=cmd_generate)

    status = subparsers.add_parser("status", help="workers, nodes, cache usage, queue depths (gRPC)")
    _connection_args(status)
    status.set_defaults(func=cmd_status)

    scale = subparsers.add_parser("scale", help="grow or shrink the worker pools of a running server (gRPC)")
    scale.add_argument("--prefill", type=int, default=None, help="prefill workers wanted (default: unchanged)")
    scale.add_argument("--decode", type=int, default=None, help="decode workers wanted (default: unchanged)")
    restart = subparsers.add_parser("restart-workers", help="replace every worker, one at a time (gRPC)")
    for parser in (scale, restart):
        parser.add_argument("--drain-timeout", type=float, default=None,
                            help="seconds a removed worker may finish its streams before they are handed over (default 30)")
        _connection_args(parser)
        parser.set_defaults(func=cmd_scale)
