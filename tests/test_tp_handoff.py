"""Hand-offs between tensor-parallel engines of different sizes (1->2, 2->1, 2->2) through
engine.tp.staging, the wire simulated by row copies of the un-sharded staging rows: every token
judged by transformers, nothing leaked. The cluster over real transports: tests/test_cluster_tp.py.
"""

from __future__ import annotations

import random

import pytest

from engine import SamplingParams
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.staging import HandoffStaging
from tests.test_handoff_engine import judged_and_freed

PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def wire(engine, staging):
    """The cache the transport would read or write: staging rows on a TP engine."""
    return staging.cache if staging is not None else engine.cache


def copy_rows(src_cache, dst_cache, src_blocks, src_slot, dst_blocks, dst_slot):
    for (_, s), (_, d) in zip(src_cache.block_tensors(), dst_cache.block_tensors()):
        d[dst_blocks[: len(src_blocks)]] = s[src_blocks]
    for (_, s), (_, d) in zip(src_cache.slot_tensors(), dst_cache.slot_tensors()):
        d[dst_slot] = s[src_slot]


def hand_off(prefill, decode, prompts, params=PARAMS) -> dict:
    """Each prompt prefilled by `prefill` and decoded by `decode` (either tensor-parallel:
    through its staging rows); the final outputs by request id."""
    p_stage = HandoffStaging(prefill, requests=2) if prefill.tp is not None else None
    d_stage = HandoffStaging(decode, requests=8) if decode.tp is not None else None
    reservations, targets = {}, {}
    for i, prompt in enumerate(prompts):
        rid = f"r{i}"
        res = reservations[rid] = decode.reserve_for_handoff(prompt, params, rid)
        staged = d_stage.take(rid, len(res.block_ids)) if d_stage else None
        targets[rid] = (staged.blocks, staged.slot) if staged else (res.block_ids, res.slot)
        prefill.add_request(prompt, params, request_id=rid)
    final, waiting = {}, []
    while len(final) < len(prompts):
        prefill.step()
        waiting += prefill.take_handoffs()
        for h in list(waiting):
            blocks, slot = h.block_ids, h.slot
            if p_stage is not None:  # two staging rows: later hand-offs wait, as on a worker
                staged = p_stage.take(h.request_id, len(blocks))
                if staged is None:
                    continue
                p_stage.gather(staged, blocks, slot)
                blocks, slot = staged.blocks, staged.slot
            waiting.remove(h)
            copy_rows(wire(prefill, p_stage), wire(decode, d_stage), blocks, slot, *targets[h.request_id])
            prefill.finish_handoff(h.request_id)
            if p_stage is not None:
                p_stage.give_back(h.request_id)
            if d_stage is not None:
                res = reservations[h.request_id]
                d_stage.scatter(d_stage.held[h.request_id], decode.blocks.blocks_needed(h.num_tokens),
                                res.block_ids, res.slot)
                d_stage.give_back(h.request_id)
            decode.accept_handoff(h.request_id, h.first_token, h.first_logprob)
        for out in decode.step():
            if out.finished:
                final[out.request_id] = out
    for stage, regions in ((p_stage, 2), (d_stage, 8)):
        assert stage is None or (not stage.held and len(stage.free_regions) == regions)
    return final


# With tests/test_cluster_tp.py (jamba 2->1, granitemoehybrid 1->2, llama 2->2 over real
# transports) every family meets every size pair once.
@pytest.mark.parametrize(("family", "sizes"), [
    ("jamba", (1, 2)), ("jamba", (2, 2)), ("granitemoehybrid", (2, 1)), ("granitemoehybrid", (2, 2)),
    ("llama", (2, 1)), ("llama", (1, 2)),
    ("mistral_mqa_window", (1, 2)),  # one KV head, two decode ranks: each keeps a copy of it
    ("kimi_linear", (1, 2)), ("kimi_linear", (2, 1))])  # MLA's latent rows: kept whole by every rank
def test_tp_sizes_hand_off_exactly(model_factory, family, sizes):
    path, hf = model_factory(family)
    p_tp, d_tp = sizes
    prefill = LLMEngine(EngineConfig(str(path), block_size=4, mode="prefill", max_num_batched_tokens=8,
                                     tensor_parallel_size=p_tp))
    decode = LLMEngine(EngineConfig(str(path), block_size=4, mode="decode", tensor_parallel_size=d_tp))
    try:
        rng = random.Random(sum(sizes))
        prompts = [[rng.randrange(3, 300) for _ in range(n)] for n in (3, 9, 17, 30)]
        final = hand_off(prefill, decode, prompts)
        judged_and_freed(hf, prompts, final, (prefill, decode))
    finally:
        prefill.close()
        decode.close()
