"""The phase is derived from counters, never from the number of tokens in the step."""

from __future__ import annotations

import pytest

from engine.phase import Phase, PhaseError, classify
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams


def test_one_token_prompt_is_a_fresh_prefill():
    assert classify(num_computed_tokens=0, num_prefill_tokens=1, num_tokens=1) is Phase.FRESH_PREFILL


def test_later_chunk_is_a_continued_prefill_even_with_one_token():
    assert classify(7, 8, 8) is Phase.CONTINUED_PREFILL


def test_decode_feeds_exactly_one_token():
    assert classify(8, 8, 9) is Phase.DECODE
    with pytest.raises(PhaseError, match="exactly one token"):
        classify(8, 8, 10)
    with pytest.raises(PhaseError, match="nothing to run"):
        classify(9, 8, 9)


def test_state_received_from_a_prefill_worker_is_a_decode():
    r = Request("r", [4, 5, 6], SamplingParams())
    r.num_prefill_tokens = r.num_computed_tokens = 3  # prefilled elsewhere
    r.output_token_ids.append(9)  # the first token came with the state
    r.status = RequestStatus.DECODING
    assert r.phase() is Phase.DECODE


def test_preempted_request_recomputes_from_zero_state():
    r = Request("r", [4, 5, 6], SamplingParams())
    r.start_prefill()
    r.num_computed_tokens = 3
    r.output_token_ids += [7, 8]
    r.num_computed_tokens = 4
    assert r.phase() is Phase.DECODE
    r.num_computed_tokens = 0  # preempted: blocks and slot dropped
    r.start_prefill()
    assert r.num_prefill_tokens == 5
    assert r.phase() is Phase.FRESH_PREFILL  # reads nothing from the dropped slot
    r.num_computed_tokens = 2
    assert r.phase() is Phase.CONTINUED_PREFILL
    r.num_computed_tokens = 4
    assert r.phase() is Phase.CONTINUED_PREFILL  # last chunk of a recompute is still a prefill


def test_status_order():
    assert RequestStatus.WAITING < RequestStatus.DECODING < RequestStatus.FINISHED_STOPPED
    assert all(s.finished for s in RequestStatus if s >= RequestStatus.FINISHED_STOPPED)
    assert not any(s.finished for s in RequestStatus if s < RequestStatus.FINISHED_STOPPED)


def test_decode_tokens_are_a_slice_only_when_every_token_is_a_decode_rows():
    """Mixers index decode tokens with batch.decode_tokens: the whole batch as a slice (views,
    no gathers) only when it holds decode rows alone; any prefill row makes it the index."""
    import torch

    from engine.models.batch import ForwardBatch

    def batch(phases, starts):
        n = len(phases)
        return ForwardBatch(
            input_ids=torch.zeros(starts[-1], dtype=torch.long), positions=torch.zeros(starts[-1], dtype=torch.long),
            query_starts=starts, context_lens=[4] * n, phases=phases, state_slots=list(range(n)),
            block_tables=torch.zeros(n, 1, dtype=torch.long), kv_write_index=torch.zeros(starts[-1], dtype=torch.long),
            block_size=16, logits_indices=torch.tensor(starts[1:]) - 1)

    assert batch([Phase.DECODE] * 3, [0, 1, 2, 3]).decode_tokens == slice(None)
    mixed = batch([Phase.DECODE, Phase.FRESH_PREFILL, Phase.DECODE], [0, 1, 4, 5])
    assert torch.equal(mixed.decode_tokens, torch.tensor([0, 4]))
