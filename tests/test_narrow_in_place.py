"""An all-decode step on Triton (a decode worker's steady state on a GPU) hands each narrow
layer its pools in place of working rows: FP8 KV blocks read through their scales
(engine.kv_format) and half-width recurrent state read and rounded by the decode kernels
themselves (engine.state_format). The oracle is the same engine on the working rows, which the
rest of the suite holds to float32 and to transformers: each step's logits and the pools' bytes
must be theirs bit for bit. Run as on CUDA (tests/test_decode_host_reads.cuda_like_engine):
Triton kernels under the interpreter here, compiled on CUDA tensors where there is a GPU."""

from __future__ import annotations

import pytest
import torch

from tests.kernel_support import DEVICE, requires_triton  # first: it sets Triton's mode
from engine import SamplingParams
from engine.cache_formats import NarrowCache
from engine.models.hybrid import HybridLM
from tests.test_decode_host_reads import cuda_like_engine

FEW = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
PROMPTS = [[5, 6, 7], list(range(3, 12))]


@requires_triton
@pytest.mark.triton
@pytest.mark.parametrize("family, options", [
    ("jamba", dict(kv_cache_dtype="fp8_e4m3", mamba_state_dtype="bfloat16")),  # Mamba; attention as a mixer
    ("falcon_h1", dict(kv_cache_dtype="fp8_e4m3", mamba_state_dtype="float16")),  # Mamba2 beside attention
    ("qwen3_next", dict(kv_cache_dtype="fp8_e5m2", mamba_state_dtype="bfloat16")),  # Gated DeltaNet; gated attention
    ("kimi_linear", dict(kv_cache_dtype="fp8_e4m3", mamba_state_dtype="bfloat16")),  # KDA; MLA's latent rows
])
def test_an_all_decode_step_reads_and_writes_the_narrow_pools_in_place(family, options, model_factory, monkeypatch):
    """No part of an all-decode step's narrow layers is loaded into working rows or stored from
    them, and the step computes and stores exactly what the working rows give. Which layers may
    be handed their pools is checked for every family in tests/test_kv_format.py and
    tests/test_state_format.py (HybridLM.in_place_readers)."""
    path, _ = model_factory(family)
    loads = []
    load = NarrowCache.load
    monkeypatch.setattr(NarrowCache, "load", lambda self, layer, batch, in_place=(): loads.append(
        (not batch.prefill_rows, len(in_place), len(self._parts[layer]))) or load(self, layer, batch, in_place))
    runs = {}
    for in_place in (True, False):
        if not in_place:  # the same engine on its working rows
            monkeypatch.setattr(HybridLM, "in_place_readers", lambda self, index: frozenset())
        llm = cuda_like_engine(path, monkeypatch, static=False, device=DEVICE, **options)
        logits = []
        execute = llm.engine.runner.execute
        llm.engine.runner.execute = lambda seqs, run=execute, kept=logits: kept.append(run(seqs).clone()) or kept[-1]
        tokens = [out.token_ids for out in llm.generate(PROMPTS, FEW)]
        pools = [t.view(torch.uint8).clone() for t in llm.engine.cache.layers.tensors()]
        runs[in_place] = logits, tokens, pools
        decode_loads = [(handed, parts) for all_decode, handed, parts in loads if all_decode]
        assert decode_loads, "no all-decode step"
        assert all(handed == (parts if in_place else 0) for handed, parts in decode_loads), decode_loads
        assert not any(handed for all_decode, handed, _ in loads if not all_decode)  # prefills: working rows
        loads.clear()
    (steps, tokens, pools), (steps_ref, tokens_ref, pools_ref) = runs[True], runs[False]
    assert tokens == tokens_ref and len(steps) == len(steps_ref)
    for step, (got, want) in enumerate(zip(steps, steps_ref)):
        assert torch.equal(got, want), f"step {step}"
    assert all(torch.equal(a, b) for a, b in zip(pools, pools_ref))
