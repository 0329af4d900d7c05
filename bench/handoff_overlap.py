"""What of the hand-off a streamed prefill hides: streamed against sent whole, side by side.

Per transport, two worker pairs in this process (no Ray), the same settings but one:
`streamed` sends each chunk's finished KV rows while later chunks compute
(TransferConfig.stream_prefill), `whole` sends everything after the last chunk. Rounds
alternate between the two, one request at a time. Per request, on one clock:
- exposed: from the prefill engine handing over the finished prompt (take_handoffs, right
  after the step that ran its last chunk and sampled its first token) to the decode engine
  accepting it (accept_handoff): the part of the hand-off the prefill did not hide;
- prefill: from the prefill call to take_handoffs, so what streaming costs the prefill
  itself shows (shm copies a chunk's rows on the engine thread).

Model: the bundled demo model (Jamba: 6 layers, attention at 1 and 4, float32), its context
limit raised to fit the longest prompt (Jamba has no position embeddings, so its weights serve
any length); 2048-token chunks.

    python -m bench.handoff_overlap [--lengths 1024,8192,32768] [--transports shm,gloo] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from bench.tp_handoff import one, stamp
from decode_worker.worker import DecodeWorker
from engine import demo_model_path
from prefill_worker.worker import PrefillWorker

BLOCK_SIZE, CHUNK = 16, 2048
MODES = ("whole", "streamed")


def long_context_model(folder: Path, max_len: int) -> str:
    """The demo model with max_position_embeddings raised to max_len (weights linked, not copied)."""
    source = Path(demo_model_path())
    for item in source.iterdir():
        if item.name != "config.json":
            (folder / item.name).symlink_to(item)
    config = json.loads((source / "config.json").read_text())
    config["max_position_embeddings"] = max_len
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


async def sitting(model: str, transport: str, lengths: list[int], rounds: int, chunk: int = CHUNK) -> dict:
    """{(length, mode): {"exposed": [...], "prefill": [...]}} over `rounds` alternating rounds."""
    blocks = 2 * (max(lengths) // BLOCK_SIZE + 8)
    options = {"block_size": BLOCK_SIZE, "max_num_batched_tokens": chunk, "num_kv_blocks": blocks,
               "max_model_len": max(lengths) + 8}
    pairs, taken, accepted = {}, {}, {}
    try:
        for mode in MODES:
            # no router renews the reservation here while a 32k prompt prefills: a timeout to match
            prefill = PrefillWorker(f"p-{mode}", model, options, transport, transfer_timeout_s=600)
            decode = DecodeWorker(f"d-{mode}", model, options, transport, transfer_timeout_s=600)
            prefill.transfer_config.stream_prefill = mode == "streamed"
            await prefill.connect(decode.name, await decode.accept(prefill.name, 1))
            stamp(prefill, "take_handoffs", taken, lambda args, handoffs: [h.request_id for h in handoffs])
            stamp(decode, "accept_handoff", accepted, lambda args, result: [args[0]])
            pairs[mode] = (prefill, decode)
        times = {(n, mode): {"exposed": [], "prefill": []} for n in lengths for mode in MODES}
        for n in lengths:
            prompt = [(7 * i) % 4000 + 3 for i in range(n)]
            for r in range(rounds + 1):  # round 0 warms up
                for mode in (MODES if r % 2 else MODES[::-1]):
                    prefill, decode = pairs[mode]
                    rid = f"{mode}-{n}-{r}"
                    started = time.perf_counter()
                    exposed = await one(prefill, decode, prefill.name, rid, prompt, taken, accepted)
                    if r:
                        times[n, mode]["exposed"].append(exposed)
                        times[n, mode]["prefill"].append(taken[rid] - started)
        return times
    finally:
        for prefill, decode in pairs.values():
            for worker in (prefill, decode):
                worker.shutdown()
                worker.engine.close()


def report(transport: str, times: dict, bytes_of) -> None:
    print(f"\n{transport}: last chunk done on the prefill engine -> accepted by the decode engine (exposed), "
          f"and the prefill itself; medians over the rounds, ms")
    print(f"{'prompt':>8} {'hand-off MB':>11} | {'exposed whole':>13} {'streamed':>9} {'ratio':>6} | "
          f"{'prefill whole':>13} {'streamed':>9} {'ratio':>6}")
    for n in sorted({n for n, _ in times}):
        med = {(mode, k): statistics.median(times[n, mode][k]) * 1e3 for mode in MODES for k in ("exposed", "prefill")}
        print(f"{n:>8} {bytes_of(n) / 1e6:>11.1f} | {med['whole', 'exposed']:>13.2f} {med['streamed', 'exposed']:>9.2f} "
              f"{med['streamed', 'exposed'] / med['whole', 'exposed']:>6.2f} | {med['whole', 'prefill']:>13.0f} "
              f"{med['streamed', 'prefill']:>9.0f} {med['streamed', 'prefill'] / med['whole', 'prefill']:>6.2f}")


async def main(args) -> None:
    lengths = [int(n) for n in args.lengths.split(",")]
    folder = Path(tempfile.mkdtemp(prefix="splitserve-overlap-"))
    try:
        model = long_context_model(folder, max(lengths) + 64)
        for transport in args.transports.split(","):
            times = await sitting(model, transport, lengths, args.rounds)
            probe = PrefillWorker("probe", model, {"block_size": BLOCK_SIZE, "num_kv_blocks": 8}, "shm")
            try:
                report(transport, times, probe.cache_tensors.layout.handoff_bytes)
            finally:
                probe.shutdown()
                probe.engine.close()
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="1024,8192,32768", help="prompt lengths, comma-separated")
    parser.add_argument("--transports", default="shm,gloo")
    parser.add_argument("--rounds", type=int, default=3)
    asyncio.run(main(parser.parse_args()))
