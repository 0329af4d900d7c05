"""Benchmark request generators: prompt/output lengths and arrival times, seeded, no torch.

Shapes:
- fixed:         every prompt `input_len` tokens, every output `output_len` tokens;
- random:        lengths uniform in [len * (1 - range_ratio), len * (1 + range_ratio)];
- sharegpt:      a ShareGPT-like mix generated here (no download): heavy-tailed lognormal
                 prompt and output lengths, correlated weakly, clipped to the model;
- prefill-heavy: long prompts (`input_len`), short outputs (output_len / 8, at least 1);
- decode-heavy:  short prompts (input_len / 8, at least 1), long outputs (`output_len`).

Arrivals follow vLLM's benchmark_serving: gaps drawn from a gamma distribution with shape
`burstiness` and mean 1/rate (burstiness 1 is Poisson; below 1 burstier, above 1 steadier);
rate = inf sends everything at t=0.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

WORKLOAD_KINDS = ("fixed", "random", "sharegpt", "prefill-heavy", "decode-heavy")

# ShareGPT conversations measured in Llama tokens have medians near 100 prompt tokens and
# 200 output tokens with long right tails; these lognormal parameters give that shape and
# are scaled by `input_len / 128` and `output_len / 128` so the mix fits a small context.
SHAREGPT_PROMPT_MU, SHAREGPT_PROMPT_SIGMA = math.log(100.0), 1.1
SHAREGPT_OUTPUT_MU, SHAREGPT_OUTPUT_SIGMA = math.log(200.0), 0.9
SHAREGPT_MIN_TOKENS = 4


@dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: list[int] = field(repr=False)
    output_len: int
    arrival_s: float  # offset from the start of the run

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


@dataclass
class WorkloadConfig:
    kind: str = "fixed"
    num_requests: int = 64
    input_len: int = 128
    output_len: int = 128
    range_ratio: float = 0.5  # "random" only
    vocab_size: int = 320
    first_token_id: int = 3  # ids below this (pad/bos/eos of the tiny test models) are not used
    max_model_len: int = 2048  # prompt + output never exceeds this
    request_rate: float = math.inf  # requests per second
    burstiness: float = 1.0
    seed: int = 0

    def __post_init__(self):
        if self.kind not in WORKLOAD_KINDS:
            raise ValueError(f"kind: {self.kind!r} not in {WORKLOAD_KINDS}")
        for name in ("num_requests", "input_len", "output_len", "vocab_size", "max_model_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: must be a positive integer, got {value!r}")
        if not 0 <= self.range_ratio < 1:
            raise ValueError(f"range_ratio: must be in [0, 1), got {self.range_ratio!r}")
        if not 0 <= self.first_token_id < self.vocab_size:
            raise ValueError(f"first_token_id: must be in [0, vocab_size), got {self.first_token_id!r}")
        if not self.request_rate > 0:
            raise ValueError(f"request_rate: must be > 0 (inf: all at once), got {self.request_rate!r}")
        if not (self.burstiness > 0 and math.isfinite(self.burstiness)):
            raise ValueError(f"burstiness: must be a positive number, got {self.burstiness!r}")
        if self.max_model_len < 2:
            raise ValueError("max_model_len: must leave room for one prompt and one output token")


def arrival_offsets(num: int, rate: float, burstiness: float, rng: random.Random) -> list[float]:
    """Start times (seconds from 0) of `num` requests: gamma gaps of mean 1/rate."""
    if math.isinf(rate):
        return [0.0] * num
    theta = 1.0 / (rate * burstiness)
    times, now = [], 0.0
    for _ in range(num):
        times.append(now)
        now += rng.gammavariate(burstiness, theta)
    return times


def _lengths(cfg: WorkloadConfig, rng: random.Random) -> list[tuple[int, int]]:
    n, inp, out = cfg.num_requests, cfg.input_len, cfg.output_len
    if cfg.kind == "fixed":
        pairs = [(inp, out)] * n
    elif cfg.kind == "random":
        def draw(center):
            return rng.randint(max(1, int(center * (1 - cfg.range_ratio))),
                               max(1, int(center * (1 + cfg.range_ratio))))
        pairs = [(draw(inp), draw(out)) for _ in range(n)]
    elif cfg.kind == "sharegpt":
        pairs = []
        for _ in range(n):
            z_prompt = rng.gauss(0.0, 1.0)
            z_output = 0.3 * z_prompt + math.sqrt(1 - 0.3 ** 2) * rng.gauss(0.0, 1.0)
            p = math.exp(SHAREGPT_PROMPT_MU + SHAREGPT_PROMPT_SIGMA * z_prompt) * inp / 128
            o = math.exp(SHAREGPT_OUTPUT_MU + SHAREGPT_OUTPUT_SIGMA * z_output) * out / 128
            pairs.append((max(SHAREGPT_MIN_TOKENS, round(p)), max(SHAREGPT_MIN_TOKENS, round(o))))
    elif cfg.kind == "prefill-heavy":
        pairs = [(inp, max(1, out // 8))] * n
    else:  # decode-heavy
        pairs = [(max(1, inp // 8), out)] * n
    limit = cfg.max_model_len
    fitted = []
    for p, o in pairs:
        p = min(p, limit - 1)
        fitted.append((p, max(1, min(o, limit - p))))
    return fitted


def generate_requests(cfg: WorkloadConfig) -> list[BenchRequest]:
    """The workload as requests in arrival order; the same config always gives the same list."""
    rng = random.Random(cfg.seed)
    lengths = _lengths(cfg, rng)
    starts = arrival_offsets(cfg.num_requests, cfg.request_rate, cfg.burstiness, rng)
    low, high = cfg.first_token_id, cfg.vocab_size - 1
    return [BenchRequest([rng.randint(low, high) for _ in range(p)], o, t)
            for (p, o), t in zip(lengths, starts)]


def describe(requests: list[BenchRequest]) -> dict:
    """Summary statistics of a workload, for the JSON results."""
    prompts = [r.prompt_len for r in requests]
    outputs = [r.output_len for r in requests]
    span = requests[-1].arrival_s - requests[0].arrival_s if requests else 0.0
    return {
        "num_requests": len(requests),
        "prompt_tokens": {"total": sum(prompts), "mean": _mean(prompts), "max": max(prompts, default=0)},
        "output_tokens": {"total": sum(outputs), "mean": _mean(outputs), "max": max(outputs, default=0)},
        "arrival_span_s": span,
        "offered_rate": (len(requests) - 1) / span if span > 0 else math.inf,
    }


def _mean(values) -> float:
    return sum(values) / len(values) if values else 0.0
