"""`splitserve bench quant`: what each cache format costs and saves, side by side in one run
(half-width recurrent state: engine.state_format; FP8 KV: engine.kv_format).

Each option is an engine that differs from the float32 baseline in one cache format. Reported
per option:
- bytes per sequence: KV bytes per token, recurrent-state bytes per sequence, and how many
  sequences of `--seq-len` tokens fit a `--budget-mib` cache, over the baseline's count;
- drift against the baseline, teacher-forced: the baseline decodes `--steps` greedy tokens
  after each prompt, the option is fed the same tokens one decode step at a time, and the
  mean and max absolute difference of the two logits rows at every step (and how often the
  argmax agrees);
- perplexity on held-out text (the demo model's held-out files from this Python's standard
  library, engine/demo_model/README.md), teacher-forced token by token the same way, so every
  token's state went through the format;
- decode tokens/s at `--batch` concurrent requests, rounds alternating the engines.
"""

from __future__ import annotations

import math
import random
import sysconfig
import time
from pathlib import Path

import torch

from engine import LLM, SamplingParams
from engine.cache_formats import kv_working_bytes_per_block
from engine.sampler import SampleResult
from engine.state_format import working_bytes

OPTIONS = {"float32": {}, "state-bfloat16": {"mamba_state_dtype": "bfloat16"},
           "state-float16": {"mamba_state_dtype": "float16"}, "kv-fp8_e4m3": {"kv_cache_dtype": "fp8_e4m3"},
           "kv-fp8_e5m2": {"kv_cache_dtype": "fp8_e5m2"},
           "both": {"kv_cache_dtype": "fp8_e4m3", "mamba_state_dtype": "bfloat16"}}
HELD_OUT = ("ast.py", "cProfile.py", "asyncio/runners.py")  # three of the demo model's held-out files


def forced_logits(llm: LLM, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """[len(tokens), vocab]: row i is the engine's logits for the position after prompt +
    tokens[:i], each of `tokens` fed back as if sampled (one decode step per token after the
    prompt's prefill)."""
    runner = llm.engine.runner
    rows: list[torch.Tensor] = []

    def execute(seqs):
        logits = type(runner).execute(runner, seqs)
        rows.append(logits[0].float().clone())
        return logits

    def sample(logits, seqs):
        return SampleResult([tokens[len(rows) - 1]], [None])

    runner.execute, runner.sample = execute, sample
    try:
        llm.generate([prompt], SamplingParams(max_tokens=len(tokens), temperature=0.0, ignore_eos=True))
    finally:
        del runner.execute, runner.sample
    return torch.stack(rows)


def footprint(llm: LLM, seq_len: int, budget: int) -> dict:
    """Bytes a sequence keeps (what a hand-off or a tier entry moves), and how many sequences of
    seq_len tokens a budget holds counting the working rows a narrow format adds per slot and
    per block (engine.cache_formats)."""
    engine = llm.engine
    sizes, spec, block = engine.cache.sizes, engine.cache.spec, engine.config.block_size
    kv_per_token = sizes.bytes_per_block / block
    per_sequence = sizes.bytes_per_slot + kv_per_token * seq_len
    working = working_bytes(spec, 1) + kv_working_bytes_per_block(spec, engine.config.torch_dtype, block) / block * seq_len
    return {"kv_bytes_per_token": kv_per_token, "state_bytes_per_seq": sizes.bytes_per_slot,
            "bytes_per_seq": per_sequence, "working_bytes_per_seq": working,
            "seqs_in_budget": int(budget // (per_sequence + working))}


def held_out_tokens(llm: LLM, limit: int) -> list[list[int]]:
    """The demo model's held-out files, as tokens, `limit` per file; [] without a tokenizer or
    where this Python's library lacks them."""
    if llm.tokenizer is None:
        return []
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = [(stdlib / name).read_text() for name in HELD_OUT if (stdlib / name).is_file()]
    return [llm.engine.tokenize(text)[:limit] for text in texts]


def perplexity(llm: LLM, documents: list[list[int]]) -> float | None:
    if not documents:
        return None
    nll, count = 0.0, 0
    for doc in documents:
        logits = forced_logits(llm, doc[:1], doc[1:])
        nll -= float(torch.log_softmax(logits, -1).gather(1, torch.tensor(doc[1:])[:, None]).sum())
        count += len(doc) - 1
    return math.exp(nll / count)


def decode_speed(engines: dict[str, LLM], batch: int, max_tokens: int, rounds: int, vocab: int, seed: int) -> dict:
    rng = random.Random(seed)
    prompts = [[rng.randrange(1, vocab) for _ in range(32)] for _ in range(batch)]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    best = {name: 0.0 for name in engines}
    for _ in range(rounds):
        for name, llm in engines.items():
            llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0.0))  # the prompts' prefill cost apart
            start = time.perf_counter()
            llm.generate(prompts, params)
            best[name] = max(best[name], batch * max_tokens / (time.perf_counter() - start))
    return best


def run_quant(model: str, options: list[str], steps: int, num_prompts: int, seq_lens: tuple[int, ...],
              budget_mib: int, ppl_tokens: int, batch: int, rounds: int, seed: int) -> list[dict]:
    engines = {name: LLM(model, **OPTIONS[name]) for name in ["float32", *[o for o in options if o != "float32"]]}
    base = engines["float32"]
    vocab = base.engine.spec.vocab_size
    rng = random.Random(seed)
    prompts = [[rng.randrange(1, vocab) for _ in range(rng.randrange(8, 64))] for _ in range(num_prompts)]
    greedy = SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True)
    references = [out.token_ids for out in base.generate(prompts, greedy)]
    base_logits = [forced_logits(base, p, t) for p, t in zip(prompts, references)]
    documents = held_out_tokens(base, ppl_tokens)
    speed = decode_speed(engines, batch, steps, rounds, vocab, seed)
    base_fit = {n: footprint(base, n, budget_mib << 20)["seqs_in_budget"] for n in seq_lens}
    rows = []
    for name, llm in engines.items():
        diffs, agree = [], 0
        for prompt, tokens, ref in zip(prompts, references, base_logits):
            logits = forced_logits(llm, prompt, tokens)
            diffs.append((logits - ref).abs())
            agree += int((logits.argmax(-1) == ref.argmax(-1)).sum())
        diff = torch.cat(diffs)
        fits = {n: footprint(llm, n, budget_mib << 20) for n in seq_lens}
        first = fits[seq_lens[0]]
        rows.append({"option": name, "kv_bytes_per_token": first["kv_bytes_per_token"],
                     "state_bytes_per_seq": first["state_bytes_per_seq"],
                     "seqs_in_budget": {n: f["seqs_in_budget"] for n, f in fits.items()},
                     "seqs_vs_float32": {n: f["seqs_in_budget"] / base_fit[n] for n, f in fits.items()},
                     "logit_diff_mean": float(diff.mean()), "logit_diff_max": float(diff.max()),
                     "argmax_agree": agree / sum(len(t) for t in references),
                     "perplexity": perplexity(llm, documents), "decode_tok_s": speed[name],
                     "decode_vs_float32": speed[name] / speed["float32"]})
    return rows


def format_rows(rows: list[dict]) -> str:
    lengths = list(rows[0]["seqs_in_budget"])
    fit_head = "".join(f"{f'fit@{n} (x f32)':>20}" for n in lengths)
    lines = [f"{'option':<16}{'KV B/token':>11}{'state B/seq':>12}{fit_head}"
             f"{'|dlogit| mean':>14}{'max':>9}{'argmax=':>8}{'ppl':>8}{'tok/s':>8}{'x f32':>7}"]
    for r in rows:
        ppl = f"{r['perplexity']:.3f}" if r["perplexity"] is not None else "-"
        fit_cells = [f"{r['seqs_in_budget'][n]} ({r['seqs_vs_float32'][n]:.2f})" for n in lengths]
        fits = "".join(f"{cell:>20}" for cell in fit_cells)
        lines.append(f"{r['option']:<16}{r['kv_bytes_per_token']:>11.0f}{r['state_bytes_per_seq']:>12}{fits}"
                     f"{r['logit_diff_mean']:>14.2e}{r['logit_diff_max']:>9.2e}{r['argmax_agree']:>8.3f}{ppl:>8}"
                     f"{r['decode_tok_s']:>8.1f}{r['decode_vs_float32']:>7.2f}")
    return "\n".join(lines)


def add_quant_arguments(p) -> None:
    p.add_argument("--options", default=",".join(OPTIONS), help=f"comma-separated, of {', '.join(OPTIONS)}")
    p.add_argument("--steps", type=int, default=64, help="greedy decode steps per prompt (drift, speed)")
    p.add_argument("--num-prompts", type=int, default=4)
    p.add_argument("--seq-lens", default="512,4096", help="sequence lengths for the sequences-that-fit counts")
    p.add_argument("--budget-mib", type=int, default=1024, help="cache budget for the sequences-that-fit count")
    p.add_argument("--ppl-tokens", type=int, default=512, help="held-out tokens per file for the perplexity")
    p.add_argument("--batch", type=int, default=8, help="concurrent requests for the decode speed")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write the JSON rows here")
