"""Runs an engine's step loop on its own thread; everything else talks to it through calls.

The engine is not thread-safe: only this thread touches it. `call` queues a function to run
on the loop thread between steps and returns a future. Outputs of each step are handed, all
at once, to `on_outputs` (so a worker can ship one message per step for all its requests),
then `after_step` runs.
"""

from __future__ import annotations

import concurrent.futures
import gc
import logging
import queue
import threading
from collections.abc import Callable

from engine.llm_engine import LLMEngine
from engine.output import RequestOutput

log = logging.getLogger(__name__)

IDLE_WAIT_S = 0.05
HANDOFF_POLL_S = 0.0005


class EngineThread:
    def __init__(self, engine: LLMEngine, on_outputs: Callable[[list[RequestOutput]], None],
                 after_step: Callable[[LLMEngine], None] | None = None, name: str = "engine-loop"):
        self.engine = engine
        self.on_outputs = on_outputs
        self.after_step = after_step
        self.step_delay_s = 0.0  # drills and tests: a pause after each step, as on a slow machine
        self._commands: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        # What the process holds once the engine is loaded (modules, the model, 230k objects
        # with transformers, Ray and the APIs imported) lives as long as the process: frozen out
        # of the collector, a full collection scans only what came after instead of stalling
        # a step over all of it. Once per serving loop; the collect keeps garbage out of it,
        # and stop() unfreezes (a stopped loop's engine must be collectable again).
        gc.collect()
        gc.freeze()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def call(self, fn: Callable, *args) -> concurrent.futures.Future:
        """Run fn(engine, *args) on the loop thread."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put((fn, args, fut))
        return fut

    def _run(self) -> None:
        while not self._stop.is_set():
            # Nothing to run: wait for a call (IDLE_WAIT_S), or, while requests wait for their
            # hand-off, at most HANDOFF_POLL_S before the next step polls for it: a busy loop
            # here takes a core from the prefill worker computing that very state.
            wait = None
            if not self.engine.has_runnable():
                wait = HANDOFF_POLL_S if self.engine.has_unfinished() else IDLE_WAIT_S
            try:
                while True:
                    fn, args, fut = self._commands.get(timeout=wait) if wait else self._commands.get_nowait()
                    wait = None
                    try:
                        fut.set_result(fn(self.engine, *args))
                    except BaseException as e:  # goes to the caller; never kills the loop
                        fut.set_exception(e)
            except queue.Empty:
                pass
            if not self.engine.has_unfinished():
                continue
            try:
                outputs = self.engine.step()
                # Outputs leave first: a prefill worker's first token goes to the caller before
                # its hand-off starts (prefill_worker), not after.
                if outputs:
                    self.on_outputs(outputs)
                if self.after_step is not None:
                    self.after_step(self.engine)
                if self.step_delay_s:
                    self._stop.wait(self.step_delay_s)
            except Exception:  # the engine already failed the requests it could not run; a
                # failing on_outputs or after_step is logged and the loop goes on
                log.exception("engine step failed")

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        gc.unfreeze()
