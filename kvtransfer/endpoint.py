"""Bookkeeping shared by every transport: results, deadlines, aborts, callbacks.

Invariant on both sides: a failed hand-off is reported (poll, wait_for, on_done) only once
the transport can no longer touch that request's rows, so the caller may free its blocks
and slot the moment it sees the result.
"""

from __future__ import annotations

import atexit
import threading
import time
import weakref
from collections.abc import Callable

from kvtransfer.config import TransferConfig
from kvtransfer.layout import CacheTensors
from kvtransfer.messages import HandoffResult

OnDone = Callable[[HandoffResult], None]
_OPEN_ENDPOINTS: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _close_open_endpoints() -> None:
    # Endpoints left open would otherwise be torn down during interpreter shutdown, when
    # their transport threads can no longer run and Gloo's can abort the process.
    for endpoint in list(_OPEN_ENDPOINTS):
        endpoint.close()


def record_compute_event(cache: CacheTensors):
    """A CUDA event on the caller's current stream (None on CPU): the point the transfer must wait for."""
    if cache.device.type != "cuda":
        return None
    import torch

    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(cache.device))
    return event


class Endpoint:
    side = "?"
    transport = "?"
    devices: tuple[str, ...] = ("cpu",)  # cache device types this transport moves

    def __init__(self, name: str, cache: CacheTensors, config: TransferConfig | None = None, on_done: OnDone | None = None):
        if not name:
            raise ValueError("an endpoint needs a non-empty name")
        if cache.device.type not in self.devices:
            hint = "use nccl" if cache.device.type == "cuda" else "use shm or gloo"
            raise ValueError(
                f"the {self.transport} transport moves {'/'.join(self.devices)} caches; this one is on {cache.device} ({hint})"
            )
        self.name = name
        self.cache = cache
        self.layout = cache.layout
        self.config = config or TransferConfig()
        self.on_done = on_done
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)  # notified on any state change
        self._results: list[HandoffResult] = []
        self._closed = False
        self._stop = threading.Event()
        self._watchdog = threading.Thread(target=self._watch, name=f"kvtransfer-watchdog-{name}", daemon=True)
        self._watchdog.start()
        _OPEN_ENDPOINTS.add(self)

    # ---- what the caller uses ----

    def poll(self) -> list[HandoffResult]:
        """Finished hand-offs since the last poll (each reported exactly once). Cheap enough
        to call at every engine step: shm completions are found right here."""
        self._sweep()
        with self._lock:
            out, self._results = self._results, []
        return out

    def wait_for(self, request_ids: list[str], timeout_s: float) -> dict[str, HandoffResult]:
        """Block until every listed request has a result here; returns and consumes them."""
        wanted, got = set(request_ids), {}
        deadline = time.monotonic() + timeout_s
        while True:
            self._sweep()
            with self._lock:
                for r in [r for r in self._results if r.request_id in wanted]:
                    got[r.request_id] = r
                    self._results.remove(r)
                if len(got) == len(wanted):
                    return got
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    missing = sorted(wanted - got.keys())
                    raise TimeoutError(f"{self.side} {self.name}: no result for {missing[:5]} within {timeout_s}s")
                self._changed.wait(min(remaining, self._sweep_interval_s))

    def close(self) -> None:
        """Close every channel; hand-offs still in flight fail (reported like any failure)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._stop.set()
        self._watchdog.join(timeout=5)
        self._close_channels()
        _OPEN_ENDPOINTS.discard(self)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- for subclasses ----

    def _abandon(self) -> None:
        """Undo what __init__ started, for a subclass whose own setup then failed: it has no
        channels to close."""
        self._closed = True
        self._stop.set()
        self._watchdog.join(timeout=5)
        _OPEN_ENDPOINTS.discard(self)

    def _deliver(self, results: list[HandoffResult]) -> None:
        """Publish results; call only without holding the lock (on_done may call back in)."""
        if not results:
            return
        with self._lock:
            self._results.extend(results)
            self._changed.notify_all()
        if self.on_done is not None:
            for r in results:
                self.on_done(r)

    def _result(self, request_id: str, ok: bool, started: float, **fields) -> HandoffResult:
        return HandoffResult(request_id, ok, self.side, elapsed_s=time.monotonic() - started, **fields)

    # Transports whose completions sit in shared memory find them here (poll, wait_for and
    # the watchdog sweep); the others push results as they land.
    _sweep_interval_s = 0.1

    def _sweep(self) -> None:
        pass

    def _watch(self) -> None:
        while not self._stop.wait(self.config.watchdog_interval_s):
            self._sweep()
            self._expire(time.monotonic())

    def _expire(self, now: float) -> None:
        raise NotImplementedError

    def _close_channels(self) -> None:
        raise NotImplementedError
