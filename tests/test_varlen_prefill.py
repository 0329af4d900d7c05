"""Every prefill row of a step in one pass of a recurrent layer (engine.models.ssm.PrefillRows):
the Mamba2 SSD scan on CUDA (its chunked reference over all rows at once), the gated delta rule
through fla's varlen kernels (tests/test_fla_rule.py). On CPU the C++ recurrence runs per row, so
these engines switch the C++ kernels off to take the one-pass path, and are judged by
transformers: fresh and continued prefills side by side in one step, chunked prompts, a prompt
of one token.
"""

from __future__ import annotations

import random

import pytest

from engine import LLM, SamplingParams
from engine.models import mamba2
from tests.oracle import judge_greedy

GREEDY = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("family", ["mamba2", "bamba", "granitemoehybrid", "nemotron_h", "falcon_h1", "zamba2"])
def test_ssd_prefill_of_all_rows_in_one_pass_matches_transformers(model_factory, monkeypatch, family):
    path, hf = model_factory(family)
    monkeypatch.setenv("SPLITSERVE_DISABLE_CPU_KERNELS", "1")  # the CPU's per-row recurrence off
    passes: list[list[int]] = []
    one_pass = mamba2.ssd_chunk_scan_varlen

    def counted(x, dt, A, B, C, h0, bounds, chunk_size):
        passes.append(bounds)
        return one_pass(x, dt, A, B, C, h0, bounds, chunk_size)

    monkeypatch.setattr(mamba2, "ssd_chunk_scan_varlen", counted)
    rng = random.Random(11)
    prompts = [[rng.randrange(3, 300) for _ in range(n)] for n in (1, 6, 29, 13)]
    llm = LLM(path, block_size=4, max_num_batched_tokens=24)  # the 29-token prompt continues later
    outs = llm.generate(prompts, GREEDY)
    for prompt, out in zip(prompts, outs):
        judge_greedy(hf, prompt, out.token_ids)
    assert passes and max(len(bounds) - 1 for bounds in passes) >= 3  # several rows in one pass
    assert sum(bounds[-1] for bounds in passes) % sum(len(p) for p in prompts) == 0  # every prompt token, per layer
