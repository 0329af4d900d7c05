"""How much of a decode step is the engine around the model: whole engine steps against the
forward + greedy argmax alone, alternating in one process.

    python -m bench.decode_step_split [--tiny jamba] [--rounds 4]

Each round runs the bench roofline's decode workload (64 x (128 + 128), greedy, delta outputs)
through LLMEngine.step, then the same number of forwards of one batch captured at the middle
step (the median context) with the argmax the greedy sampler runs. The difference is the
engine's own per-step work: scheduling, the batch, the state guard, sampling's Python, outputs.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch

from bench.checkpoints import BENCH_CHECKPOINTS, build_checkpoint
from engine import LLM, SamplingParams
from engine.kernels import cpu

BATCH, PROMPT, OUTPUT = 64, 128, 128


def engine_steps(llm: LLM, generator: torch.Generator, capture_at: int | None = None):
    """Seconds per decode step over one whole decode, and the batch of step `capture_at`."""
    engine = llm.engine
    for _ in range(BATCH):
        prompt = torch.randint(3, engine.spec.vocab_size, (PROMPT,), generator=generator).tolist()
        engine.add_request(prompt, SamplingParams(max_tokens=OUTPUT, ignore_eos=True, temperature=0.0))
    engine.step()  # the prefill
    steps, batch = 0, None
    start = time.perf_counter()
    while engine.has_unfinished():
        if steps == capture_at:
            batch = engine.runner.build_batch(engine.scheduler.schedule().seqs)
        engine.step()
        steps += 1
    return (time.perf_counter() - start) / steps, batch


@torch.inference_mode()
def forwards_alone(llm: LLM, batch, count: int = OUTPUT - 1) -> float:
    runner = llm.engine.runner
    start = time.perf_counter()
    for _ in range(count):
        cpu.row_argmax_cpu(runner.model(batch, runner.cache.layers)).tolist()
    return (time.perf_counter() - start) / count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", default="jamba", choices=BENCH_CHECKPOINTS)
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        build_checkpoint(args.tiny, folder)
        llm = LLM(folder, max_num_batched_tokens=BATCH * PROMPT, max_num_seqs=BATCH,
                  max_model_len=PROMPT + OUTPUT + 2, output_kind="delta")
        generator = torch.Generator().manual_seed(0)
        _, batch = engine_steps(llm, generator, capture_at=OUTPUT // 2)
        for _ in range(args.rounds):
            step, forward = engine_steps(llm, generator)[0], forwards_alone(llm, batch)
            print(f"engine step {step * 1e3:.2f} ms, forward + argmax {forward * 1e3:.2f} ms, "
                  f"the engine around it {(step - forward) * 1e3:.2f} ms ({(step - forward) / step:.1%})",
                  flush=True)


if __name__ == "__main__":
    main()
