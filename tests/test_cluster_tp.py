"""Tensor-parallel workers on the session's Ray test cluster: prefill and decode workers of
different TP sizes (2->1, 1->2, 2->2) hand requests off over shm and gloo, every token judged by
transformers. The engine side of each size pair for three families: tests/test_tp_handoff.py.
"""

from __future__ import annotations

import random

import pytest

ray = pytest.importorskip("ray")

from tests.oracle import judge_greedy
from tests.test_cluster_recurrent import GREEDY, PLACEMENTS, every_one_split_and_judged


# The Granite 4.0-H pair also differs in block size (8 -> 4): the trap of a P/D pair whose
# block sizes differ, on a TP worker.
@pytest.mark.parametrize(("family", "prefill_tp", "decode_tp", "transport", "prefill_block_size"), [
    ("jamba", 2, 1, "shm", 4), ("granitemoehybrid", 1, 2, "gloo", 8), ("llama", 2, 2, "gloo", 4)])
def test_workers_of_different_tp_sizes_hand_off_exactly(ray_nodes, model_factory, family, prefill_tp,
                                                         decode_tp, transport, prefill_block_size):
    from router.cluster import launch

    path, hf = model_factory(family)
    cluster = launch(path, prefill=1, decode=1, transport=transport, address=ray_nodes[0].address,
                     prefill_tp=prefill_tp, decode_tp=decode_tp, block_size=4, num_kv_blocks=120,
                     prefill_block_size=prefill_block_size, max_num_seqs=8, max_num_batched_tokens=13,
                     transfer_timeout_s=30.0, enable_prefix_caching=True, host_cache_bytes=1 << 20,
                     **PLACEMENTS[transport])
    try:
        assert cluster.workers.transport == transport
        layouts = ray.get([w.handle.layout.remote() for w in cluster.workers.prefill + cluster.workers.decode])
        assert [layout["block_size"] for layout in layouts] == [prefill_block_size, 4]
        for worker, tp in ((cluster.workers.prefill[0], prefill_tp), (cluster.workers.decode[0], decode_tp)):
            # one Ray actor per rank, each in a bundle of the worker's placement group, on one node
            table = ray.util.placement_group_table(worker.group)
            assert len(table["bundles"]) == tp + (prefill_tp if transport == "shm" and worker.kind == "decode" else 0) \
                + (decode_tp if transport == "shm" and worker.kind == "prefill" else 0)
            assert len(ray.get(worker.handle.tp_rank_pids.remote())) == tp - 1
        rng = random.Random(family)
        prompts = [[rng.randrange(3, 300) for _ in range(n)] for n in (1, 4, 9, 17, 30, 3, 12, 25)]
        every_one_split_and_judged(cluster, hf, prompts)
        # equal sizes go rank to rank (engine.tp.rank_handoffs), others through rank 0's staging rows
        stats = ray.get(cluster.workers.prefill[0].handle.stats.remote())
        assert stats["handoffs_by_rank"] == (stats["handoff_count"] if prefill_tp == decode_tp else 0)
        assert stats["handoff_count"] >= len(prompts) and stats["handoff_failures"] == 0
        assert "tier_host_bytes" in stats  # a TP worker's host tier (its entries un-sharded on rank 0)
        again = prompts[4][:28] + [7, 8, 9]  # the prefill worker checkpointed 28 (24) of prompt 4's 30 tokens
        (out,) = cluster.generate([again], GREEDY)
        assert out.error is None and out.num_cached_tokens == 28 // prefill_block_size * prefill_block_size
        judge_greedy(hf, again, out.token_ids)
    finally:
        cluster.shutdown()


def test_gpu_tp_workers_take_a_whole_gpu_per_rank(model_factory):
    from router.cluster import ClusterConfig
    from router.placement import PlacementConfig

    path, _ = model_factory("llama")
    config = ClusterConfig(str(path), placement=PlacementConfig(gpus_per_worker=1, prefill_tp=2))
    assert config.placement.bundle("prefill")["GPU"] == 1 and config.placement.ranks("prefill") == 2
    with pytest.raises(ValueError, match="gpus_per_worker=0.5 with tensor-parallel workers: each rank"):
        PlacementConfig(gpus_per_worker=0.5, decode_tp=2)
    with pytest.raises(ValueError, match="prefill_tp: must be a positive integer"):
        PlacementConfig(prefill_tp=0)


def test_serve_flags_size_each_kind():
    from router.cli import build_parser, serve_options

    options = serve_options(build_parser().parse_args(["serve", "--prefill-tp", "2", "--decode-tp", "1",
                                                       "--block-size", "8", "--decode-block-size", "16"]))[0]
    assert (options["prefill_tp"], options["decode_tp"]) == (2, 1)
    assert (options["block_size"], options["prefill_block_size"], options["decode_block_size"]) == (8, None, 16)
    from router.workers import engine_options

    from router.placement import PlacementConfig

    config = type("C", (), {"placement": PlacementConfig(prefill_tp=2), "engine_options": {"block_size": 8},
                            "prefill_block_size": None, "decode_block_size": 16})
    assert engine_options(config, "prefill") == {"block_size": 8, "tensor_parallel_size": 2}
    assert engine_options(config, "decode") == {"block_size": 16}


def test_a_bad_per_kind_block_size_is_refused_by_name(model_factory):
    from router.cluster import ClusterConfig

    path, _ = model_factory("llama")
    with pytest.raises(ValueError, match="decode_block_size: block_size: must be a positive integer, got 0"):
        ClusterConfig(str(path), engine_options={"block_size": 4}, decode_block_size=0)
    assert ClusterConfig(str(path), prefill_block_size=16).prefill_block_size == 16


def test_a_killed_rank_takes_its_worker_down_and_the_stream_resumes(ray_nodes, model_factory):
    """A decode worker's second rank is killed mid-stream: the worker exits with it (rank 0 would
    otherwise wait in a collective), Ray restarts it with both ranks, and the router resumes the
    request from the tokens already delivered: one stream, no token twice, none missing. Both
    workers are TP=2, so the resumed request is handed off rank to rank to the new ranks, over
    channels the router reconnected."""
    import os
    import signal

    from engine import SamplingParams
    from router.cluster import launch
    from tests.oracle import judge_greedy

    path, hf = model_factory("jamba")
    cluster = launch(path, prefill=1, decode=1, transport="gloo", address=ray_nodes[0].address,
                     prefill_tp=2, decode_tp=2, block_size=4, num_kv_blocks=200, max_num_seqs=8, transfer_timeout_s=30.0,
                     **PLACEMENTS["gloo"])
    try:
        decode = cluster.workers.decode[0]
        (follower,) = ray.get(decode.handle.tp_rank_pids.remote())
        params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)  # killed at the 3rd
        prompt = [5, 17, 60, 2, 99, 41]

        async def stream_and_kill():
            seen = []
            async for out in cluster.stream("rank-dies", prompt, params):
                seen.append(out)
                if len(seen) == 3:
                    os.kill(follower, signal.SIGKILL)
            return seen

        retries = cluster.retries
        seen = cluster._run(stream_and_kill(), timeout=180)
        final = seen[-1]
        assert final.error is None and final.finish_reason == "length", final
        tokens = [t for out in seen for t in out.new_token_ids]
        assert tokens == final.token_ids and len(tokens) == params.max_tokens
        judge_greedy(hf, prompt, final.token_ids)
        assert cluster.retries == retries + 1
        assert ray.get(decode.handle.tp_rank_pids.remote()) != [follower]  # a new second rank
        stats = ray.get(cluster.workers.prefill[0].handle.stats.remote())
        assert stats["handoffs_by_rank"] == 2 and stats["handoff_failures"] == 0
    finally:
        cluster.shutdown()
