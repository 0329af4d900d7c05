"""The disaggregated cluster: prefill and decode worker actors behind the Backend protocol.

Per request: pick a decode worker (most free slots and blocks, fewest running) and a prefill
worker (fewest queued prompt tokens), then ask the one to reserve room and the other to
prefill at once: the prefill's hand-off waits for the reservation only once its rows are ready
(prefill_worker.PendingTarget), and a refused reservation calls the prefill off before the
attempt is placed again. The first token comes from the prefill worker as soon as it is
sampled, while the hand-off runs; the decode worker pushes every later one as its steps
produce them (Ray streaming generators both). Prompts of at most `local_prefill_tokens` skip
the split and prefill on the decode worker itself.
When a worker dies or a hand-off breaks, the request runs again on live workers from the
tokens the caller already has (router/tracking.py); Ray restarts the dead actor and the
router pairs it up again. All cluster bookkeeping runs on one asyncio loop of its own
("the router loop").
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import AsyncIterator

from engine.config import EngineConfig
from engine.output import RequestOutput
from engine.prefix_cache import block_hashes
from engine.prompts import as_batch, check_prompt_length, prompt_token_ids
from engine.sampling_params import InvalidRequest, SamplingParams
from engine.tokenizer import Tokenizer
from prefill_worker.worker import PendingTarget, PrefillOutcome
from worker_base.prefix_wire import PendingPrefix
from kvtransfer.transport import check_transport
from router.backend import ModelInfo, Overloaded, Unavailable
from router.autoscaler import AutoscaleConfig
from router.placement import PlacementConfig
from router.prefix_fetch import plan_fetch
from router.scaling import ElasticPools
from router.tracking import Failure, PrefillFirst, Tracked
from router.workers import STATS_INTERVAL_S, WorkerRef, WorkerSet

PLACING_WAIT_S = 30.0  # the longest a cancelled attempt's abort waits for the call placing it

log = logging.getLogger(__name__)


class CallerGone(Exception):
    """The caller's event loop closed under a stream: nobody is left to tell."""


@dataclass
class ClusterConfig:
    model: str
    prefill: int = 1
    decode: int = 1
    transport: str = "auto"  # "auto": nccl between whole GPUs, else shm on one node, gloo across nodes
    address: str | None = None  # None: start a local Ray; "auto" or host:port: join one
    engine_options: dict = field(default_factory=dict)
    # One kind's block size when it differs from engine_options' (hand-offs re-block: kvtransfer/grid.py)
    prefill_block_size: int | None = None
    decode_block_size: int | None = None
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    local_prefill_tokens: int = 0  # conditional disaggregation threshold; 0: always split
    # Fetch a prefix another worker reports holding when it covers at least this many more
    # prompt tokens than the chosen prefill worker holds (router.prefix_fetch); 0: never.
    prefix_fetch_tokens: int = 256
    # ... and when moving it takes less time than the prefill it saves: its bytes over a link of
    # this many Gb/s plus a fixed cost per fetch (the calls that order it, and the bench's stage,
    # move and adopt: docs/benchmarks.md)
    prefix_fetch_gbps: float = 10.0
    prefix_fetch_overhead_ms: float = 3.0
    max_queued: int = 1024  # requests in flight before Overloaded
    transfer_timeout_s: float = 30.0
    max_retries: int = 3  # attempts after the first, when a worker dies or a hand-off breaks
    retry_wait_s: float = 60.0  # how long a retry waits for a live worker (Ray restarts dead ones)
    max_restarts: int = -1  # Ray restarts of a dead worker actor; -1: always
    ray_init_options: dict = field(default_factory=dict)
    autoscale: AutoscaleConfig | None = None  # None: the pools change only when told (scale())
    model_path: str = field(init=False, default="")  # the folder `model` names on this node

    def __post_init__(self):
        if self.placement.gpus_per_worker and "device" not in self.engine_options:
            self.engine_options["device"] = "cuda"
        # Validate the engine options here; the device is checked on the workers that use it.
        # A Hub id is resolved here, once: workers get the id with the commit it resolved to, so
        # every node loads the same snapshot (each from its own cache).
        checked = EngineConfig(model=self.model, **{**self.engine_options, "device": "cpu"})
        self.model_path = checked.model
        for kind in ("prefill", "decode"):
            size = getattr(self, f"{kind}_block_size")
            if size is not None:
                try:
                    EngineConfig(model=self.model_path, **{**self.engine_options, "block_size": size, "device": "cpu"})
                except ValueError as error:
                    raise ValueError(f"{kind}_block_size: {error}") from None
        if checked.revision is not None:
            self.engine_options["revision"] = checked.revision
        if self.prefill < 1 or self.decode < 1:
            raise ValueError(f"need at least one worker of each kind, got prefill={self.prefill} "
                             f"decode={self.decode}")
        check_transport(self.transport, self.placement.gpus_per_worker)
        if self.local_prefill_tokens < 0 or self.max_queued < 1:
            raise ValueError("local_prefill_tokens must be >= 0 and max_queued >= 1")
        if isinstance(self.prefix_fetch_tokens, bool) or not isinstance(self.prefix_fetch_tokens, int) \
                or self.prefix_fetch_tokens < 0:
            raise ValueError(f"prefix_fetch_tokens must be an integer >= 0, got {self.prefix_fetch_tokens!r}")
        if not self.prefix_fetch_gbps > 0 or not self.prefix_fetch_overhead_ms >= 0:
            raise ValueError(f"prefix_fetch_gbps must be > 0 and prefix_fetch_overhead_ms >= 0, got "
                             f"{self.prefix_fetch_gbps!r} and {self.prefix_fetch_overhead_ms!r}")
        if self.max_retries < 0 or self.retry_wait_s < 0 or self.max_restarts < -1:
            raise ValueError("max_retries and retry_wait_s must be >= 0, max_restarts >= -1")


class Cluster(ElasticPools):
    def __init__(self, config: ClusterConfig):
        self.config = config
        path = Path(config.model_path)
        try:
            self._tokenizer: Tokenizer | None = Tokenizer(path)
        except FileNotFoundError:
            self._tokenizer = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="router-loop", daemon=True)
        self._thread.start()
        self._ids = itertools.count()
        self._requests: dict[str, Tracked] = {}  # by the caller's request id
        self._attempts: dict[str, Tracked] = {}  # by the current attempt's worker-side id
        self._background: set[asyncio.Task] = set()  # unawaited router-loop tasks (_spawn)
        self._room = self._run(self._make_condition())  # signalled when capacity may have freed
        self.retries = 0
        self.prefix_fetches = 0  # prefixes asked of one worker for another (router.prefix_fetch)
        self.workers = WorkerSet(config, on_lost=self._worker_lost, on_room=self._notify_room)
        try:
            self._run(self.workers.start(self._route))
        except BaseException:
            self.shutdown()
            raise
        self.start_autoscaler(config.autoscale)
        facts = self.workers.model_facts
        name = config.model if "revision" in config.engine_options else path.name  # a Hub id names itself
        self.info = ModelInfo(name, str(path), facts["model_type"], facts["vocab_size"],
                              facts["max_model_len"], facts["layer_kinds"], facts["eos_token_ids"])

    @property
    def tokenizer(self):
        return self._tokenizer

    @staticmethod
    async def _make_condition() -> asyncio.Condition:
        return asyncio.Condition()

    def _run(self, coro, timeout: float | None = None):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    # ---- Backend protocol ----

    def ready(self) -> bool:
        return self.workers.all_alive()

    async def stream(self, request_id: str, prompt, params: SamplingParams, whole: bool = True
                     ) -> AsyncIterator[RequestOutput]:
        """Usable from any event loop: the request itself runs on the router loop. whole=False:
        each output carries only what is new except the final one (engine.output.Cumulative.add)."""
        caller = asyncio.get_running_loop()
        sink: asyncio.Queue = asyncio.Queue()

        def emit(item):
            try:
                caller.call_soon_threadsafe(sink.put_nowait, item)
            except RuntimeError as e:  # its loop closed: asyncio.run() returned as it cancelled us
                raise CallerGone(f"request {request_id}: the caller's event loop is closed") from e

        task = asyncio.run_coroutine_threadsafe(self._serve(request_id, prompt, params, emit, whole), self._loop)
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
                task.cancel()  # _serve then aborts the request on the workers

    async def abort(self, request_id: str) -> bool:
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(self._abort(request_id), self._loop))

    def status(self) -> dict:
        """Fresh from every worker (a few ms): callers poll it to watch requests come and go."""
        try:
            self._run(self.workers.refresh_stats(), timeout=10)
        except Exception:
            log.warning("stats refresh failed; showing the last known", exc_info=True)
        status = {**self.workers.status(), "in_flight": len(self._requests), "retries": self.retries,
                  "prefix_fetches": self.prefix_fetches}
        if self.autoscaler is not None:
            status["autoscaler"] = self.autoscaler.status()
        return status

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
        self.stop_autoscaler()
        try:
            self._run(self.workers.stop(), timeout=60)
        except Exception:
            log.exception("worker shutdown")
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)

    # ---- on the router loop ----

    async def _serve(self, request_id: str, prompt, params: SamplingParams, emit, whole: bool) -> None:
        try:
            if len(self._requests) >= self.config.max_queued:
                raise Overloaded(f"{len(self._requests)} requests in flight (limit {self.config.max_queued})")
            facts = self.workers.model_facts
            ids = prompt_token_ids(prompt, self._tokenizer, facts["vocab_size"])
            check_prompt_length(len(ids), facts["max_model_len"])
            if request_id in self._requests:
                raise InvalidRequest("request_id", f"{request_id!r} is already in flight")
            tracked = Tracked(request_id, ids, params, whole=whole)
            self._requests[request_id] = tracked
            self.record_arrival(len(ids))
            try:
                await self._follow(tracked, emit)
            except BaseException:  # cancelled, the caller gone, placing failed: stop it everywhere
                self._spawn(self._abort_once_placed(tracked.worker_id, tracked.placing))
                raise
            finally:
                self._requests.pop(request_id, None)
                self._attempts.pop(tracked.worker_id, None)
                self.workers.owner.pop(tracked.worker_id, None)
                self._notify_room()
        except (asyncio.CancelledError, CallerGone):
            raise
        except BaseException as e:
            emit(e)

    async def _follow(self, tracked: Tracked, emit) -> None:
        """Run attempts until the request finishes; the caller sees one stream."""
        first_seen = None  # on this router's clock, for the autoscaler
        while True:
            await self._launch(tracked)
            while True:
                event = await tracked.events.get()
                failure = tracked.classify(event)
                if failure is None:
                    out = await tracked.delivered(event)
                    if out is None:  # a first token the caller already has
                        continue
                    if first_seen is None and tracked.tokens:
                        first_seen = time.monotonic()
                    if out.finished and out.error is None:
                        self._remember_answer(tracked)
                        self.record_latency(tracked.arrival_time, first_seen, len(tracked.tokens))
                    emit(out)
                    if out.finished:
                        return
                    continue
                self._drop_attempt(tracked)
                if not failure.retryable or tracked.attempt >= self.config.max_retries:
                    emit(tracked.failed(failure.error))
                    return
                log.warning("request %s: attempt %d failed (%s); retrying with %d tokens delivered",
                            tracked.request_id, tracked.attempt, failure.error, len(tracked.tokens))
                if tracked.split:  # a broken channel fails every attempt on it until paired again
                    with contextlib.suppress(Exception):
                        await self.workers.repair_channels()
                tracked.next_attempt()
                self.retries += 1
                break

    async def _launch(self, tracked: Tracked) -> None:
        """Place the current attempt, waiting while no decode worker has room (or, for a
        retry, while no worker of a kind is alive: Ray may be restarting it)."""
        self._attempts[tracked.worker_id] = tracked
        deadline = time.monotonic() + self.config.retry_wait_s
        while True:
            try:
                tracked.split = await self._start(tracked)
                return
            except MemoryError:  # the chosen decode worker had no room after all: wait for some
                pass
            except Unavailable:
                if tracked.attempt == 0 or time.monotonic() > deadline:
                    raise
            except InvalidRequest:
                raise
            except Exception as e:  # the decode worker died under the reservation
                if tracked.attempt >= self.config.max_retries or time.monotonic() > deadline:
                    raise Unavailable(f"request {tracked.request_id}: cannot place it: {e}") from e
                log.warning("request %s: placement failed (%s); trying again", tracked.request_id, e)
            async with self._room:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._room.wait(), STATS_INTERVAL_S)

    async def _start(self, tracked: Tracked) -> bool:
        """Place the attempt; True when it is split across a prefill and a decode worker."""
        wid, ids, params, resume = tracked.worker_id, tracked.prompt_ids, tracked.params, tracked.resume()
        hashes = self._block_hashes(ids + tracked.tokens)
        if params.max_tokens - len(tracked.tokens) <= 1:
            # Its one token left comes from the prefill: nothing to decode, so no reservation,
            # no hand-off, and nothing on a decode worker to race the request's end.
            prefill, charge = self.workers.pick_prefill(tracked.num_tokens, hashes)
            tracked.prefill_outcome = asyncio.get_running_loop().create_future()
            asked = time.monotonic()
            prefix = self._prefix_for(prefill, hashes, tracked.num_tokens - charge)
            call = prefill.handle.prefill.remote(wid, ids, params, None, resume, prefix)
            self._spawn(self._prefill(prefill, None, tracked, wid, charge, call, asked))
            return True
        decode, cached = self.workers.pick_decode(tracked.num_tokens, hashes, self.config.local_prefill_tokens)
        life = decode.incarnation
        self.workers.owner[wid] = (decode, life)
        try:
            if tracked.num_tokens - cached <= self.config.local_prefill_tokens:
                tracked.placing = decode.handle.generate_local.remote(wid, ids, params, resume)
                await tracked.placing
                tracked.placing = None
                decode.prefixes.add(hashes)  # it prefills, so it checkpoints, this prompt itself
                return False
            # The prefill worker is chosen first: the reservation depends on how it sends
            # (rank to rank between equal TP sizes, else one un-sharded copy).
            prefill, charge = self.workers.pick_prefill(tracked.num_tokens, hashes)
            try:
                asked = time.monotonic()
                tracked.placing = decode.handle.reserve.remote(wid, ids, params, resume, prefill.name)
                # The prefill starts now, not a round trip later: its hand-off waits for the
                # reservation only once its rows are ready (PendingTarget).
                prefix = self._prefix_for(prefill, hashes, tracked.num_tokens - charge)
                stream = prefill.handle.prefill_stream.remote(wid, ids, params, PendingTarget(tracked.placing), resume,
                                                              prefix)
                try:
                    await tracked.placing
                except Exception:  # (a cancel: _abort_once_placed aborts it everywhere, the prefill too)
                    await self._call_off(prefill, wid, self._prefill_report(stream, None))
                    raise
                # Its first token goes to the caller as soon as it is sampled (PrefillFirst).
                call = self._prefill_report(stream, lambda out: self._deliver(wid, PrefillFirst(out)))
                tracked.note(f"reserve on {decode.name}", asked)
            except BaseException:
                prefill.queued_tokens -= charge
                raise
            tracked.placing = None
        except BaseException as e:  # a cancel leaves `placing` set, for _abort_once_placed
            self.workers.owner.pop(wid, None)
            self.workers.lost_if_dead(decode, e, life)  # so the next placement goes elsewhere at once
            raise
        tracked.prefill_outcome = asyncio.get_running_loop().create_future()
        self._spawn(self._prefill(prefill, decode, tracked, wid, charge, call, asked))
        return True

    @staticmethod
    async def _prefill_report(stream, on_first):
        """The PrefillOutcome at the end of a prefill_stream call; the first token it yields
        before that goes to `on_first` (None: dropped)."""
        async for ref in stream:
            item = await ref
            if isinstance(item, PrefillOutcome):
                return item
            if on_first is not None:
                on_first(item)
        raise RuntimeError("the prefill stream ended without an outcome")

    async def _call_off(self, prefill, wid: str, call) -> None:
        """A prefill whose reservation failed: abort it and wait for its end, since the next
        placement of the attempt uses the same id (its hand-off fails without a reservation)."""
        with contextlib.suppress(Exception):
            await asyncio.wait_for(prefill.handle.abort.remote(wid), PLACING_WAIT_S)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(call, PLACING_WAIT_S)

    def _prefix_for(self, prefill: WorkerRef, hashes: list[bytes], cached: int) -> PendingPrefix | None:
        """The fetch of the request's longest cached prefix from the worker that holds more of it
        than `prefill` does (its `cached` tokens), where fetching pays (router.prefix_fetch)."""
        config = self.config
        plan = plan_fetch(self.workers.prefill + self.workers.decode, prefill, hashes, cached,
                          self.workers.model_facts.get("block_size", 1), config.prefix_fetch_tokens,
                          config.prefix_fetch_gbps * 1e9 / 8, config.prefix_fetch_overhead_ms / 1000)
        if plan is None:
            return None
        self.prefix_fetches += 1
        return PendingPrefix(plan.source.handle, plan.source.name, plan.hashes, plan.source.node_id == prefill.node_id)

    def _block_hashes(self, token_ids: list[int]) -> list[bytes]:
        """The engine's block keys of `token_ids` when workers cache prefixes, else none."""
        if not self.config.engine_options.get("enable_prefix_caching"):
            return []
        return block_hashes(token_ids, self.workers.model_facts["block_size"], [])

    def _remember_answer(self, tracked: Tracked) -> None:
        """A finished request's decode worker keeps its prompt + answer blocks and a checkpoint
        at the answer's last block boundary: the next turn of the chat is cheapest there."""
        owner = self.workers.owner.get(tracked.worker_id)
        if owner is not None:
            owner[0].prefixes.add(self._block_hashes(tracked.prompt_ids + tracked.tokens[:-1]))

    async def _abort_once_placed(self, wid: str, placing) -> None:
        """A caller that goes away while a decode worker call places its attempt: that call
        still runs on the worker, and an abort arriving before it would find nothing there and
        leave the reservation (or a local generation) running for no one. Abort after it."""
        if placing is not None:
            with contextlib.suppress(Exception):  # failed or slow: abort all the same
                await asyncio.wait_for(placing, PLACING_WAIT_S)
        await self.workers.abort_everywhere(wid)

    async def _prefill(self, prefill, decode, tracked: Tracked, wid: str, charge: int, call, asked: float) -> None:
        """Follow the attempt's prefill `call` (made at `asked`); `decode` holds its reservation
        (None: it finishes on the prefill worker)."""
        waiter, life, outcome = tracked.prefill_outcome, prefill.incarnation, None
        try:
            outcome = await self._while_prefill_queued(call, prefill, decode, wid)
            tracked.note(f"prefill call to {prefill.name}", asked)
            error, retryable = outcome.error, outcome.retryable
        except Exception as e:  # the actor died or the call failed
            outcome, error, retryable = None, f"prefill worker {prefill.name} failed: {e}", True
            self.workers.lost_if_dead(prefill, e, life)  # so the retry goes elsewhere at once
        finally:
            prefill.queued_tokens -= charge
            handed_off = outcome is not None and outcome.handed_off
            if not waiter.done():  # cancelled too: the attempt's last output waits on it
                waiter.set_result(outcome if handed_off else None)
        if handed_off:
            return
        # The attempt's end goes to the caller before the reservation is released: the decode
        # worker reports the released reservation as a failed hand-off, and that report must
        # find the attempt over, not be taken for a broken hand-off and retried.
        if outcome is not None and outcome.output is not None and outcome.output.error is None:
            self._deliver(wid, outcome.output)  # finished at its first token on the prefill worker
        else:
            self._deliver(wid, Failure(error or "prefill failed", retryable))
        if decode is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(decode.handle.abort.remote(wid, error), 10)

    async def _while_prefill_queued(self, call, prefill, decode, wid: str):
        """Await the prefill call. The decode worker's reservation waits transfer_timeout_s for
        its hand-off; while the prefill worker is making progress (its step count moves) and has
        not begun this hand-off, or streams it as its prompt prefills and has landed more rows
        since the last renewal, a long prefill is not a stalled hand-off, so the router restarts
        that wait (the receiver decides which, kvtransfer keep_waiting). A stuck prefill worker or
        a hand-off that stopped moving times out as before."""
        if decode is None:  # no reservation to keep
            return await call
        task = asyncio.ensure_future(call)
        period = self.config.transfer_timeout_s / 3
        steps = prefill.stats.get("steps")
        while True:
            done, _ = await asyncio.wait({task}, timeout=period)
            if done:
                return task.result()
            now = prefill.stats.get("steps")
            if now is not None and now != steps:
                steps = now
                decode.handle.keep_reserved.remote(wid)  # fire and forget: the next period retries

    def _spawn(self, coro) -> None:
        """Run `coro` on the router loop unawaited; the loop keeps only weak references to
        tasks, so one nothing else holds could be collected before it ends."""
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _deliver(self, worker_id: str, event) -> None:
        tracked = self._attempts.get(worker_id)
        if tracked is not None:
            tracked.events.put_nowait(event)

    async def _route(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            self._deliver(out.request_id, out)

    def _worker_lost(self, worker, incarnation: str) -> None:
        """Every attempt that lived on this incarnation of a decode worker is gone."""
        for wid, (owner, where) in list(self.workers.owner.items()):
            if owner is worker and where == incarnation:
                self._deliver(wid, Failure(f"decode worker {worker.name} died", retryable=True))

    def _drop_attempt(self, tracked: Tracked) -> None:
        """Whatever of the attempt a live worker still holds is aborted; the next attempt runs
        under another id, so it need not wait for that (a restarting worker can take seconds)."""
        self._attempts.pop(tracked.worker_id, None)
        self._spawn(self.workers.abort_everywhere(tracked.worker_id))

    def _notify_room(self) -> None:
        async def notify():
            async with self._room:
                self._room.notify_all()
        self._spawn(notify())

    async def _abort(self, request_id: str) -> bool:
        tracked = self._requests.get(request_id)
        if tracked is None:
            return False
        self._deliver(tracked.worker_id, tracked.aborted())  # ends the caller's stream
        await self._abort_once_placed(tracked.worker_id, tracked.placing)
        return True


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
