"""Decode worker: reserves room for incoming requests, receives their state, runs the token loop.

A request arrives in two steps: `reserve` (blocks + state slot held, WAITING_FOR_STATE,
receiver told to expect it), then the prefill worker's hand-off lands and the request starts
decoding. A tensor-parallel worker receives from a prefill worker of its own TP size rank to
rank (engine.tp.rank_handoffs), from any other through rank 0's staging rows; a GPU worker
on a host-side wire (shm, gloo) receives into host staging rows (engine.staging). Outputs of
every step, for all requests, go to the router as one batch (decode_worker.outbox: over the
router's direct connection, else its Ray `outputs` stream).
Short prompts can skip the split and prefill right here (`generate_local`).
"""

from __future__ import annotations

import asyncio

from decode_worker.outbox import Outbox
from engine.engine_thread import EngineThread
from engine.llm_engine import LLMEngine, Reservation
from engine.output import RequestOutput
from engine.request import RequestStatus, Resume
from engine.sampling_params import SamplingParams
from kvtransfer import HandoffTarget
from worker_base import WorkerBase, node_ip


class DecodeWorker(WorkerBase):
    def __init__(self, name: str, model: str, engine_options: dict, transport: str,
                 transfer_timeout_s: float = 30.0, tp_ranks: tuple | None = None):
        super().__init__(name, model, engine_options, transport, "decode", "receiver",
                         transfer_timeout_s, tp_ranks, output_kind="delta")
        self._reservations: dict[str, Reservation] = {}  # staged hand-offs: where the rows go
        self._slow_reservations = (0, 0.0)  # fault injection: (count, seconds) before reserving
        # No on_done: the engine loop polls the receiver after every step (_take_handoffs), which
        # is where shm finds its landings, and applies results on its own thread.
        self.receiver = self.wire.receiver(name, self.cache_tensors, self.transfer_config)
        self.outbox = Outbox(node_ip(), name)
        self.thread = EngineThread(self.engine, self._deliver, after_step=self._take_handoffs, name=f"{name}-loop")

    # ---- router-facing (Ray actor methods) ----

    def facts(self) -> dict:
        return {**self.model_facts(), "num_kv_blocks": self.engine.blocks.num_blocks,
                "block_size": self.engine.config.block_size}

    async def accept(self, peer: str, peer_ranks: int = 1):
        """An offer for prefill worker `peer` (of TP size `peer_ranks`) to connect its sender:
        one per rank (RankOffers) when the sizes are equal, else rank 0's staging receiver's."""
        if self.rank_handoffs is not None and peer_ranks == self.ranks:
            offers = await asyncio.wrap_future(self.thread.call(lambda engine: self.rank_handoffs.accept(peer)))
            self._rank_peers.add(peer)
            return offers
        self._rank_peers.discard(peer)
        return self.receiver.accept(peer)

    async def reserve(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                      resume: Resume | None = None, peer: str | None = None) -> HandoffTarget:
        """Room for a request that prefill worker `peer` will send (None: any, un-sharded)."""
        if params.structured_output is not None:  # compiled here, off the engine loop (engine/structured.py)
            await asyncio.to_thread(self.engine.grammars.compile, params.structured_output)
        count, seconds = self._slow_reservations
        if count > 0:
            self._slow_reservations = (count - 1, seconds)
            await asyncio.sleep(seconds)

        by_rank = peer in self._rank_peers

        def reserve(engine: LLMEngine) -> HandoffTarget:
            reservation = engine.reserve_for_handoff(prompt_token_ids, params, request_id, resume)
            if by_rank:
                target = self._target(request_id, reservation.block_ids, reservation.slot, self.ranks)
                try:
                    self.rank_handoffs.expect(target)
                except Exception:
                    engine.cancel_reservation(request_id)
                    raise
                return target
            if self.staging is None:
                return self._target(request_id, reservation.block_ids, reservation.slot)
            staged = self.staging.take(request_id, len(reservation.block_ids))
            if staged is None:  # the router waits for room, as for a full cache
                engine.cancel_reservation(request_id)
                raise MemoryError("hand-off staging rows are all in use")
            self._reservations[request_id] = reservation
            return self._target(request_id, staged.blocks, staged.slot)

        target = await asyncio.wrap_future(self.thread.call(reserve))
        if not by_rank:
            self.receiver.expect(target)
        return target

    def _target(self, request_id: str, blocks, slot: int | None, ranks: int = 1) -> HandoffTarget:
        return HandoffTarget(request_id, self.name, tuple(blocks), slot if self.cache_tensors.num_slots else None,
                             ranks)

    async def generate_local(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                             resume: Resume | None = None) -> None:
        if params.structured_output is not None:  # as in reserve
            await asyncio.to_thread(self.engine.grammars.compile, params.structured_output)
        await asyncio.wrap_future(self.thread.call(
            lambda engine: engine.add_request(prompt_token_ids, params, request_id=request_id, resume=resume)))

    def inject_slow_reservations(self, count: int, seconds: float) -> None:
        """Fault injection for tests and drills: the next `count` reservations take `seconds`
        longer before they exist, as under a loaded worker."""
        self._slow_reservations = (count, seconds)

    def keep_reserved(self, request_id: str) -> bool:
        if request_id in self._rank_pending():
            self.thread.call(lambda engine: self.rank_handoffs.keep_waiting(request_id))
            return True
        return self.receiver.keep_waiting(request_id)

    async def abort(self, request_id: str, error: str | None = None) -> None:
        reason = error or "aborted by the router"

        def abort(engine: LLMEngine) -> None:
            # On the engine thread, as _take_handoffs: a hand-off in flight is revoked (its rows may
            # still be written: the receiver reports, and _take_handoffs frees, once they are not);
            # one that has landed, even a moment ago, is the engine's to abort with its reservation.
            if request_id in self._rank_pending():
                self.rank_handoffs.abort(request_id, reason)
            elif not self.receiver.abort(request_id, reason):
                engine.abort(request_id, error)

        await asyncio.wrap_future(self.thread.call(abort))

    def output_address(self) -> tuple[str, int, bytes]:
        """Where the router connects for this worker's outputs, and the token both ends prove
        they hold (decode_worker.outbox)."""
        return (*self.outbox.address, self.outbox.token)

    async def outputs(self):
        """Every step's outputs as they happen, as a Ray streaming generator: for a router that
        cannot reach output_address. One consumer at a time: a newer one ends this one."""
        async for batch in self.outbox.stream():
            yield batch

    async def poll(self, timeout_s: float = 1.0) -> list[RequestOutput]:
        """Every output since the last poll, waiting up to timeout_s: for in-process callers
        (tests, scripts/gpu_check_handoff.py); the router reads `output_address`."""
        return await asyncio.to_thread(self.outbox.take, timeout_s)

    def stats(self) -> dict:
        stats = self.engine.stats()
        events = self.engine.drain_cache_events()  # the router's index of what this worker caches
        if events is not None:
            stats["cache_events"] = events
        stats.update(incarnation=self.incarnation,
                     waiting_for_state=len(self.receiver.pending()) + len(self._rank_pending()))
        return stats

    def shutdown(self) -> None:
        self.thread.stop()
        self.outbox.close()
        self.receiver.close()
        if self.rank_handoffs is not None:
            self.rank_handoffs.close()
        self._close_prefix_wire()

    def _rank_pending(self) -> frozenset[str]:
        return self.rank_handoffs.pending_ids if self.rank_handoffs is not None else frozenset()

    # ---- engine thread and transport callbacks ----

    def _take_handoffs(self, engine: LLMEngine) -> None:
        """After each step, on the engine thread: start decoding what landed, drop what failed.
        The loop keeps stepping while a request waits for its state, so this runs every step then."""
        by_rank = self.rank_handoffs.poll() if self.rank_handoffs is not None else []
        outputs = []
        for result in by_rank + self.receiver.poll():
            request = engine.requests.get(result.request_id)
            reservation = self._reservations.pop(result.request_id, None)
            if request is not None and request.status is RequestStatus.WAITING_FOR_STATE:
                if result.ok:
                    if reservation is not None:  # staging rows -> the request's rows (on every rank)
                        self.staging.scatter(self.staging.held[result.request_id],
                                             engine.blocks.blocks_needed(result.num_tokens),
                                             reservation.block_ids, reservation.slot)
                    outputs.append(engine.accept_handoff(result.request_id, result.first_token))
                else:
                    engine.abort(result.request_id, f"state hand-off failed: {result.error}")
            if self.staging is not None:
                self.staging.give_back(result.request_id)
        if outputs:
            self._deliver(outputs)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        self._crash_point({out.request_id for out in outputs})
        # Deltas (the engine's output_kind): the router rebuilds the prompt, tokens, text and
        # logprobs (Tracked.delivered), else each step would ship them all again (8k-token
        # prompts: 1.5 MB a step for 64).
        self.outbox.put(outputs)
