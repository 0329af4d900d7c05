"""The scheduler's decode lane (Scheduler._decode_in_place) decides exactly what the general
path decides: the same rows, phases, token counts, slots and block tables, through chunked
prefills, block boundaries, preemptions and finishes."""

from __future__ import annotations

import random

import pytest

from engine.block_manager import BlockManager
from engine.phase import Phase
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.state_slots import StateSlotAllocator


def twin_schedulers():
    made = []
    for lane in (True, False):
        scheduler = Scheduler(BlockManager(num_blocks=14, block_size=4), StateSlotAllocator(4),
                              max_num_batched_tokens=12)
        if not lane:
            scheduler._decode_in_place = lambda request: None
        made.append(scheduler)
    return made


def plan_of(out):
    return [(s.request.request_id, s.phase, s.num_new_tokens, s.num_later_tokens, s.slot, list(s.block_table))
            for s in out.seqs] + [("preempted", r.request_id) for r in out.preempted]


def run_step(scheduler: Scheduler, out, token: int) -> None:
    """The engine's bookkeeping after a step: counters advance, rows at their end get a token."""
    for seq in out.seqs:
        request = seq.request
        request.num_computed_tokens += seq.num_new_tokens + seq.num_later_tokens
        if request.num_computed_tokens == request.num_tokens:
            request.status = RequestStatus.DECODING
            request.output_token_ids.append(token)
            if request.num_output_tokens >= request.sampling_params.max_tokens:
                request.finish(RequestStatus.FINISHED_LENGTH)
                scheduler.release(request)


@pytest.mark.parametrize("seed", range(6))
def test_the_decode_lane_plans_what_the_general_path_plans(seed):
    rng = random.Random(seed)
    lane, general = twin_schedulers()
    decodes_in_lane = 0
    for step in range(120):
        if rng.random() < 0.3:
            prompt = [rng.randrange(100) for _ in range(rng.randint(1, 14))]
            params = SamplingParams(max_tokens=rng.randint(1, 12))
            for scheduler in (lane, general):
                scheduler.add(Request(f"r{step}", list(prompt), params))
        lane_out, general_out = lane.schedule(), general.schedule()
        assert plan_of(lane_out) == plan_of(general_out), f"step {step}"
        decodes_in_lane += sum(s.phase is Phase.DECODE for s in lane_out.seqs)
        token = rng.randrange(100)
        run_step(lane, lane_out, token)
        run_step(general, general_out, token)
        lane.blocks.check_integrity()
        lane.slots.check_integrity()
    assert decodes_in_lane > 50
    assert lane.num_preemptions == general.num_preemptions


def test_a_prefill_only_scheduler_takes_whole_prompts_at_admission_and_never_preempts():
    """A prefill worker's request holds its whole prompt's blocks from its first chunk (its
    hand-off streams from them while later chunks run) and keeps them until its hand-off is
    done, two steps after its last chunk here; one that does not fit waits. Nothing is
    preempted, while the general scheduler on the same arrivals grows tables chunk by chunk
    and must preempt."""
    runs = {}
    for prefill_only in (True, False):
        scheduler = Scheduler(BlockManager(num_blocks=10, block_size=4), StateSlotAllocator(4),
                              max_num_batched_tokens=8, prefill_only=prefill_only)
        for i, length in enumerate([6, 22, 22]):
            scheduler.add(Request(f"r{i}", list(range(length)), SamplingParams(max_tokens=4)))
        tables, sending = {}, []
        for step in range(40):
            for seq in scheduler.schedule().seqs:
                request = seq.request
                if prefill_only:
                    tables.setdefault(request.request_id, list(seq.block_table))
                    assert seq.block_table == tables[request.request_id]  # never grows or moves
                    assert len(seq.block_table) == -(-request.num_tokens // 4)
                request.num_computed_tokens += seq.num_new_tokens + seq.num_later_tokens
                if request.num_computed_tokens == request.num_tokens:  # first token: handed off
                    request.status = RequestStatus.HANDED_OFF
                    scheduler.running.remove(request)
                    sending.append((step + 2, request))
            for due, request in [(d, r) for d, r in sending if d <= step]:
                sending.remove((due, request))
                request.finish(RequestStatus.FINISHED_STOPPED)
                scheduler.release(request)
            scheduler.blocks.check_integrity()
        assert not scheduler.has_unfinished() and not sending
        runs[prefill_only] = scheduler.num_preemptions
    assert runs == {True: 0, False: 1}
