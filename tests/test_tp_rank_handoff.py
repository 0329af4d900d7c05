"""Rank-to-rank hand-offs between tensor-parallel workers of equal size (engine.tp.rank_handoffs):
real PrefillWorker and DecodeWorker objects (not Ray actors: their ranks are local processes)
over real transports, every token judged by transformers, nothing leaked on either side. The
cluster, through the router: tests/test_cluster_tp.py.
"""

from __future__ import annotations

import asyncio
import random

import pytest

from decode_worker.worker import DecodeWorker
from engine import SamplingParams
from engine.tp.rank_handoffs import RankOffers
from prefill_worker.worker import PrefillWorker
from tests.test_handoff_engine import judged_and_freed

PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
OPTIONS = {"block_size": 4, "tensor_parallel_size": 2, "max_num_batched_tokens": 8}


class Pair:
    """A TP=2 prefill worker connected rank to rank to a TP=2 decode worker."""

    def __init__(self, path, transport: str):
        self.prefill = PrefillWorker("p0", str(path), OPTIONS, transport, transfer_timeout_s=20)
        self.decode = DecodeWorker("d0", str(path), OPTIONS, transport, transfer_timeout_s=20)

    async def connect(self) -> None:
        offer = await self.decode.accept("p0", self.prefill.handoff_ranks())
        assert isinstance(offer, RankOffers) and len(offer.offers) == 2
        await self.prefill.connect("d0", offer)
        # nothing goes through rank 0's staging rows: its un-sharded channel does not exist
        assert not self.prefill.sender.connected("d0")
        assert await self.prefill.disconnected_peers() == []

    async def run(self, prompts, before_prefill=None) -> tuple[dict, dict]:
        """Reserve, prefill and decode every prompt; (final decode outputs, prefill outcomes)."""
        targets = {}
        for i, prompt in enumerate(prompts):
            targets[f"r{i}"] = await self.decode.reserve(f"r{i}", prompt, PARAMS, None, "p0")
            assert targets[f"r{i}"].ranks == 2
        if before_prefill is not None:
            await before_prefill(self)
        outcomes = await asyncio.gather(*[self.prefill.prefill(rid, prompts[int(rid[1:])], PARAMS, target)
                                          for rid, target in targets.items()])
        final = {}  # the decode worker ends every request it reserved, failed ones with an error
        while len(final) < len(prompts):
            for out in await self.decode.poll(1.0):
                if out.finished:
                    final[out.request_id] = out
        return final, {o.request_id: o for o in outcomes}

    def settled(self) -> None:
        """Every row is free again on both sides, and no rank holds a hand-off."""
        assert self.prefill.rank_senders.pending_ids == frozenset()
        assert self.decode.rank_receivers.pending_ids == frozenset()
        for worker in (self.prefill, self.decode):
            engine = worker.engine
            assert not engine.requests
            assert engine.blocks.num_available_blocks == engine.blocks.num_blocks
            assert engine.slots.num_free_slots == engine.slots.num_slots

    def close(self) -> None:
        for worker in (self.prefill, self.decode):
            worker.shutdown()
            worker.engine.close()


def run(coro):
    return asyncio.run(coro)


@pytest.mark.parametrize(("family", "transport"), [
    ("jamba", "shm"), ("granitemoehybrid", "gloo"), ("llama", "gloo")])
def test_equal_tp_workers_hand_off_rank_to_rank(model_factory, family, transport):
    path, hf = model_factory(family)
    pair = Pair(path, transport)
    try:
        rng = random.Random(7)
        prompts = [[rng.randrange(3, 300) for _ in range(n)] for n in (3, 9, 17, 30)]

        async def go():
            await pair.connect()
            return await pair.run(prompts)

        final, outcomes = run(go())
        assert all(o.handed_off for o in outcomes.values()), outcomes
        judged_and_freed(hf, prompts, final, ())
        pair.settled()
        assert pair.prefill.staging.held == {} and pair.decode.staging.held == {}
    finally:
        pair.close()


@pytest.mark.parametrize("transport", ["shm", "gloo"])
def test_one_rank_failing_fails_the_request_on_every_rank(model_factory, transport):
    """Decode rank 1 drops r1's reservation (as if it timed out there): r1 fails on the decode
    worker once every rank let go, its rows come back on both, and the others are served
    exactly. Over shm prefill rank 1 sees the refusal and the prefill fails too; Gloo's sender
    has sent its bytes before the receiver drains them, so only the decode side can say."""
    path, hf = model_factory("granitemoehybrid")
    pair = Pair(path, transport)
    try:
        rng = random.Random(3)
        prompts = [[rng.randrange(3, 300) for _ in range(n)] for n in (5, 11, 7)]

        async def drop_r1_on_rank1(p: Pair) -> None:
            receivers = p.decode.rank_receivers
            [(ok, _)] = await asyncio.wrap_future(p.decode.thread.call(
                lambda engine: receivers.tp.ask("xfer", "abort", "r1", "dropped by the test")))
            assert ok

        async def go():
            await pair.connect()
            return await pair.run(prompts, before_prefill=drop_r1_on_rank1)

        final, outcomes = run(go())
        if transport == "shm":
            assert not outcomes["r1"].handed_off and "rank 1" in outcomes["r1"].error
        assert outcomes["r0"].handed_off and outcomes["r2"].handed_off
        assert "state hand-off failed" in final["r1"].error and "rank 1" in final["r1"].error
        judged_and_freed(hf, [prompts[0]], {"r0": final["r0"]}, ())
        judged_and_freed(hf, [prompts[2]], {"r0": final["r2"]}, ())
        pair.settled()
    finally:
        pair.close()
