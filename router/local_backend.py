"""One engine in a background thread behind the Backend protocol (no Ray)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from collections.abc import AsyncIterator

from engine.config import EngineConfig
from engine.engine_thread import EngineThread
from engine.llm_engine import LLMEngine
from engine.output import Cumulative, RequestOutput
from engine.sampling_params import SamplingParams
from router.backend import ModelInfo, Overloaded


class LocalBackend:
    def __init__(self, model: str | Path, model_name: str | None = None, max_queued: int = 1024,
                 **engine_options):
        # Deltas from the engine; each stream rebuilds what its caller asks for (Cumulative).
        self.engine = LLMEngine(EngineConfig(**{**engine_options, "model": str(model), "output_kind": "delta"}))
        spec = self.engine.spec
        self.info = ModelInfo(model_name or Path(model).name, str(model), spec.model_type,
                              spec.vocab_size, self.engine.max_model_len, list(spec.layer_kinds),
                              list(self.engine.eos_token_ids))
        self.max_queued = max_queued
        self._sinks: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._loop = EngineThread(self.engine, self._deliver)

    def _deliver(self, outputs) -> None:
        for out in outputs:
            target = self._sinks.get(out.request_id)
            if target is not None:
                loop, sink = target
                loop.call_soon_threadsafe(sink.put_nowait, out)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def ready(self) -> bool:
        return True

    async def stream(self, request_id: str, prompt, params: SamplingParams, whole: bool = True
                     ) -> AsyncIterator[RequestOutput]:
        """Whole outputs, or (whole=False) what is new and a whole final one."""
        if len(self.engine.requests) >= self.max_queued:
            raise Overloaded(f"{len(self.engine.requests)} requests in flight (limit {self.max_queued})")
        loop = asyncio.get_running_loop()
        sink: asyncio.Queue = asyncio.Queue()
        self._sinks[request_id] = (loop, sink)
        finished = False
        try:
            def add(engine):
                return engine.requests[engine.add_request(prompt, params, request_id=request_id)].prompt_token_ids

            prompt_ids = await asyncio.wrap_future(self._loop.call(add))
            so_far = Cumulative(prompt_ids, params.logprobs is not None)
            while True:
                out = so_far.add(await sink.get(), whole=whole)
                finished = out.finished
                yield out
                if finished:
                    return
        finally:
            self._sinks.pop(request_id, None)
            if not finished:
                self._loop.call(lambda engine: engine.abort(request_id))

    async def abort(self, request_id: str) -> bool:
        return await asyncio.wrap_future(self._loop.call(lambda engine: engine.abort(request_id)))

    def status(self) -> dict:
        return {"workers": [{"id": "local-0", "kind": "colocated", "node": "local", "alive": True,
                             **self.engine.stats()}]}

    def shutdown(self) -> None:
        self._loop.stop()
