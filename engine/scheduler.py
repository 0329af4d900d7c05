"""Continuous batching under a per-step token budget. No torch: it returns plain data.

Each step: running requests first, in arrival order (decodes take one token, unfinished
prefills take their next chunk); then waiting requests, first come first served, while the
budget, the state slots and the KV blocks allow. When blocks run out, the most recently
arrived running request is preempted: its blocks and slot are dropped and it is recomputed
from zero later (its phase is then FRESH_PREFILL again, never a read of the dropped slot).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from engine.block_manager import BlockManager
from engine.phase import Phase
from engine.request import Request, RequestStatus
from engine.state_slots import StateSlotAllocator


@dataclass
class ScheduledSeq:
    request: Request
    phase: Phase
    num_new_tokens: int
    slot: int
    block_table: list[int]


@dataclass
class SchedulerOutput:
    seqs: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.seqs)


class Scheduler:
    def __init__(self, blocks: BlockManager, slots: StateSlotAllocator, max_num_batched_tokens: int,
                 prefill_only: bool = False):
        self.blocks = blocks
        self.slots = slots
        self.max_num_batched_tokens = max_num_batched_tokens
        self.prefill_only = prefill_only
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def add_reserved(self, request: Request) -> None:
        """Decode side of a hand-off: blocks and slot are already reserved, state is on its way."""
        request.status = RequestStatus.WAITING_FOR_STATE
        self.running.append(request)

    def reserve(self, request: Request, num_tokens: int) -> tuple[list[int], int]:
        """Take blocks for `num_tokens` tokens and a slot for `request`, all or nothing."""
        if self.slots.num_free_slots == 0 or not self.blocks.can_allocate(request.request_id, num_tokens):
            raise MemoryError(f"no room to reserve {num_tokens} tokens for {request.request_id!r}")
        table = self.blocks.allocate(request.request_id, num_tokens)
        return table, self.slots.allocate(request.request_id)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def release(self, request: Request) -> None:
        """Drop everything `request` holds; safe to call in any state, more than once."""
        self.blocks.free(request.request_id)
        self.slots.free(request.request_id)
        if request in self.running:
            self.running.remove(request)
        if request in self.waiting:
            self.waiting.remove(request)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            if request.status not in (RequestStatus.PREFILLING, RequestStatus.DECODING):
                index += 1
                continue
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            total = request.num_computed_tokens + num_new
            while not self.blocks.can_allocate(request.request_id, total):
                victim = self._preemption_victim(request)
                self._preempt(victim, out)
                if victim is request:
                    break
            if request.status is RequestStatus.PREEMPTED:
                continue  # `request` itself was preempted and removed from running
            out.seqs.append(self._scheduled(request, num_new, total))
            budget -= num_new
            index += 1
        if out.preempted:
            return out  # admitting new work in a step that had to preempt would thrash
        while self.waiting and budget > 0 and self.slots.num_free_slots > 0:
            request = self.waiting[0]
            num_new = min(request.num_tokens, budget)
            if not self.blocks.can_allocate(request.request_id, num_new):
                break
            self.waiting.popleft()
            request.start_prefill()
            self.slots.allocate(request.request_id)
            self.running.append(request)
            out.seqs.append(self._scheduled(request, num_new, num_new))
            budget -= num_new
        return out

    def _scheduled(self, request: Request, num_new: int, total: int) -> ScheduledSeq:
        table = self.blocks.allocate(request.request_id, total)
        return ScheduledSeq(request, request.phase(), num_new,
                            self.slots.slot_of[request.request_id], table)

    def _preemption_victim(self, request: Request) -> Request:
        candidates = [r for r in self.running
                      if r.status in (RequestStatus.PREFILLING, RequestStatus.DECODING)]
        return candidates[-1] if candidates else request

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        self.blocks.free(request.request_id)
        self.slots.free(request.request_id)
        self.running.remove(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)
        out.preempted.append(request)
