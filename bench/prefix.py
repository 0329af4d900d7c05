"""`splitserve bench prefix`: prefix caching on vs off, side by side in one run.

Three workloads on the colocated engine, each run on two engines that differ only in
`enable_prefix_caching`, alternating so that a shared box's noise falls on both:
- multi-turn chat: every session's next prompt is its history (prompts and answers so far)
  plus a new message; all sessions' turn t run together;
- shared system prompt: waves of requests that start with the same system prompt;
- no reuse: distinct random prompts (what caching costs when it cannot help).
Reported: TTFT p50, prompt tokens actually computed (prompt minus cached), output tokens/s.
Greedy decoding, so both engines must produce the same tokens; the run checks that too.

`--cluster` runs the multi-turn chat on three 1P+1D clusters instead: cache off; cache on with
every turn prefilled on the prefill worker (which holds a checkpoint at the end of the
previous turn's prompt, not of its answer); cache on with turns whose uncached part is at most
`--local-prefill-tokens` prefilled on the decode worker that answered the previous turn.
"""

from __future__ import annotations

import random
import statistics
import time


def _engines(model: str, options: dict):
    from engine import LLM

    return {"off": LLM(model, **options), "on": LLM(model, enable_prefix_caching=True, **options)}


def _run(llm, prompts, params) -> dict:
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    return {"outs": outs, "seconds": seconds,
            "ttft": [o.first_token_time - o.arrival_time for o in outs],
            "computed": sum(len(p) - o.num_cached_tokens for p, o in zip(prompts, outs)),
            "output_tokens": sum(len(o.token_ids) for o in outs)}


def _row(workload: str, cache: str, runs: list[dict]) -> dict:
    ttft = [t for r in runs for t in r["ttft"]]
    seconds = sum(r["seconds"] for r in runs)
    return {"workload": workload, "cache": cache, "requests": len(ttft),
            "ttft_p50_ms": 1000 * statistics.median(ttft), "prompt_tokens_computed": sum(r["computed"] for r in runs),
            "seconds": seconds, "output_tokens_per_s": sum(r["output_tokens"] for r in runs) / seconds}


def _same(a: dict, b: dict, workload: str) -> None:
    if [o.token_ids for o in a["outs"]] != [o.token_ids for o in b["outs"]]:
        raise AssertionError(f"{workload}: outputs differ with the cache on")  # never expected: greedy


def run_prefix(model: str, sessions: int = 8, turns: int = 4, system_len: int = 512, message_len: int = 64,
               answer_len: int = 32, waves: int = 4, no_reuse_len: int = 512, seed: int = 0,
               engine_options: dict | None = None) -> list[dict]:
    from engine import SamplingParams

    llms = _engines(model, dict(engine_options or {}))
    vocab = llms["on"].engine.spec.vocab_size
    rng = random.Random(seed)
    words = lambda n: [rng.randrange(3, vocab) for _ in range(n)]  # noqa: E731
    params = SamplingParams(max_tokens=answer_len, temperature=0.0, ignore_eos=True)
    for llm in llms.values():  # warm-up: first-call costs land on neither side
        llm.generate([words(16)], SamplingParams(max_tokens=2))
    rows = []

    histories = [words(message_len) for _ in range(sessions)]
    runs = {"off": [], "on": []}
    for turn in range(turns):
        prompts = [list(h) for h in histories]
        order = ("off", "on") if turn % 2 == 0 else ("on", "off")
        done = {cache: _run(llms[cache], prompts, params) for cache in order}
        _same(done["off"], done["on"], "multi-turn")
        for cache in order:
            runs[cache].append(done[cache])
        histories = [p + o.token_ids + words(message_len) for p, o in zip(prompts, done["on"]["outs"])]
    rows += [_row("multi-turn", cache, runs[cache]) for cache in ("off", "on")]

    system = words(system_len)
    runs = {"off": [], "on": []}
    for wave in range(waves):
        prompts = [system + words(message_len) for _ in range(sessions)]
        order = ("off", "on") if wave % 2 == 0 else ("on", "off")
        done = {cache: _run(llms[cache], prompts, params) for cache in order}
        _same(done["off"], done["on"], "shared system prompt")
        for cache in order:
            runs[cache].append(done[cache])
    rows += [_row("shared-system", cache, runs[cache]) for cache in ("off", "on")]

    runs = {"off": [], "on": []}
    for wave in range(waves):
        prompts = [words(no_reuse_len) for _ in range(sessions)]
        order = ("off", "on") if wave % 2 == 0 else ("on", "off")
        for cache in order:
            runs[cache].append(_run(llms[cache], prompts, params))
    rows += [_row("no-reuse", cache, runs[cache]) for cache in ("off", "on")]
    return rows


def run_prefix_cluster(model: str, sessions: int = 8, turns: int = 4, message_len: int = 64,
                       answer_len: int = 32, local_prefill_tokens: int = 128, seed: int = 0,
                       engine_options: dict | None = None) -> list[dict]:
    from engine import SamplingParams
    from router.cluster import launch

    options = dict(engine_options or {})
    configs = {"off": dict(options),
               "on, prefill worker": dict(options, enable_prefix_caching=True),
               "on, decode worker": dict(options, enable_prefix_caching=True,
                                         local_prefill_tokens=local_prefill_tokens)}
    clusters = {}
    try:
        for name, config in configs.items():  # six workers side by side on one machine's CPUs
            clusters[name] = launch(model, prefill=1, decode=1, cpus_per_worker=0.25, **config)
        vocab = clusters["off"].workers.model_facts["vocab_size"]
        rng = random.Random(seed)
        params = SamplingParams(max_tokens=answer_len, temperature=0.0, ignore_eos=True)
        for cluster in clusters.values():
            cluster.generate([[rng.randrange(3, vocab) for _ in range(16)]], SamplingParams(max_tokens=2))
        histories = [[rng.randrange(3, vocab) for _ in range(message_len)] for _ in range(sessions)]
        runs = {name: [] for name in clusters}
        for turn in range(turns):
            prompts = [list(h) for h in histories]
            names = list(clusters) if turn % 2 == 0 else list(reversed(clusters))
            done = {name: _run(clusters[name], prompts, params) for name in names}
            for name in names:
                _same(done["off"], done[name], f"multi-turn on the cluster ({name})")
                runs[name].append(done[name])
            histories = [p + o.token_ids + [rng.randrange(3, vocab) for _ in range(message_len)]
                         for p, o in zip(prompts, done["off"]["outs"])]
        return [_row("multi-turn 1P1D", name, runs[name]) for name in clusters]
    finally:
        for cluster in reversed(list(clusters.values())):  # the first one started Ray: it stops it
            cluster.shutdown()


def format_rows(rows: list[dict]) -> str:
    lines = [f"{'workload':<16} {'cache':>18} {'requests':>8} {'TTFT p50 ms':>11} {'prompt tok computed':>19} "
             f"{'seconds':>8} {'out tok/s':>9}"]
    for r in rows:
        lines.append(f"{r['workload']:<16} {r['cache']:>18} {r['requests']:>8} {r['ttft_p50_ms']:>11.1f} "
                     f"{r['prompt_tokens_computed']:>19} {r['seconds']:>8.2f} {r['output_tokens_per_s']:>9.1f}")
    by = {(r["workload"], r["cache"]): r for r in rows}
    for r in rows:
        off = by[(r["workload"], "off")]
        if r["cache"] != "off":
            lines.append(f"{r['workload']} ({r['cache']}): TTFT p50 off/on {off['ttft_p50_ms'] / r['ttft_p50_ms']:.2f}x, "
                         f"throughput on/off {r['output_tokens_per_s'] / off['output_tokens_per_s']:.3f}")
    return "\n".join(lines)


def add_prefix_arguments(p) -> None:
    p.add_argument("--sessions", type=int, default=8, help="chats (multi-turn) / requests per wave")
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--system-len", type=int, default=512)
    p.add_argument("--message-len", type=int, default=64, help="tokens of each new user message")
    p.add_argument("--answer-len", type=int, default=32)
    p.add_argument("--waves", type=int, default=4)
    p.add_argument("--no-reuse-len", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cluster", action="store_true", help="multi-turn chat on 1P1D clusters (see above)")
    p.add_argument("--tiers", action="store_true",
                   help="instead: an agentic trace 4x the pool, the pool alone against the pool with a host tier "
                        "(bench/tiers.py)")
    p.add_argument("--disk-cache-dir", default=None, help="--tiers: add a disk tier in this folder")
    p.add_argument("--fetch", action="store_true",
                   help="instead: fetching a cached prefix from another engine against recomputing it, "
                        "by prefix length (bench/fetch.py)")
    p.add_argument("--local-prefill-tokens", type=int, default=128,
                   help="--cluster: uncached part a decode worker prefills itself")
    p.add_argument("--out", default=None, help="write the JSON rows here")
