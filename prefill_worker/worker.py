"""Prefill worker: a prefill-only engine that ships each finished prompt to its decode worker.

Per request: the router passes the HandoffTarget (decode worker's reserved blocks and slot);
the engine batches and chunks prompts like any engine; once a prompt's first token is
sampled, its KV rows, recurrent state and the token go out through kvtransfer, and the blocks
and slot are freed only when the transport reports it can no longer read them. A prompt
prefilled in several chunks streams: its hand-off begins after its first chunk, each step's
finished KV rows go while later chunks compute, and what is left after the last chunk is that
chunk's rows and the recurrent state (TransferConfig.stream_prefill). A
tensor-parallel worker sends to a decode worker of its own TP size rank to rank
(engine.tp.rank_handoffs), to any other through rank 0's staging rows; a GPU worker on a
host-side wire (shm, gloo) sends through host staging rows (engine.staging).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from dataclasses import dataclass

from engine.engine_thread import EngineThread
from engine.llm_engine import Handoff, LLMEngine
from engine.output import RequestOutput
from engine.request import Resume
from engine.staging import StagedSendPump
from engine.trace import engine_spans, span
from engine.sampling_params import SamplingParams
from engine.tp.rank_handoffs import RankOffers
from kvtransfer import HandoffResult, HandoffTarget
from worker_base import WorkerBase
from worker_base.prefix_wire import PendingPrefix, fetch

log = logging.getLogger(__name__)


@dataclass
class PrefillOutcome:
    """How a prefill ended, for the router: handed off, finished here, or failed."""

    request_id: str
    handed_off: bool
    output: RequestOutput | None = None  # set when the request finished on this worker
    error: str | None = None
    handoff_bytes: int = 0
    handoff_seconds: float = 0.0
    first_logprob: dict | None = None  # the wire carries the first token, not its logprobs
    num_cached_tokens: int = 0  # prompt tokens the prefix cache supplied
    prompt_logprobs: list | None = None  # SamplingParams.prompt_logprobs, computed here
    retryable: bool = False  # failed in the plumbing (hand-off), not because of the request
    spans: tuple = ()  # queued, prefill and the hand-off, as this worker measured them (engine.trace)


class PendingTarget:
    """A reservation asked for together with the prefill (the ObjectRef of the decode worker's
    reserve(); inside an object, so Ray does not wait for it before the call runs): the prefill
    starts at once, and its hand-off waits for the reservation only once its rows are ready."""

    def __init__(self, reservation):
        self.reservation = reservation

    async def resolve(self) -> HandoffTarget:
        return await self.reservation


@dataclass(frozen=True)
class ReservationFailed:
    why: str


_AWAITED = object()  # the target of a request whose reservation is still on its way


class PrefillWorker(WorkerBase):
    def __init__(self, name: str, model: str, engine_options: dict, transport: str,
                 transfer_timeout_s: float = 30.0, tp_ranks: tuple | None = None):
        super().__init__(name, model, engine_options, transport, "prefill", "sender",
                         transfer_timeout_s, tp_ranks)
        self.sender = self.wire.sender(name, self.cache_tensors, self.transfer_config,
                                       on_done=self._handoff_done)
        self._targets: dict[str, HandoffTarget] = {}
        self._peers: set[str] = set()
        self._waiters: dict[str, concurrent.futures.Future] = {}
        self._queued_tokens: dict[str, int] = {}
        self._shipped: dict[str, Handoff] = {}  # what the outcome reports of a sent hand-off
        self._sent: dict[str, tuple] = {}  # request -> (its engine spans, when its send began)
        self._deferred: list[Handoff] = []  # waiting for staging rows
        self._streaming: dict = {}  # request -> its hand-off begun while the prompt prefills
        self._first_token_to: dict = {}  # request -> where its first token goes (prefill_stream)
        self.handoffs = {"count": 0, "failures": 0, "bytes": 0, "seconds": 0.0, "by_rank": 0}
        self._stall_next = 0  # fault injection: hand-offs to start and never finish
        # GPU rows copied to host staging asynchronously: a thread feeds the wire as layers land
        self.pump = StagedSendPump(name) if self.staging is not None and self.staging.copy_stream is not None else None
        self.thread = EngineThread(self.engine, self._on_outputs, self._ship, name=f"{name}-loop")

    # ---- router-facing (Ray actor methods) ----

    def handoff_ranks(self) -> int:
        """The TP size a decode worker's accept() is told: equal sizes hand off rank to rank."""
        return self.ranks

    async def connect(self, peer: str, offer) -> None:
        """Connect to decode worker `peer` with its accept()'s offer: one per rank (RankOffers)
        or one for rank 0's staging rows; whichever it is replaces the other kind."""
        self._peers.add(peer)
        if isinstance(offer, RankOffers):
            if self.rank_handoffs is None:
                raise ValueError(f"decode worker {peer!r} offers {len(offer.offers)} ranks; this worker has one")
            self.sender.disconnect(peer)
            await asyncio.wrap_future(self.thread.call(lambda engine: self.rank_handoffs.connect(peer, offer)))
            self._rank_peers.add(peer)
            return
        if peer in self._rank_peers:
            self._rank_peers.discard(peer)
            await asyncio.wrap_future(self.thread.call(lambda engine: self.rank_handoffs.disconnect(peer)))
        self.sender.connect(peer, offer)

    async def disconnect(self, peer: str) -> None:
        """Decode worker `peer` left the cluster: no channel to it, none to repair."""
        self._peers.discard(peer)
        self.sender.disconnect(peer)
        if peer in self._rank_peers:
            self._rank_peers.discard(peer)
            await asyncio.wrap_future(self.thread.call(lambda engine: self.rank_handoffs.disconnect(peer)))

    async def disconnected_peers(self) -> list[str]:
        """Decode workers whose channel broke (e.g. a hand-off died mid-stream): reconnect them."""
        by_rank = sorted(self._rank_peers)

        def broken_by_rank(engine) -> list[str]:
            return [p for p in by_rank if not self.rank_handoffs.connected(p)]

        broken = await asyncio.wrap_future(self.thread.call(broken_by_rank)) if by_rank else []
        return sorted(broken + [p for p in self._peers - self._rank_peers if not self.sender.connected(p)])

    async def prefill(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                      target: HandoffTarget | PendingTarget | None, resume: Resume | None = None,
                      prefix: PendingPrefix | None = None) -> PrefillOutcome:
        """Prefill one request and send it to `target` (a PendingTarget: once the reservation it
        awaits is granted); None: the router reserved nowhere, since the request ends at its first
        token (the outcome then carries its output). `prefix`: a cached prefix another worker
        holds for it (worker_base.prefix_wire), fetched before the request is queued."""
        return await self._prefill(request_id, prompt_token_ids, params, target, resume, None, prefix)

    async def prefill_stream(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                             target: HandoffTarget | PendingTarget | None, resume: Resume | None = None,
                             prefix: PendingPrefix | None = None):
        """prefill() as the router calls it, a Ray streaming generator: the first token (a
        RequestOutput delta, with its logprobs and the prompt's) the moment it is sampled, so it
        reaches the caller while the hand-off runs, then the PrefillOutcome. A request that ends
        at its first token yields only the outcome, which carries its output."""
        loop = asyncio.get_running_loop()
        first: asyncio.Future = loop.create_future()

        def on_first(out: RequestOutput) -> None:  # on the engine thread, once (_on_outputs pops it)
            loop.call_soon_threadsafe(first.set_result, out)

        outcome = asyncio.ensure_future(self._prefill(request_id, prompt_token_ids, params, target,
                                                      resume, on_first, prefix))
        await asyncio.wait({first, outcome}, return_when=asyncio.FIRST_COMPLETED)
        if first.done():
            yield first.result()
        yield await outcome

    async def _prefill(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       target, resume: Resume | None, on_first, prefix: PendingPrefix | None = None) -> PrefillOutcome:
        waiter: concurrent.futures.Future = concurrent.futures.Future()
        self._waiters[request_id] = waiter
        self._targets[request_id] = _AWAITED if isinstance(target, PendingTarget) else target
        self._queued_tokens[request_id] = len(prompt_token_ids) + len(resume.output_token_ids if resume else ())
        if on_first is not None:
            self._first_token_to[request_id] = on_first
        granting = (asyncio.ensure_future(self._await_target(request_id, target))
                    if isinstance(target, PendingTarget) else None)
        try:
            if params.structured_output is not None:  # compiled here, off the engine loop (engine/structured.py)
                await asyncio.to_thread(self.engine.grammars.compile, params.structured_output)
            if prefix is not None:
                await self._import_prefix(request_id, prefix)
            await asyncio.wrap_future(self.thread.call(
                lambda engine: engine.add_request(prompt_token_ids, params, request_id=request_id, resume=resume)))
            return await asyncio.wrap_future(waiter)
        except Exception as e:
            return PrefillOutcome(request_id, False, error=f"{type(e).__name__}: {e}")
        finally:
            if granting is not None:
                granting.cancel()
            self._waiters.pop(request_id, None)
            self._targets.pop(request_id, None)
            self._queued_tokens.pop(request_id, None)
            self._shipped.pop(request_id, None)
            self._sent.pop(request_id, None)
            self._first_token_to.pop(request_id, None)
            self._streaming.pop(request_id, None)

    async def _import_prefix(self, request_id: str, prefix: PendingPrefix) -> None:
        """The prefix another worker holds, into this engine's host tier (worker_base.prefix_wire);
        a failed or slow fetch, or one refused here, only means the request computes that part
        itself."""
        if self.prefix_wire is None:
            return
        try:
            # each wait a third of the hand-off's timeout: the decode worker's reservation waits meanwhile
            await fetch(self, request_id, prefix, self.transfer_config.timeout_s / 3)
        except Exception as e:
            log.warning("%s: prefix from %s for %s not fetched (%s: %s); computing it", self.name,
                        prefix.source_name, request_id, type(e).__name__, e)

    async def _await_target(self, request_id: str, pending: PendingTarget) -> None:
        try:
            target = await pending.resolve()
        except Exception as e:  # the decode worker had no room, or died: the hand-off fails
            target = ReservationFailed(f"{type(e).__name__}: {e}")
        if request_id in self._waiters:
            self._targets[request_id] = target
            self.thread.call(self._send_ready)  # a hand-off that waited for it goes now

    async def abort(self, request_id: str) -> None:
        if self.rank_handoffs is not None and request_id in self.rank_handoffs.pending_ids:
            await asyncio.wrap_future(self.thread.call(
                lambda engine: self.rank_handoffs.abort(request_id, "aborted by the router")))
            return
        if request_id in self.sender.pending():
            # The transport may still read its rows: _handoff_done frees them once it lets go.
            self.sender.abort(request_id)
            return
        await asyncio.wrap_future(self.thread.call(lambda engine: engine.abort(request_id)))

    def inject_stalled_handoffs(self, count: int) -> None:
        """Fault injection for tests and drills: the next `count` hand-offs start and then stall,
        as if the sender hung mid-transfer; both sides must time out and free."""
        self._stall_next = count

    def inject_broken_channels(self) -> None:
        """Fault injection for tests and drills: every channel to a decode worker breaks, as
        when a timed-out hand-off closes its wire; the router must pair them again."""
        for peer in sorted(self._peers - self._rank_peers):
            self.sender.break_channel(peer, "broken by fault injection")

    def stats(self) -> dict:
        stats = self.engine.stats()
        events = self.engine.drain_cache_events()  # the router's index of what this worker caches
        if events is not None:
            stats["cache_events"] = events
        stats.update(incarnation=self.incarnation, queued_prompt_tokens=sum(self._queued_tokens.values()),
                     handoff_count=self.handoffs["count"], handoff_failures=self.handoffs["failures"],
                     handoff_bytes=self.handoffs["bytes"], handoff_seconds_sum=self.handoffs["seconds"],
                     handoffs_by_rank=self.handoffs["by_rank"])
        return stats

    def shutdown(self) -> None:
        self.thread.stop()
        if self.pump is not None:
            self.pump.close()
        self.sender.close()
        if self.rank_handoffs is not None:
            self.rank_handoffs.close()
        self._close_prefix_wire()

    # ---- engine thread and transport callbacks ----

    def _ship(self, engine: LLMEngine) -> None:
        """After each step, on the engine thread: send what is ready."""
        self._crash_point(engine.requests)
        self._send_ready(engine)
        self._stream_prefills(engine)

    def _stream_prefills(self, engine: LLMEngine) -> None:
        """Prompts still prefilling whose reservation is granted: begin their hand-off after
        their first chunk, then report each step's progress (the rows it finished go out).
        Not for staged rows or rank-to-rank hand-offs, which go after the prefill."""
        if not self.transfer_config.stream_prefill or self.staging is not None or self.rank_handoffs is not None \
                or not self.cache_tensors.layout.has_blocks:  # without attention all of it is state, final at the end
            return
        for request_id, target in list(self._targets.items()):
            if not isinstance(target, HandoffTarget) or target.ranks > 1:
                continue
            progress = engine.prefill_progress(request_id)
            if progress is None:
                continue
            if request_id in self._streaming:
                job = self._streaming[request_id]
                if job is not None:
                    job.tokens_done(progress.num_computed_tokens)
                continue
            slot = progress.slot if self.cache_tensors.num_slots else None
            try:
                self._streaming[request_id] = self.sender.begin(target, progress.num_tokens, progress.block_ids, slot,
                                                                computed_tokens=progress.num_computed_tokens)
            except Exception as e:  # no channel, say: it is sent whole after its prefill, and fails there
                log.debug("%s: not streaming %s: %s", self.name, request_id, e)
                self._streaming[request_id] = None

    def _send_ready(self, engine: LLMEngine) -> None:
        if self.rank_handoffs is not None:
            for result in self.rank_handoffs.poll():  # every rank let go of the request's rows
                self._handoff_done(result)
        ready, self._deferred = self._deferred + engine.take_handoffs(), []
        for handoff in ready:
            target = self._targets.get(handoff.request_id)
            if handoff.request_id not in engine.requests:  # aborted meanwhile: its output says so
                continue
            if target is _AWAITED:  # its rows are ready before the reservation is granted
                self._deferred.append(handoff)
                continue
            if target is None or isinstance(target, ReservationFailed):
                # None: the router reserved nowhere, expecting it to end at its first token
                error = (f"no reservation: {target.why}" if target is not None
                         else "no decode worker holds room for this request")
                engine.finish_handoff(handoff.request_id, error)
                self._resolve(handoff.request_id, PrefillOutcome(handoff.request_id, False, error=error))
                continue
            if target.ranks > 1 or target.receiver in self._rank_peers:
                self._ship_by_rank(engine, handoff, target)
                continue
            if self._streaming.get(handoff.request_id) is not None:
                self._finish_stream(engine, handoff)
                continue
            blocks, slot, copying = handoff.block_ids, handoff.slot, []
            if self.staging is not None:  # the wire reads staging rows (engine.staging)
                staged = self.staging.take(handoff.request_id, len(blocks))
                if staged is None:
                    self._deferred.append(handoff)
                    continue
                copying = self.staging.gather(staged, blocks, slot)  # layers still copying to the host
                blocks, slot = staged.blocks, staged.slot
            self._shipped[handoff.request_id] = handoff
            self._sent[handoff.request_id] = (engine_spans(engine.requests[handoff.request_id], self.name),
                                              time.monotonic())
            slot = slot if self.cache_tensors.num_slots else None
            try:
                if self._stall_next > 0:
                    self._stall_next -= 1
                    self.sender.begin(target, handoff.num_tokens, blocks, slot)
                    continue
                if copying:  # the pump marks each layer ready as its copy lands, then finishes
                    self.pump.submit(self.sender.begin(target, handoff.num_tokens, blocks, slot), copying,
                                     handoff.first_token)
                else:
                    self.sender.send(target, handoff.num_tokens, blocks, slot, handoff.first_token)
            except Exception as e:
                self._ship_failed(engine, handoff.request_id, e)

    def _finish_stream(self, engine: LLMEngine, handoff: Handoff) -> None:
        """The last chunk ran: what is left of a streaming hand-off goes, the first token with it."""
        rid = handoff.request_id
        job = self._streaming.pop(rid)
        self._shipped[rid] = handoff
        self._sent[rid] = (engine_spans(engine.requests[rid], self.name), time.monotonic())
        n = self.cache_tensors.layout.num_blocks_for(handoff.num_tokens)
        if job.num_tokens != handoff.num_tokens or job.src_block_ids != handoff.block_ids[:n]:
            # cannot happen while a prefill-only scheduler never moves a request's blocks
            job.abort(f"the prompt's blocks changed while its hand-off streamed ({job.num_tokens} "
                      f"tokens streamed, {handoff.num_tokens} computed)")
            return
        job.finish(handoff.first_token)

    def _ship_by_rank(self, engine: LLMEngine, handoff: Handoff, target: HandoffTarget) -> None:
        """Every rank sends its own shard (engine.tp.rank_handoffs); results come from poll()."""
        rid = handoff.request_id
        try:
            sends = self.ranks if target.receiver in self._rank_peers else 1
            if target.ranks != sends:
                raise ValueError(f"request {rid}: decode worker {target.receiver!r} expects {target.ranks} "
                                 f"shard(s); this worker sends {sends} (its channels changed since the reservation)")
            self._shipped[rid] = handoff
            self._sent[rid] = (engine_spans(engine.requests[rid], self.name), time.monotonic())
            slot = handoff.slot if self.cache_tensors.num_slots else None
            self.rank_handoffs.send(target, handoff.num_tokens, handoff.block_ids, slot, handoff.first_token)
            self.handoffs["by_rank"] += 1
        except Exception as e:
            self._ship_failed(engine, rid, e)

    def _ship_failed(self, engine: LLMEngine, request_id: str, error: Exception) -> None:
        """A hand-off that could not start: its rows are free now, and the router may retry."""
        engine.finish_handoff(request_id, str(error))
        if self.staging is not None:
            self.staging.give_back(request_id)
        self._resolve(request_id, PrefillOutcome(request_id, False, error=str(error), retryable=True))

    def _handoff_done(self, result: HandoffResult) -> None:
        # The transport no longer touches the rows: free them on the engine thread.
        def finish(engine: LLMEngine) -> None:
            engine.finish_handoff(result.request_id, result.error)
            if self.staging is not None:
                self.staging.give_back(result.request_id)
                self._send_ready(engine)  # a deferred hand-off may fit in the rows just freed

        self.thread.call(finish)
        self.handoffs["count"] += 1
        self.handoffs["seconds"] += result.elapsed_s
        if result.ok:
            self.handoffs["bytes"] += self.cache_tensors.layout.handoff_bytes(result.num_tokens)
        else:
            self.handoffs["failures"] += 1
        shipped = self._shipped.get(result.request_id)
        spans, began = self._sent.get(result.request_id, ((), None))
        spans += tuple(span("hand-off", began, time.monotonic(), self.name))
        self._resolve(result.request_id, PrefillOutcome(
            result.request_id, result.ok, error=result.error,
            handoff_bytes=self.cache_tensors.layout.handoff_bytes(result.num_tokens),
            handoff_seconds=result.elapsed_s, first_logprob=shipped.first_logprob if shipped else None,
            num_cached_tokens=shipped.num_cached_tokens if shipped else 0,
            prompt_logprobs=shipped.prompt_logprobs if shipped else None, retryable=not result.ok,
            spans=spans))

    def _on_outputs(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            if out.finished and out.request_id in self._waiters:
                # Finished at its first token (max_tokens=1, EOS, stop) or failed: no hand-off.
                self._resolve(out.request_id, PrefillOutcome(out.request_id, False, output=out,
                                                             error=out.error))
                if self._streaming.get(out.request_id) is not None:  # its stream stops; the receiver frees
                    self.sender.abort(out.request_id, f"the request ended on the prefill worker ({out.error or 'finished'})")
            elif not out.finished and out.new_token_ids:  # its first token: the hand-off follows
                on_first = self._first_token_to.pop(out.request_id, None)
                if on_first is not None:
                    on_first(out.delta())

    def _resolve(self, request_id: str, outcome: PrefillOutcome) -> None:
        waiter = self._waiters.get(request_id)
        if waiter is not None and not waiter.done():
            waiter.set_result(outcome)

