"""`splitserve bench spec`: speculative decoding against plain decoding, side by side in one run.

Two workloads on the colocated engine:
- hit: greedy continuations of code that repeats itself (the prompt holds the same functions
  several times, and ends where one of them begins again): n-gram drafts can hit;
- miss: seeded sampling at temperature 1 from distinct random prompts: drafts rarely hit.
Each at batch 1, 4 and 16 on three engines that differ only in `speculative_config`: none,
n-gram drafting in every step ("always"), and n-gram with the governor that drafts only where
it measures faster ("adaptive"). Rounds alternate the engines so that a shared box's noise
falls on all of them. Reported: decode tokens/s (output tokens after the first over the time
after the first token), TPOT p50/p99 over requests, acceptance, and each engine's decode
tokens/s over plain's (the median over rounds of the round's ratio). Both speculating engines must produce plain's tokens (greedy, and
seeded draws): the run checks that too.
"""

from __future__ import annotations

import random
import statistics
import time
from pathlib import Path

CODE = '''def area(width, height):
    return width * height


def perimeter(width, height):
    return 2 * (width + height)


def scale(width, height, factor):
    return width * factor, height * factor

'''
ENGINES = ("plain", "always", "adaptive")


def _prompts(workload: str, batch: int, vocab: int, seed: int, has_tokenizer: bool) -> list:
    rng = random.Random(seed)
    if workload == "hit" and has_tokenizer:
        heads = ["def area(", "def perimeter(", "def scale("]
        return [CODE * 3 + heads[i % len(heads)] for i in range(batch)]
    if workload == "hit":  # a checkpoint without a tokenizer: a random "file" of ids, repeated
        text = [rng.randrange(3, vocab) for _ in range(60)]
        return [text * 3 + text[:3 + i] for i in range(batch)]
    return [[rng.randrange(3, vocab) for _ in range(64)] for _ in range(batch)]


def _params(workload: str, max_tokens: int, batch: int):
    from engine import SamplingParams

    if workload == "hit":
        return [SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)] * batch
    return [SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=i, ignore_eos=True) for i in range(batch)]


def _run(llm, prompts, params) -> dict:
    before = dict(llm.engine.stats())
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    after = llm.engine.stats()
    decode_s = max(o.finish_time for o in outs) - min(o.first_token_time for o in outs)
    return {"outs": [o.token_ids for o in outs], "seconds": seconds, "decode_s": decode_s,
            "decode_tokens": sum(len(o.token_ids) - 1 for o in outs),
            "tpot": [(o.finish_time - o.first_token_time) / (len(o.token_ids) - 1) for o in outs if len(o.token_ids) > 1],
            "drafted": after.get("spec_draft_tokens", 0) - before.get("spec_draft_tokens", 0),
            "accepted": after.get("spec_accepted_tokens", 0) - before.get("spec_accepted_tokens", 0)}


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run_spec(model: str, batches=(1, 4, 16), max_tokens: int = 128, k: int = 4, rounds: int = 5,
             seed: int = 0, engine_options: dict | None = None) -> list[dict]:
    from engine import LLM

    options = dict(engine_options or {})
    ngram = {"method": "ngram", "num_speculative_tokens": k}
    llms = {"plain": LLM(model, **options),
            "always": LLM(model, speculative_config={**ngram, "adaptive": False}, **options),
            "adaptive": LLM(model, speculative_config=ngram, **options)}
    vocab = llms["plain"].engine.spec.vocab_size
    rows = []
    for workload in ("hit", "miss"):
        for batch in batches:
            prompts = _prompts(workload, batch, vocab, seed, llms["plain"].engine.tokenizer is not None)
            params = _params(workload, max_tokens, batch)
            for llm in llms.values():  # warm: kernels built, the governor past its first probes
                llm.generate(prompts, params)
            runs = {name: [] for name in ENGINES}
            for _ in range(rounds):
                for name in ENGINES:
                    runs[name].append(_run(llms[name], prompts, params))
            for name in ENGINES:
                if any(r["outs"] != runs["plain"][0]["outs"] for r in runs[name]):
                    raise AssertionError(f"{workload} batch {batch}: {name} changed the outputs")
                rows.append(_row(workload, batch, name, runs[name], runs["plain"]))
    return rows


def _rate(run: dict) -> float:
    return run["decode_tokens"] / run["decode_s"]


def _row(workload: str, batch: int, engine: str, runs: list[dict], plain: list[dict]) -> dict:
    """vs_plain: the median over rounds of this engine's decode rate over plain's in the same
    round, so that a round a neighbour slowed decides nothing."""
    decode_s = sum(r["decode_s"] for r in runs)
    tpot = [t for r in runs for t in r["tpot"]]
    drafted = sum(r["drafted"] for r in runs)
    return {"workload": workload, "batch": batch, "engine": engine,
            "decode_tokens_per_s": sum(r["decode_tokens"] for r in runs) / decode_s,
            "vs_plain": statistics.median(_rate(r) / _rate(p) for r, p in zip(runs, plain)),
            "tpot_p50_ms": 1000 * statistics.median(tpot), "tpot_p99_ms": 1000 * _percentile(tpot, 0.99),
            "draft_tokens": drafted, "acceptance": sum(r["accepted"] for r in runs) / drafted if drafted else None}


def draft_prefill_cost(model: str, draft: str, prompt_len: int = 1024, k: int = 4, seed: int = 0) -> dict:
    """What the decode worker's own prefill of the draft costs (engine.draft_model): for one
    request of `prompt_len` tokens, the target's prefill, the draft's first proposal (its
    catch-up over the whole prompt, then k - 1 draft decodes) and its later proposals; and the
    bytes the draft's cache for that prompt would add to the hand-off had the prefill worker run
    the draft instead."""
    from engine import LLM, SamplingParams
    from engine.draft_model import DraftModelProposer

    llm = LLM(model, speculative_config={"method": "draft_model", "model": draft, "num_speculative_tokens": k,
                                         "adaptive": False})
    proposer: DraftModelProposer = llm.engine.speculation.proposer
    timings, propose = [], proposer.propose_all

    def timed(requests, limits):
        start = time.perf_counter()
        drafts = propose(requests, limits)
        timings.append(time.perf_counter() - start)
        return drafts

    proposer.propose_all = timed
    rng = random.Random(seed)
    prompt = [rng.randrange(3, llm.engine.spec.vocab_size) for _ in range(prompt_len)]
    llm.generate([prompt[:16]], SamplingParams(max_tokens=4))  # warm
    timings.clear()
    [out] = llm.generate([prompt], SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True))
    spec, block = proposer.model.spec, proposer.cache.sizes
    blocks = -(-prompt_len // proposer.cache.block_size) if spec.attention_layers else 0
    return {"prompt_len": prompt_len, "target_prefill_ms": 1000 * (out.first_token_time - out.arrival_time),
            "draft_first_proposal_ms": 1000 * timings[0],
            "draft_later_proposal_ms": 1000 * statistics.median(timings[1:]),
            "draft_cache_bytes": blocks * block.bytes_per_block + block.bytes_per_slot}


def mtp_handoff_bytes(model: str, prompt_lens=(1024, 8192), dtype: str = "bfloat16") -> list[dict]:
    """What an MTP head (engine.mtp) adds to a hand-off: its KV per prompt token and its g per
    slot, beside the target's own cache, for the model whose config.json is in `model` (built
    on the meta device: no weights needed)."""
    import dataclasses

    import torch

    from engine.cache import bytes_per_block, bytes_per_slot
    from engine.models import FAMILIES
    from engine.models.checkpoint import ConfigReader, read_config
    from engine.models.families_qwen3_next import MTP_HEADS

    config = read_config(Path(model))
    reader = ConfigReader(config, Path(model) / "config.json")
    build, _ = FAMILIES[config["model_type"]]
    build_head, _ = MTP_HEADS[config["model_type"]]
    torch_dtype = getattr(torch, dtype)
    with torch.device("meta"):
        spec = build(reader).spec
        head = build_head(reader)
    with_head = dataclasses.replace(spec, layers=spec.layers + (head.cache_spec(torch_dtype),))
    rows = []
    for n in prompt_lens:
        target, both = (bytes_per_block(s, torch_dtype, 1) * n + bytes_per_slot(s) for s in (spec, with_head))
        rows.append({"prompt_len": n, "target_bytes": target, "with_head_bytes": both, "added": both / target - 1})
    return rows


def format_rows(rows: list[dict]) -> str:
    lines = [f"{'workload':<8} {'batch':>5} {'engine':>9} {'decode tok/s':>12} {'TPOT p50 ms':>11} "
             f"{'TPOT p99 ms':>11} {'drafted':>8} {'accepted':>8} {'vs plain':>8}"]
    for r in rows:
        accepted = f"{100 * r['acceptance']:.0f}%" if r["acceptance"] is not None else "-"
        lines.append(f"{r['workload']:<8} {r['batch']:>5} {r['engine']:>9} {r['decode_tokens_per_s']:>12.1f} "
                     f"{r['tpot_p50_ms']:>11.2f} {r['tpot_p99_ms']:>11.2f} {r['draft_tokens']:>8} {accepted:>8} "
                     f"{r['vs_plain']:>7.2f}x")
    lines.append("vs plain: the median over rounds of each round's ratio (the engines run back to back in a round)")
    return "\n".join(lines)


def add_spec_arguments(p) -> None:
    p.add_argument("--batches", default="1,4,16", help="comma-separated batch sizes")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write the JSON rows here")
    p.add_argument("--draft-cost", default=None, metavar="DRAFT",
                   help="instead: what prefilling this draft model on the decode worker costs, next to the "
                        "target's prefill and the bytes its cache would add to the hand-off")
    p.add_argument("--prompt-len", type=int, default=1024, help="--draft-cost: the prompt's tokens")
    p.add_argument("--mtp-handoff", action="store_true",
                   help="instead: the bytes an MTP head's cache adds to a hand-off of the model (its config.json "
                        "alone, e.g. bench/qwen3_next_80b)")
