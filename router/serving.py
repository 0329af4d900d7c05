"""What gRPC and HTTP share: admission, one generation as Delta/Final events, timings, metrics.

Everything here runs on the front door's event loop; the in-flight count needs no lock because
only that loop touches it.
"""

from __future__ import annotations

import asyncio
import functools
import time
from dataclasses import dataclass, field
from collections.abc import AsyncIterator

from engine.prompts import fitting_prompt_ids
from engine.sampling_params import InvalidRequest, SamplingParams
from engine.structured import GrammarCompiler
from router.backend import Backend, Overloaded, Unavailable
from router.metrics import FrontDoorMetrics


class GenerationFailed(RuntimeError):
    """The backend ended the request with finish_reason "error" (an internal failure)."""


@dataclass
class Delta:
    token_ids: list[int]
    text: str
    logprobs: list[dict] = field(default_factory=list)  # {"token": lp, "top": [(id, lp)]} per token
    # The first delta of a request with SamplingParams.prompt_logprobs: the prompt's ids and an
    # entry per prompt token ({"token": lp, "rank": r, "top": [...]}; the first None).
    prompt_token_ids: list[int] | None = None
    prompt_logprobs: list[dict | None] | None = None


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass
class Final:
    """The last event of a generation; comes after every Delta."""

    request_id: str
    finish_reason: str  # "stop", "length" or "abort" (aborted through abort())
    usage: Usage
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    logprobs: list[dict]
    time_to_first_token_s: float
    time_per_output_token_s: float
    e2e_s: float
    prompt_logprobs: list[dict | None] | None = None
    spans: tuple = ()  # engine.trace.Span: where the request's time went


class ServingCore:
    def __init__(self, backend: Backend, max_queued: int, metrics_compat: str = "none"):
        self.backend = backend
        self.max_queued = max_queued
        self.in_flight = 0
        self.metrics = FrontDoorMetrics(backend.status, metrics_compat,
                                        backend.info.model_name if metrics_compat != "none" else "")

    @functools.cached_property
    def grammars(self) -> GrammarCompiler:
        info = self.backend.info
        return GrammarCompiler(self.backend.tokenizer, info.vocab_size, info.eos_token_ids)

    async def ready(self) -> bool:
        return bool(await asyncio.to_thread(self.backend.ready))

    async def status(self) -> dict:
        return await asyncio.to_thread(self.backend.status)

    async def resize(self, method: str, *args, **kwargs) -> dict:
        """Elastic pools (router/scaling.py): `scale` or `restart_workers` on the backend."""
        if not hasattr(self.backend, method):
            raise NotImplementedError(f"{method}: this server's backend ({type(self.backend).__name__}) "
                                      "has no worker pools to change")
        return await asyncio.to_thread(getattr(self.backend, method), *args, **kwargs)

    async def metrics_text(self) -> bytes:
        return await asyncio.to_thread(self.metrics.render)

    def count_invalid(self, protocol: str) -> None:
        """A request refused while parsing, before it reached generate()."""
        self.metrics.requests.labels(protocol, "invalid").inc()

    async def abort(self, request_id: str) -> bool:
        return bool(await self.backend.abort(request_id))

    async def generate(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                       protocol: str) -> AsyncIterator[Delta | Final]:
        """Deltas, then one Final. Close it (contextlib.aclosing) to abort the request early.

        Raises Overloaded at once when max_queued requests are in flight, InvalidRequest for a
        prompt or max_tokens that cannot fit, and InvalidRequest, Overloaded, Unavailable from
        the backend before the first event.
        """
        outcome = "cancelled"  # stays so unless the request finishes or fails
        if self.in_flight >= self.max_queued:
            self.metrics.requests.labels(protocol, "overloaded").inc()
            raise Overloaded(f"{self.in_flight} requests in flight (limit {self.max_queued})")
        self.in_flight += 1
        self.metrics.in_flight.inc()
        start = last_token_at = time.monotonic()
        first_token_at = None
        prompt_sent = False  # a request's prompt logprobs go out once, with its first delta
        stream = None
        try:
            ids = await self._checked_prompt(prompt, params)
            if params.structured_output is not None:  # compiled here, off every engine loop
                await asyncio.to_thread(self.grammars.compile, params.structured_output)
            stream = self.backend.stream(request_id, ids, params, whole=False)  # whole: the final only
            async for out in stream:
                now = time.monotonic()
                new = list(out.new_token_ids)
                if new:
                    if first_token_at is None:
                        first_token_at = now
                        self.metrics.ttft.observe(now - start)
                    else:
                        gap = (now - last_token_at) / len(new)  # tokens that arrive together share it
                        for _ in new:
                            self.metrics.itl.observe(gap)
                    last_token_at = now
                if out.finished and out.finish_reason == "error":
                    outcome = "error"
                    raise GenerationFailed(out.error or "the backend failed this request")
                prompt_logprobs = None if prompt_sent else out.prompt_logprobs  # whole outputs repeat them
                prompt_sent = prompt_sent or prompt_logprobs is not None
                if new or out.new_text or prompt_logprobs is not None:
                    yield Delta(new, out.new_text, list(out.new_logprobs or []),
                                ids if prompt_logprobs is not None else None, prompt_logprobs)
                if out.finished:
                    outcome = out.finish_reason or "stop"
                    self.metrics.count_finished(outcome)
                    yield self._final(out, start, first_token_at, now)
                    return
        except InvalidRequest:
            outcome = "invalid"
            raise
        except Overloaded:
            outcome = "overloaded"
            raise
        except Unavailable:
            outcome = "unavailable"
            raise
        except (GenerationFailed, asyncio.CancelledError, GeneratorExit):
            raise
        except Exception:
            outcome = "error"
            raise
        finally:
            if stream is not None and hasattr(stream, "aclose"):
                await stream.aclose()  # the backend aborts and frees an unfinished request
            self.in_flight -= 1
            self.metrics.in_flight.dec()
            self.metrics.requests.labels(protocol, outcome).inc()

    async def _checked_prompt(self, prompt, params: SamplingParams) -> list[int]:
        """Token ids checked against the vocabulary and the context here, so both protocols
        refuse the same input and a request that cannot fit never reaches a worker."""
        info = self.backend.info
        check = functools.partial(fitting_prompt_ids, prompt, self.backend.tokenizer,
                                  info.vocab_size, info.max_model_len, params.max_tokens)
        # tokenizing a long text here would stall every other request on this loop
        return await asyncio.to_thread(check) if isinstance(prompt, str) else check()

    def _final(self, out, start: float, first_token_at: float | None, now: float) -> Final:
        usage = Usage(len(out.prompt_token_ids), len(out.token_ids), out.num_cached_tokens or 0)
        ttft = (first_token_at - start) if first_token_at is not None else 0.0
        tpot = (now - first_token_at) / (usage.completion_tokens - 1) if (
            first_token_at is not None and usage.completion_tokens > 1) else 0.0
        m = self.metrics
        m.e2e.observe(now - start)
        if usage.completion_tokens > 1:
            m.tpot.observe(tpot)
        m.prompt_tokens.inc(usage.prompt_tokens)
        m.generation_tokens.inc(usage.completion_tokens)
        return Final(out.request_id, out.finish_reason or "stop", usage, list(out.prompt_token_ids),
                     list(out.token_ids), out.text, list(out.logprobs or []), ttft, tpot, now - start,
                     out.prompt_logprobs, tuple(out.spans))

