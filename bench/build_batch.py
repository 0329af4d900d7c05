"""Per-step cost of ModelRunner.build_batch (scheduler output -> ForwardBatch tensors), CPU.

    python -m bench.build_batch [--repeat 200]

Cases: 64 decode rows with 1024-token contexts, and 8 fresh 1024-token prefill rows, block
size 16. Builds tensors on CPU only (no model runs). To time another checkout of the engine,
put it first on PYTHONPATH.
"""

from __future__ import annotations

import argparse
import random
import timeit

import torch

from engine.model_runner import ModelRunner
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledSeq

BLOCK = 16


def runner() -> ModelRunner:
    """build_batch reads only the cache's block size and the device: no model needed."""
    r = object.__new__(ModelRunner)
    r.cache = type("Cache", (), {"block_size": BLOCK, "scratch_block": 0})()
    r.device = torch.device("cpu")
    try:
        from engine.model_runner import SlotBlockTables
        r.block_tables = SlotBlockTables(64, 128)
    except ImportError:  # an engine from before the vectorised builder
        pass
    return r


def seqs(num: int, context: int, decode: bool) -> list[ScheduledSeq]:
    rng = random.Random(0)
    free = rng.sample(range(num * (context // BLOCK + 1)), num * (context // BLOCK + 1))
    out = []
    for i in range(num):
        request = Request(f"r{i}", [rng.randrange(32000) for _ in range(context)], SamplingParams())
        request.num_prefill_tokens = context
        if decode:
            request.output_token_ids = [rng.randrange(32000)]
            request.num_computed_tokens = context
        table = [free.pop() for _ in range(context // BLOCK + 1)]
        out.append(ScheduledSeq(request, request.phase(), 1 if decode else context, i, table))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=200)
    args = parser.parse_args()
    torch.set_num_threads(1)
    r = runner()
    for name, batch in (("64 decode rows, 1024-token contexts", seqs(64, 1024, True)),
                        ("8 x 1024-token fresh prefills", seqs(8, 1024, False))):
        def step():
            if not batch[0].phase.reads_state:  # a fresh prefill's table is a new list
                for seq in batch:
                    seq.block_table = list(seq.block_table)
            r.build_batch(batch)

        step()  # warm-up
        times = timeit.repeat(step, number=1, repeat=args.repeat)
        times.sort()
        print(f"{name:40s} median {times[len(times) // 2] * 1e6:9.1f} us   min {times[0] * 1e6:9.1f} us")


if __name__ == "__main__":
    main()
