"""Each Mamba2 family on a 2 prefill + 2 decode cluster, over gloo (prefill and decode workers
on different nodes) and over shared memory (workers packed in prefill/decode pairs).

The hand-off moves whatever state the layers declare; nothing in kvtransfer, the workers or
the router knows these families. Every output is judged by transformers.
"""

from __future__ import annotations

import random

import pytest

from engine import SamplingParams
from tests.oracle import MAMBA2_FAMILIES, judge_greedy

ray = pytest.importorskip("ray")

from tests.conftest import DECODE_RES, PREFILL_RES

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
PLACEMENTS = {
    "gloo": dict(prefill_resource=PREFILL_RES, decode_resource=DECODE_RES),
    "shm": dict(pack_pairs=True, prefill_resource=None, decode_resource=None),
}


@pytest.mark.parametrize("transport", sorted(PLACEMENTS))
@pytest.mark.parametrize("family", MAMBA2_FAMILIES)
def test_two_by_two_cluster_matches_transformers(ray_nodes, model_factory, family, transport):
    from router.cluster import launch

    path, hf = model_factory(family)
    cluster = launch(path, prefill=2, decode=2, transport=transport, address=ray_nodes[0].address,
                     block_size=4, num_kv_blocks=200, max_num_seqs=8, max_num_batched_tokens=13,
                     transfer_timeout_s=15.0, **PLACEMENTS[transport])
    try:
        assert cluster.workers.transport == transport
        rng = random.Random(family)
        # 1-token, block-boundary and multi-chunk prompts; budget 13 splits the longer ones.
        prompts = [[rng.randrange(3, 300) for _ in range(n)] for n in (1, 4, 5, 8, 9, 17, 30, 3)]
        outs = cluster.generate(prompts, GREEDY)
        for prompt, out in zip(prompts, outs):
            assert out.error is None, out.error
            judge_greedy(hf, prompt, out.token_ids)
        workers = cluster.status()["workers"]
        assert sum(w.get("handoff_count", 0) for w in workers) == len(prompts)  # all split
    finally:
        cluster.shutdown()
