"""`splitserve bench prefix --tiers`: the prefix cache's lower tiers against its pool alone.

An agentic trace: `conversations` conversations take `turns` turns each, one request at a
time, one conversation after another, each turn's prompt the conversation's history (its
prompts and answers so far) plus a tool result of `message_len` tokens. The pool (KV blocks
and checkpoint rows) is sized to a quarter of the trace's working set (every conversation's
final history; at least twice the longest), so by the time a conversation comes back, the ones
between have evicted it from the pool. Three colocated engines, alike but for the cache (4 sequences a step each):
- off: no prefix caching;
- pool: prefix caching, the pool alone;
- tiers: the same pool, and a host tier (and a disk tier with `disk_dir`) that keeps what the
  pool evicts.
Reported per engine: the hit rate (prompt tokens the cache supplied over those looked up),
TTFT p50 and p99; and for a no-reuse workload (distinct prompts), each engine's output
tokens/s. Greedy, so the engines must produce the same tokens; the run
checks that too.
"""

from __future__ import annotations

import random
import statistics
import time


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run_tiers(model: str, conversations: int = 16, turns: int = 4, message_len: int = 128, answer_len: int = 16,
              block_size: int = 16, host_bytes: int = 1 << 30, disk_dir: str | None = None, seed: int = 0) -> list[dict]:
    from engine import LLM, SamplingParams

    working_set = conversations * turns * (message_len + answer_len)
    longest = turns * (message_len + answer_len)  # a conversation's last prompt and answer
    pool = dict(num_kv_blocks=max(working_set // 4, 2 * longest) // block_size,
                prefix_checkpoints=max(2, conversations // 4))
    shared = dict(block_size=block_size, max_num_seqs=4)
    disk = dict(disk_cache_dir=disk_dir, disk_cache_bytes=16 << 30) if disk_dir is not None else {}
    llms = {"off": LLM(model, **shared),
            "pool": LLM(model, enable_prefix_caching=True, **pool, **shared),
            "tiers": LLM(model, enable_prefix_caching=True, host_cache_bytes=host_bytes, **disk, **pool, **shared)}
    rng = random.Random(seed)
    vocab = llms["off"].engine.spec.vocab_size
    words = lambda n: [rng.randrange(3, vocab) for _ in range(n)]  # noqa: E731
    params = SamplingParams(max_tokens=answer_len, temperature=0.0, ignore_eos=True)
    for llm in llms.values():
        llm.generate([words(16)], SamplingParams(max_tokens=2))
    histories = [words(message_len) for _ in range(conversations)]
    ttft = {name: [] for name in llms}
    before = {name: dict(llm.engine.stats()) for name, llm in llms.items()}
    for turn in range(turns):
        for chat in range(conversations):
            prompt = histories[chat]
            outs = {}
            for name in (list(llms) if (turn + chat) % 2 == 0 else list(llms)[::-1]):
                [outs[name]] = llms[name].generate([prompt], params)
                ttft[name].append(outs[name].first_token_time - outs[name].arrival_time)
            if len({tuple(o.token_ids) for o in outs.values()}) != 1:
                raise AssertionError(f"turn {turn} conversation {chat}: outputs differ between engines")
            histories[chat] = prompt + outs["off"].token_ids + words(message_len)
    rows = []
    for name, llm in llms.items():
        stats = llm.engine.stats()
        queried = stats.get("prefix_cache_queried_tokens", 0) - before[name].get("prefix_cache_queried_tokens", 0)
        hits = stats.get("prefix_cache_hit_tokens", 0) - before[name].get("prefix_cache_hit_tokens", 0)
        rows.append({"workload": "agentic", "engine": name, "requests": len(ttft[name]),
                     "hit_rate": hits / queried if queried else 0.0,
                     "ttft_p50_ms": 1000 * statistics.median(ttft[name]),
                     "ttft_p99_ms": 1000 * _percentile(ttft[name], 0.99),
                     "pool_blocks": pool["num_kv_blocks"], "working_set_tokens": working_set,
                     **{k: v for k, v in stats.items() if k.startswith("tier_")}})
    return rows + _no_reuse(llms, words, params, conversations, longest - answer_len)


def _no_reuse(llms: dict, words, params, requests: int, length: int, rounds: int = 9) -> list[dict]:
    """Distinct prompts of `length` tokens on every engine, the order rotating each round:
    output tokens/s."""
    names = list(llms)
    tokens, seconds = dict.fromkeys(names, 0), dict.fromkeys(names, 0.0)
    for round_ in range(rounds):
        prompts = [words(length) for _ in range(requests)]
        for name in names[round_ % len(names):] + names[:round_ % len(names)]:
            start = time.perf_counter()
            outs = llms[name].generate(prompts, params)
            seconds[name] += time.perf_counter() - start
            tokens[name] += sum(len(o.token_ids) for o in outs)
    return [{"workload": "no-reuse", "engine": name, "output_tokens_per_s": tokens[name] / seconds[name]}
            for name in names]


def format_rows(rows: list[dict]) -> str:
    agentic = {r["engine"]: r for r in rows if r["workload"] == "agentic"}
    lines = [f"{'engine':<6} {'hit rate':>8} {'TTFT p50 ms':>11} {'TTFT p99 ms':>11}"]
    for name, r in agentic.items():
        lines.append(f"{name:<6} {100 * r['hit_rate']:>7.1f}% {r['ttft_p50_ms']:>11.1f} {r['ttft_p99_ms']:>11.1f}")
    pool, tiers = agentic["pool"], agentic["tiers"]
    ratio = f"{tiers['hit_rate'] / pool['hit_rate']:.2f}x" if pool["hit_rate"] else "(the pool hit nothing)"
    lines.append(f"tiers vs pool: hit rate {ratio}, "
                 f"TTFT p50 {pool['ttft_p50_ms'] / tiers['ttft_p50_ms']:.2f}x lower "
                 f"(working set {pool['working_set_tokens']} tokens, pool {pool['pool_blocks']} blocks)")
    no_reuse = {r["engine"]: r["output_tokens_per_s"] for r in rows if r["workload"] == "no-reuse"}
    lines.append(f"no reuse: output tok/s over off's: pool {no_reuse['pool'] / no_reuse['off']:.3f}, "
                 f"tiers {no_reuse['tiers'] / no_reuse['off']:.3f}")
    return "\n".join(lines)
