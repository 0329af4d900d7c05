"""The colocated engine sharded over two real ranks (engine.tp.ranks: a follower process and a
gloo group), judged token by token by transformers: chunked prefill, preemption, prefix caching.
"""

from __future__ import annotations

import os
import random

import pytest

from engine import LLM, SamplingParams
from tests.oracle import judge_greedy

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


def prompts(seed: int, n: int = 5):
    rng = random.Random(seed)
    return [[rng.randrange(3, 300) for _ in range(rng.randrange(5, 40))] for _ in range(n)]


@pytest.mark.parametrize("family", ["jamba", "granitemoehybrid", "llama", "lfm2_moe", "olmo_hybrid", "kimi_linear"])
def test_two_ranks_match_transformers_through_chunks_and_preemption(model_factory, family):
    path, hf = model_factory(family)
    # 8-token chunks cross every prompt; 24 blocks of 4 cannot hold five sequences at once.
    llm = LLM(path, tensor_parallel_size=2, max_num_batched_tokens=8, block_size=4, num_kv_blocks=24)
    try:
        assert llm.engine.tp.group.size == 2
        batch = prompts(1)
        outs = llm.generate(batch, GREEDY)
        for prompt, out in zip(batch, outs):
            assert out.error is None and len(out.token_ids) == 10
            judge_greedy(hf, prompt, out.token_ids)
        assert llm.engine.scheduler.num_preemptions > 0
        assert llm.engine.blocks.num_available_blocks == 24  # nothing leaked
    finally:
        llm.engine.close()
    assert not any(proc.is_alive() for proc in llm.engine.tp._procs)


def test_prefix_cache_checkpoints_are_restored_on_every_rank(model_factory):
    """A hit copies a recurrent-state checkpoint into the request's slot: the follower must copy
    its shard too, or rank 1 would resume from a stranger's (or no) state."""
    path, hf = model_factory("jamba")
    llm = LLM(path, tensor_parallel_size=2, enable_prefix_caching=True, block_size=4)
    try:
        system = [random.Random(2).randrange(3, 300) for _ in range(24)]
        first = llm.generate([system + [5, 6, 7]], GREEDY)[0]
        second = llm.generate([system + [8, 9]], GREEDY)[0]
        assert second.num_cached_tokens == 24  # the checkpoint the first left at its last boundary
        judge_greedy(hf, system + [5, 6, 7], first.token_ids)
        judge_greedy(hf, system + [8, 9], second.token_ids)
    finally:
        llm.engine.close()


def test_tensor_parallel_options_are_checked(model_factory):
    path, _ = model_factory("llama")
    for bad, match in ((dict(tensor_parallel_size=0), "tensor_parallel_size"),
                       (dict(tensor_parallel_size=2, device="cuda:0"), "cuda|CUDA"),
                       (dict(tensor_parallel_size=2, device="cuda:1"), "placed from cuda:0 on"),
                       (dict(tensor_parallel_size=2, device="gpu0"), "'gpu0' is not a torch device"),
                       (dict(device="mps"), "only 'cpu' and 'cuda'")):
        with pytest.raises(ValueError, match=match):
            LLM(path, **bad)
    odd, _ = model_factory("mamba2_tied_limit")  # 3 Mamba2 heads do not split over 2 ranks
    with pytest.raises(ValueError, match="Mamba2 heads \\(3\\)"):
        LLM(odd, tensor_parallel_size=2)


def test_each_gpu_rank_gets_its_own_device(monkeypatch):
    import torch

    from engine.tp.ranks import rank_device

    assert rank_device("cpu", 1) == "cpu"
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)  # a Ray rank sees only its own GPU
    assert [rank_device("cuda", r) for r in range(2)] == ["cuda:0", "cuda:0"]
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)  # local ranks see them all
    assert [rank_device("cuda", r) for r in range(4)] == ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ValueError, match="rank 3 needs its own GPU; this process sees 2"):
        rank_device("cuda", 3)
    with pytest.raises(ValueError, match="placed from cuda:0 on"):
        rank_device("cuda:1", 0)


def test_gpu_ranks_form_an_nccl_group_or_say_why_not():
    import torch.distributed as dist

    from engine.tp.ranks import StoreGroup

    store, _ = StoreGroup.open_store(1)
    assert StoreGroup(store, 0, 1, "cpu").backend == "gloo"
    if dist.is_nccl_available():
        pytest.skip("this torch has NCCL: the GPU test below covers the group")
    with pytest.raises(RuntimeError, match="GPU ranks need torch built with NCCL"):
        StoreGroup(store, 0, 1, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["jamba", "llama"])
def test_two_gpu_ranks_match_transformers(model_factory, family):
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs: NCCL refuses two ranks on one device")
    path, hf = model_factory(family)
    llm = LLM(path, device="cuda", dtype="float32", tensor_parallel_size=2, max_num_batched_tokens=8,
              block_size=4, num_kv_blocks=24)
    try:
        assert llm.engine.tp.group.backend == "nccl"
        batch = prompts(3)
        for prompt, out in zip(batch, llm.generate(batch, GREEDY)):
            assert out.error is None and len(out.token_ids) == 10
            judge_greedy(hf, prompt, out.token_ids)
        assert llm.engine.scheduler.num_preemptions > 0
    finally:
        llm.engine.close()


def _send_environment_variable(conn, name):
    import os

    conn.send(os.environ.get(name))


def test_a_rank_runs_under_rank_0s_environment_of_the_moment(monkeypatch):
    """Ranks fork from a forkserver that keeps the environment it started with; a variable set
    after it started (e.g. SPLITSERVE_DISABLE_CPU_KERNELS) must still reach a new rank."""
    from engine.tp.ranks import rank_context, with_environment

    context = rank_context()

    def environment_seen_by_a_rank():
        here, there = context.Pipe()
        proc = context.Process(target=with_environment, args=(dict(os.environ), _send_environment_variable,
                                                              there, "SPLITSERVE_RANK_PROBE"))
        proc.start()
        try:
            assert here.poll(60), "the rank did not answer"
            return here.recv()
        finally:
            proc.join(30)

    monkeypatch.delenv("SPLITSERVE_RANK_PROBE", raising=False)
    assert environment_seen_by_a_rank() is None  # the forkserver runs now, without the variable
    monkeypatch.setenv("SPLITSERVE_RANK_PROBE", "set later")
    assert environment_seen_by_a_rank() == "set later"


def test_olmo_attention_whose_kv_heads_cannot_split_is_refused_by_name(tmp_path):
    """OLMo Hybrid's key norm spans all KV heads: with one KV head over two ranks (replicated, so
    counted twice in the shared sum) TP 2 is refused at start, naming the layer and why."""
    from tests.oracle import CONFIGS, tiny_hf_model

    family, config = CONFIGS["olmo_hybrid"]
    tiny_hf_model(family, dict(config, num_key_value_heads=1), seed=3).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"layer 2 \(attention\).*k norm spans all 1 KV heads.*TP size 2"):
        LLM(str(tmp_path), tensor_parallel_size=2)


@pytest.mark.parametrize("family", ["jamba", "qwen3_next"])
def test_static_decode_runs_on_every_rank(model_factory, family):
    """Decode steps through the static padded buffers (the path CUDA graphs replay) on both ranks:
    rank 0 sends each such step as ("static_step", host), which a follower without static buffers
    of its own could not run; tokens equal the eager engine's and transformers' answer."""
    path, hf = model_factory(family)
    batch = prompts(2)
    eager = LLM(path, tensor_parallel_size=2, block_size=4)
    try:
        expected = [o.token_ids for o in eager.generate(batch, GREEDY)]
    finally:
        eager.engine.close()
    llm = LLM(path, tensor_parallel_size=2, block_size=4)
    try:
        runner = llm.engine.runner
        runner.use_static_decode(capture=False)  # on CPU: the eager static path, on every rank
        static_steps = []
        run = runner.static.run
        runner.static.run = lambda host: static_steps.append(len(host.phases)) or run(host)
        outs = llm.generate(batch, GREEDY)
        assert static_steps and max(static_steps) == len(batch)
        assert [o.token_ids for o in outs] == expected
        for prompt, out in zip(batch, outs):
            judge_greedy(hf, prompt, out.token_ids)
    finally:
        llm.engine.close()
