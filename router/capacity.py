"""The capacity model of one worker: its fitted step times (WorkerProfile, measured by
`splitserve bench plan`) and what they imply for pool sizes (CapacityModel, which the
autoscaler uses to size its steps and the planner to simulate a split)."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass
class WorkerProfile:
    """Seconds. Prefill step: base + per_token*L + per_token2*L^2 per prompt; decode step:
    base + per_seq*B for B running sequences; hand-off: per request."""

    prefill_base_s: float
    prefill_per_token_s: float
    prefill_per_token2_s: float
    decode_base_s: float
    decode_per_seq_s: float
    handoff_s: float = 0.0
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64

    def __post_init__(self):
        for name, value in asdict(self).items():
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"{name}: must be a finite number >= 0, got {value!r}")
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be >= 1")

    def prefill_step_s(self, prompt_lens: list[int]) -> float:
        return (self.prefill_base_s + self.prefill_per_token_s * sum(prompt_lens)
                + self.prefill_per_token2_s * sum(n * n for n in prompt_lens))

    def decode_step_s(self, batch: int) -> float:
        return self.decode_base_s + self.decode_per_seq_s * batch


@dataclass
class CapacityModel:
    """What one worker can do, from its fitted profile (WorkerProfile). Prefill workers are
    sized to run at `prefill_utilization` at most (a queue at higher load makes TTFT grow
    without bound); decode workers to batches whose step time is within `tpot_headroom` of
    the TPOT SLO."""

    profile: WorkerProfile
    prefill_utilization: float = 0.7
    tpot_headroom: float = 0.8

    def __post_init__(self):
        if not 0 < self.prefill_utilization <= 1 or not 0 < self.tpot_headroom <= 1:
            raise ValueError("capacity model: prefill_utilization and tpot_headroom must be in (0, 1]")

    @classmethod
    def from_file(cls, path: str | Path, **options) -> CapacityModel:
        """A `bench plan --out` report (its "profile") or a bare profile JSON."""
        try:
            data = json.loads(Path(path).read_text())
            return cls(WorkerProfile(**data.get("profile", data)), **options)
        except (OSError, ValueError, TypeError) as e:
            raise ValueError(f"capacity profile {path}: {e}") from e

    def prefill_tokens_per_s(self, mean_prompt_len: float) -> float:
        """Prompt tokens one worker computes per second, steps packed with prompts of this length."""
        budget = self.profile.max_num_batched_tokens
        length = max(1, min(budget, round(mean_prompt_len)))
        per_step = max(1, budget // length)
        return per_step * length / self.profile.prefill_step_s([length] * per_step)

    def prefill_workers(self, prompt_tokens_per_s: float, mean_prompt_len: float) -> int:
        if prompt_tokens_per_s <= 0:
            return 1
        capacity = self.prefill_tokens_per_s(mean_prompt_len) * self.prefill_utilization
        return max(1, math.ceil(prompt_tokens_per_s / capacity))

    def decode_batch(self, slo_tpot_s: float) -> int:
        """The largest batch whose step meets the TPOT SLO with headroom (at least 1)."""
        limit = slo_tpot_s * self.tpot_headroom
        best = 1
        for batch in range(1, self.profile.max_num_seqs + 1):
            if self.profile.decode_step_s(batch) <= limit:
                best = batch
        return best

    def decode_workers(self, running: int, slo_tpot_s: float) -> int:
        return max(1, math.ceil(running / self.decode_batch(slo_tpot_s)))
