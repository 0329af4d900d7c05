"""Speculative decoding with a checkpoint's MTP head (engine.mtp): its drafts are the head's
own as transformers' modules compute it, the outputs stay exact, and the head's cache
travels with the hand-off."""

from __future__ import annotations

import json
import random

import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.mtp import MTPProposer
from engine.phase import Phase
from kvtransfer.errors import LayoutMismatchError
from kvtransfer.layout import CacheTensors
from tests.mtp_oracle import assert_drafts_are_the_heads, save_mtp_model
from tests.oracle import judge_greedy
from tests.test_handoff_engine import run_disaggregated

MTP = {"method": "mtp", "num_speculative_tokens": 3, "adaptive": False}  # drafts every step
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def mtp_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_next_mtp")
    hf, head = save_mtp_model(path)
    return path, hf, head


def prompts_for(seed: int, lengths=(1, 6, 19, 40)) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 300) for _ in range(n)] for n in lengths]


def record_proposals(monkeypatch, script: dict | None = None) -> list[tuple[list[int], list[int]]]:
    """(the request's tokens, the head's drafts) of every proposal. With `script` (request
    prompt -> the plain run's outputs), the drafts verified are the plain run's next tokens up
    to a point that cycles, then the head's: drafts are accepted and rejected both, so what
    the head observes after each verify is tested, not only after rejections."""
    proposals, calls = [], [0]
    original = MTPProposer.propose_all

    def recorded(self, requests, limits):
        drafts = original(self, requests, limits)
        out = []
        for request, made in zip(requests, drafts):
            tokens = list(request.prompt_token_ids) + list(request.output_token_ids)
            proposals.append((tokens, list(made)))
            if script is None or not made:
                out.append(made)
                continue
            calls[0] += 1
            plain = script[tuple(request.prompt_token_ids)][request.num_output_tokens:]
            right = calls[0] % (len(made) + 1)
            out.append((plain[:right] + made[right:])[:len(made)])
        return out

    monkeypatch.setattr(MTPProposer, "propose_all", recorded)
    return proposals


def test_mtp_drafts_are_the_heads_and_the_outputs_stay_exact(mtp_model, monkeypatch):
    path, hf, head = mtp_model
    prompts = prompts_for(3)
    plain = [out.token_ids for out in LLM(str(path), block_size=4).generate(prompts, GREEDY)]
    proposals = record_proposals(monkeypatch, {tuple(p): o for p, o in zip(prompts, plain)})
    llm = LLM(str(path), block_size=4, speculative_config=MTP)
    speculated = [out.token_ids for out in llm.generate(prompts, GREEDY)]
    assert speculated == plain
    for prompt, output in zip(prompts, speculated):
        judge_greedy(hf, prompt, output)
    stats = llm.engine.speculation.stats()
    assert 0 < stats["spec_accepted_tokens"] < stats["spec_draft_tokens"], stats
    assert len(proposals) > 20
    for tokens, drafts in proposals[::3]:
        assert_drafts_are_the_heads(hf, head, tokens, drafts)


def test_mtp_under_preemption_prefix_caching_sampled_rows_and_a_resume(mtp_model, monkeypatch):
    """The head's rows beside sampled ones, under preemption and the prefix cache (its KV rides
    in the shared blocks), and a request resumed from delivered tokens: outputs stay the plain
    decode's, seeded draws included, and the drafts stay the head's."""
    from engine.request import Resume

    path, hf, head = mtp_model
    prompts = prompts_for(8) * 2
    params = [GREEDY if i % 2 == 0 else SamplingParams(max_tokens=24, temperature=0.8, seed=i, ignore_eos=True)
              for i in range(len(prompts))]
    options = dict(block_size=4, num_kv_blocks=24, max_num_batched_tokens=24, enable_prefix_caching=True)
    plain = [out.token_ids for out in LLM(str(path), **options).generate(prompts, params)]
    proposals = record_proposals(monkeypatch, {tuple(p): o for p, o in zip(prompts, plain)})
    llm = LLM(str(path), speculative_config=MTP, **options)
    assert [out.token_ids for out in llm.generate(prompts, params)] == plain
    stats = llm.engine.stats()
    assert stats["preemptions"] > 0 and stats["prefix_cache_hit_tokens"] > 0 and stats["spec_accepted_tokens"] > 0, stats
    llm.engine.add_request(prompts[2], GREEDY, request_id="resumed", resume=Resume(tuple(plain[2][:7])))
    while llm.engine.has_unfinished():
        for out in llm.engine.step():
            if out.finished:
                assert out.token_ids == plain[2]
    llm.engine.check_integrity()
    assert llm.engine.slots.num_free_slots == llm.engine.slots.num_slots
    for tokens, drafts in proposals[::7]:
        assert_drafts_are_the_heads(hf, head, tokens, drafts)


def test_decode_steps_on_the_static_path_give_the_head_its_hidden_states(mtp_model, monkeypatch):
    """A CUDA graph's decode step (the static path, run here on the CPU) gives the head the
    step's hidden states as one more output: drafts that follow a plain decode step start
    from the g it observed there, and stay the head's. Two proposals of three are dropped: a
    step that replays a rejected draft's accepted tokens, then a plain decode step."""
    path, hf, head = mtp_model
    prompts = prompts_for(5)
    plain = [out.token_ids for out in LLM(str(path), block_size=4).generate(prompts, GREEDY)]
    proposals, calls = record_proposals(monkeypatch), [0]
    drafting = MTPProposer.propose_all

    def every_other(self, requests, limits):
        calls[0] += 1
        drafts = drafting(self, requests, limits)
        return drafts if calls[0] % 3 == 0 else [[] for _ in requests]

    monkeypatch.setattr(MTPProposer, "propose_all", every_other)
    llm = LLM(str(path), block_size=4, speculative_config=MTP)
    llm.engine.runner.use_static_decode(capture=False)
    static, runs = llm.engine.runner.static, []
    run = static.run
    monkeypatch.setattr(static, "run", lambda host: runs.append(len(host.phases)) or run(host))
    assert [out.token_ids for out in llm.generate(prompts, GREEDY)] == plain
    assert len(runs) > 5 and static.keep_hidden
    after_static = [(tokens, drafts) for tokens, drafts in proposals if drafts]
    assert len(after_static) > 10
    for tokens, drafts in after_static[::3]:
        assert_drafts_are_the_heads(hf, head, tokens, drafts)


def test_a_head_that_skips_the_accepted_positions_drafts_wrong_tokens(mtp_model, monkeypatch):
    """The mutation: observe only the first position of a VERIFY row (its accepted drafts
    never reach the head's KV, and g comes from the wrong position) and the drafts stop being
    the head's."""
    original = MTPProposer.observe

    def first_only(self, seqs, begins):
        picked, kept, at = [], [], 0
        for seq in seqs:
            width = 1 if seq.phase is Phase.VERIFY else seq.num_new_tokens
            kept.append(type(seq)(seq.request, seq.phase, width, seq.slot, seq.block_table))
            picked += range(at, at + width)
            at += seq.num_new_tokens
        runner = self.engine.runner
        runner.last_hidden = runner.last_hidden[picked]
        return original(self, kept, begins)

    monkeypatch.setattr(MTPProposer, "observe", first_only)
    with pytest.raises(AssertionError, match="the head run by transformers"):
        test_mtp_drafts_are_the_heads_and_the_outputs_stay_exact(mtp_model, monkeypatch)


def test_the_head_drafts_on_the_decode_side_from_what_the_handoff_carried(mtp_model, monkeypatch):
    """The prefill worker runs the head over the prompt; the decode worker's first drafts come
    from the head's KV and g that traveled in the request's blocks and slot."""
    path, hf, head = mtp_model
    prompts = prompts_for(4, (2, 9, 21))
    plain = [out.token_ids for out in LLM(str(path), block_size=4).generate(prompts, GREEDY)]
    proposals = record_proposals(monkeypatch)
    engines = (LLMEngine(EngineConfig(str(path), block_size=4, mode="prefill", max_num_batched_tokens=16,
                                      speculative_config=MTP)),
               LLMEngine(EngineConfig(str(path), block_size=4, mode="decode", speculative_config=MTP)))
    outputs = run_disaggregated(path, prompts, GREEDY, engines=engines)
    assert [out.token_ids for out in outputs] == plain
    for prompt in prompts:  # each request's first proposal: right after the hand-off
        tokens, drafts = next((t, d) for t, d in proposals if t[:len(prompt)] == prompt)
        assert len(tokens) == len(prompt) + 1 and drafts
        assert_drafts_are_the_heads(hf, head, tokens, drafts)


def test_a_decode_worker_without_the_handed_off_head_cache_drafts_wrong_tokens(mtp_model, monkeypatch):
    """The mutation: the hand-off drops the head's layer (its KV and g) and the decode side's
    first drafts are not the head's."""
    import tests.test_handoff_engine as handoff

    original = handoff.copy_state

    def without_head(src, dst, handoff_, reservation):
        index = len(src.model.layers)
        saved = [t.clone() for t in dst.cache.layers.kv[index]] + [dst.cache.layers.state[index][0].clone()]
        original(src, dst, handoff_, reservation)
        *kv, kept = saved
        for tensor, before in zip(dst.cache.layers.kv[index], kv):
            tensor.copy_(before)
        dst.cache.layers.state[index][0].copy_(kept)

    monkeypatch.setattr(handoff, "copy_state", without_head)
    with pytest.raises(AssertionError, match="the head run by transformers"):
        test_the_head_drafts_on_the_decode_side_from_what_the_handoff_carried(mtp_model, monkeypatch)


def test_the_handshake_names_a_pair_whose_mtp_settings_differ(mtp_model):
    path, _, _ = mtp_model
    with_head = LLMEngine(EngineConfig(str(path), block_size=4, mode="prefill", speculative_config=MTP))
    without = LLMEngine(EngineConfig(str(path), block_size=4, mode="decode"))
    layouts = [CacheTensors.from_named(4, engine.cache.handoff_tensors(),
                                       speculative=(engine.config.speculative_config.canonical()
                                                    if engine.config.speculative_config else "")).layout
               for engine in (with_head, without)]
    layer = len(with_head.model.layers)
    with pytest.raises(LayoutMismatchError, match=rf"speculative_config .*mtp.* vs none.*layer {layer}: "
                                                  r"attention\+mtp_hidden vs no cache"):
        layouts[0].check_compatible(layouts[1], "prefill", "decode")


def test_mtp_is_refused_where_there_is_no_head_naming_why(mtp_model, model_factory, tmp_path):
    jamba, _ = model_factory("jamba")
    with pytest.raises(ValueError, match="model_type 'jamba' has no MTP head"):
        LLM(str(jamba), speculative_config=MTP)
    bare, _ = model_factory("qwen3_next")
    with pytest.raises(ValueError, match=r"carries no mtp\.\* weights"):
        LLM(str(bare), speculative_config=MTP)
    path, _, _ = mtp_model
    two = tmp_path / "two_heads"
    two.mkdir()
    for item in path.iterdir():
        (two / item.name).write_bytes(item.read_bytes())
    config = json.loads((path / "config.json").read_text())
    (two / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 2}))
    with pytest.raises(ValueError, match="num_nextn_predict_layers"):
        LLM(str(two), speculative_config=MTP)


def test_the_head_drafts_on_two_ranks_as_on_one(mtp_model, monkeypatch):
    """The head sharded over two ranks like the target: its drafts are still the head's and the
    outputs the plain decode's of the same ranks."""
    path, hf, head = mtp_model
    prompts = prompts_for(5, (6, 19, 40))
    plain_llm = LLM(str(path), block_size=4, tensor_parallel_size=2)
    try:
        plain = [out.token_ids for out in plain_llm.generate(prompts, GREEDY)]
    finally:
        plain_llm.engine.close()
    proposals = record_proposals(monkeypatch, {tuple(p): o for p, o in zip(prompts, plain)})
    llm = LLM(str(path), block_size=4, tensor_parallel_size=2, speculative_config=MTP)
    try:
        assert [out.token_ids for out in llm.generate(prompts, GREEDY)] == plain
        stats = llm.engine.speculation.stats()
    finally:
        llm.engine.close()
    for prompt, output in zip(prompts, plain):
        judge_greedy(hf, prompt, output)
    assert 0 < stats["spec_accepted_tokens"] < stats["spec_draft_tokens"], stats
    for tokens, drafts in proposals[::3]:
        assert_drafts_are_the_heads(hf, head, tokens, drafts)


@pytest.mark.parametrize("sizes", [(2, 1), (1, 2)])
def test_the_head_cache_crosses_between_tp_sizes(mtp_model, monkeypatch, sizes):
    """The head's KV and g travel un-sharded between workers of different TP sizes: the
    decode side's first drafts are the head's."""
    from tests.test_handoff_engine import judged_and_freed
    from tests.test_tp_handoff import hand_off

    path, hf, head = mtp_model
    prompts = prompts_for(6, (2, 9, 21))
    proposals = record_proposals(monkeypatch)
    prefill = LLMEngine(EngineConfig(str(path), block_size=4, mode="prefill", max_num_batched_tokens=8,
                                     tensor_parallel_size=sizes[0], speculative_config=MTP))
    decode = LLMEngine(EngineConfig(str(path), block_size=4, mode="decode", tensor_parallel_size=sizes[1],
                                    speculative_config=MTP))
    try:
        final = hand_off(prefill, decode, prompts, GREEDY)
        judged_and_freed(hf, prompts, final, (prefill, decode))
    finally:
        prefill.close()
        decode.close()
    for prompt in prompts:  # each request's first proposal: right after the hand-off
        tokens, drafts = next((t, d) for t, d in proposals if t[:len(prompt)] == prompt)
        assert len(tokens) == len(prompt) + 1 and drafts
        assert_drafts_are_the_heads(hf, head, tokens, drafts)


def test_equal_tp_workers_hand_the_head_cache_off_rank_to_rank(mtp_model, monkeypatch):
    """2 -> 2 workers over shm: each rank sends its own shard of the head's KV and its g."""
    from tests.test_tp_rank_handoff import Pair, parity_run

    path, hf, head = mtp_model
    proposals = record_proposals(monkeypatch)
    pair = Pair(path, "shm", options={"speculative_config": MTP})
    try:
        prompts = parity_run(pair, hf, (2, 9, 21))
    finally:
        pair.close()
    for prompt in prompts:  # each request's first proposal: right after the hand-off
        tokens, drafts = next((t, d) for t, d in proposals if t[:len(prompt)] == prompt)
        assert len(tokens) == len(prompt) + 1 and drafts
        assert_drafts_are_the_heads(hf, head, tokens, drafts)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_mtp_on_cuda_keeps_the_outputs_of_plain_decoding(mtp_model, monkeypatch):
    """On a GPU: verify steps run eagerly, plain decode steps replay graphs that also capture
    the final hidden states the head reads. Drafts accepted and rejected both (scripted as in
    the CPU test); the outputs are plain decoding's on the same device, or ties transformers
    finds, and the drafts are the head's."""
    path, hf, head = mtp_model
    prompts = prompts_for(5)
    plain = [out.token_ids for out in LLM(str(path), block_size=4, device="cuda").generate(prompts, GREEDY)]
    proposals = record_proposals(monkeypatch, {tuple(p): o for p, o in zip(prompts, plain)})
    llm = LLM(str(path), block_size=4, device="cuda", speculative_config=MTP)
    speculated = [out.token_ids for out in llm.generate(prompts, GREEDY)]
    for prompt, output in zip(prompts, speculated):
        judge_greedy(hf, prompt, output)
    stats = llm.engine.speculation.stats()
    assert 0 < stats["spec_accepted_tokens"] < stats["spec_draft_tokens"], stats
    for tokens, drafts in proposals[::3]:
        assert_drafts_are_the_heads(hf, head, tokens, drafts)
