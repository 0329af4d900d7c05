"""Each recurrent family (the Mamba2 families, LFM2, ...) on a 1 prefill + 1 decode cluster, over gloo (prefill and decode
workers on different nodes) or over shared memory (the pair packed on one node). Routing across
several workers of a kind is family-agnostic and tested on 2P+2D in tests/test_cluster.py.

The hand-off moves whatever state the layers declare; nothing in kvtransfer, the workers or
the router knows these families. So each family runs over one transport, the families
alternating between the two (every transport carries several state layouts; the transports
themselves are tested layout by layout in tests/test_kvtransfer_*.py), which halves the
cluster launches; and a family whose cache is shaped like another's here is left to the
in-process hand-off tests (tests/test_handoff_engine.py, every family): Nemotron-H's is Bamba's
(Mamba2 + attention layers), and Granite 4.0-H runs through the cluster in the API test below.
Every output is judged by transformers.
"""

from __future__ import annotations

import random

import pytest

from engine import SamplingParams
from tests.oracle import RECURRENT_FAMILIES, judge_greedy

ray = pytest.importorskip("ray")

from tests.conftest import DECODE_RES, PREFILL_RES

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
PLACEMENTS = {
    "gloo": dict(prefill_resource=PREFILL_RES, decode_resource=DECODE_RES),
    "shm": dict(pack_pairs=True, prefill_resource=None, decode_resource=None),
}


CLUSTER_FAMILIES = [f for f in RECURRENT_FAMILIES if f not in ("nemotron_h", "granitemoehybrid")]


@pytest.mark.parametrize(("family", "transport"), [(family, sorted(PLACEMENTS)[i % 2])
                                                   for i, family in enumerate(CLUSTER_FAMILIES)])
def test_family_through_the_cluster_matches_transformers(ray_nodes, model_factory, family, transport):
    # 1-token, block-boundary and multi-chunk prompts; budget 13 splits the longer ones.
    family_through_a_cluster(ray_nodes, model_factory, family, transport, 1, family, (1, 4, 5, 8, 9, 17, 30, 3))


def other_transport(family: str) -> str:
    """The transport the 1 prefill + 1 decode test above does not run `family` over."""
    index = CLUSTER_FAMILIES.index(family)
    return sorted(PLACEMENTS)[(index + 1) % 2]


@pytest.mark.parametrize(("family", "transport"), [(family, other_transport(family))
                                                   for family in ("lfm2_moe", "olmo_hybrid", "kimi_linear")])
def test_newer_families_through_two_prefill_and_two_decode_workers(ray_nodes, model_factory, family, transport):
    """The families that arrived as modules of their own (LFM2-MoE, OLMo Hybrid, Kimi Linear) through a
    2 prefill + 2 decode cluster, over the transport the test above does not give them, so each
    crosses both: every request handed off, transformers' tokens."""
    family_through_a_cluster(ray_nodes, model_factory, family, transport, 2, family + transport,
                             (1, 5, 9, 17, 30, 3, 12, 8))


def family_through_a_cluster(ray_nodes, model_factory, family, transport, workers: int, seed: str,
                             lengths) -> None:
    """`workers` prefill and as many decode workers over `transport`, 13-token steps over
    4-token blocks; random prompts of `lengths`, each handed off once and judged."""
    from router.cluster import launch

    path, hf = model_factory(family)
    cluster = launch(path, prefill=workers, decode=workers, transport=transport, address=ray_nodes[0].address,
                     block_size=4, num_kv_blocks=200, max_num_seqs=8, max_num_batched_tokens=13,
                     transfer_timeout_s=15.0, **PLACEMENTS[transport])
    try:
        assert cluster.workers.transport == transport
        rng = random.Random(seed)
        prompts = [[rng.randrange(3, 300) for _ in range(n)] for n in lengths]
        every_one_split_and_judged(cluster, hf, prompts)
    finally:
        cluster.shutdown()


def every_one_split_and_judged(cluster, hf, prompts) -> None:
    """Each prompt handed off once, without failures; each output transformers' greedy tokens."""
    outs = cluster.generate(prompts, GREEDY)
    for prompt, out in zip(prompts, outs):
        assert out.error is None, out.error
        judge_greedy(hf, prompt, out.token_ids)
    workers = cluster.status()["workers"]
    assert sum(w.get("handoff_count", 0) for w in workers) == len(prompts)  # all split
    assert sum(w.get("handoff_failures", 0) for w in workers) == 0


def test_api_and_a_retry_on_a_mamba2_family(ray_nodes, model_factory, tmp_path):
    """Granite 4.0-H's layout behind the front door: the official openai client (plain and
    streamed) and gRPC give transformers' tokens; then a decode worker dies mid-stream and the
    request is resumed on the other from the tokens already delivered, as for Jamba."""
    import asyncio

    import openai

    from router.client import SplitServeClient
    from router.cluster import launch
    from tests.test_api_support import make_api_model, serving
    from tests.test_reliability import arm_crash, assert_one_clean_stream, collect, the_one_that_died

    path = make_api_model(model_factory, tmp_path, "granitemoehybrid")
    _, hf = model_factory("granitemoehybrid")
    cluster = launch(path, prefill=2, decode=2, address=ray_nodes[0].address, block_size=4,
                     num_kv_blocks=200, max_num_seqs=8, transfer_timeout_s=15.0,
                     prefill_resource=PREFILL_RES, decode_resource=DECODE_RES)
    try:
        with serving(cluster) as door:
            prompt = "def fibonacci(n):"
            ids = cluster.tokenizer.encode(prompt)
            with openai.OpenAI(base_url=f"http://127.0.0.1:{door.http_port}/v1", api_key="none",
                               max_retries=0, timeout=60) as client:
                model = client.models.list().data[0].id
                body = {"ignore_eos": True, "return_token_ids": True}
                plain = client.completions.create(model=model, prompt=prompt, max_tokens=8,
                                                  temperature=0.0, extra_body=body)
                streamed = "".join(c.choices[0].text for c in client.completions.create(
                    model=model, prompt=prompt, max_tokens=8, temperature=0.0, stream=True,
                    extra_body={"ignore_eos": True}))
            tokens = plain.choices[0].model_extra["token_ids"]
            judge_greedy(hf, ids, tokens)
            assert streamed == plain.choices[0].text
            with SplitServeClient(f"127.0.0.1:{door.grpc_port}") as grpc_client:
                assert "mamba2" in grpc_client.model_info().layer_kinds
                done = grpc_client.generate(ids, max_tokens=8, temperature=0.0, ignore_eos=True)
            assert list(done.token_ids) == tokens
        retries = cluster.retries
        before = arm_crash(cluster.workers.decode, "granite-dies-in-decode", after=4)
        prompt_ids = [2, 71, 82, 81, 82, 84, 59]
        params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        seen, final = asyncio.run(collect(cluster, "granite-dies-in-decode", prompt_ids, params))
        assert_one_clean_stream(seen, final, hf, prompt_ids)
        assert cluster.retries == retries + 1
        the_one_that_died(cluster, cluster.workers.decode, before)
    finally:
        cluster.shutdown()


@pytest.mark.parametrize("transport", sorted(PLACEMENTS))
def test_fp8_kv_and_half_width_state_cross_the_wire(ray_nodes, model_factory, transport):
    """FP8 blocks and bfloat16 state rows over each transport: each request, sent alone, gets the
    tokens of a colocated engine in the same formats (the same passes, the same roundings)."""
    from engine import LLM
    from router.cluster import launch

    path, _ = model_factory("jamba")
    formats = dict(kv_cache_dtype="fp8_e4m3", mamba_state_dtype="bfloat16", block_size=4,
                   max_num_batched_tokens=13)
    cluster = launch(path, prefill=1, decode=1, transport=transport, address=ray_nodes[0].address,
                     num_kv_blocks=200, max_num_seqs=8, transfer_timeout_s=15.0, **formats, **PLACEMENTS[transport])
    try:
        colocated = LLM(str(path), **formats)
        rng = random.Random(transport)
        for n in (3, 9, 30):
            prompt = [rng.randrange(3, 300) for _ in range(n)]
            out = cluster.generate([prompt], GREEDY)[0]
            assert out.error is None, out.error
            assert out.token_ids == colocated.generate([prompt], GREEDY)[0].token_ids
        workers = cluster.status()["workers"]
        assert sum(w.get("handoff_count", 0) for w in workers) == 3
    finally:
        cluster.shutdown()
