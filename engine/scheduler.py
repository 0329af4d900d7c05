"""Continuous batching under a per-step token budget. No torch: it returns plain data.

Each step: running requests first, in arrival order (decodes take one token, unfinished
prefills take their next chunk); then waiting requests, first come first served, while the
budget, the state slots and the KV blocks allow. When blocks run out, the most recently
arrived running request is preempted: its blocks and slot are dropped and it is recomputed
from zero later (its phase is then FRESH_PREFILL again, never a read of the dropped slot).

With a prefix cache, an admitted request starts from its longest cached prefix: the blocks are
shared, the checkpoint is listed in `restores` for the engine to copy into the request's own
slot before the step, and the rest runs as a CONTINUED_PREFILL. A prefill chunk may cross a
point of `request.save_points` (block boundaries whose state the engine checkpoints): the
engine has the pass leave the state there in a checkpoint row (ScheduledSeq.captures). Where
the model cannot (split_at_save_points), the chunk runs in pieces that end at the points, one
pass of the step each (ScheduledSeq.num_later_tokens).

A prefill-only scheduler (a prefill worker's) admits a request only with blocks for its whole
prompt, taken at admission: its requests never grow afterwards, so none is ever preempted, and
a hand-off may read a chunk's blocks while later chunks compute (prefill_worker streams them).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from engine.block_manager import BlockManager
from engine.phase import Phase
from engine.prefix_cache import PrefixCache, block_hashes
from engine.request import Request, RequestStatus
from engine.state_slots import StateSlotAllocator


@dataclass
class ScheduledSeq:
    request: Request
    phase: Phase
    num_new_tokens: int
    slot: int
    block_table: list[int]
    # Tokens this step runs after `num_new_tokens`, in further passes of the same step: a
    # prefill chunk that crosses a save point stops there so the state can be checkpointed
    # (engine.LLMEngine.step), then goes on without waiting for the next step.
    num_later_tokens: int = 0
    # VERIFY (engine.speculative): the slot its state is copied to before the step, to copy
    # back if a draft is rejected; None where nothing needs rolling back.
    scratch_slot: int | None = None
    # (tokens into this chunk, checkpoint row): where the engine has this pass leave the state
    # after that many of the chunk's tokens in that prefix-cache checkpoint row (each strictly
    # inside the chunk, at a save point); the engine attaches each row to its block after the
    # pass and takes it off this list.
    captures: list[tuple[int, int]] = field(default_factory=list)

    def then(self) -> ScheduledSeq | None:
        """This sequence's next pass within the step, after the engine advanced its counters."""
        if not self.num_later_tokens:
            return None
        piece = first_piece(self.request, self.num_later_tokens)
        return ScheduledSeq(self.request, self.request.phase(), piece, self.slot, self.block_table,
                            self.num_later_tokens - piece)


def scratch_owner(request_id: str) -> str:
    """Who holds a verify step's scratch slot (engine.speculative), for the ownership guard."""
    return f"{request_id}#verify"


def first_piece(request: Request, num_tokens: int) -> int:
    """Of `num_tokens` tokens to run, how many come before the next save point."""
    computed = request.num_computed_tokens
    end = computed + num_tokens
    for point in request.save_points:
        if computed < point < end:
            end = point
    return end - computed


@dataclass
class SchedulerOutput:
    seqs: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    restores: list[tuple[int, int, str]] = field(default_factory=list)  # (checkpoint row, slot, request id)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens + s.num_later_tokens for s in self.seqs)


class Scheduler:
    def __init__(self, blocks: BlockManager, slots: StateSlotAllocator, max_num_batched_tokens: int,
                 prefill_only: bool = False, prefix_cache: PrefixCache | None = None,
                 verify_needs_scratch: bool = False, split_at_save_points: bool = True):
        self.blocks = blocks
        self.slots = slots
        self.prefix_cache = prefix_cache
        self.max_num_batched_tokens = max_num_batched_tokens
        self.prefill_only = prefill_only  # whole prompts' blocks at admission (see above)
        # Recurrent layers: a step verifying drafts needs a scratch slot to roll back (see _verify).
        self.verify_needs_scratch = verify_needs_scratch
        # False where the engine captures a save point's state inside a pass (see above).
        self.split_at_save_points = split_at_save_points
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
        self.slots.free(scratch_owner(request.request_id))
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
            decoding = request.status is RequestStatus.DECODING
            if decoding and (request.draft_token_ids or request.num_replay_tokens):
                if not self._fit_drafts(request, budget):  # its replayed tokens wait for a roomier step
                    index += 1
                    continue
                if request.draft_token_ids:  # else a replay alone: the general path below runs it
                    verify = self._verify(request)
                    out.seqs.append(verify)
                    budget -= verify.num_new_tokens
                    index += 1
                    continue
            decode = self._decode_in_place(request) if decoding else None
            if decode is not None:
                out.seqs.append(decode)
                budget -= 1
                index += 1
                continue
            num_new = self._chunk(request, budget)
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
            hit = self._lookup(request)
            hit_blocks = len(hit.blocks) if hit else 0
            status = request.status
            request.start_prefill(hit.num_tokens if hit else 0)
            num_new = self._chunk(request, budget)
            total = request.num_tokens if self.prefill_only else request.num_computed_tokens + num_new
            reused_free = sum(b in self.blocks.evictable for b in hit.blocks) if hit else 0
            if self.blocks.blocks_needed(total) - hit_blocks > self.blocks.num_available_blocks - reused_free:
                request.status, request.num_computed_tokens = status, 0
                break
            self.waiting.popleft()
            if hit:
                self.prefix_cache.record(request.num_tokens, hit.num_tokens)
            if hit_blocks:
                self.blocks.share(request.request_id, hit.blocks)
            slot = self.slots.allocate(request.request_id)
            if hit and hit.checkpoint is not None:
                out.restores.append((hit.checkpoint, slot, request.request_id))
            if request.num_cached_tokens is None:
                request.num_cached_tokens = request.num_computed_tokens
            self.running.append(request)
            out.seqs.append(self._scheduled(request, num_new, total))
            budget -= num_new
        return out

    def _lookup(self, request: Request):
        wants_prompt_logits = request.prompt_logprobs is not None and \
            len(request.prompt_logprobs) < request.num_prompt_tokens
        if self.prefix_cache is None or wants_prompt_logits:  # a cached block has no logits to give
            return None
        request.block_hashes = block_hashes(request.all_token_ids, self.blocks.block_size, request.block_hashes)
        hit = self.prefix_cache.lookup(request.block_hashes, request.num_tokens)
        request.save_points = []
        if self.prefix_cache.needs_state:
            size = self.blocks.block_size
            for point in (hit.num_matched_tokens, (request.num_tokens - 1) // size * size):
                if point > hit.num_tokens and point not in request.save_points \
                        and not self.prefix_cache.has_checkpoint(request.block_hashes[point // size - 1]):
                    request.save_points.append(point)
        return hit

    def _decode_in_place(self, request: Request) -> ScheduledSeq | None:
        """The common decode step, without the general path's per-row work: the phase says
        DECODE (exactly one token to run, so no save point falls inside it) and that token's
        KV position is in a block the request holds, so nothing is allocated. Else None."""
        phase = request.phase()
        if phase is not Phase.DECODE:
            return None
        table = self.blocks.block_tables.get(request.request_id)
        if table is None or request.num_computed_tokens >= len(table) * self.blocks.block_size:
            return None
        return ScheduledSeq(request, phase, 1, self.slots.slot_of[request.request_id], table)

    def _fit_drafts(self, request: Request, budget: int) -> bool:
        """Keep as many of a decoding request's drafts as the budget, the blocks and (where
        state must roll back) a free slot for scratch allow, after its pending tokens; False
        when the pending tokens themselves do not fit the budget."""
        pending = request.num_tokens - request.num_computed_tokens
        drafts = request.draft_token_ids[:max(0, budget - pending)]
        # A free slot goes to a waiting request before it goes to a draft.
        if drafts and self.verify_needs_scratch and self.slots.num_free_slots <= len(self.waiting):
            drafts = []
        if drafts and not self.blocks.can_allocate(request.request_id, request.num_tokens + len(drafts)):
            drafts = []
        request.draft_token_ids = drafts
        return budget >= pending

    def _verify(self, request: Request) -> ScheduledSeq:
        """The VERIFY step of a request whose drafts fit (_fit_drafts, blocks included): its
        pending tokens (the last one, and any replayed) and its drafts, with a scratch slot where
        state may roll back."""
        drafts = request.draft_token_ids
        table = self.blocks.allocate(request.request_id, request.num_tokens + len(drafts))
        scratch = None
        if drafts and self.verify_needs_scratch:
            scratch = self.slots.allocate(scratch_owner(request.request_id))
        pending = request.num_tokens - request.num_computed_tokens
        return ScheduledSeq(request, Phase.VERIFY, pending + len(drafts), self.slots.slot_of[request.request_id],
                            table, scratch_slot=scratch)

    @staticmethod
    def _chunk(request: Request, budget: int) -> int:
        """Tokens to run this step: the rest, within the budget."""
        return min(request.num_tokens - request.num_computed_tokens, budget)

    def _scheduled(self, request: Request, num_new: int, total: int) -> ScheduledSeq:
        table = self.blocks.allocate(request.request_id, total)
        piece = first_piece(request, num_new) if self.split_at_save_points else num_new
        return ScheduledSeq(request, request.phase(), piece, self.slots.slot_of[request.request_id],
                            table, num_new - piece)

    def _preemption_victim(self, request: Request) -> Request:
        candidates = [r for r in self.running
                      if r.status in (RequestStatus.PREFILLING, RequestStatus.DECODING)]
        return candidates[-1] if candidates else request

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        self.blocks.free(request.request_id)
        self.slots.free(request.request_id)
        self.running.remove(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = request.num_indexed_blocks = 0
        request.save_points = []
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)
        out.preempted.append(request)
