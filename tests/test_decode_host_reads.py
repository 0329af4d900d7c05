"""No host reads in a decode step, on any family: the forward a CUDA graph captures.

The static decode path's forward (engine.cuda_graphs.StaticDecode: what every replay runs) is
run on CPU tensors the way it runs on CUDA: Triton kernels (under the interpreter), no C++ CPU
kernels, MoE without the per-expert loop. A guard fails on any host read of a tensor value
(tests/host_reads.py); the tokens are judged by transformers as everywhere else.
"""

from __future__ import annotations

import pytest
import torch

from tests.kernel_support import enter_kernel_mode, requires_triton  # first: it sets Triton's mode
from engine import LLM, SamplingParams
from engine.cuda_graphs import capture_blockers
from engine.models.expert_dispatch import STATIC_ENV
from tests.host_reads import no_host_reads
from tests.oracle import judge_greedy

FAMILIES = ["jamba", "mamba", "llama", "mistral_mqa_window", "mamba2", "bamba", "granitemoehybrid",
            "nemotron_h", "nemotron_h_latent", "falcon_h1", "zamba2", "qwen3_next", "lfm2", "lfm2_moe", "olmo_hybrid",
            "kimi_linear"]
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@requires_triton
@pytest.mark.triton
@pytest.mark.parametrize("name", FAMILIES)
def test_the_decode_forward_reads_nothing_on_the_host(model_factory, monkeypatch, name):
    enter_kernel_mode()
    path, hf = model_factory(name)
    monkeypatch.setenv("SPLITSERVE_FORCE_TRITON", "1")
    monkeypatch.setenv("SPLITSERVE_DISABLE_CPU_KERNELS", "1")
    monkeypatch.setenv(STATIC_ENV, "1")
    llm = LLM(path, block_size=4, max_num_seqs=4, num_kv_blocks=48)
    runner = llm.engine.runner
    runner.use_static_decode(capture=False)
    static = runner.static
    forward, guarded = static.model, []

    def model(batch, caches):
        with no_host_reads():
            guarded.append(len(batch.input_ids))
            return forward(batch, caches)

    monkeypatch.setattr(static, "model", model)
    prompts = [[5, 6, 7], [9], list(range(3, 14))]
    outs = llm.generate(prompts, GREEDY)
    assert guarded, "no decode step took the static path"
    for prompt, out in zip(prompts, outs):
        assert out.error is None and len(out.token_ids) == GREEDY.max_tokens, out.error  # a guard's error fails the request
        judge_greedy(hf, prompt, out.token_ids)
    assert capture_blockers(llm.engine.model, torch.device("cpu")) == []  # Triton forced, as on CUDA
