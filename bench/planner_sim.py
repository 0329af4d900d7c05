"""Discrete-event simulation of a disaggregated cluster from a WorkerProfile (no torch).

Mirrors the router and engines closely enough to plan with:
- a request arriving goes to the prefill worker with the fewest queued prompt tokens;
- an idle prefill worker takes queued prompts first come first served up to the token
  budget into one step (a prompt over the budget is one request of ceil(L / budget) chunks,
  each chunk paying the step's base cost);
- when the step ends, each prompt's first token exists; after the hand-off delay the
  request joins the decode worker with the fewest sequences, at its next step boundary;
- a decode worker runs continuous-batching steps over up to max_num_seqs sequences, one token
  each per step; a request finishes with its last token.
Records are bench.metrics.RequestRecords (first token, then the rest as one chunk), so TTFT,
TPOT, E2E and SLO attainment come out of the same code as for measured runs.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque

from bench.metrics import RequestRecord


class _Prefill:
    def __init__(self):
        self.queue: deque = deque()
        self.queued_tokens = 0
        self.busy = False
        self.draining = False
        self.starting = False

    @property
    def load(self) -> int:
        return len(self.queue)


class _Decode:
    def __init__(self):
        self.waiting: deque = deque()
        self.active: list = []
        self.busy = False
        self.draining = False
        self.starting = False

    @property
    def load(self) -> int:
        return len(self.waiting) + len(self.active)


class _Req:
    __slots__ = ("index", "arrival", "prompt_len", "output_len", "first", "generated", "finish")

    def __init__(self, index, arrival, prompt_len, output_len):
        self.index, self.arrival = index, arrival
        self.prompt_len, self.output_len = prompt_len, output_len
        self.first = self.finish = None
        self.generated = 0


def simulate(profile, requests, num_prefill: int, num_decode: int) -> tuple[list[RequestRecord], float]:
    """Simulated (records, duration) of `requests` (bench.workloads.BenchRequest) on P:D workers."""
    return ClusterSim(profile, num_prefill, num_decode).run(requests)


class ClusterSim:
    """The simulated cluster. Pools may change while it runs: `run(..., controller=f,
    interval_s=dt)` calls f(sim, now) every dt seconds of simulated time, and f may call
    `grow(kind, now, startup_s)` (the worker takes work once started) and `shrink(kind)` (the
    newest worker takes nothing new and leaves once its queue or streams are done).
    `timeline` records (time, prefill workers, decode workers) at each change."""

    def __init__(self, profile, num_prefill: int, num_decode: int):
        if num_prefill < 1 or num_decode < 1:
            raise ValueError("need at least one prefill and one decode worker")
        self.profile = profile
        self.prefills = [_Prefill() for _ in range(num_prefill)]
        self.decodes = [_Decode() for _ in range(num_decode)]
        self.timeline: list[tuple[float, int, int]] = [(0.0, num_prefill, num_decode)]
        self.worker_seconds = 0.0
        self.finished: list[_Req] = []  # since the controller last looked
        self.arrived: list[_Req] = []
        self._events: list = []
        self._tie = itertools.count()
        self._last_change = 0.0

    def serving(self, kind: str) -> list:
        pool = self.prefills if kind == "prefill" else self.decodes
        return [w for w in pool if not w.draining]

    def grow(self, kind: str, now: float, startup_s: float = 0.0) -> None:
        self._account(now)
        w = _Prefill() if kind == "prefill" else _Decode()
        w.draining = w.starting = True  # until it has started: nothing is sent to it
        (self.prefills if kind == "prefill" else self.decodes).append(w)
        self._push(now + startup_s, "started", w)

    def shrink(self, kind: str, now: float) -> None:
        live = self.serving(kind)
        if len(live) > 1:
            self._account(now)
            live[-1].draining = True
            self._retire_if_idle(live[-1], now)
            self._record(now)

    def run(self, requests, controller=None, interval_s: float | None = None) -> tuple[list[RequestRecord], float]:
        reqs = [_Req(i, r.arrival_s, r.prompt_len, r.output_len) for i, r in enumerate(requests)]
        for r in reqs:
            self._push(r.arrival, "arrive", r)
        if controller is not None:
            self._push(interval_s, "tick")
        pending, now = len(reqs), 0.0
        while self._events and pending:
            now, _, kind, payload = heapq.heappop(self._events)
            if kind == "tick":
                controller(self, now)
                self._push(now + interval_s, "tick")
                continue
            pending -= getattr(self, "_on_" + kind)(now, *payload)
        self._account(now)
        records = []
        for r in reqs:
            times = [r.first] if r.output_len <= 1 else [r.first, r.finish]
            counts = [1] if r.output_len <= 1 else [1, r.output_len - 1]
            records.append(RequestRecord(r.prompt_len, r.arrival, times, counts, success=True))
        start = min((r.arrival for r in reqs), default=0.0)
        return records, max(now - start, 1e-9)

    # ---- events; each returns how many requests finished ----

    def _on_arrive(self, now, r) -> int:
        self.arrived.append(r)
        w = min(self.serving("prefill"), key=lambda p: p.queued_tokens)
        w.queue.append(r)
        w.queued_tokens += r.prompt_len
        if not w.busy:
            self._start_prefill(w, now)
        return 0

    def _on_prefilled(self, now, w, batch, tokens) -> int:
        w.queued_tokens -= tokens
        done = 0
        for r in batch:
            r.generated = 1
            if r.output_len <= 1:
                r.first = r.finish = now
                self.finished.append(r)
                done += 1
            else:
                self._push(now + self.profile.handoff_s, "landed", r)
        w.busy = False
        if w.queue:
            self._start_prefill(w, now)
        self._retire_if_idle(w, now)
        return done

    def _on_landed(self, now, r) -> int:
        r.first = now  # the first token reaches the client with the hand-off
        d = min(self.serving("decode"), key=lambda x: x.load)
        d.waiting.append(r)
        if not d.busy:
            self._start_decode(d, now)
        return 0

    def _on_decoded(self, now, d) -> int:
        still, done = [], 0
        for r in d.active:
            r.generated += 1
            if r.generated >= r.output_len:
                r.finish = now
                self.finished.append(r)
                done += 1
            else:
                still.append(r)
        d.active = still
        self._start_decode(d, now)
        self._retire_if_idle(d, now)
        return done

    def _on_started(self, now, w) -> int:
        w.draining = w.starting = False
        self._record(now)
        return 0

    # ---- workers ----

    def _start_prefill(self, w: _Prefill, now: float) -> None:
        budget = self.profile.max_num_batched_tokens
        batch, tokens = [], 0
        while w.queue and (not batch or tokens + w.queue[0].prompt_len <= budget):
            r = w.queue.popleft()
            batch.append(r)
            tokens += r.prompt_len
        chunks = sum(max(1, math.ceil(r.prompt_len / budget)) for r in batch)
        duration = self.profile.prefill_step_s([r.prompt_len for r in batch]) + \
            self.profile.prefill_base_s * (chunks - len(batch))
        w.busy = True
        self._push(now + duration, "prefilled", w, batch, tokens)

    def _start_decode(self, d: _Decode, now: float) -> None:
        while d.waiting and len(d.active) < self.profile.max_num_seqs:
            d.active.append(d.waiting.popleft())
        if not d.active:
            d.busy = False
            return
        d.busy = True
        self._push(now + self.profile.decode_step_s(len(d.active)), "decoded", d)

    def _retire_if_idle(self, w, now: float) -> None:
        pool = self.prefills if isinstance(w, _Prefill) else self.decodes
        if w.draining and not w.starting and not w.busy and w.load == 0 and w in pool:
            self._account(now)
            pool.remove(w)
            self._record(now)

    def _account(self, now: float) -> None:
        self.worker_seconds += (len(self.prefills) + len(self.decodes)) * (now - self._last_change)
        self._last_change = now

    def _record(self, now: float) -> None:
        counts = (len(self.serving("prefill")), len(self.serving("decode")))
        if counts != self.timeline[-1][1:]:
            self.timeline.append((now, *counts))

    def _push(self, t, kind, *payload):
        heapq.heappush(self._events, (t, next(self._tie), kind, payload))
