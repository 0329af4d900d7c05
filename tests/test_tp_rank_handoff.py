"""Hand-offs between tensor-parallel workers: rank to rank between equal sizes
(engine.tp.rank_handoffs), through rank 0's staging rows otherwise (engine.tp.staging). Real
PrefillWorker and DecodeWorker objects (not Ray actors: their ranks are local processes) over
real transports, every token judged by transformers, nothing leaked on either side. The
cluster, through the router: tests/test_cluster_tp.py.
"""

from __future__ import annotations

import asyncio
import random

import pytest

from decode_worker.worker import DecodeWorker
from engine import SamplingParams
from engine.output import Cumulative
from engine.tp.rank_handoffs import RankOffers
from prefill_worker.worker import PrefillWorker
from tests.test_handoff_engine import judged_and_freed

PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
OPTIONS = {"block_size": 4, "max_num_batched_tokens": 8}


class Pair:
    """A prefill worker connected to a decode worker, TP=2 each unless told."""

    def __init__(self, path, transport: str, sizes: tuple[int, int] = (2, 2), options: dict | None = None):
        self.sizes = sizes
        options = {**OPTIONS, **(options or {})}
        self.prefill = PrefillWorker("p0", str(path), {**options, "tensor_parallel_size": sizes[0]}, transport,
                                     transfer_timeout_s=20)
        self.decode = DecodeWorker("d0", str(path), {**options, "tensor_parallel_size": sizes[1]}, transport,
                                   transfer_timeout_s=20)

    @property
    def by_rank(self) -> bool:
        return self.sizes[0] == self.sizes[1] > 1

    async def connect(self) -> None:
        offer = await self.decode.accept("p0", self.prefill.handoff_ranks())
        if self.by_rank:  # rank r meets only rank r: crossed offers are refused at the handshake
            with pytest.raises(Exception, match="shard 'rank 0 of 2' vs 'rank 1 of 2'"):
                await self.prefill.connect("d0", RankOffers(offer.offers[::-1]))
            offer = await self.decode.accept("p0", self.prefill.handoff_ranks())
        assert isinstance(offer, RankOffers) == self.by_rank
        await self.prefill.connect("d0", offer)
        # rank to rank, nothing goes through rank 0's staging rows: its channel does not exist
        assert self.prefill.sender.connected("d0") != self.by_rank
        assert await self.prefill.disconnected_peers() == []

    async def run(self, prompts, before_prefill=None, prefix: str = "r") -> tuple[dict, dict]:
        """Reserve, prefill and decode every prompt (request ids prefix + index); (final decode
        outputs, prefill outcomes)."""
        targets = {}
        for i, prompt in enumerate(prompts):
            target = targets[f"{prefix}{i}"] = await self.decode.reserve(f"{prefix}{i}", prompt, PARAMS, None, "p0")
            assert target.ranks == (2 if self.by_rank else 1)
        if before_prefill is not None:
            await before_prefill(self)
        outcomes = await asyncio.gather(*[self.prefill.prefill(rid, prompts[i], PARAMS, target)
                                          for i, (rid, target) in enumerate(targets.items())])
        final = {}  # the decode worker ends every request it reserved, failed ones with an error
        whole = {rid: Cumulative(prompts[i]) for i, rid in enumerate(targets)}  # it sends deltas
        while len(final) < len(prompts):
            for out in await self.decode.poll(1.0):
                assert not (out.prompt_token_ids or out.token_ids or out.text or out.logprobs)  # deltas only
                out = whole[out.request_id].add(out)
                if out.finished:
                    final[out.request_id] = out
        return final, {o.request_id: o for o in outcomes}

    def settled(self) -> None:
        """Every row is free again on both sides, and no rank holds a hand-off."""
        for worker in (self.prefill, self.decode):
            assert worker.rank_handoffs is None or worker.rank_handoffs.pending_ids == frozenset()
            assert worker.staging is None or not worker.staging.held
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


def parity_run(pair: Pair, hf, lengths) -> list[list[int]]:
    """The prompts (of these lengths) handed off and judged; returns them."""
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 300) for _ in range(n)] for n in lengths]

    async def go():
        await pair.connect()
        return await pair.run(prompts)

    final, outcomes = run(go())
    assert all(o.handed_off for o in outcomes.values()), outcomes
    judged_and_freed(hf, prompts, final, ())
    pair.settled()
    assert pair.prefill.handoffs["by_rank"] == (len(prompts) if pair.by_rank else 0)
    return prompts


def one_rank_fails(pair: Pair, hf, transport: str) -> None:
    """Decode rank 1 drops f1's reservation (as if it timed out there): f1 fails on the decode
    worker once every rank let go, its rows come back on both, and the others are served
    exactly. Over shm prefill rank 1 sees the refusal and the prefill fails too; Gloo's sender
    has sent its bytes before the receiver drains them, so only the decode side can say."""
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 300) for _ in range(n)] for n in (5, 11, 7)]

    async def drop_f1_on_rank1(p: Pair) -> None:
        receivers = p.decode.rank_handoffs
        [(ok, _)] = await asyncio.wrap_future(p.decode.thread.call(
            lambda engine: receivers.tp.ask("xfer", "abort", "f1", "dropped by the test")))
        assert ok

    final, outcomes = run(pair.run(prompts, before_prefill=drop_f1_on_rank1, prefix="f"))
    if transport == "shm":
        assert not outcomes["f1"].handed_off and "rank 1" in outcomes["f1"].error
    assert outcomes["f0"].handed_off and outcomes["f2"].handed_off
    assert "state hand-off failed" in final["f1"].error and "rank 1" in final["f1"].error
    judged_and_freed(hf, [prompts[0]], {"r0": final["f0"]}, ())
    judged_and_freed(hf, [prompts[2]], {"r0": final["f2"]}, ())
    pair.settled()


# With tests/test_cluster_tp.py (llama 2->2 over gloo through the router) three families.
@pytest.mark.parametrize(("family", "transport"), [("jamba", "shm"), ("granitemoehybrid", "gloo")])
def test_equal_tp_workers_hand_off_rank_to_rank(model_factory, family, transport):
    path, hf = model_factory(family)
    pair = Pair(path, transport)
    try:
        # the first three finish in one step: the later hand-offs queue behind the first on
        # each rank's channel and go out from its thread, not the engine's
        parity_run(pair, hf, (3, 2, 3, 9, 17, 30))
        one_rank_fails(pair, hf, transport)
    finally:
        pair.close()


# With tests/test_cluster_tp.py (2->1 over shm, 1->2 over gloo) both pairs over both transports.
@pytest.mark.parametrize(("family", "transport", "sizes"), [
    ("jamba", "gloo", (2, 1)), ("granitemoehybrid", "shm", (1, 2))])
def test_different_tp_workers_hand_off_through_staging(model_factory, family, transport, sizes):
    path, hf = model_factory(family)
    pair = Pair(path, transport, sizes)
    try:
        # a TP decode worker's staging rows hold 4 reservations: these all reserve before any prefill
        parity_run(pair, hf, (3, 2, 3, 9, 17, 30) if sizes[1] == 1 else (3, 2, 17, 30))
    finally:
        pair.close()
