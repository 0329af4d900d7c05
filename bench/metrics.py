"""Serving metrics from per-request timestamps, as vLLM's benchmark_serving reports them.

- TTFT: send to first token.  TPOT: (e2e - ttft) / (output_tokens - 1), per request.
- ITL: gaps between successive streamed chunks (a chunk may carry several tokens).
- E2EL: send to last token.
- Throughput: completed requests, output tokens, and prompt + output tokens per second
  of benchmark duration.
- Goodput (DistServe): completed requests per second that met every given SLO;
  SLO attainment: the fraction of all requests (failed ones count as misses) that met them.
Times are seconds in, milliseconds in the reported latency statistics (vLLM's units).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

DEFAULT_PERCENTILES = (50.0, 90.0, 99.0)
SLO_KEYS = ("ttft", "tpot", "e2el")


@dataclass
class RequestRecord:
    prompt_len: int
    start: float  # when the request was sent
    chunk_times: list[float] = field(default_factory=list)  # arrival of each streamed chunk
    chunk_tokens: list[int] = field(default_factory=list)  # tokens in each chunk
    success: bool = False
    error: str | None = None

    @property
    def output_len(self) -> int:
        return sum(self.chunk_tokens)

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] - self.start if self.chunk_times else None

    @property
    def e2el(self) -> float | None:
        return self.chunk_times[-1] - self.start if self.chunk_times else None

    @property
    def tpot(self) -> float | None:
        if self.output_len < 2:
            return None
        return (self.e2el - self.ttft) / (self.output_len - 1)

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]


@dataclass
class SLO:
    """Latency targets in seconds; None: not part of the goodput test."""

    ttft: float | None = None
    tpot: float | None = None
    e2el: float | None = None

    def __post_init__(self):
        for key in SLO_KEYS:
            value = getattr(self, key)
            if value is not None and not (isinstance(value, (int, float)) and value > 0):
                raise ValueError(f"{key}: an SLO must be a positive number of seconds, got {value!r}")

    @property
    def empty(self) -> bool:
        return all(getattr(self, k) is None for k in SLO_KEYS)

    def met_by(self, record: RequestRecord) -> bool:
        if not record.success:
            return False
        for key in SLO_KEYS:
            target = getattr(self, key)
            value = getattr(record, key)
            # TPOT of a one-token output is undefined: nothing to miss.
            if target is not None and value is not None and value > target:
                return False
        return True

    def to_dict(self) -> dict:
        return {f"{k}_ms": None if getattr(self, k) is None else getattr(self, k) * 1000 for k in SLO_KEYS}


def percentile(values: list[float], q: float) -> float:
    """numpy's default (linear interpolation between closest ranks), without numpy."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def latency_stats(values_s: list[float], percentiles=DEFAULT_PERCENTILES) -> dict:
    """mean / median / std / p.. of a list of seconds, in milliseconds."""
    ms = [v * 1000.0 for v in values_s]
    if not ms:
        stats = {"mean": math.nan, "median": math.nan, "std": math.nan}
    else:
        mean = sum(ms) / len(ms)
        stats = {"mean": mean, "median": percentile(ms, 50.0),
                 "std": math.sqrt(sum((v - mean) ** 2 for v in ms) / len(ms))}
    for q in percentiles:
        stats[f"p{q:g}"] = percentile(ms, q)
    return stats


def compute_metrics(records: list[RequestRecord], duration_s: float, slo: SLO | None = None,
                    percentiles=DEFAULT_PERCENTILES) -> dict:
    """vLLM's result fields (flattened as mean_ttft_ms, p99_tpot_ms, ...) plus goodput."""
    if duration_s <= 0:
        raise ValueError(f"duration_s: must be positive, got {duration_s!r}")
    done = [r for r in records if r.success]
    input_tokens = sum(r.prompt_len for r in done)
    output_tokens = sum(r.output_len for r in done)
    result = {
        "num_requests": len(records),
        "completed": len(done),
        "failed": len(records) - len(done),
        "duration_s": duration_s,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(done) / duration_s,
        "output_throughput": output_tokens / duration_s,
        "total_token_throughput": (input_tokens + output_tokens) / duration_s,
    }
    series = {
        "ttft": [r.ttft for r in done if r.ttft is not None],
        "tpot": [r.tpot for r in done if r.tpot is not None],
        "itl": [gap for r in done for gap in r.itls],
        "e2el": [r.e2el for r in done if r.e2el is not None],
    }
    for name, values in series.items():
        for stat, value in latency_stats(values, percentiles).items():
            result[f"{stat}_{name}_ms"] = value
    slo = slo or SLO()
    if not slo.empty:
        good = sum(slo.met_by(r) for r in records)
        result["slo"] = slo.to_dict()
        result["goodput"] = good / duration_s
        result["slo_attainment"] = good / len(records) if records else math.nan
    errors = sorted({r.error for r in records if r.error})
    if errors:
        result["errors"] = errors[:10]
    return result


def records_to_dicts(records: list[RequestRecord]) -> list[dict]:
    """Per-request timings (seconds), for the JSON results and plots."""
    return [{"prompt_len": r.prompt_len, "output_len": r.output_len, "success": r.success,
             "ttft": r.ttft, "tpot": r.tpot, "e2el": r.e2el, "error": r.error} for r in records]


def jsonable(value):
    """Non-finite floats become strings ("inf", "nan") so the file is strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    return value


def dump_json(value, path) -> None:
    with open(path, "w") as f:
        json.dump(jsonable(value), f, indent=2)
        f.write("\n")


def summary_line(name: str, m: dict) -> str:
    """One human line per run: the numbers people compare first."""
    line = (f"{name:<28} {m['completed']:>4}/{m['num_requests']:<4} req  "
            f"{m['request_throughput']:7.2f} req/s  {m['output_throughput']:8.1f} out tok/s  "
            f"TTFT p50 {m['median_ttft_ms']:8.1f} p99 {m['p99_ttft_ms']:8.1f} ms  "
            f"TPOT p50 {m['median_tpot_ms']:7.2f} p99 {m['p99_tpot_ms']:7.2f} ms")
    if "slo_attainment" in m:
        line += f"  SLO {m['slo_attainment'] * 100:5.1f}%  goodput {m['goodput']:.2f} req/s"
    return line
