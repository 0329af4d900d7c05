"""Speculative decoding (engine.speculative): the n-gram proposer, the VERIFY phase, state
rollback, and greedy outputs token-identical to plain decoding for every family."""

from __future__ import annotations

import random

import pytest

from engine import LLM, SamplingParams
from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.decode_stack import DecodeStack
from engine.llm_engine import LLMEngine
from engine import model_runner
from engine.model_runner import ModelRunner
from engine.models import ssm
from engine.phase import Phase, PhaseError, classify
from engine.request import Request, RequestStatus
from engine.scheduler import Scheduler, scratch_owner
from engine.speculative import NgramProposer, Proposer, SpeculationGovernor, SpeculativeConfig, accepted_prefix
from engine.state_slots import StateSlotAllocator
from engine.verify import Speculation
from tests.conftest import record_calls
from tests.oracle import hf_logits, judge_greedy
from tests.test_handoff_engine import run_disaggregated

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "adaptive": False}  # drafts every step
GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)


# ---------------------------------------------------------------- configuration and proposer

@pytest.mark.parametrize("value, names", [
    ({"method": "eagle", "num_speculative_tokens": 2}, "method"),
    ({"method": "eagle3", "num_speculative_tokens": 2}, "not supported yet"),
    ({"method": "mtp", "num_speculative_tokens": 2, "model": "x"}, "only method 'draft_model'"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "model: required"),
    ({"method": "ngram", "num_speculative_tokens": 2, "model": "x"}, "only method 'draft_model'"),
    ({"method": "ngram"}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 3},
     "prompt_lookup_min"),
    ({"method": "ngram", "num_speculative_tokens": 2, "speculative_tokens": 3}, "speculative_tokens"),
    ("ngram", "dict"),
])
def test_bad_speculative_config_is_refused_naming_the_field(value, names, tmp_path):
    with pytest.raises(ValueError, match=names):
        SpeculativeConfig.of(value)
    with pytest.raises(ValueError, match=names):
        EngineConfig("engine/demo_model", speculative_config=value)


def test_ngram_drafts_follow_the_latest_longest_match():
    proposer = NgramProposer(SpeculativeConfig("ngram", 3, prompt_lookup_max=3, prompt_lookup_min=1))
    # the 3-gram (1, 2, 3) occurred at 0 and at 4: the latest earlier one wins
    assert proposer.propose("a", [1, 2, 3, 9, 1, 2, 3, 7, 8], [1, 2, 3], 10) == [7, 8, 1]
    assert proposer.propose("a", [1, 2, 3, 9, 1, 2, 3, 7, 8], [1, 2, 3, 7], 10) == [8, 1, 2]  # appended
    assert proposer.propose("b", [5, 6, 7], [], 10) == []  # nothing repeats
    assert proposer.propose("c", [4, 5, 4, 5], [4], 1) == [5]  # the limit (max_tokens left)
    assert proposer.propose("d", [4, 5, 4], [], 0) == []
    # token 256's bytes contain token 1's: a match must start on a token boundary
    assert proposer.propose("e", [256, 1, 0, 0, 0, 7, 1], [], 2) == [0, 0]
    proposer.forget("a")
    assert "a" not in proposer._contexts


def test_the_governor_drafts_where_drafting_is_faster_and_keeps_probing():
    governor = SpeculationGovernor(probe_steps=2, period=10)
    modes = []
    for _ in range(40):
        drafting = governor.drafting()
        modes.append(drafting)
        governor.record(drafting, 1.0, 3 if drafting else 1)  # drafting emits 3x the tokens
    assert modes[:4] == [True, True, False, False]  # both measured first
    assert modes[4:].count(False) == 6 and modes[4:].count(True) == 30  # 2 probes each period of 10
    slow, modes = SpeculationGovernor(probe_steps=2, period=10), []
    for _ in range(40):
        modes.append(slow.drafting())
        slow.record(modes[-1], 2.0 if modes[-1] else 1.0, 1)  # drafts that never hit: slower steps
    assert modes[4:].count(True) == 6 and slow.rates() == {"rows 1": {"drafting": 0.5, "plain": 1.0}}
    # each load keeps its own: at 16 rows drafting is measured afresh, so it drafts first
    assert slow.drafting(16) is True and "rows 16-31" not in slow.rates()
    with pytest.raises(ValueError, match="adaptive"):
        SpeculativeConfig("ngram", 2, adaptive="yes")


def test_accepted_prefix():
    assert accepted_prefix([4, 5, 6], [4, 5, 6, 7]) == 3
    assert accepted_prefix([4, 5, 6], [4, 9, 6, 7]) == 1
    assert accepted_prefix([], [3]) == 0


def test_verify_phase_is_derived_from_the_counters():
    assert classify(10, 8, 11, 0, 3) is Phase.VERIFY
    assert classify(8, 8, 11, 2, 0) is Phase.VERIFY  # a replay alone
    assert classify(10, 8, 11, 0, 0) is Phase.DECODE
    with pytest.raises(PhaseError, match="exactly 3"):
        classify(9, 8, 11, 2, 1)  # counters that disagree on what is pending
    assert classify(4, 8, 11, 0, 3) is Phase.CONTINUED_PREFILL  # drafts never reach a prefill


def decoding(request_id: str, prompt: int, outputs: int) -> Request:
    request = Request(request_id, list(range(prompt)), GREEDY)
    request.start_prefill()
    request.output_token_ids = list(range(outputs))
    request.num_computed_tokens = prompt + outputs - 1
    request.status = RequestStatus.DECODING
    return request


def test_scheduler_fits_drafts_to_budget_blocks_and_free_slots():
    blocks, slots = BlockManager(16, 4), StateSlotAllocator(3)
    scheduler = Scheduler(blocks, slots, max_num_batched_tokens=4, verify_needs_scratch=True)
    request = decoding("a", 6, 2)
    blocks.allocate("a", 8)
    slots.allocate("a")
    scheduler.running.append(request)
    request.draft_token_ids = [1, 2, 3, 4, 5]
    (seq,) = scheduler.schedule().seqs
    assert seq.phase is Phase.VERIFY and seq.num_new_tokens == 4  # 1 pending + 3 drafts: the budget
    assert request.draft_token_ids == [1, 2, 3] and slots.slot_of[scratch_owner("a")] == seq.scratch_slot
    assert len(seq.block_table) == 3  # the drafts' KV rows have blocks
    scheduler.release(request)
    assert slots.num_free_slots == 3  # the scratch slot went back with the request's own

    # A free slot goes to a waiting request before it goes to a draft.
    request = decoding("b", 6, 2)
    blocks.allocate("b", 8)
    slots.allocate("b")
    slots.allocate("c")
    scheduler.running.append(request)
    scheduler.add(Request("w", [1, 2], GREEDY))
    request.draft_token_ids = [1, 2]
    seqs = scheduler.schedule().seqs
    assert seqs[0].phase is Phase.DECODE and request.draft_token_ids == []


# ---------------------------------------------------------------- exactness, every family

def prompts_for(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 300) for _ in range(n)] for n in (1, 6, 11, 30)] + [[5, 6, 5, 6, 5]]


class ScriptedProposer(Proposer):
    """Drafts that are the plain decode's own next tokens, each replaced by a wrong one with
    probability `miss`: tiny random models rarely repeat their context, so n-gram drafts
    would almost never hit them, and the verify and rollback paths need both outcomes."""

    def __init__(self, prompts, plain, k: int = 4, miss: float = 0.3):
        super().__init__(SpeculativeConfig("ngram", k))
        self.script = {tuple(p): out for p, out in zip(prompts, plain)}
        self.rng = random.Random(0)
        self.miss = miss

    def propose(self, request_id, prompt, outputs, limit):
        ahead = self.script[tuple(prompt)][len(outputs):len(outputs) + min(self.config.num_speculative_tokens, limit)]
        return [t if self.rng.random() > self.miss else (t + 1) % 300 for t in ahead]


def scripted(path, prompts, params=None, plain=None, **options):
    """generate() with ScriptedProposer drafts, against the plain decode's outputs."""
    params = params or GREEDY
    plain = plain or generate(path, prompts, params, **options)[0]
    llm = LLM(str(path), block_size=4, speculative_config=NGRAM, **options)
    llm.engine.speculation.proposer = ScriptedProposer(prompts, plain)
    outs = [o.token_ids for o in llm.generate(prompts, params)]
    llm.engine.check_integrity()
    assert llm.engine.slots.num_free_slots == llm.engine.slots.num_slots  # scratch slots included
    return outs, plain, llm.engine.stats()


def generate(path, prompts, params=GREEDY, **options):
    llm = LLM(str(path), block_size=4, **options)
    outs = llm.generate(prompts, params)
    llm.engine.check_integrity()
    assert llm.engine.slots.num_free_slots == llm.engine.slots.num_slots  # scratch slots included
    return [o.token_ids for o in outs], llm.engine.stats()


def test_greedy_with_speculation_is_token_identical_for_every_family(family_model, monkeypatch):
    family, path, hf = family_model
    prompts = prompts_for(3)
    as_decode_rows = record_calls(monkeypatch, model_runner, "verify_host_batch")
    speculated, plain, stats = scripted(path, prompts)
    assert as_decode_rows  # each VERIFY step ran as consecutive decode rows of its slot
    assert speculated == plain
    for prompt, output in zip(prompts, speculated):
        judge_greedy(hf, prompt, output)
    # drafts were accepted, and rejected ones rolled back
    assert 0 < stats["spec_accepted_tokens"] < stats["spec_draft_tokens"], stats


@pytest.mark.parametrize("name", ["jamba", "mamba2", "qwen3_next", "lfm2", "kimi_linear"])
@pytest.mark.parametrize("kernels", ["C++", "torch references"])
def test_verify_rows_on_the_layer_path_keep_the_outputs(name, kernels, model_factory, monkeypatch):
    """Off the CPU's one-call decode stack (as on a GPU, or under tensor parallelism) each
    layer's own decode path runs the verify's rows, its state kernels told that adjacent rows
    share a slot (engine.kernels.slot_runs): the C++ kernels, or the torch references."""
    path, _ = model_factory(name)
    prompts = prompts_for(3)
    if kernels != "C++":
        monkeypatch.setenv("SPLITSERVE_DISABLE_CPU_KERNELS", "1")
    plain = generate(path, prompts)[0]
    monkeypatch.setattr(DecodeStack, "plan", lambda self, batch, caches: None)
    as_decode_rows = record_calls(monkeypatch, model_runner, "verify_host_batch")
    conv_runs, conv = [], ssm.causal_conv1d_update  # every one of these layers has a conv
    monkeypatch.setattr(ssm, "causal_conv1d_update",
                        lambda *args, **kwargs: conv_runs.append(kwargs["slot_runs"]) or conv(*args, **kwargs))
    speculated, _, stats = scripted(path, prompts, plain=plain)
    assert speculated == plain
    assert as_decode_rows and 0 < stats["spec_accepted_tokens"] < stats["spec_draft_tokens"], stats
    if kernels != "C++":  # (the C++ path runs each mixer as one call, its conv inside)
        assert any(conv_runs)


@pytest.mark.parametrize("name", ["jamba", "mamba2", "qwen3_next", "lfm2", "kimi_linear", "nemotron_h"])
def test_a_rejected_draft_left_in_the_state_changes_the_output(name, model_factory, monkeypatch):
    """The stale-state mutation: skip the copy back from the scratch slot and the outputs go
    wrong, so the parity above depends on the rollback."""
    path, _ = model_factory(name)
    prompts = prompts_for(3)
    original = Speculation.verified

    def without_rollback(self, verified):
        copy = self.engine.runner.copy_state
        self.engine.runner.copy_state = lambda pairs: None
        try:
            return original(self, verified)
        finally:
            self.engine.runner.copy_state = copy

    plain = generate(path, prompts)[0]
    monkeypatch.setattr(Speculation, "verified", without_rollback)
    speculated, _, _ = scripted(path, prompts, plain=plain)
    assert speculated != plain


def test_a_steps_rollbacks_are_one_copy_and_its_greedy_targets_one_read(model_factory, monkeypatch):
    """The rows a step rolls back go back in one state copy, and the greedy rows' targets come
    from one argmax over all of them (on a GPU, one read of the device a step)."""
    path, _ = model_factory("jamba")
    prompts = prompts_for(3)
    rollbacks, verified, copy = [], Speculation.verified, ModelRunner.copy_state

    def verifying(self, rows):  # the copies made while a step's rows are verified: the rollbacks
        monkeypatch.setattr(ModelRunner, "copy_state", lambda runner, pairs: rollbacks.append(pairs) or copy(runner, pairs))
        try:
            return verified(self, rows)
        finally:
            monkeypatch.setattr(ModelRunner, "copy_state", copy)

    monkeypatch.setattr(Speculation, "verified", verifying)
    argmaxes = record_calls(monkeypatch, Speculation, "_greedy_targets")
    speculated, plain, _ = scripted(path, prompts)
    assert speculated == plain
    steps = len(argmaxes)  # one a verified step
    assert len(rollbacks) <= steps and any(len(pairs) > 1 for pairs in rollbacks), rollbacks
    assert any(len(rows) > 1 for _, rows in argmaxes)


@pytest.mark.parametrize("name", ["jamba", "llama"])
def test_speculation_with_preemption_prefix_caching_and_plain_rows(name, model_factory):
    """Speculating rows beside sampled ones, under preemption and with the prefix cache: the
    greedy outputs stay the plain decode's, the seeded sampled ones stay theirs."""
    path, _ = model_factory(name)
    prompts = prompts_for(8) * 2
    params = [GREEDY if i % 2 == 0 else SamplingParams(max_tokens=40, temperature=0.8, seed=i, ignore_eos=True)
              for i in range(len(prompts))]
    options = dict(num_kv_blocks=40, max_num_batched_tokens=24, enable_prefix_caching=True)
    speculated, plain, stats = scripted(path, prompts, params, **options)
    assert speculated == plain
    assert stats["preemptions"] > 0 and stats["spec_accepted_tokens"] > 0, stats


def test_ngram_speculation_end_to_end_on_the_demo_model():
    """The real proposer on a model that repeats: most drafts hit, and outputs are unchanged."""
    prompt = "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return a + b\n\ndef add(a, b):\n"
    prompts = [prompt, "hello world " * 20, "x"]
    plain, _ = generate("engine/demo_model", prompts)
    speculated, stats = generate("engine/demo_model", prompts, speculative_config=NGRAM)
    assert speculated == plain
    assert stats["spec_accepted_tokens"] > stats["spec_draft_tokens"] / 2, stats


def test_stops_inside_the_accepted_drafts(model_factory):
    path, _ = model_factory("jamba")
    prompts = prompts_for(3)
    stop = generate(path, prompts)[0][1][5]
    params = SamplingParams(max_tokens=13, temperature=0.0, stop_token_ids=[stop])
    got, expected, _ = scripted(path, prompts, params)
    assert got == expected and expected[1][-1] == stop
    assert all(len(out) <= 13 for out in got)


def test_decode_worker_speculates_after_the_handoff(model_factory):
    path, hf = model_factory("jamba")
    prompts = prompts_for(3)
    plain, _ = generate(path, prompts)
    engines = (LLMEngine(EngineConfig(str(path), block_size=4, mode="prefill", max_num_batched_tokens=16)),
               LLMEngine(EngineConfig(str(path), block_size=4, mode="decode", speculative_config=NGRAM)))
    engines[1].speculation.proposer = ScriptedProposer(prompts, plain)
    outs = run_disaggregated(path, prompts, GREEDY, engines=engines)
    assert [o.token_ids for o in outs] == plain
    assert engines[1].stats()["spec_accepted_tokens"] > 0
    assert engines[0].speculation is None  # a prefill worker never speculates


def test_tensor_parallel_ranks_verify_and_roll_back_together(model_factory):
    """Every rank runs the VERIFY rows and copies its state shard back on a rejection."""
    path, hf = model_factory("jamba")
    prompts = prompts_for(4)
    speculated, plain, stats = scripted(path, prompts, tensor_parallel_size=2)
    assert speculated == plain
    assert 0 < stats["spec_accepted_tokens"] < stats["spec_draft_tokens"], stats
    # A draft model runs whole on rank 0 beside the sharded target.
    draft, _ = model_factory("mamba")
    short = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    drafted, stats = generate(path, prompts[2:4], short, tensor_parallel_size=2, speculative_config=draft_config(draft))
    assert drafted == [out[:12] for out in plain[2:4]] and stats["spec_draft_tokens"] > 0, stats


def test_seeded_sampling_with_penalties_and_logprobs_keeps_its_tokens(model_factory):
    """A seeded draw depends only on (seed, output index): verified positions draw what the
    plain decode draws, penalties see the drafts before them, logprobs come out the same."""
    path, _ = model_factory("jamba")
    prompts = prompts_for(5)
    params = SamplingParams(max_tokens=30, temperature=0.9, top_p=0.9, seed=7, logprobs=2,
                            presence_penalty=0.3, frequency_penalty=0.2, ignore_eos=True)
    plain = LLM(str(path), block_size=4).generate(prompts, params)
    llm = LLM(str(path), block_size=4, speculative_config=NGRAM)
    llm.engine.speculation.proposer = ScriptedProposer(prompts, [o.token_ids for o in plain])
    speculated = llm.generate(prompts, params)
    assert [o.token_ids for o in speculated] == [o.token_ids for o in plain]
    for ours, theirs in zip(speculated, plain):
        assert [lp["token"] for lp in ours.logprobs] == pytest.approx([lp["token"] for lp in theirs.logprobs], abs=1e-4)
    stats = llm.engine.stats()
    assert 0 < stats["spec_accepted_tokens"] < stats["spec_draft_tokens"], stats


def test_sampled_outputs_keep_the_target_distribution(model_factory):
    """Chi-square over the joint (first, second) token of unseeded draws at top_k=3: the
    second is drawn in a verify step against a draft of the greedy token, and must follow the
    target's distribution, computed here from transformers' logits."""
    import torch

    path, hf = model_factory("llama")
    prompt, top_k, samples = [11, 42, 7, 99], 3, 2000
    params = SamplingParams(max_tokens=3, temperature=1.0, top_k=top_k, ignore_eos=True)

    class GreedyDrafts(Proposer):
        def propose(self, request_id, prompt_ids, outputs, limit):
            return [int(hf_logits(hf, prompt_ids + outputs)[-1].argmax())][:limit]

    def top(ids):
        logits = hf_logits(hf, ids)[-1]
        values, tokens = logits.topk(top_k)
        return dict(zip(tokens.tolist(), torch.softmax(values, -1).tolist()))

    expected = {(a, b): pa * pb for a, pa in top(prompt).items() for b, pb in top(prompt + [a]).items()}
    drafts = GreedyDrafts(SpeculativeConfig("ngram", 1))
    cached = {}
    drafts.propose = lambda rid, p, o, limit: cached.setdefault(tuple(o), GreedyDrafts.propose(drafts, rid, p, o, limit))
    torch.manual_seed(0)
    llm = LLM(str(path), block_size=4, max_num_seqs=256,
              speculative_config={"method": "ngram", "num_speculative_tokens": 1, "adaptive": False})
    llm.engine.speculation.proposer = drafts
    counts: dict = {}
    for out in llm.generate([prompt] * samples, params):
        key = tuple(out.token_ids[:2])  # the third follows an accepted draft or a rejection's redraw
        counts[key] = counts.get(key, 0) + 1
    stats = llm.engine.stats()
    assert 0 < stats["spec_accepted_tokens"] < stats["spec_draft_tokens"], stats
    assert set(counts) <= set(expected)
    chi2 = sum((counts.get(key, 0) - samples * p) ** 2 / (samples * p) for key, p in expected.items())
    assert chi2 < 26.12, (chi2, counts, expected)  # chi-square, 8 degrees of freedom, p = 0.001


def test_structured_outputs_speculate_with_drafts_the_grammar_refuses_cut(api_model_path):
    """Under a JSON schema a draft the grammar refuses is cut before verification, and each
    verified position is sampled under the mask of the grammar after the drafts before it:
    greedy and seeded outputs stay the plain decode's, and stay valid."""
    from tests.test_structured import BOUNDED, PROMPT, check

    specs = [(spec, seed) for spec in BOUNDED.values() for seed in range(2)]  # seed 0 greedy, 1 sampled
    params = [SamplingParams(max_tokens=120, temperature=float(seed), seed=seed, structured_output=spec)
              for spec, seed in specs]
    prompts = [PROMPT + " " * i for i in range(len(specs))]  # distinct prompts: the script's keys
    llm = LLM(api_model_path, block_size=4, num_kv_blocks=400)
    plain = [o.token_ids for o in llm.generate(prompts, params)]
    tokenized = [llm.engine.tokenize(p) for p in prompts]
    spec_llm = LLM(api_model_path, block_size=4, num_kv_blocks=400, speculative_config=NGRAM)
    proposer = ScriptedProposer(tokenized, plain, miss=0.5)
    proposed, propose = [], proposer.propose

    def counted(*args):
        drafts = propose(*args)
        proposed.append(len(drafts))
        return drafts

    proposer.propose = counted
    spec_llm.engine.speculation.proposer = proposer
    outs = spec_llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == plain
    for (spec, _), out in zip(specs, outs):
        if out.finish_reason == "stop":
            check(spec, out.text)
    stats = spec_llm.engine.stats()
    assert 0 < stats["spec_accepted_tokens"] < stats["spec_draft_tokens"] < sum(proposed), (stats, sum(proposed))


def test_a_resumed_request_speculates_from_what_its_caller_has(model_factory):
    """A retry resumes from the tokens already delivered (engine.request.Resume): they are
    recomputed with the prompt, and speculation then goes on exactly as plain decoding would."""
    from engine.request import Resume

    path, _ = model_factory("jamba")
    prompts = prompts_for(6)
    plain, _ = generate(path, prompts)
    llm = LLM(str(path), block_size=4, speculative_config=NGRAM)
    llm.engine.speculation.proposer = ScriptedProposer(prompts, plain)
    for i, (prompt, expected) in enumerate(zip(prompts, plain)):
        llm.engine.add_request(prompt, GREEDY, request_id=f"resumed-{i}", resume=Resume(tuple(expected[:7])))
    finals = {}
    while llm.engine.has_unfinished():
        for out in llm.engine.step():
            if out.finished:
                finals[out.request_id] = out.token_ids
    assert [finals[f"resumed-{i}"] for i in range(len(prompts))] == plain
    assert llm.engine.stats()["spec_accepted_tokens"] > 0


# ---------------------------------------------------------------- draft models

def draft_config(path, k: int = 3) -> dict:
    return {"method": "draft_model", "model": str(path), "num_speculative_tokens": k, "adaptive": False}


@pytest.mark.parametrize("target, draft", [("jamba", "jamba"), ("jamba", "mamba"), ("llama", "llama"),
                                           ("qwen3_next", "lfm2")])
def test_a_draft_model_keeps_the_outputs_and_drafts_its_own_argmax(target, draft, model_factory, monkeypatch):
    """Greedy and seeded outputs stay the plain decode's. Every proposal is the draft model's
    greedy continuation of the request's tokens as they were, judged by transformers: the draft
    prefilled the prompt itself, caught up with what the target kept and rolled its own state
    back past what the target rejected (seeded sampling makes the target reject often)."""
    from engine.draft_model import DraftModelProposer

    target_path, _ = model_factory(target)
    draft_path, draft_hf = model_factory(draft)
    prompts = prompts_for(9)
    params = [GREEDY if i % 2 else SamplingParams(max_tokens=40, temperature=1.0, seed=i, ignore_eos=True)
              for i in range(len(prompts))]
    plain, _ = generate(target_path, prompts, params)
    proposals, original = [], DraftModelProposer.propose_all

    def recorded(self, requests, limits):
        drafts = original(self, requests, limits)
        proposals.extend((r.all_token_ids, d) for r, d in zip(requests, drafts) if d)
        return drafts

    monkeypatch.setattr(DraftModelProposer, "propose_all", recorded)
    speculated, stats = generate(target_path, prompts, params, speculative_config=draft_config(draft_path))
    assert speculated == plain
    assert stats["spec_draft_tokens"] > 0 and (stats["spec_accepted_tokens"] > 0 or target != draft), stats
    for context, drafts in proposals:
        judge_greedy(draft_hf, context, drafts)


def test_a_draft_model_keeps_every_familys_outputs(family_model):
    """draft_model on every family, the model its own draft (so most drafts are accepted):
    greedy outputs token-identical to plain decoding, judged by transformers."""
    family, path, hf = family_model
    prompts = prompts_for(10)[:3]
    plain, _ = generate(path, prompts)
    speculated, stats = generate(path, prompts, speculative_config=draft_config(path))
    assert speculated == plain
    for prompt, output in zip(prompts, speculated):
        judge_greedy(hf, prompt, output)
    assert stats["spec_accepted_tokens"] > stats["spec_draft_tokens"] / 2, stats


def test_a_draft_that_keeps_rejected_drafts_in_its_state_proposes_wrong_tokens(model_factory, monkeypatch):
    """The stale-state mutation of the draft: a recurrent draft that rolls back its counters
    but not its state (as an attention-only draft may) stops proposing its own argmax."""
    from engine.draft_model import DraftModelProposer

    init = DraftModelProposer.__init__

    def counters_only(self, *args):
        init(self, *args)
        self.rolls_back = False

    monkeypatch.setattr(DraftModelProposer, "__init__", counters_only)
    with pytest.raises(AssertionError, match="transformers"):
        test_a_draft_model_keeps_the_outputs_and_drafts_its_own_argmax("jamba", "jamba", model_factory, monkeypatch)


def test_a_draft_with_another_vocabulary_is_refused_naming_it(model_factory, api_model_path):
    path, _ = model_factory("jamba")
    with pytest.raises(ValueError, match="vocab_size 4096 differs from the target's 320"):
        LLM(str(path), speculative_config=draft_config("engine/demo_model"))
    with pytest.raises(ValueError, match="has no tokenizer.json and the target has"):
        LLM(str(api_model_path), speculative_config=draft_config(path))


def test_a_decode_worker_prefills_its_draft_after_the_handoff(model_factory):
    path, _ = model_factory("jamba")
    draft, _ = model_factory("mamba")
    prompts = prompts_for(3)
    plain, _ = generate(path, prompts)
    engines = (LLMEngine(EngineConfig(str(path), block_size=4, mode="prefill", max_num_batched_tokens=16)),
               LLMEngine(EngineConfig(str(path), block_size=4, mode="decode", speculative_config=draft_config(draft))))
    outs = run_disaggregated(path, prompts, GREEDY, engines=engines)
    assert [o.token_ids for o in outs] == plain
    proposer = engines[1].speculation.proposer
    assert engines[1].stats()["spec_draft_tokens"] > 0 and not proposer.mirrors
    assert proposer.slots.num_free_slots == proposer.slots.num_slots  # every draft slot given back
    proposer.blocks.check_integrity()
    assert proposer.blocks.num_available_blocks == proposer.blocks.num_blocks
