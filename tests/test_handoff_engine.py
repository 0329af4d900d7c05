"""Prefill-mode and decode-mode engines with the hand-off done in-process (row copies).

This pins the engine side of disaggregation independently of any transport: the decode
engine must continue exactly where the prefill engine stopped, for every family.
"""

from __future__ import annotations

import random

import pytest

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.request import RequestStatus
from engine.state_slots import StateOwnershipError
from tests.oracle import assert_same_tokens, judge_greedy

PARAMS = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


def copy_state(src: LLMEngine, dst: LLMEngine, handoff, reservation) -> None:
    """What kvtransfer does over a wire: the request's block rows and slot rows, nothing else."""
    for (_, s), (_, d) in zip(src.cache.block_tensors(), dst.cache.block_tensors()):
        d[reservation.block_ids[: len(handoff.block_ids)]] = s[handoff.block_ids]
    for (_, s), (_, d) in zip(src.cache.slot_tensors(), dst.cache.slot_tensors()):
        d[reservation.slot] = s[handoff.slot]


def run_disaggregated(path, prompts, params, block_size=4, budget=16, engines=None, caching=False):
    prefill, decode = engines or (
        LLMEngine(EngineConfig(str(path), block_size=block_size, mode="prefill", max_num_batched_tokens=budget,
                               enable_prefix_caching=caching)),
        LLMEngine(EngineConfig(str(path), block_size=block_size, mode="decode", enable_prefix_caching=caching)))
    reservations = {}
    for i, prompt in enumerate(prompts):
        rid = f"r{i}"
        reservations[rid] = decode.reserve_for_handoff(prompt, params, rid)
        prefill.add_request(prompt, params, request_id=rid)
    final = {}
    while len(final) < len(prompts):
        prefill.step()
        for h in prefill.take_handoffs():
            copy_state(prefill, decode, h, reservations[h.request_id])
            prefill.finish_handoff(h.request_id)
            decode.accept_handoff(h.request_id, h.first_token, h.first_logprob)
        for out in decode.step():
            if out.finished:
                final[out.request_id] = out
    for engine in (prefill, decode):
        engine.check_integrity()
        assert engine.blocks.num_available_blocks == engine.blocks.num_blocks  # free, or cached only
        assert engine.slots.num_free_slots == engine.slots.num_slots
    return [final[f"r{i}"] for i in range(len(prompts))]


def test_disaggregated_equals_colocated_and_transformers(family_model):
    family, path, hf = family_model
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 300) for _ in range(n)] for n in (1, 3, 4, 5, 17, 40)]
    disagg = run_disaggregated(path, prompts, PARAMS)
    colocated = LLM(path, block_size=4).generate(prompts, PARAMS)
    for prompt, d, c in zip(prompts, disagg, colocated):
        assert len(d.token_ids) == PARAMS.max_tokens
        judge_greedy(hf, prompt, d.token_ids)
        assert_same_tokens(hf, prompt, d.token_ids, c.token_ids)


@pytest.mark.parametrize("name", ["jamba", "mamba2", "llama"])
def test_prefix_caching_on_both_sides_of_the_split(model_factory, name):
    """The prefill engine hits its cache the second time round, and the decode engine receives
    state for prefixes it has cached itself (from the first round's hand-offs and answers):
    the same tokens, nothing double-freed, nothing leaked."""
    path, hf = model_factory(name)
    rng = random.Random(11)
    prompts = [[rng.randrange(3, 300) for _ in range(n)] for n in (9, 17, 24)]
    engines = tuple(LLMEngine(EngineConfig(str(path), block_size=4, mode=mode, max_num_batched_tokens=16,
                                           enable_prefix_caching=True)) for mode in ("prefill", "decode"))
    first = run_disaggregated(path, prompts, PARAMS, engines=engines)
    second = run_disaggregated(path, prompts, PARAMS, engines=engines)
    assert engines[0].prefix_cache.hit_tokens >= 8 + 16 + 20  # each prompt's last boundary short of its end
    for prompt, a, b in zip(prompts, first, second):
        judge_greedy(hf, prompt, b.token_ids)
        assert a.token_ids == b.token_ids
    assert engines[1].prefix_cache.num_cached_blocks > 0


def test_decode_without_landed_state_never_runs(model_factory):
    path, _ = model_factory("jamba")
    decode = LLMEngine(EngineConfig(str(path), block_size=4, mode="decode"))
    decode.reserve_for_handoff([5, 6, 7], PARAMS, "r")
    for _ in range(3):
        assert decode.step() == []  # WAITING_FOR_STATE is never scheduled
    assert decode.requests["r"].status is RequestStatus.WAITING_FOR_STATE
    decode.abort("r")
    decode.check_integrity()
    assert decode.slots.num_free_slots == decode.slots.num_slots


def test_a_loop_waiting_for_hand_offs_does_not_spin(model_factory):
    """While its requests wait for state, the decode loop polls every HANDOFF_POLL_S instead of
    stepping flat out: a spinning loop takes a core from the prefill worker computing that state."""
    import time

    from engine.engine_thread import EngineThread

    path, _ = model_factory("jamba")
    decode = LLMEngine(EngineConfig(str(path), block_size=4, mode="decode"))
    polls = []
    loop = EngineThread(decode, lambda outputs: None, after_step=lambda engine: polls.append(1))
    try:
        loop.call(lambda engine: engine.reserve_for_handoff([5, 6, 7], PARAMS, "r")).result(timeout=10)
        clock = time.pthread_getcpuclockid(loop._thread.ident)
        cpu_before, wall_before, polls_before = time.clock_gettime(clock), time.monotonic(), len(polls)
        time.sleep(1.0)
        cpu = time.clock_gettime(clock) - cpu_before
        wall = time.monotonic() - wall_before
        assert len(polls) - polls_before > 50, "the loop must keep polling for the hand-off"
        assert cpu < 0.5 * wall, f"the waiting loop used {cpu:.2f} s of CPU in {wall:.2f} s"
        assert decode.requests["r"].status is RequestStatus.WAITING_FOR_STATE
    finally:
        loop.stop()


def test_a_serving_loop_freezes_the_loaded_heap(model_factory):
    """A full collection in a loaded serving process scanned about 230k objects (90 ms, a
    stalled step); the loop freezes what exists when it starts, so one scans only what came
    after. The engine's model is among the frozen objects; once the loop stops, nothing is (a
    stopped engine in a reference cycle must be collectable)."""
    import gc

    from engine.engine_thread import EngineThread

    path, _ = model_factory("jamba")
    engine = LLMEngine(EngineConfig(str(path), block_size=4))
    gc.unfreeze()
    assert gc.get_freeze_count() == 0
    loop = EngineThread(engine, lambda outputs: None)
    try:
        assert gc.get_freeze_count() > 10_000
        assert not any(o is engine.model for o in gc.get_objects())
    finally:
        loop.stop()
    assert gc.get_freeze_count() == 0


def test_decode_refuses_a_slot_nobody_wrote(model_factory):
    """If a hand-off were marked landed without the state being written, the guard must fire."""
    path, _ = model_factory("jamba")
    decode = LLMEngine(EngineConfig(str(path), block_size=4, mode="decode"))
    decode.reserve_for_handoff([5, 6, 7], PARAMS, "r")
    request = decode.requests["r"]
    request.num_computed_tokens = 3  # pretend it landed, skipping accept_handoff's mark_written
    request.output_token_ids.append(9)
    request.status = RequestStatus.DECODING
    with pytest.raises(StateOwnershipError, match="stale or missing"):
        decode.step()


def test_first_token_that_finishes_is_not_handed_off(model_factory):
    path, _ = model_factory("jamba")
    prefill = LLMEngine(EngineConfig(str(path), block_size=4, mode="prefill"))
    prefill.add_request([5, 6, 7], SamplingParams(max_tokens=1, temperature=0.0), request_id="one")
    outs = prefill.step()
    assert outs[0].finished and outs[0].finish_reason == "length"
    assert prefill.take_handoffs() == []
    assert prefill.blocks.num_free_blocks == prefill.blocks.num_blocks


@pytest.mark.parametrize(("family", "sizes", "transport"), [
    ("jamba", (8, 4), "shm"), ("granitemoehybrid", (4, 16), "gloo"), ("llama", (6, 4), "gloo")])
def test_prefill_and_decode_with_different_block_sizes(model_factory, family, sizes, transport):
    """A prefill engine with blocks of one size hands off over a real transport to a decode
    engine with another (configured apart, or mid-way through a rolling restart that changes
    the block size): every token judged by transformers, nothing leaked on either side."""
    from kvtransfer import CacheTensors, HandoffTarget, TransferConfig, make_transport

    path, hf = model_factory(family)
    prefill, decode = (LLMEngine(EngineConfig(str(path), block_size=size, mode=mode, max_num_batched_tokens=8))
                       for size, mode in zip(sizes, ("prefill", "decode")))
    caches = [CacheTensors.from_named(e.config.block_size, e.cache.handoff_tensors()) for e in (prefill, decode)]
    config = TransferConfig(timeout_s=20)
    rng = random.Random(sum(sizes))
    prompts = [[rng.randrange(3, 300) for _ in range(n)] for n in (1, 5, 12, 23)]
    slotted = caches[1].num_slots > 0
    with make_transport(transport).receiver("D", caches[1], config) as receiver, \
            make_transport(transport).sender("P", caches[0], config) as sender:
        sender.connect("D", receiver.accept("P"))
        targets = {}
        for i, prompt in enumerate(prompts):
            res = decode.reserve_for_handoff(prompt, PARAMS, f"r{i}")
            targets[f"r{i}"] = HandoffTarget(f"r{i}", "D", tuple(res.block_ids), res.slot if slotted else None)
            receiver.expect(targets[f"r{i}"])
            prefill.add_request(prompt, PARAMS, request_id=f"r{i}")
        final, sent = {}, set()
        # Until the sender has reported every hand-off too: the decode side can land and finish
        # a request before the sender's thread reports its send done (the prefill side frees the
        # request's blocks only then).
        while len(final) < len(prompts) or len(sent) < len(prompts):
            prefill.step()
            for h in prefill.take_handoffs():
                sender.send(targets[h.request_id], h.num_tokens, h.block_ids, h.slot if slotted else None, h.first_token)
            for result in sender.poll():
                assert result.ok, result
                prefill.finish_handoff(result.request_id)
                sent.add(result.request_id)
            for result in receiver.poll():
                assert result.ok, result
                decode.accept_handoff(result.request_id, result.first_token)
            for out in decode.step():
                if out.finished:
                    final[out.request_id] = out
    judged_and_freed(hf, prompts, final, (prefill, decode))


def judged_and_freed(hf, prompts, final: dict, engines) -> None:
    """Request r{i} answered prompts[i] as transformers would, and every block and slot is back."""
    for i, prompt in enumerate(prompts):
        judge_greedy(hf, prompt, final[f"r{i}"].token_ids)
    for engine in engines:
        engine.check_integrity()
        assert engine.blocks.num_available_blocks == engine.blocks.num_blocks
        assert engine.slots.num_free_slots == engine.slots.num_slots
