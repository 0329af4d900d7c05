"""One engine in a background thread behind the Backend protocol (no Ray).

The engine is not thread-safe: only the loop thread touches it; callers hand it commands
through a queue and receive outputs on their own asyncio loop.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from pathlib import Path
from typing import AsyncIterator

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.output import RequestOutput
from engine.sampling_params import SamplingParams
from router.backend import ModelInfo, Overloaded


class EngineThread:
    """Runs engine.step() whenever there is work; applies add/abort commands between steps."""

    def __init__(self, engine: LLMEngine, max_queued: int = 1024):
        self.engine = engine
        self.max_queued = max_queued
        self._commands: queue.Queue = queue.Queue()
        self._sinks: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    def call(self, fn, *args):
        """Run fn(engine, *args) on the loop thread; returns a concurrent future."""
        import concurrent.futures

        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put((fn, args, fut))
        return fut

    def subscribe(self, request_id: str, loop: asyncio.AbstractEventLoop, sink: asyncio.Queue):
        self._sinks[request_id] = (loop, sink)

    def unsubscribe(self, request_id: str):
        self._sinks.pop(request_id, None)

    def _run(self) -> None:
        while not self._stop.is_set():
            block = not self.engine.has_unfinished()
            try:
                while True:
                    fn, args, fut = self._commands.get(timeout=0.05) if block else self._commands.get_nowait()
                    block = False
                    try:
                        fut.set_result(fn(self.engine, *args))
                    except BaseException as e:  # delivered to the caller, never kills the loop
                        fut.set_exception(e)
            except queue.Empty:
                pass
            if self.engine.has_unfinished():
                for out in self.engine.step():
                    target = self._sinks.get(out.request_id)
                    if target is not None:
                        loop, sink = target
                        loop.call_soon_threadsafe(sink.put_nowait, out)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


class LocalBackend:
    def __init__(self, model: str | Path, model_name: str | None = None, max_queued: int = 1024,
                 **engine_options):
        self.engine = LLMEngine(EngineConfig(model=str(model), **engine_options))
        spec = self.engine.spec
        self.info = ModelInfo(model_name or Path(model).name, str(model), spec.model_type,
                              spec.vocab_size, self.engine.max_model_len, list(spec.layer_kinds),
                              list(self.engine.eos_token_ids))
        self.max_queued = max_queued
        self._loop = EngineThread(self.engine)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def ready(self) -> bool:
        return True

    async def generate(self, request_id: str, prompt, params: SamplingParams
                       ) -> AsyncIterator[RequestOutput]:
        if len(self.engine.requests) >= self.max_queued:
            raise Overloaded(f"{len(self.engine.requests)} requests in flight (limit {self.max_queued})")
        loop = asyncio.get_running_loop()
        sink: asyncio.Queue = asyncio.Queue()
        self._loop.subscribe(request_id, loop, sink)
        finished = False
        try:
            await asyncio.wrap_future(self._loop.call(
                lambda engine: engine.add_request(prompt, params, request_id=request_id)))
            while True:
                out = await sink.get()
                finished = out.finished
                yield out
                if finished:
                    return
        finally:
            self._loop.unsubscribe(request_id)
            if not finished:
                self._loop.call(lambda engine: engine.abort(request_id))

    async def abort(self, request_id: str) -> bool:
        return await asyncio.wrap_future(self._loop.call(lambda engine: engine.abort(request_id)))

    def status(self) -> dict:
        return {"workers": [{"id": "local-0", "kind": "colocated", "node": "local", "alive": True,
                             **self.engine.stats()}]}

    def shutdown(self) -> None:
        self._loop.stop()
