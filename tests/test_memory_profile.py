"""--dtype and --gpu-memory-utilization: what they resolve to, what they refuse, and the cache
budget's arithmetic (engine.memory_profile) with the profile step run on CPU tensors."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.memory_profile import DeviceMemory, cache_budget, device_stats, measure, rank_budget

GiB = 1 << 30


def test_auto_dtype_is_float32_on_cpu_and_recurrent_state_stays_float32(model_factory):
    path, _ = model_factory("jamba")
    assert EngineConfig(model=str(path)).dtype == "float32"
    llm = LLM(path, dtype="bfloat16", num_kv_blocks=32)
    assert all(t.dtype == torch.float32 for _, t in llm.engine.cache.slot_tensors())
    assert all(t.dtype == torch.bfloat16 for _, t in llm.engine.cache.block_tensors())


@pytest.mark.parametrize("value", [0, 0.0, -0.1, 1.01, True, "0.9"])
def test_impossible_memory_fractions_are_refused_naming_the_flag(model_factory, value):
    path, _ = model_factory("jamba")
    with pytest.raises(ValueError, match=r"gpu_memory_utilization: must be in \(0, 1\]"):
        EngineConfig(model=str(path), gpu_memory_utilization=value)


def test_unknown_dtypes_are_refused_naming_the_choices(model_factory):
    path, _ = model_factory("jamba")
    with pytest.raises(ValueError, match=r"dtype: 'fp8' not in \['auto', 'bfloat16'"):
        EngineConfig(model=str(path), dtype="fp8")


def test_the_budget_is_the_fraction_less_other_users_weights_and_the_peak_step():
    memory = DeviceMemory(total=80 * GiB, free=70 * GiB, allocated=8 * GiB, peak=12 * GiB,
                          profile_cache=1 * GiB)
    # others: 80 - 70 - 8 = 2; the model: 12 - 1 = 11 (8 of weights, 3 of the step)
    assert cache_budget(memory, 0.9) == int(0.9 * 80 * GiB) - 2 * GiB - 11 * GiB
    assert cache_budget(memory, 0.1) < 0  # the engine refuses that, naming the flag


@pytest.mark.parametrize("name", ["jamba", "qwen3_next", "mamba", "llama"])
def test_the_profile_step_runs_the_largest_prefill_on_a_throwaway_cache(model_factory, name):
    path, _ = model_factory(name)
    engine = LLM(path, num_kv_blocks=32).engine
    calls = []
    forward = engine.model.forward

    def spy(batch, caches):
        calls.append((batch.input_ids.shape[0], batch.phases))
        return forward(batch, caches)

    engine.model.forward = spy
    memory = measure(engine.model, engine.spec, torch.float32, 16, 100, torch.device("cpu"),
                     stats=lambda device: (5 * GiB, 8 * GiB, 1 * GiB))
    assert [n for n, _ in calls] == [100]
    assert memory.profile_cache > 0 and memory.peak == 1 * GiB + memory.profile_cache
    assert (memory.total, memory.free, memory.allocated) == (8 * GiB, 5 * GiB, 1 * GiB)


def test_cpu_engines_keep_cache_memory_bytes(model_factory):
    path, _ = model_factory("jamba")
    with_fraction = LLM(path, gpu_memory_utilization=0.5).engine.cache.sizes
    assert with_fraction == LLM(path).engine.cache.sizes


def test_layers_ask_about_their_tensors_before_the_cpu_library(model_factory, monkeypatch):
    """A GPU worker must not build the C++ CPU library (the CUDA image needs no compiler): the
    layers that call it directly look at their tensors first (bf16 ones stand in for CUDA ones
    here; scripts/gpu_check.py checks that a CUDA engine builds nothing)."""
    from engine.kernels import cpu
    from engine.models.layers import RMSNorm

    def no_build():
        raise AssertionError("the C++ CPU library was asked for")

    monkeypatch.setattr(cpu, "available", no_build)
    norm = RMSNorm(8, 1e-6).to(torch.bfloat16)
    norm(torch.randn(3, 8, dtype=torch.bfloat16))
    path, _ = model_factory("llama")
    attention = next(m for m in LLM(path, num_kv_blocks=8, dtype="bfloat16").engine.model.modules()
                     if hasattr(m, "_attend_one"))
    q, kv = torch.randn(2, 4, 16, dtype=torch.bfloat16), torch.randn(5, 4, 16, dtype=torch.bfloat16)
    assert attention._attend_one(q, kv, kv, 5).shape == (2, 4, 16)



def test_the_smallest_rank_budget_sizes_every_rank():
    roomy = DeviceMemory(total=80 * GiB, free=70 * GiB, allocated=8 * GiB, peak=12 * GiB, profile_cache=1 * GiB)
    crowded = DeviceMemory(total=80 * GiB, free=40 * GiB, allocated=8 * GiB, peak=12 * GiB, profile_cache=1 * GiB)
    budget, rank = rank_budget([roomy, crowded], 0.9)
    assert (budget, rank) == (cache_budget(crowded, 0.9), 1)


def test_tensor_parallel_ranks_run_the_profile_step_together(model_factory):
    """gpu_memory_utilization under tensor parallelism: rank 0 and the follower run the profile
    step at once (its sharded layers' collectives meet: a rank that skipped it would hang rank 0),
    each on its own shard, and the engine serves exactly afterwards (the ranks stay in step)."""
    from tests.oracle import judge_greedy

    path, hf = model_factory("jamba")
    llm = LLM(path, tensor_parallel_size=2, block_size=4)
    try:
        memories = llm.engine.rank_memories(24, device_stats)
        # CPU ranks report zero device numbers (engine.memory_profile.device_stats): no device budget
        assert len(memories) == 2 and all((m.total, m.free, m.allocated) == (0, 0, 0) for m in memories)
        assert memories[0].profile_cache == memories[1].profile_cache > 0  # equal shards of one cache
        prompt = [4, 8, 15, 16, 23, 42]
        out = llm.generate([prompt], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))[0]
        judge_greedy(hf, prompt, out.token_ids)
    finally:
        llm.engine.close()
