"""TP=2 -> TP=2 hand-offs, rank to rank against through rank 0's staging rows, side by side.

One prefill and one decode worker object each (their second ranks local processes), connected
twice over the same transport: once rank to rank (engine.tp.rank_handoffs), once through the
staging rows (the decode worker told its peer has one rank). Rounds alternate between the two;
each request is reserved, prefilled and decoded for one more token. Both workers live in this
process, so one clock times the hand-off itself: from the prefill engine handing the finished
prompt to its worker (take_handoffs) to the decode engine accepting it (accept_handoff), gather,
wire, landing and scatter included.

    python -m bench.tp_handoff [--transport gloo|shm] [--prompt-len 512] [--rounds 10]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from decode_worker.worker import DecodeWorker
from engine import SamplingParams, demo_model_path
from prefill_worker.worker import PrefillWorker

PARAMS = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)


def stamp(worker, method: str, stamps: dict, rid_of) -> None:
    """Record when `method` of the worker's engine runs, per request (it runs on the engine thread)."""
    original = getattr(worker.engine, method)

    def stamped(*args, **kwargs):
        result = original(*args, **kwargs)
        for rid in rid_of(args, result):
            stamps[rid] = time.perf_counter()
        return result

    setattr(worker.engine, method, stamped)


async def one(prefill, decode, peer: str, rid: str, prompt: list[int], taken: dict, accepted: dict) -> float:
    target = await decode.reserve(rid, prompt, PARAMS, None, peer)
    outcome = await prefill.prefill(rid, prompt, PARAMS, target)
    assert outcome.handed_off, outcome
    while True:
        for out in await decode.poll(1.0):
            if out.request_id == rid and out.finished:
                assert out.error is None, out.error
                return accepted[rid] - taken[rid]


async def main(args) -> None:
    model, options = str(args.model or demo_model_path()), {"tensor_parallel_size": 2, "block_size": 16}
    workers, taken, accepted = {}, {}, {}
    for mode, ranks in (("rank to rank", 2), ("staging", 1)):  # a worker pair per mode, same settings
        prefill = PrefillWorker(f"p-{ranks}", model, options, args.transport)
        decode = DecodeWorker(f"d-{ranks}", model, options, args.transport)
        await prefill.connect(decode.name, await decode.accept(prefill.name, ranks))
        stamp(prefill, "take_handoffs", taken, lambda args, handoffs: [h.request_id for h in handoffs])
        stamp(decode, "accept_handoff", accepted, lambda args, result: [args[0]])
        workers[mode] = (prefill, decode)
    prompt = [(7 * i) % 200 + 3 for i in range(args.prompt_len)]
    times = {mode: [] for mode in workers}
    try:
        for r in range(args.rounds + 1):  # round 0 warms up
            for mode, (prefill, decode) in workers.items():
                elapsed = await one(prefill, decode, prefill.name, f"{mode[0]}{r}", prompt, taken, accepted)
                if r:
                    times[mode].append(elapsed)
        bytes_each = workers["staging"][0].cache_tensors.layout.handoff_bytes(args.prompt_len)
        print(f"TP 2 -> 2 over {args.transport}, {args.prompt_len}-token prompt ({bytes_each / 1e6:.2f} MB "
              f"un-sharded), {args.rounds} alternating rounds, prompt done on the prefill engine -> accepted "
              f"by the decode engine:")
        for mode, ts in times.items():
            print(f"  {mode:13s} median {statistics.median(ts) * 1e3:7.2f} ms   min {min(ts) * 1e3:7.2f} ms   "
                  f"max {max(ts) * 1e3:7.2f} ms")
        print(f"  staging / rank to rank (medians): "
              f"{statistics.median(times['staging']) / statistics.median(times['rank to rank']):.2f}x")
        print(f"  hand-offs rank to rank: {workers['rank to rank'][0].handoffs['by_rank']}, "
              f"through staging: {workers['staging'][0].handoffs['count']}")
    finally:
        for prefill, decode in workers.values():
            for worker in (prefill, decode):
                worker.shutdown()
                worker.engine.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--transport", default="gloo", choices=["gloo", "shm"])
    parser.add_argument("--model", default=None, help="checkpoint directory (default: the bundled demo model)")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=10)
    asyncio.run(main(parser.parse_args()))
