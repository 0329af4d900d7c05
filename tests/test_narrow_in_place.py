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
from engine.models.batch import Fp8Blocks
from engine.models.hybrid import HybridLM
from tests.test_decode_host_reads import cuda_like_engine, run_as_on_cuda
from tests.test_static_decode import cache_tensors, decode_step, decoding_engine

FEW = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
# With 8 tokens a step the long prompt is prefilled in chunks while the short one decodes:
# steps that mix prefill and decode rows, then all-decode steps.
PROMPTS = [[5, 6, 7], list(range(3, 23))]
NARROW = (torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16, torch.float16)


def handed(cache: NarrowCache, layer: int) -> tuple[str | None, str | None]:
    """What `layer` was handed for its KV and its state: its pool, the pool beside working rows
    (FP8 KV in a step that prefills), its working rows, or None where that storage is not narrow."""
    kv = state = None
    if cache.kv is not None and cache.kv.holds(layer):
        given = cache.handed.kv[layer]
        kv = "working" if not isinstance(given, Fp8Blocks) else "pool" if given.working is None else "beside"
    if cache.state is not None and cache.state.holds(layer):
        state = "pool" if cache.handed.state[layer] is cache.state.pool.state[layer] else "working"
    return kv, state


@requires_triton
@pytest.mark.triton
@pytest.mark.parametrize("family, options", [
    ("jamba", dict(kv_cache_dtype="fp8_e4m3", mamba_state_dtype="bfloat16")),  # Mamba; attention as a mixer
    ("falcon_h1", dict(kv_cache_dtype="fp8_e4m3", mamba_state_dtype="float16")),  # Mamba2 beside attention
    ("qwen3_next", dict(kv_cache_dtype="fp8_e5m2", mamba_state_dtype="bfloat16")),  # Gated DeltaNet; gated attention
    ("kimi_linear", dict(kv_cache_dtype="fp8_e4m3", mamba_state_dtype="bfloat16")),  # KDA; MLA's latent rows
    ("lfm2", dict(kv_cache_dtype="fp8_e4m3", mamba_state_dtype="float16")),  # short conv; normed attention
])
def test_steps_read_and_write_the_narrow_pools_in_place(family, options, model_factory, monkeypatch):
    """An all-decode step hands every narrow layer its pools (nothing loaded into working rows or
    stored from them); a step that prefills hands FP8 layers their blocks beside working rows
    that hold only its prefill rows' blocks. Either way each step's logits and the pools' bytes
    are bit for bit those of the same engine on working rows alone. Which layers may be handed
    their pools is checked for every family in tests/test_kv_format.py and
    tests/test_state_format.py (HybridLM.in_place_readers)."""
    import engine.kv_format as kv_format

    path, _ = model_factory(family)
    seen, loaded = [], []
    load = NarrowCache.load

    def watched_load(self, layer, batch, readers=frozenset()):
        caches = load(self, layer, batch, readers)
        seen.append((bool(batch.prefill_rows), bool(batch.decode_rows), handed(self, layer)))
        return caches

    kv_load = kv_format.kv_load_triton
    monkeypatch.setattr(NarrowCache, "load", watched_load)
    monkeypatch.setattr(kv_format, "kv_load_triton", lambda pool, blocks, *rest: loaded.append(blocks.numel())
                        or kv_load(pool, blocks, *rest))
    runs = {}
    for in_place in (True, False):
        if not in_place:  # the same engine on its working rows
            monkeypatch.setattr(HybridLM, "in_place_readers", lambda self, index: frozenset())
        llm = cuda_like_engine(path, monkeypatch, static=False, device=DEVICE, max_num_batched_tokens=8, **options)
        logits = []
        execute = llm.engine.runner.execute
        llm.engine.runner.execute = lambda seqs, run=execute, kept=logits: kept.append(run(seqs).clone()) or kept[-1]
        tokens = [out.token_ids for out in llm.generate(PROMPTS, FEW)]
        pools = [t.view(torch.uint8).clone() for t in llm.engine.cache.layers.tensors()]
        runs[in_place] = logits, tokens, pools, sum(loaded)
        decodes = {given for prefills, _, given in seen if not prefills}
        mixed = {given for prefills, decodes_too, given in seen if prefills and decodes_too}
        assert decodes and mixed, "no all-decode step or no step mixing prefill and decode rows"
        if in_place:
            assert all(kv in (None, "pool") and state in (None, "pool") for kv, state in decodes), decodes
            assert all(kv in (None, "beside") and state in (None, "working") for kv, state in mixed), mixed
        else:
            assert all(kind in (None, "working") for pair in decodes | mixed for kind in pair)
        seen.clear()
        loaded.clear()
    (steps, tokens, pools, blocks), (steps_ref, tokens_ref, pools_ref, blocks_ref) = runs[True], runs[False]
    assert blocks < blocks_ref  # a step that prefills loads its prefill rows' blocks alone
    assert tokens == tokens_ref and len(steps) == len(steps_ref)
    for step, (got, want) in enumerate(zip(steps, steps_ref)):
        assert torch.equal(got, want), f"step {step}"
    assert all(torch.equal(a, b) for a, b in zip(pools, pools_ref))


@requires_triton
@pytest.mark.triton
@pytest.mark.parametrize("family, options", [
    ("jamba", dict(kv_cache_dtype="fp8_e4m3", mamba_state_dtype="bfloat16")),
    ("kimi_linear", dict(kv_cache_dtype="fp8_e5m2", mamba_state_dtype="float16")),
])
def test_the_static_decode_step_reads_and_writes_the_pools_as_the_eager_one(family, options, model_factory,
                                                                            monkeypatch):
    """The forward a CUDA graph captures (engine.cuda_graphs.StaticDecode, run uncaptured) on
    narrow pools, from the same cache contents as the eager step: the same logits and the same
    bytes in every pool row. Eight requests fill the padded batch: a CPU GEMM over five rows
    rounds otherwise than over eight, and padded rows are tests/test_static_decode.py's (which
    captures this step on CUDA)."""
    path, _ = model_factory(family)
    run_as_on_cuda(monkeypatch)
    llm = decoding_engine(path, 8, device=DEVICE, **options)
    llm.engine.runner.use_static_decode(capture=False)
    plan = llm.engine.scheduler.schedule()
    assert len(plan.seqs) == 8 and 8 in llm.engine.runner.static.sizes
    snapshot = [t.clone() for t in cache_tensors(llm)]
    eager_logits, eager_cache = decode_step(llm, plan.seqs, snapshot, None)
    static_logits, static_cache = decode_step(llm, plan.seqs, snapshot, llm.engine.runner.static)
    assert torch.equal(static_logits, eager_logits)
    written = 0
    for before, eager, static in zip(snapshot, eager_cache, static_cache):
        assert before.dtype in NARROW and torch.equal(static[:-1].view(torch.uint8), eager[:-1].view(torch.uint8))
        written += not torch.equal(before.view(torch.uint8), eager.view(torch.uint8))
    assert written == len(snapshot)  # every pool took the step's token or state

