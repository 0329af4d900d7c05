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


class _Decode:
    def __init__(self):
        self.waiting: deque = deque()
        self.active: list = []
        self.busy = False

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
    if num_prefill < 1 or num_decode < 1:
        raise ValueError("need at least one prefill and one decode worker")
    events: list = []
    tie = itertools.count()

    def push(t, kind, *payload):
        heapq.heappush(events, (t, next(tie), kind, payload))

    prefills = [_Prefill() for _ in range(num_prefill)]
    decodes = [_Decode() for _ in range(num_decode)]
    reqs = [_Req(i, r.arrival_s, r.prompt_len, r.output_len) for i, r in enumerate(requests)]
    for r in reqs:
        push(r.arrival, "arrive", r)
    budget = profile.max_num_batched_tokens

    def start_prefill(w: _Prefill, now: float) -> None:
        batch, tokens = [], 0
        while w.queue and (not batch or tokens + w.queue[0].prompt_len <= budget):
            r = w.queue.popleft()
            batch.append(r)
            tokens += r.prompt_len
        chunks = sum(max(1, math.ceil(r.prompt_len / budget)) for r in batch)
        duration = profile.prefill_step_s([r.prompt_len for r in batch]) + \
            profile.prefill_base_s * (chunks - len(batch))
        w.busy = True
        push(now + duration, "prefilled", w, batch, tokens)

    def start_decode(d: _Decode, now: float) -> None:
        while d.waiting and len(d.active) < profile.max_num_seqs:
            d.active.append(d.waiting.popleft())
        if not d.active:
            d.busy = False
            return
        d.busy = True
        push(now + profile.decode_step_s(len(d.active)), "decoded", d)

    now = 0.0
    while events:
        now, _, kind, payload = heapq.heappop(events)
        if kind == "arrive":
            (r,) = payload
            w = min(prefills, key=lambda p: p.queued_tokens)
            w.queue.append(r)
            w.queued_tokens += r.prompt_len
            if not w.busy:
                start_prefill(w, now)
        elif kind == "prefilled":
            w, batch, tokens = payload
            w.queued_tokens -= tokens
            for r in batch:
                r.generated = 1
                if r.output_len <= 1:
                    r.first = r.finish = now
                else:
                    push(now + profile.handoff_s, "landed", r)
            w.busy = False
            if w.queue:
                start_prefill(w, now)
        elif kind == "landed":
            (r,) = payload
            r.first = now  # the first token reaches the client with the hand-off
            d = min(decodes, key=lambda x: x.load)
            d.waiting.append(r)
            if not d.busy:
                start_decode(d, now)
        else:  # "decoded"
            (d,) = payload
            still = []
            for r in d.active:
                r.generated += 1
                if r.generated >= r.output_len:
                    r.finish = now
                else:
                    still.append(r)
            d.active = still
            start_decode(d, now)
    records = []
    for r in reqs:
        times = [r.first] if r.output_len <= 1 else [r.first, r.finish]
        counts = [1] if r.output_len <= 1 else [1, r.output_len - 1]
        records.append(RequestRecord(r.prompt_len, r.arrival, times, counts, success=True))
    start = min((r.arrival for r in reqs), default=0.0)
    return records, max(now - start, 1e-9)
