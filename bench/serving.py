"""Serving under Poisson arrivals: colocated vs disaggregated, conditional disaggregation, hand-off.

Equal total cores: the colocated engine runs with `total_cores` torch threads in this
process (or `colocated_cores`); a disaggregated cluster gets `total_cores / workers` CPUs per
worker (Ray sets each actor's OMP_NUM_THREADS from it). Scenarios:
- serving:     a prefill-heavy mix (long prompts, short outputs) at each rate, colocated vs
               every P:D split with the split always on; the rates go on doubling from the
               last one given until colocated misses its SLO (attainment below
               sweep_attainment), and the sweep summary names the rates where a split's
               goodput beats colocated's and by how much; reports p99 TPOT colocated / 1P1D;
- conditional: a ShareGPT-like mix, colocated vs 1P1D with conditional disaggregation off
               (every prompt split) and on (prompts <= local_prefill_tokens prefill on the
               decode worker).
Disaggregated runs also report the hand-off: bytes/s against a memcpy of the same bytes in
this process, and mean hand-off time as a share of mean TTFT.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.metrics import SLO
from bench.runner import RunConfig, handoff_totals, open_target, run_benchmark
from bench.workloads import WorkloadConfig, generate_requests


@dataclass
class ServingConfig:
    num_requests: int = 32
    input_len: int = 1024  # prefill-heavy: prompts this long, outputs output_len / 8
    output_len: int = 256
    rates: tuple[float, ...] = (0.5,)
    sweep_factor: float = 2.0  # after the given rates, the next is the last times this (1: no sweep)
    sweep_attainment: float = 0.9  # ... while colocated's SLO attainment stays at least this
    max_rates: int = 8
    burstiness: float = 1.0
    splits: tuple[str, ...] = ("1:1",)  # "P:D"; the first is the sweep's split, the best of the rest its rival
    total_cores: int = 2
    # The colocated engine's torch threads (None: total_cores). The prefill worker's share
    # (total_cores / workers) gives both systems' prefills the same cores, which separates the
    # split's own cost from the cost of prefilling on fewer of them.
    colocated_cores: int | None = None
    slo_ttft_s: float = 4.0
    slo_tpot_s: float = 0.1
    conditional_requests: int = 48
    conditional_input_len: int = 256  # ShareGPT-like scale: median prompt ~ 200 tokens
    conditional_output_len: int = 64
    conditional_rate: float = 1.0
    local_prefill_tokens: int = 256
    max_concurrency: int | None = None
    max_num_batched_tokens: int = 2048
    seed: int = 0
    progress: bool = True

    def __post_init__(self):
        self.rates = tuple(float(r) for r in self.rates)
        if not self.rates or min(self.rates) <= 0:
            raise ValueError(f"rates: need positive request rates, got {self.rates!r}")
        if self.sweep_factor < 1 or not 0 < self.sweep_attainment <= 1 or self.max_rates < len(self.rates):
            raise ValueError(f"sweep: need sweep_factor >= 1 (got {self.sweep_factor}), sweep_attainment in "
                             f"(0, 1] (got {self.sweep_attainment}), max_rates >= the rates given (got {self.max_rates})")
        for split in self.splits:
            parse_split(split)
        if self.total_cores < 2:
            raise ValueError("total_cores: a disaggregated pair needs at least 2")
        if self.colocated_cores is not None and self.colocated_cores < 1:
            raise ValueError(f"colocated_cores: must be >= 1, got {self.colocated_cores}")
        for name in ("num_requests", "input_len", "output_len", "conditional_requests",
                     "conditional_input_len", "conditional_output_len", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1")
        if self.local_prefill_tokens < 1 or not self.conditional_rate > 0:
            raise ValueError("local_prefill_tokens must be >= 1 and conditional_rate > 0")
        SLO(self.slo_ttft_s, self.slo_tpot_s)  # validates both

    @property
    def slo(self) -> SLO:
        return SLO(self.slo_ttft_s, self.slo_tpot_s)


def quick_overrides() -> dict:
    """A smoke-sized serving run (seconds of work, not minutes)."""
    return dict(num_requests=6, input_len=256, output_len=64, rates=(4.0,), max_rates=2, conditional_requests=8,
                conditional_input_len=64, conditional_output_len=16, conditional_rate=4.0,
                local_prefill_tokens=64)


def parse_split(split: str) -> tuple[int, int]:
    try:
        p, d = (int(x) for x in split.split(":"))
    except ValueError:
        raise ValueError(f"split: expected 'P:D' like '1:1', got {split!r}") from None
    if p < 1 or d < 1:
        raise ValueError(f"split: need at least one worker of each kind, got {split!r}")
    return p, d


def memcpy_seconds(nbytes: int, repeats: int = 10) -> float:
    """Median time of one contiguous copy of `nbytes` in this process."""
    import torch

    src = torch.empty(max(nbytes, 1), dtype=torch.uint8).fill_(7)
    dst = torch.empty_like(src)
    times = []
    for _ in range(repeats + 1):
        t = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t)
    times = sorted(times[1:])
    return times[len(times) // 2]


def handoff_report(before: dict, after: dict, metrics: dict) -> dict:
    count = after["count"] - before["count"]
    nbytes = after["bytes"] - before["bytes"]
    seconds = after["seconds"] - before["seconds"]
    if count == 0:
        return {"count": 0}
    mean_bytes = nbytes / count
    mean_s = seconds / count
    copy_s = memcpy_seconds(int(mean_bytes))
    return {
        "count": count, "failures": after["failures"] - before["failures"],
        "mean_bytes": mean_bytes, "mean_seconds": mean_s,
        "bytes_per_s": mean_bytes / mean_s if mean_s > 0 else math.nan,
        "memcpy_bytes_per_s": mean_bytes / copy_s if copy_s > 0 else math.nan,
        "ratio_to_memcpy": copy_s / mean_s if mean_s > 0 else math.nan,
        "share_of_mean_ttft": mean_s / (metrics["mean_ttft_ms"] / 1000.0),
    }


def rate_tag(rate: float) -> str:
    return f"{rate:g}rps"


def split_name(split: str) -> str:
    p, d = parse_split(split)
    return f"disagg-{p}P{d}D"


def sweep_rates(cfg: ServingConfig, attainment_at) -> list[float]:
    """The given rates, then each the last times sweep_factor while colocated meets its SLO
    (attainment_at(rate): its attainment, measuring that rate), up to max_rates."""
    rates = list(cfg.rates)
    for rate in rates:  # grows while it is iterated
        met = attainment_at(rate) >= cfg.sweep_attainment
        if rate == rates[-1] and met and cfg.sweep_factor > 1 and len(rates) < cfg.max_rates:
            rates.append(round(rate * cfg.sweep_factor, 6))
    return rates


def sweep_summary(runs: dict, rates: list[float], splits: tuple[str, ...]) -> dict:
    """Per rate, colocated against the sweep's split and the best other split (the most goodput
    over the sweep): TTFT/TPOT p50/p99, SLO attainment, goodput; and the rates where the split
    wins on goodput, with the largest ratio."""
    names = [split_name(s) for s in splits]
    others = [n for n in names[1:] if all(f"{n}@{rate_tag(r)}" in runs for r in rates)]
    best_other = max(others, key=lambda n: sum(runs[f"{n}@{rate_tag(r)}"]["metrics"]["goodput"] for r in rates),
                     default=None)
    keys = ("p50_ttft_ms", "p99_ttft_ms", "p50_tpot_ms", "p99_tpot_ms", "slo_attainment", "goodput")
    table, wins = [], []
    for rate in rates:
        row = {"rate": rate}
        for system in ("colocated", names[0], best_other):
            run = runs.get(f"{system}@{rate_tag(rate)}") if system else None
            if run is not None:
                row[system] = {k: run["metrics"][k] for k in keys}
        split_best = max((row[n]["goodput"] for n in (names[0], best_other) if n in row), default=None)
        colocated = row["colocated"]["goodput"]
        if split_best is not None and split_best > colocated:
            wins.append((rate, split_best / colocated if colocated > 0 else math.inf))
        table.append(row)
    return {"split": names[0], "best_other": best_other, "table": table,
            "split_wins_at": [r for r, _ in wins],
            "largest_goodput_ratio": max((x for _, x in wins), default=None)}


def _run_colocated(model: Path, workloads: dict[str, list], cfg: ServingConfig, sweep=None) -> dict:
    """Every workload; with `sweep` (rate -> its requests) also the sweep's rates, returned as
    runs["rates"]."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(cfg.colocated_cores or cfg.total_cores)
    runs = {}

    def run(tag: str, requests) -> dict:
        label = f"colocated@{tag}"
        runs[label] = run_benchmark(target, requests, _run_cfg(label, cfg))
        runs[label]["system"] = "colocated"
        return runs[label]["metrics"]

    try:
        with open_target("llm", str(model), max_num_batched_tokens=cfg.max_num_batched_tokens) as target:
            if sweep is not None:
                rates = sweep_rates(cfg, lambda rate: run(rate_tag(rate), sweep(rate))["slo_attainment"])
                return {"rates": rates, **runs}
            for tag, requests in workloads.items():
                run(tag, requests)
    finally:
        torch.set_num_threads(before)
    return runs


def _run_cluster(model: Path, split: str, local_prefill_tokens: int, workloads: dict[str, list],
                 cfg: ServingConfig, name: str) -> dict:
    p, d = parse_split(split)
    runs = {}
    with open_target("cluster", str(model), prefill=p, decode=d, local_prefill_tokens=local_prefill_tokens,
                     cpus_per_worker=cfg.total_cores / (p + d),
                     max_num_batched_tokens=cfg.max_num_batched_tokens) as target:
        for tag, requests in workloads.items():
            label = f"{name}@{tag}"
            before = handoff_totals(target.backend)
            result = run_benchmark(target, requests, _run_cfg(label, cfg))
            result["handoff"] = handoff_report(before, handoff_totals(target.backend), result["metrics"])
            result["system"] = name
            runs[label] = result
    return runs


def _run_cfg(label: str, cfg: ServingConfig) -> RunConfig:
    return RunConfig(label=label, max_concurrency=cfg.max_concurrency, progress=cfg.progress, slo=cfg.slo)


def run_serving_scenario(scenario: str, model: Path, cfg: ServingConfig) -> dict:
    import json

    from bench.checkpoints import SPECIAL_TOKENS

    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    result: dict = {"config": asdict(cfg), "runs": {}}
    if scenario == "serving":
        def at(rate: float) -> list:
            return generate_requests(WorkloadConfig(
                "prefill-heavy", cfg.num_requests, cfg.input_len, cfg.output_len, vocab_size=vocab,
                first_token_id=SPECIAL_TOKENS, max_model_len=4096, request_rate=rate,
                burstiness=cfg.burstiness, seed=cfg.seed))

        colocated = _run_colocated(model, {}, cfg, sweep=at)
        rates = colocated.pop("rates")
        result["runs"].update(colocated)
        workloads = {rate_tag(rate): at(rate) for rate in rates}
        for split in cfg.splits:
            result["runs"].update(_run_cluster(model, split, 0, workloads, cfg, split_name(split)))
        result["sweep"] = sweep_summary(result["runs"], rates, cfg.splits)
        first = rate_tag(cfg.rates[0])
        colocated = result["runs"][f"colocated@{first}"]["metrics"]
        split_run = result["runs"].get(f"{split_name(cfg.splits[0])}@{first}")
        if split_run is not None and split_run["metrics"]["p99_tpot_ms"] > 0:
            result["p99_tpot_ratio"] = colocated["p99_tpot_ms"] / split_run["metrics"]["p99_tpot_ms"]
            result["p99_tpot_ratio_rate"] = cfg.rates[0]
    elif scenario == "conditional":
        requests = generate_requests(WorkloadConfig(
            "sharegpt", cfg.conditional_requests, cfg.conditional_input_len, cfg.conditional_output_len,
            vocab_size=vocab, first_token_id=SPECIAL_TOKENS, max_model_len=2048,
            request_rate=cfg.conditional_rate, burstiness=cfg.burstiness, seed=cfg.seed))
        workloads = {rate_tag(cfg.conditional_rate): requests}
        result["short_prompt_share"] = sum(r.prompt_len <= cfg.local_prefill_tokens
                                           for r in requests) / len(requests)
        result["runs"].update(_run_colocated(model, workloads, cfg))
        result["runs"].update(_run_cluster(model, "1:1", 0, workloads, cfg, "disagg-1P1D-always"))
        result["runs"].update(_run_cluster(model, "1:1", cfg.local_prefill_tokens, workloads, cfg,
                                           f"disagg-1P1D-local<={cfg.local_prefill_tokens}"))
    else:
        raise ValueError(f"scenario: {scenario!r} not in serving, conditional")
    return result

