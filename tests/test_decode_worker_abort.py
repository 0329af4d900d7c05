"""An abort that reaches a decode worker as its hand-off lands must stop the request.

The request's state may have landed a moment ago, with the engine loop not yet round to start
it (a step in progress): the receiver no longer holds it, the engine holds its reservation. An
abort that asked the receiver first, having seen the hand-off listed a moment before, found
nothing to revoke there and let the request run to max_tokens (a flake of
test_reliability.py's cancel test). Real PrefillWorker and DecodeWorker objects (not Ray
actors) over real transports.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from decode_worker.worker import DecodeWorker
from engine import SamplingParams
from engine.output import Cumulative
from prefill_worker.worker import PrefillWorker

LONG = SamplingParams(max_tokens=1000, temperature=0.0, ignore_eos=True)
OPTIONS = {"block_size": 4, "max_num_batched_tokens": 16}


@pytest.mark.parametrize("transport", ["shm", "gloo"])
def test_an_abort_as_the_hand_off_lands_stops_the_request(model_factory, transport, monkeypatch):
    path, _ = model_factory("jamba")
    prefill = PrefillWorker("p0", str(path), OPTIONS, transport, transfer_timeout_s=20)
    decode = DecodeWorker("d0", str(path), OPTIONS, transport, transfer_timeout_s=20)
    gate = threading.Event()

    async def go():
        await prefill.connect("d0", await decode.accept("p0", prefill.handoff_ranks()))
        target = await decode.reserve("a", [5, 6, 7, 8, 9], LONG, None, "p0")
        decode.thread.call(lambda engine: gate.wait(30))  # the loop is busy (a long step)
        outcome = await prefill.prefill("a", [5, 6, 7, 8, 9], LONG, target)
        assert outcome.handed_off, outcome
        deadline = time.monotonic() + 10
        while transport == "gloo" and "a" in decode.receiver.pending():  # landed: the receiver let go
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        # As if the worker had listed the receiver's hand-offs just before this one landed.
        monkeypatch.setattr(decode.receiver, "pending", lambda: ["a"])
        aborting = asyncio.ensure_future(decode.abort("a"))
        await asyncio.sleep(0.05)
        gate.set()
        await aborting
        whole = Cumulative([])  # the worker sends deltas
        while True:
            for out in await decode.poll(5.0):
                if out.request_id == "a":
                    out = whole.add(out)
                    if out.finished:
                        return out

    try:
        final = asyncio.run(go())
        # aborted by the engine, or ended by its revoked hand-off's failure: either way at once
        assert final.finish_reason in ("abort", "error") and len(final.token_ids) < 50, \
            (final.finish_reason, len(final.token_ids))
        engine = decode.engine
        deadline = time.monotonic() + 10
        while engine.requests and time.monotonic() < deadline:
            time.sleep(0.01)
        monkeypatch.undo()
        assert not engine.requests and not decode.receiver.pending()
        assert engine.blocks.num_available_blocks == engine.blocks.num_blocks
        assert engine.slots.num_free_slots == engine.slots.num_slots
    finally:
        gate.set()
        for worker in (prefill, decode):
            worker.shutdown()
            worker.engine.close()
