"""The disaggregated cluster: prefill and decode worker actors behind the Backend protocol.

Per request: pick a decode worker (most free slots and blocks, fewest running) and reserve
its room first, then pick a prefill worker (fewest queued prompt tokens) and prefill there;
the decode worker streams every token (the first arrives with the hand-off). Prompts of at
most `local_prefill_tokens` skip the split and prefill on the decode worker itself.
All cluster bookkeeping runs on one asyncio loop of its own ("the router loop").
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import AsyncIterator

from engine.config import EngineConfig
from engine.output import RequestOutput
from engine.prompts import as_batch, check_prompt_length, prompt_token_ids
from engine.sampling_params import InvalidRequest, SamplingParams
from engine.tokenizer import Tokenizer
from router.backend import ModelInfo, Overloaded
from router.placement import PlacementConfig
from router.workers import WorkerSet

log = logging.getLogger(__name__)


@dataclass
class ClusterConfig:
    model: str
    prefill: int = 1
    decode: int = 1
    transport: str = "auto"  # "auto": shm when every worker shares one node, else gloo
    address: str | None = None  # None: start a local Ray; "auto" or host:port: join one
    engine_options: dict = field(default_factory=dict)
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    local_prefill_tokens: int = 0  # conditional disaggregation threshold; 0: always split
    max_queued: int = 1024  # requests in flight before Overloaded
    transfer_timeout_s: float = 30.0
    ray_init_options: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.placement.gpus_per_worker and "device" not in self.engine_options:
            self.engine_options["device"] = "cuda"
        # Validate the engine options here; the device is checked on the workers that use it.
        EngineConfig(model=self.model, **{**self.engine_options, "device": "cpu"})
        if self.prefill < 1 or self.decode < 1:
            raise ValueError(f"need at least one worker of each kind, got prefill={self.prefill} "
                             f"decode={self.decode}")
        if self.transport not in ("auto", "shm", "gloo", "nccl"):
            raise ValueError(f"transport: {self.transport!r} not in auto, shm, gloo, nccl")
        if self.local_prefill_tokens < 0 or self.max_queued < 1:
            raise ValueError("local_prefill_tokens must be >= 0 and max_queued >= 1")


class Cluster:
    def __init__(self, config: ClusterConfig):
        self.config = config
        path = Path(config.model)
        try:
            self._tokenizer: Tokenizer | None = Tokenizer(path)
        except FileNotFoundError:
            self._tokenizer = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="router-loop", daemon=True)
        self._thread.start()
        self._ids = itertools.count()
        self._streams: dict[str, asyncio.Queue] = {}
        # Request id -> the prefill worker's logprobs of the first token (decode never saw them).
        self._first_logprobs: dict[str, asyncio.Future] = {}
        self.workers = WorkerSet(config)
        try:
            self._run(self.workers.start(self._route))
        except BaseException:
            self.shutdown()
            raise
        facts = self.workers.model_facts
        self.info = ModelInfo(path.name, str(path), facts["model_type"], facts["vocab_size"],
                              facts["max_model_len"], facts["layer_kinds"], facts["eos_token_ids"])

    @property
    def tokenizer(self):
        return self._tokenizer

    def _run(self, coro, timeout: float | None = None):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    # ---- Backend protocol ----

    def ready(self) -> bool:
        return self.workers.all_alive()

    async def stream(self, request_id: str, prompt, params: SamplingParams
                     ) -> AsyncIterator[RequestOutput]:
        """Usable from any event loop: the request itself runs on the router loop."""
        caller = asyncio.get_running_loop()
        sink: asyncio.Queue = asyncio.Queue()

        def emit(item):
            caller.call_soon_threadsafe(sink.put_nowait, item)

        task = asyncio.run_coroutine_threadsafe(self._serve(request_id, prompt, params, emit), self._loop)
        finished = False
        try:
            while True:
                item = await sink.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                task.cancel()
                asyncio.run_coroutine_threadsafe(self._abort(request_id), self._loop)

    async def abort(self, request_id: str) -> bool:
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(self._abort(request_id), self._loop))

    def status(self) -> dict:
        """Fresh from every worker (a few ms): callers poll it to watch requests come and go."""
        try:
            self._run(self.workers.refresh_stats(), timeout=10)
        except Exception:
            log.warning("stats refresh failed; showing the last known", exc_info=True)
        return self.workers.status()

    # ---- the Python handle ----

    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None
                 ) -> list[RequestOutput]:
        """Like engine.LLM.generate: every prompt to completion, results in prompt order."""
        prompts, params = as_batch(prompts, params)

        async def one(prompt, p):
            final = None
            async for out in self.stream(f"gen-{next(self._ids)}", prompt, p):
                final = out
            return final

        async def everything():
            return await asyncio.gather(*(one(prompt, p) for prompt, p in zip(prompts, params)))

        return asyncio.run(everything())


    def shutdown(self) -> None:
        try:
            self._run(self.workers.stop(), timeout=60)
        except Exception:
            log.exception("worker shutdown")
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)

    # ---- on the router loop ----

    async def _serve(self, request_id: str, prompt, params: SamplingParams, emit) -> None:
        try:
            if len(self._streams) >= self.config.max_queued:
                raise Overloaded(f"{len(self._streams)} requests in flight (limit {self.config.max_queued})")
            facts = self.workers.model_facts
            ids = prompt_token_ids(prompt, self._tokenizer, facts["vocab_size"])
            check_prompt_length(len(ids), facts["max_model_len"])
            if request_id in self._streams:
                raise InvalidRequest("request_id", f"{request_id!r} is already in flight")
            stream: asyncio.Queue = asyncio.Queue()
            self._streams[request_id] = stream
            if params.logprobs is not None:
                self._first_logprobs[request_id] = asyncio.get_running_loop().create_future()
            try:
                split = await self._start(request_id, ids, params, stream)
                first_logprob = self._first_logprobs.get(request_id) if split else None
                while True:
                    out = await stream.get()
                    if first_logprob is not None and out.error is None:
                        entry = await first_logprob
                        if entry is not None:
                            out.logprobs = [entry] + list(out.logprobs or [])
                    emit(out)
                    if out.finished:
                        return
            finally:
                self._streams.pop(request_id, None)
                self._first_logprobs.pop(request_id, None)
        except asyncio.CancelledError:
            raise
        except BaseException as e:
            emit(e)

    async def _start(self, request_id, ids, params, stream: asyncio.Queue) -> bool:
        """Place the request; True when it is split across a prefill and a decode worker."""
        decode = self.workers.pick_decode()
        if len(ids) <= self.config.local_prefill_tokens:
            await decode.handle.generate_local.remote(request_id, ids, params)
            return False
        target = await decode.handle.reserve.remote(request_id, ids, params)
        self.workers.owner[request_id] = decode
        prefill = self.workers.pick_prefill(len(ids))
        asyncio.ensure_future(self._prefill(prefill, decode, request_id, ids, params, target, stream))
        return True

    async def _prefill(self, prefill, decode, request_id, ids, params, target, stream) -> None:
        try:
            outcome = await prefill.handle.prefill.remote(request_id, ids, params, target)
        except Exception as e:  # the actor died or the call failed
            outcome = None
            error = f"prefill worker {prefill.name} failed: {e}"
        else:
            error = outcome.error
        finally:
            prefill.queued_tokens -= len(ids)
        waiter = self._first_logprobs.get(request_id)
        if waiter is not None and not waiter.done():
            waiter.set_result(outcome.first_logprob if outcome is not None and outcome.handed_off else None)
        if outcome is not None and outcome.handed_off:
            return
        await decode.handle.abort.remote(request_id, error)  # free the reservation
        if outcome is not None and outcome.output is not None and outcome.output.error is None:
            stream.put_nowait(outcome.output)  # finished at its first token on the prefill worker
        elif request_id in self._streams:
            stream.put_nowait(RequestOutput(request_id, ids, [], "", True, "error",
                                            error=error or "prefill failed"))

    async def _route(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                stream.put_nowait(out)

    async def _abort(self, request_id: str) -> bool:
        stream = self._streams.pop(request_id, None)
        await self.workers.abort_everywhere(request_id)
        if stream is not None:  # end the caller's stream the way an engine ends an aborted request
            stream.put_nowait(RequestOutput(request_id, [], [], "", True, "abort"))
        return stream is not None


def launch(model: str | Path | None = None, prefill: int = 1, decode: int = 1, transport: str = "auto",
           address: str | None = None, **options) -> Cluster:
    """Start (or join, with address="auto") a Ray cluster and place the workers on it."""
    from engine import demo_model_path

    placement_keys = set(PlacementConfig.__dataclass_fields__)
    placement = PlacementConfig(**{k: options.pop(k) for k in list(options) if k in placement_keys})
    engine_keys = set(EngineConfig.__dataclass_fields__) - {"model", "mode"}
    engine_options = {k: options.pop(k) for k in list(options) if k in engine_keys}
    config = ClusterConfig(str(model or demo_model_path()), prefill, decode, transport, address,
                           engine_options=engine_options, placement=placement, **options)
    return Cluster(config)
