"""The reference point: transformers' `generate` in static batches, timed token by token.

Offline only (every request queued at t=0, batches run one after another, as a script
around `generate` would). A streamer stamps each generated step, so TTFT/TPOT/ITL come out
of the same bench.metrics code as ours. Prompts of unequal length are left-padded;
outputs are forced to their requested length (min_new_tokens) like ignore_eos on our side.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from bench.metrics import RequestRecord
from bench.workloads import BenchRequest


@dataclass
class HFConfig:
    batch_size: int = 8
    pad_token_id: int = 0

    def __post_init__(self):
        if self.batch_size < 1:
            raise ValueError(f"batch_size: must be >= 1, got {self.batch_size!r}")


class _StepClock:
    """transformers streamer: the first put() is the prompt, each later one is a decode step."""

    def __init__(self):
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def hf_generate(model, requests: list[BenchRequest], cfg: HFConfig) -> tuple[list[RequestRecord], float]:
    """Run every request through `model.generate`; records as if all were sent at t=0."""
    import torch

    records: list[RequestRecord] = []
    t0 = time.perf_counter()
    with torch.inference_mode():
        for first in range(0, len(requests), cfg.batch_size):
            batch = requests[first:first + cfg.batch_size]
            width = max(r.prompt_len for r in batch)
            ids = torch.full((len(batch), width), cfg.pad_token_id, dtype=torch.long)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for row, r in enumerate(batch):
                ids[row, width - r.prompt_len:] = torch.tensor(r.prompt_token_ids)
                mask[row, width - r.prompt_len:] = 1
            steps = max(r.output_len for r in batch)
            clock = _StepClock()
            model.generate(ids, attention_mask=mask, max_new_tokens=steps, min_new_tokens=steps,
                           do_sample=False, streamer=clock, pad_token_id=cfg.pad_token_id)
            for r in batch:
                times = clock.times[:r.output_len]
                records.append(RequestRecord(r.prompt_len, t0, times, [1] * len(times),
                                             success=len(times) == r.output_len))
    return records, time.perf_counter() - t0


def warm_up(model) -> None:
    """One tiny generate: first-call allocations and lazy imports stay out of the timing."""
    import torch

    with torch.inference_mode():
        model.generate(torch.tensor([[5, 6, 7, 8]]), max_new_tokens=2, do_sample=False, pad_token_id=0)
