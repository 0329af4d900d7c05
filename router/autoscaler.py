"""The autoscaler: changes the prefill and decode pool sizes from live signals and SLOs.

Every `interval_s` it reads the cluster's signals (queued prompt tokens on the prefill workers,
TTFT and TPOT of recent requests against the SLOs, decode slot and KV-block occupancy) and
decides per kind: grow the kind that limits goodput, shrink one that sits idle. Hysteresis
keeps it from flapping: a kind grows only after `up_intervals` pressured readings in a row,
shrinks after `down_intervals` idle ones, and is left alone for `cooldown_intervals` after a
change; shrinking also needs the load to fit the smaller pool with room to spare. Every
decision is logged and counted (splitserve_autoscaler_decisions_total{kind, direction, reason}).

Given the planner's performance model of one worker (router.capacity.CapacityModel, from
`bench plan --out`),
it also sizes its steps: how many prefill workers the prompt tokens arriving per second need,
how many decode workers the running sequences need at the largest batch whose step time meets
the TPOT SLO. A kind below that grows to it in one step (reason "capacity" when no SLO is
breached yet), and a kind shrinks only when the model says one worker fewer is enough.
The policy below has no Ray in it; router/scaling.py runs it against the real pools.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field

from router.capacity import CapacityModel

log = logging.getLogger(__name__)
KINDS = ("prefill", "decode")


@dataclass
class AutoscaleConfig:
    prefill: tuple[int, int] = (1, 4)  # min, max workers
    decode: tuple[int, int] = (1, 8)
    slo_ttft_s: float = 1.0
    slo_tpot_s: float = 0.1
    interval_s: float = 5.0
    up_intervals: int = 2
    down_intervals: int = 6
    cooldown_intervals: int = 3
    prefill_queue_tokens: int = 8192  # queued prompt tokens per prefill worker that count as pressure
    high_occupancy: float = 0.85  # decode slots or blocks
    low_occupancy: float = 0.3  # what the remaining workers may reach after a shrink
    capacity: CapacityModel | None = None  # the planner's model of one worker; None: steps of one

    def __post_init__(self):
        for kind in KINDS:
            low, high = getattr(self, kind)
            if not 1 <= low <= high:
                raise ValueError(f"autoscale {kind}: need 1 <= min <= max, got {low}:{high}")
        if self.slo_ttft_s <= 0 or self.slo_tpot_s <= 0 or self.interval_s <= 0:
            raise ValueError("autoscale: SLOs and interval must be > 0")
        if not 0 < self.low_occupancy < self.high_occupancy <= 1:
            raise ValueError("autoscale: need 0 < low_occupancy < high_occupancy <= 1")

    @classmethod
    def parse(cls, spec: str, **options) -> AutoscaleConfig:
        """`prefill=1:4,decode=1:8` (either part may be left out)."""
        bounds = {}
        for part in filter(None, (p.strip() for p in spec.split(","))):
            kind, _, span = part.partition("=")
            low, _, high = span.partition(":")
            if kind not in KINDS or not low.isdigit() or not high.isdigit():
                raise ValueError(f"--autoscale: {part!r} is not KIND=MIN:MAX with KIND prefill or decode")
            bounds[kind] = (int(low), int(high))
        return cls(**bounds, **options)


@dataclass
class Signals:
    prefill_workers: int
    decode_workers: int
    queued_prompt_tokens: int = 0
    ttft_p90_s: float | None = None  # of requests finished since the last reading; None: none
    tpot_p90_s: float | None = None
    decode_slot_occupancy: float = 0.0
    decode_block_occupancy: float = 0.0
    prompt_tokens_per_s: float = 0.0  # arrived since the last reading (the capacity model's input)
    mean_prompt_len: float = 0.0
    decode_running: int = 0  # sequences decoding or waiting on decode workers


@dataclass
class Decision:
    kind: str
    delta: int  # workers to add (> 0) or remove (-1)
    reason: str  # a metric label: ttft_slo, prefill_queue, tpot_slo, decode_occupancy, capacity, idle, bounds
    detail: str = ""  # the numbers, for the log


@dataclass
class Autoscaler:
    config: AutoscaleConfig
    _pressured: Counter = field(default_factory=Counter)
    _idle: Counter = field(default_factory=Counter)
    _cooldown: Counter = field(default_factory=Counter)
    decisions: Counter = field(default_factory=Counter)  # (kind, direction, reason) -> count
    last: list[Decision] = field(default_factory=list)  # the latest decisions, for status()

    def decide(self, s: Signals) -> list[Decision]:
        out = []
        for kind in KINDS:
            workers = s.prefill_workers if kind == "prefill" else s.decode_workers
            low, high = getattr(self.config, kind)
            pressure, idle = self._read(kind, s, workers)
            needed = self._needed(kind, s)
            if needed is not None:
                if pressure is None and needed > workers:
                    pressure = ("capacity", f"the capacity model needs {needed} {kind} workers for the load")
                if idle is not None and needed >= workers:
                    idle = None  # the model says the smaller pool would not keep up
            self._pressured[kind] = self._pressured[kind] + 1 if pressure else 0
            self._idle[kind] = self._idle[kind] + 1 if idle and not pressure else 0
            if self._cooldown[kind] > 0:
                self._cooldown[kind] -= 1
                continue
            if pressure and self._pressured[kind] >= self.config.up_intervals and workers < high:
                step = max(1, min(high, needed) - workers) if needed is not None else 1
                out.append(Decision(kind, step, *pressure))
            elif idle and self._idle[kind] >= self.config.down_intervals and workers > low:
                out.append(Decision(kind, -1, *idle))
            elif workers < low or workers > high:
                out.append(Decision(kind, 1 if workers < low else -1, "bounds", f"{workers} outside {low}:{high}"))
        for d in out:
            self._pressured[d.kind] = self._idle[d.kind] = 0
            self._cooldown[d.kind] = self.config.cooldown_intervals
            self.decisions[(d.kind, "up" if d.delta > 0 else "down", d.reason)] += 1
            log.info("autoscaler: %s %s by %d (%s): %s", "grow" if d.delta > 0 else "shrink", d.kind,
                     abs(d.delta), d.reason, d.detail)
        if out:
            self.last = out
        return out

    def _needed(self, kind: str, s: Signals) -> int | None:
        model = self.config.capacity
        if model is None:
            return None
        if kind == "prefill":
            return model.prefill_workers(s.prompt_tokens_per_s, s.mean_prompt_len)
        return model.decode_workers(s.decode_running, self.config.slo_tpot_s)

    def _read(self, kind: str, s: Signals, workers: int) -> tuple[tuple[str, str] | None, tuple[str, str] | None]:
        """((reason, detail) if the kind is pressured, (reason, detail) if it is idle)."""
        c = self.config
        if kind == "prefill":
            if s.ttft_p90_s is not None and s.ttft_p90_s > c.slo_ttft_s:
                return ("ttft_slo", f"TTFT p90 {s.ttft_p90_s * 1000:.0f} ms over the {c.slo_ttft_s * 1000:.0f} ms SLO"), None
            if s.queued_prompt_tokens > c.prefill_queue_tokens * workers:
                return ("prefill_queue", f"{s.queued_prompt_tokens} prompt tokens queued on {workers} workers"), None
            calm = s.ttft_p90_s is None or s.ttft_p90_s < c.slo_ttft_s / 2
            if calm and s.queued_prompt_tokens == 0 and workers > 1:
                return None, ("idle", "no prompt queued and TTFT under half the SLO")
            return None, None
        if s.tpot_p90_s is not None and s.tpot_p90_s > c.slo_tpot_s:
            return ("tpot_slo", f"TPOT p90 {s.tpot_p90_s * 1000:.0f} ms over the {c.slo_tpot_s * 1000:.0f} ms SLO"), None
        busiest = max(s.decode_slot_occupancy, s.decode_block_occupancy)
        if busiest > c.high_occupancy:
            return ("decode_occupancy", f"decode slots/blocks {busiest:.0%} occupied"), None
        calm = s.tpot_p90_s is None or s.tpot_p90_s < c.slo_tpot_s / 2
        if calm and workers > 1 and busiest * workers / (workers - 1) < c.low_occupancy:
            return None, ("idle", f"decode occupancy {busiest:.0%} fits one worker fewer")
        return None, None

    def status(self) -> dict:
        return {"decisions": [{"kind": k, "direction": d, "reason": r, "count": n}
                              for (k, d, r), n in sorted(self.decisions.items())],
                "last": [f"{d.kind} {d.delta:+d}: {d.detail}" for d in self.last]}
