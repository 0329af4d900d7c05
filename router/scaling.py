"""Elastic pools: change the number of workers of either kind on a running cluster.

Growing: new workers are placed (Ray's autoscaler, or KubeRay's through the node-type
resources, brings up nodes when they cannot be), paired with every live worker of the other
kind, and only then picked for work (router/workers.py `grow`).

Shrinking drains a worker: it is picked for nothing new at once; a prefill worker finishes what
it was sent; a decode worker finishes its streams, and whatever is still running at the
deadline is handed over through the retry path (router/tracking.py): the request runs again
elsewhere from the tokens the caller already has, so the caller sees one stream with no token
twice and none missing. Then the actor stops and its placement group goes.

A rolling restart replaces one worker at a time (with new engine options, if given: they must
keep the cache layout, which every pair checks, except the block size: a hand-off between an
old and a new worker re-blocks, kvtransfer/grid.py).
The autoscaler (router/autoscaler.py) drives the same `scale` from live signals.
"""

from __future__ import annotations

import asyncio
import logging
import time

from router.autoscaler import AutoscaleConfig, Autoscaler, Signals
from router.tracking import Failure
from router.workers import WorkerRef, WorkerSet

log = logging.getLogger(__name__)
DRAIN_POLL_S = 0.05


class ElasticPools:
    """router.cluster.Cluster's elastic side: scale, rolling restarts, the autoscaler."""

    autoscaler: Autoscaler | None = None
    _autoscale_task = None

    def scale(self, prefill: int | None = None, decode: int | None = None, drain_timeout_s: float = 30.0) -> dict:
        """Grow or shrink each kind of worker on the running cluster; returns the new counts."""
        return self._after(self._run(scale(self.workers, self._hand_over, prefill, decode, drain_timeout_s)))

    def restart_workers(self, engine_options: dict | None = None, drain_timeout_s: float = 30.0) -> dict:
        """Replace every worker, one at a time, without failing a request."""
        from engine.config import EngineConfig

        if engine_options:  # checked now, as at start, not by a worker that fails to come up
            EngineConfig(model=self.config.model, **{**self.config.engine_options, **engine_options, "device": "cpu"})
        return self._after(self._run(restart_workers(self.workers, self._hand_over, engine_options, drain_timeout_s)))

    def _after(self, now: dict) -> dict:
        self.config.prefill, self.config.decode = now["prefill"], now["decode"]
        self._loop.call_soon_threadsafe(self._notify_room)
        return now

    def _hand_over(self, worker: WorkerRef) -> int:
        """A draining decode worker's deadline passed: its requests run again elsewhere from
        what their callers already have (the retry path)."""
        moved = 0
        for wid, (owner, _) in list(self.workers.owner.items()):
            if owner is worker:
                self._deliver(wid, Failure(f"decode worker {worker.name} is being removed", retryable=True))
                moved += 1
        return moved

    # ---- the autoscaler ----

    def start_autoscaler(self, config: AutoscaleConfig | None) -> None:
        if config is None:
            return
        self.autoscaler = Autoscaler(config)
        self._latencies: list[tuple[float, float | None]] = []
        self._arrived: list[int] = []  # prompt lengths since the last reading
        self._last_reading = time.monotonic()
        self._autoscale_task = asyncio.run_coroutine_threadsafe(self._autoscale(), self._loop)

    def stop_autoscaler(self) -> None:
        if self._autoscale_task is not None:
            self._autoscale_task.cancel()

    def record_arrival(self, prompt_len: int) -> None:
        if self.autoscaler is not None:
            self._arrived.append(prompt_len)

    def record_latency(self, arrival: float, first_token: float | None, num_tokens: int) -> None:
        """A request finished (router clock): its TTFT and TPOT feed the next reading."""
        if self.autoscaler is None or first_token is None:
            return
        tpot = (time.monotonic() - first_token) / (num_tokens - 1) if num_tokens > 1 else None
        self._latencies.append((first_token - arrival, tpot))

    async def _autoscale(self) -> None:
        while True:
            await asyncio.sleep(self.autoscaler.config.interval_s)
            try:
                for decision in self.autoscaler.decide(self.signals()):
                    want = {decision.kind: counts(self.workers)[decision.kind] + decision.delta}
                    # Shielded: stopping the autoscaler mid-drain must not leave a worker
                    # draining forever, neither serving nor removed.
                    await asyncio.shield(self._scale_to(want))
            except asyncio.CancelledError:
                raise
            except Exception:  # the next reading tries again
                log.exception("autoscaler step failed")

    async def _scale_to(self, want: dict) -> None:
        self._after(await scale(self.workers, self._hand_over, **want))

    def signals(self) -> Signals:
        latencies, self._latencies = self._latencies, []
        arrived, self._arrived = self._arrived, []
        now, since = time.monotonic(), self._last_reading
        self._last_reading = now
        prefill, decode = serving(self.workers, "prefill"), serving(self.workers, "decode")

        def p90(values):
            values = sorted(v for v in values if v is not None)
            return values[int(0.9 * (len(values) - 1))] if values else None

        def occupancy(total: str, free: str) -> float:
            have = sum(w.stats.get(total, 0) for w in decode)
            return 1 - sum(w.stats.get(free, 0) for w in decode) / have if have else 0.0

        return Signals(len(prefill), len(decode), sum(w.queued_tokens for w in prefill),
                       p90(t for t, _ in latencies), p90(t for _, t in latencies),
                       occupancy("state_slots_total", "state_slots_free"),
                       occupancy("kv_blocks_total", "kv_blocks_free"),
                       prompt_tokens_per_s=sum(arrived) / max(now - since, 1e-3),
                       mean_prompt_len=sum(arrived) / len(arrived) if arrived else 0.0,
                       decode_running=len(self.workers.owner))  # decode slots are held from reservation


async def scale(workers: WorkerSet, hand_over, prefill: int | None = None, decode: int | None = None,
                drain_timeout_s: float = 30.0) -> dict:
    """Grow or shrink each kind to the given count (None: unchanged); the newest go first.
    `hand_over(worker)` moves a draining decode worker's remaining requests elsewhere."""
    for kind, want in (("prefill", prefill), ("decode", decode)):
        if want is not None and want < 1:
            raise ValueError(f"{kind}: a cluster needs at least one worker of each kind, got {want}")
    grow = {kind: max(0, (want or 0) - len(serving(workers, kind)))
            for kind, want in (("prefill", prefill), ("decode", decode)) if want is not None}
    if any(grow.values()):
        await workers.grow(grow.get("prefill", 0), grow.get("decode", 0))
    for kind, want in (("prefill", prefill), ("decode", decode)):
        if want is None:
            continue
        extra = serving(workers, kind)[want:]
        await asyncio.gather(*(drain(workers, w, hand_over, drain_timeout_s) for w in reversed(extra)))
    return counts(workers)


async def restart_workers(workers: WorkerSet, hand_over, engine_options: dict | None = None,
                          drain_timeout_s: float = 30.0) -> dict:
    """Replace every worker, one at a time. The last of its kind gets its successor first (the
    kind never goes without a worker, at the cost of room for one more); one of several is
    drained first (no spare room needed; the others carry the load meanwhile)."""
    if engine_options is not None:
        workers.config.engine_options = {**workers.config.engine_options, **engine_options}
        if "block_size" in engine_options:  # one size for both kinds from now on
            workers.config.prefill_block_size = workers.config.decode_block_size = None
    for old in list(serving(workers, "prefill")) + list(serving(workers, "decode")):
        successor = (int(old.kind == "prefill"), int(old.kind == "decode"))
        if len(serving(workers, old.kind)) > 1:
            await drain(workers, old, hand_over, drain_timeout_s)
            await workers.grow(*successor)
        else:
            await workers.grow(*successor)
            await drain(workers, old, hand_over, drain_timeout_s)
    return counts(workers)


def serving(workers: WorkerSet, kind: str) -> list[WorkerRef]:
    return [w for w in (workers.prefill if kind == "prefill" else workers.decode) if not w.draining]


def counts(workers: WorkerSet) -> dict:
    return {"prefill": len(serving(workers, "prefill")), "decode": len(serving(workers, "decode"))}


async def drain(workers: WorkerSet, worker: WorkerRef, hand_over, timeout_s: float) -> None:
    worker.draining = True
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and _busy(workers, worker):
        await asyncio.sleep(DRAIN_POLL_S)
    if worker.kind == "decode" and _busy(workers, worker):
        moved = hand_over(worker)
        log.info("%s: drain deadline; %d requests handed over", worker.name, moved)
        while _busy(workers, worker) and time.monotonic() < deadline + 10:
            await asyncio.sleep(DRAIN_POLL_S)
    await _remove(workers, worker)


def _busy(workers: WorkerSet, worker: WorkerRef) -> bool:
    if worker.kind == "prefill":
        return worker.queued_tokens > 0
    return any(owner is worker for owner, _ in workers.owner.values())


async def _remove(workers: WorkerSet, worker: WorkerRef) -> None:
    import ray

    from router.placement import remove_groups

    if worker.kind == "decode":
        if worker.poll_task is not None:
            worker.poll_task.cancel()
        calls = [p.handle.disconnect.remote(worker.name) for p in workers.prefill if p.alive]
        await asyncio.gather(*calls, return_exceptions=True)
    pool = workers.prefill if worker.kind == "prefill" else workers.decode
    pool.remove(worker)
    try:
        await asyncio.wait_for(worker.handle.shutdown.remote(), 10)
    except Exception as e:
        log.warning("%s: shutdown failed (%s); killing it", worker.name, e)
    ray.kill(worker.handle, no_restart=True)
    if not any(w.group is worker.group for w in workers.prefill + workers.decode):
        remove_groups([worker.group])
        workers._groups = [g for g in workers._groups if g is not worker.group]
    log.info("%s %s removed", worker.kind, worker.name)
