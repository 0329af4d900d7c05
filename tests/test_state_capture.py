"""A prefill chunk that crosses prefix-cache save points runs as one pass: each recurrent layer
runs the row's tokens in segments and leaves the state at each save point in its checkpoint row
(engine.models.batch.StateSpans), instead of the step running one pass per piece."""

from __future__ import annotations

import random

import pytest
import torch

from engine import LLM, SamplingParams
from engine.models.batch import ForwardBatch
from engine.phase import Phase
from engine.prefix_cache import block_hashes
from tests.conftest import record_calls
from tests.oracle import assert_same_tokens, judge_greedy

BLOCK = 4
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def tokens(rng, n, vocab):
    return [rng.randrange(3, vocab) for _ in range(n)]


def batch_of(phases, lens, slots, captures=()) -> ForwardBatch:
    starts = [0]
    for n in lens:
        starts.append(starts[-1] + n)
    total = starts[-1]
    return ForwardBatch(input_ids=torch.zeros(total, dtype=torch.long), positions=torch.zeros(total, dtype=torch.long),
                        query_starts=starts, context_lens=list(lens), phases=list(phases), state_slots=list(slots),
                        block_tables=torch.zeros(len(lens), 1, dtype=torch.long),
                        kv_write_index=torch.zeros(total, dtype=torch.long), block_size=BLOCK,
                        logits_indices=torch.tensor(starts[1:]) - 1, state_captures=tuple(captures))


def test_segments_split_captured_rows_into_rounds():
    fresh, cont, dec = Phase.FRESH_PREFILL, Phase.CONTINUED_PREFILL, Phase.DECODE
    # row 0 fresh, 10 tokens, captured after 4 (into state row 7) and 8 (row 8); row 1 decodes;
    # row 2 continues for 3 tokens, uncaptured.
    batch = batch_of([fresh, dec, cont], [10, 1, 3], [0, 1, 2], [(0, 8, 8), (0, 4, 7)])
    spans = batch.state_spans
    assert spans.bounds == [0, 4, 8, 10, 11, 14]
    as_tuples = [[(s.start, s.end, s.src, s.dst, s.fresh) for s in r] for r in spans.rounds]
    assert as_tuples == [[(0, 4, 0, 7, True), (11, 14, 2, 2, False)], [(4, 8, 7, 8, False)], [(8, 10, 8, 0, False)]]
    assert [spans.bounds[s.index] for r in spans.rounds for s in r] == [0, 11, 4, 8]

    # each segment finds the state its predecessor left: `prepare` copies it into its row
    pool = torch.zeros(9, 2)
    pool[2] = 5.0
    order = []
    for segment in spans.segments(pool):
        order.append(segment.dst)
        if not segment.fresh:
            assert torch.equal(pool[segment.dst], pool[segment.src])
        pool[segment.dst] = pool[segment.dst] + segment.end - segment.start  # "runs" the tokens
    assert order == [7, 2, 8, 0]
    assert pool[7].tolist() == [4, 4] and pool[8].tolist() == [8, 8] and pool[0].tolist() == [10, 10]
    assert pool[2].tolist() == [8, 8]

    for bad in [(0, 0, 7), (0, 10, 7), (1, 1, 7)]:  # no tokens before, none after, a decode row
        with pytest.raises(ValueError, match="state capture"):
            _ = batch_of([fresh, dec, cont], [10, 1, 3], [0, 1, 2], [bad]).state_spans


def _two_engines(path):
    """Alike but for how a chunk crossing save points runs: one pass with captures (the
    engine's default), or passes that end at the points."""
    one = LLM(path, block_size=BLOCK, enable_prefix_caching=True, prefix_checkpoints=8)
    pieces = LLM(path, block_size=BLOCK, enable_prefix_caching=True, prefix_checkpoints=8)
    pieces.engine.scheduler.split_at_save_points = True
    return one, pieces


def test_one_pass_leaves_the_checkpoints_the_pieces_did(family_model, monkeypatch):
    family, path, hf = family_model
    one, pieces = _two_engines(path)
    if not one.engine.prefix_cache.needs_state:
        pytest.skip(f"{family}: no recurrent layers, so no save points")
    vocab = hf.config.vocab_size
    rng = random.Random(31)
    system = tokens(rng, 13, vocab)
    first, second = system + tokens(rng, 5, vocab), system + tokens(rng, 10, vocab)
    passes = {name: record_calls(monkeypatch, llm.engine.runner, "execute")
              for name, llm in (("one", one), ("pieces", pieces))}
    plain = LLM(path, block_size=BLOCK)
    for prompt in (first, second):
        steps = {name: llm.engine.num_steps for name, llm in (("one", one), ("pieces", pieces))}
        calls = {name: len(c) for name, c in passes.items()}
        outs = {name: llm.generate([prompt], GREEDY)[0] for name, llm in (("one", one), ("pieces", pieces))}
        ref = plain.generate([prompt], GREEDY)[0]
        for out in outs.values():
            assert_same_tokens(hf, prompt, out.token_ids, ref.token_ids)
        judge_greedy(hf, prompt, outs["one"].token_ids)
        # one pass a step with captures; the pieces' prefill step ran more than one
        assert len(passes["one"]) - calls["one"] == one.engine.num_steps - steps["one"]
        assert len(passes["pieces"]) - calls["pieces"] > pieces.engine.num_steps - steps["pieces"]

    # `second` left the shared 12 tokens (a branch point) and its last boundary (20) inside its
    # one prefill chunk: both checkpointed, by both engines, to the same state.
    keys = block_hashes(second, BLOCK, [])
    states = {}
    for name, llm in (("one", one), ("pieces", pieces)):
        engine = llm.engine
        rows = [engine.prefix_cache.nodes[keys[point // BLOCK - 1]].checkpoint for point in (12, 20)]
        assert None not in rows, f"{name}: checkpoints at 12 and 20: {rows}"
        states[name] = [[t[engine.cache.checkpoint_row(r)].clone() for _, t in engine.cache.whole_state_tensors()]
                        for r in rows]
        engine.check_integrity()
    for a, b in zip(states["one"], states["pieces"]):
        for x, y in zip(a, b):
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)

    # and a prompt that hits each of them decodes from it exactly
    for hit in (system[:12] + tokens(rng, 3, vocab), second[:20] + tokens(rng, 2, vocab)):
        out = one.generate([hit], GREEDY)[0]
        assert out.num_cached_tokens in (12, 20)
        assert_same_tokens(hf, hit, out.token_ids, plain.generate([hit], GREEDY)[0].token_ids)
        judge_greedy(hf, hit, out.token_ids)
    one.engine.check_integrity()


def test_a_failed_pass_gives_back_the_rows_it_reserved(model_factory, monkeypatch):
    path, hf = model_factory("jamba")
    llm = LLM(path, block_size=BLOCK, enable_prefix_caching=True, prefix_checkpoints=4)
    engine = llm.engine
    captured = []
    original = engine.runner.execute

    def failing(seqs):
        captured.extend(c for s in seqs for c in s.captures)
        raise RuntimeError("injected")

    monkeypatch.setattr(engine.runner, "execute", failing)
    out = llm.generate([tokens(random.Random(3), 18, hf.config.vocab_size)], GREEDY)[0]
    assert out.finish_reason == "error" and captured  # the prompt's last boundary was to be captured
    engine.check_integrity()  # every checkpoint row free or owned again
    assert engine.prefix_cache.num_checkpoints_used == 0
    monkeypatch.setattr(engine.runner, "execute", original)
    assert llm.generate([[5] * 18], GREEDY)[0].finish_reason == "length"


def _varlen_gated_delta(q, k, v, g, beta, h0, cu_seqlens):
    """What fla's varlen call returns, one sequence at a time (fla needs CUDA)."""
    from engine.kernels import chunk_gated_delta_rule

    bounds = cu_seqlens.tolist()
    outs, finals = [], []
    for i, (start, end) in enumerate(zip(bounds, bounds[1:])):
        o, h = chunk_gated_delta_rule(q[start:end], k[start:end], v[start:end], g[start:end], beta[start:end],
                                      h0[i], 64)
        outs.append(o)
        finals.append(h)
    return torch.cat(outs), torch.stack(finals)


@pytest.mark.parametrize("family", ["mamba", "bamba", "qwen3_next"])
def test_the_varlen_paths_cuda_takes_capture_too(family, model_factory, monkeypatch):
    """The one-call-per-round prefill paths a GPU runs, here on their torch references: Mamba's
    varlen scan (the Triton kernel's definition), Mamba2's varlen SSD (taken with the C++
    kernels off) and Gated DeltaNet's varlen call (fla's contract, a sequence at a time)."""
    from engine.models import gated_deltanet, ssm

    monkeypatch.setenv("SPLITSERVE_DISABLE_CPU_KERNELS", "1")
    monkeypatch.setattr(ssm, "uses_triton", lambda tensor: True)
    monkeypatch.setattr(gated_deltanet, "gated_delta_varlen_available", lambda q, v, g: True)
    monkeypatch.setattr(gated_deltanet, "chunk_gated_delta_rule_varlen", _varlen_gated_delta)
    varlen_calls = record_calls(monkeypatch, *((ssm, "selective_scan_varlen") if family == "mamba"
                                               else (ssm.PrefillRows, "rounds")))
    path, hf = model_factory(family)
    one, pieces = _two_engines(path)
    plain = LLM(path, block_size=BLOCK)
    vocab = hf.config.vocab_size
    rng = random.Random(37)
    system = tokens(rng, 13, vocab)
    # two requests in one step, one of them crossing two save points: three rounds
    prompts = [system + tokens(rng, 5, vocab), tokens(rng, 9, vocab)]
    one.generate(prompts[:1], GREEDY)
    pieces.generate(prompts[:1], GREEDY)
    prompts[0] = system + tokens(rng, 10, vocab)
    refs = plain.generate(prompts, GREEDY)
    for llm in (one, pieces):
        for prompt, out, ref in zip(prompts, llm.generate(prompts, GREEDY), refs):
            assert_same_tokens(hf, prompt, out.token_ids, ref.token_ids)
            judge_greedy(hf, prompt, out.token_ids)
    keys = block_hashes(prompts[0], BLOCK, [])
    for point in (12, 20):
        rows = [llm.engine.prefix_cache.nodes[keys[point // BLOCK - 1]].checkpoint for llm in (one, pieces)]
        assert None not in rows
        for (_, a), (_, b) in zip(one.engine.cache.whole_state_tensors(), pieces.engine.cache.whole_state_tensors()):
            torch.testing.assert_close(a[one.engine.cache.checkpoint_row(rows[0])],
                                       b[pieces.engine.cache.checkpoint_row(rows[1])], rtol=1e-5, atol=1e-5)
    hit = system[:12] + tokens(rng, 3, vocab)
    out = one.generate([hit], GREEDY)[0]
    assert out.num_cached_tokens == 12
    judge_greedy(hf, hit, out.token_ids)
    assert varlen_calls, "the varlen path did not run"
    one.engine.check_integrity()
