"""One caller request as the router follows it across attempts.

An attempt is one placement on workers under its own worker-side id, so nothing a dead or
abandoned attempt still emits can reach the caller. When an attempt fails in the plumbing
(a worker died, a hand-off broke or timed out) the next one resumes from exactly what the
caller has received: its tokens, its text, its logprobs; the caller sees one stream.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field, replace

from engine.output import Cumulative, RequestOutput
from engine.request import Resume
from engine.sampling_params import SamplingParams
from engine.trace import span


@dataclass
class Failure:
    """An attempt ended without finishing the request."""

    error: str
    retryable: bool  # True: the request itself was fine; run it again elsewhere


@dataclass
class PrefillFirst:
    """A split attempt's first token straight from the prefill worker, sent as it is sampled
    (a RequestOutput delta with its logprobs and the prompt's). The decode worker's first
    output repeats that one token once the hand-off lands; whichever arrives second adds
    nothing."""

    output: RequestOutput


@dataclass
class Tracked:
    request_id: str  # the caller's
    prompt_ids: list[int]
    params: SamplingParams
    attempt: int = 0
    so_far: Cumulative = field(init=False)  # what the caller has been sent: tokens, text, logprobs
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    events: asyncio.Queue = field(default_factory=asyncio.Queue)  # the current attempt's
    split: bool = False  # the current attempt prefills on a prefill worker
    # Split attempts: the prefill worker's report once its send is done (a PrefillOutcome, or
    # None when it did not hand off). It can arrive after the decode worker's last token.
    prefill_outcome: asyncio.Future | None = None
    tokens_this_attempt: int = 0  # delivered to the caller
    decoded_this_attempt: int = 0  # sent by the decode worker (the hand-off's first token too)
    placing: object = None  # the decode worker call placing the current attempt, until it returns
    whole: bool = True  # False: outputs are deltas until the final one (Cumulative.add)
    spans: list = field(default_factory=list)  # the router's own (engine.trace), every attempt's
    # wall minus monotonic, read once: the router's spans of one request share one conversion,
    # so two that start at one instant (request, first token) start at one wall time
    clock_offset_ns: int = field(default_factory=lambda: time.time_ns() - time.monotonic_ns())

    def __post_init__(self):
        self.so_far = Cumulative(self.prompt_ids, self.params.logprobs is not None)

    @property
    def tokens(self) -> list[int]:
        return self.so_far.token_ids

    @property
    def worker_id(self) -> str:
        return self.request_id if self.attempt == 0 else f"{self.request_id}#retry{self.attempt}"

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.tokens)

    def resume(self) -> Resume | None:
        return Resume(tuple(self.tokens), len(self.so_far.text)) if self.tokens else None

    def next_attempt(self) -> None:
        self.attempt += 1
        self.events = asyncio.Queue()
        self.split, self.prefill_outcome, self.tokens_this_attempt, self.decoded_this_attempt = False, None, 0, 0

    def classify(self, event) -> Failure | None:
        """A Failure for events that end the attempt without finishing the request."""
        if isinstance(event, Failure):
            return event
        if isinstance(event, PrefillFirst):
            return None
        if event.error is not None and self.split and self.decoded_this_attempt == 0:
            return Failure(event.error, retryable=True)  # the decode side lost the hand-off
        return None

    async def delivered(self, event: RequestOutput | PrefillFirst) -> RequestOutput | None:
        """The worker's output (a delta: RequestOutput.delta) as the caller must see it, whole,
        recorded as delivered; None when it adds nothing the caller has not got.
        A split attempt's first token comes from the prefill worker (PrefillFirst) with its
        logprobs and the prompt's. When the decode worker's copy of it comes first, that one
        waits for the prefill worker's report for those logprobs (the decode worker never saw
        them), as does the attempt's last output, for how much of the prompt the prefill
        worker's cache supplied."""
        early = isinstance(event, PrefillFirst)
        out = event.output if early else event
        if early and self.tokens_this_attempt:
            return None
        if not early and out.error is None and out.new_token_ids:
            repeats_first = self.decoded_this_attempt == 0 and self.split and self.tokens_this_attempt > 0
            self.decoded_this_attempt += len(out.new_token_ids)
            if repeats_first:  # the hand-off's output: that one token (its logprob never reached
                # the decode worker), and the caller has it
                out = replace(out, new_token_ids=out.new_token_ids[1:], new_text="")
                if not out.new_token_ids and not out.finished:
                    return None
        first_token = out.error is None and bool(out.new_token_ids) and self.tokens_this_attempt == 0
        wants_prefill_side = self.params.logprobs is not None or self.params.prompt_logprobs is not None
        prefill = None
        if self.prefill_outcome is not None and out.error is None and not early and (
                out.finished or (first_token and wants_prefill_side) or self.prefill_outcome.done()):
            prefill = await self.prefill_outcome
        if out.error is None and out.new_token_ids:
            self.tokens_this_attempt += len(out.new_token_ids)
            if self.first_token_time is None:
                self.first_token_time = out.first_token_time or time.monotonic()
                self.note("first token", self.arrival_time)  # from arrival until the caller gets it
        first_logprob = prefill.first_logprob if first_token and prefill is not None else None
        prompt_logprobs = prefill.prompt_logprobs if first_token and prefill is not None else None
        out = self.so_far.add(out, first_logprob, self.whole, prompt_logprobs)
        out.request_id = self.request_id
        if prefill is not None:
            out.num_cached_tokens = prefill.num_cached_tokens
        out.arrival_time, out.first_token_time = self.arrival_time, self.first_token_time
        if out.finished:  # the whole story: the router's spans, the prefill worker's, the decode worker's
            out.spans = (*span("request", self.arrival_time, time.monotonic(), "router", self.clock_offset_ns), *self.spans,
                         *(prefill.spans if prefill is not None else ()), *out.spans)
        return out

    def note(self, name: str, start_s: float) -> None:
        """A span of the router's own, from `start_s` (monotonic) to now."""
        self.spans += span(name, start_s, time.monotonic(), "router", self.clock_offset_ns)

    def failed(self, error: str) -> RequestOutput:
        return RequestOutput(self.request_id, self.prompt_ids, list(self.tokens), "", True, "error",
                             error=error, arrival_time=self.arrival_time,
                             first_token_time=self.first_token_time, finish_time=time.monotonic())

    def aborted(self) -> RequestOutput:
        return RequestOutput(self.request_id, self.prompt_ids, list(self.tokens), "", True, "abort",
                             arrival_time=self.arrival_time, first_token_time=self.first_token_time,
                             finish_time=time.monotonic())
