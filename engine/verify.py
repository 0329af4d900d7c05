"""A speculating engine's side of each step (engine.speculative says what speculation is):
drafts before the schedule, each VERIFY row's state kept in its scratch slot before the
forward, and after it the drafts the target keeps, the state rolled back where it did not.

Owned by an LLMEngine whose config has a speculative_config; the engine's step hands over to
`Speculation.step`, which runs the engine's own step between the drafting and the measuring.
"""

from __future__ import annotations

import time

import torch

from engine.output import RequestOutput
from engine.phase import Phase
from engine.request import Request, RequestStatus
from engine.scheduler import ScheduledSeq, scratch_owner
from engine.speculative import (NgramProposer, Proposer, SpeculationGovernor, SpeculationStats, SpeculativeConfig,
                                accepted_prefix)

DECODING = RequestStatus.DECODING


def make_proposer(config: SpeculativeConfig, engine) -> Proposer:
    if config.method == "mtp":  # the engine's own: it observes every pass, speculating or not
        return engine.mtp
    if config.method == "draft_model":
        from engine.draft_model import DraftModelProposer

        return DraftModelProposer(config, engine)
    return NgramProposer(config)


class Speculation:
    def __init__(self, config: SpeculativeConfig, engine):
        self.config = config
        self.engine = engine
        self.proposer = make_proposer(config, engine)
        self.governor = SpeculationGovernor() if config.adaptive else None
        self.counts = SpeculationStats(config.num_speculative_tokens)

    def step(self) -> list[RequestOutput]:
        """The engine's step, drafting first where the governor says it pays, and timed for it."""
        engine = self.engine
        started = time.perf_counter()
        decoding = [r for r in engine.scheduler.running if r.status is DECODING]
        if decoding and (self.governor is None or self.governor.drafting(len(decoding))):
            self.propose(decoding)
        plan = engine.schedule()
        if not plan.seqs:
            return []
        scratch = [s for s in plan.seqs if s.scratch_slot is not None]
        # What the governor measures is a step that verified drafts, not one that looked for some
        # and found none (that is a plain step, and the first steps after a prefill run cold).
        verifies = any(s.phase is Phase.VERIFY and s.request.draft_token_ids for s in plan.seqs)
        try:
            stepped = engine._step(plan, scratch)
        finally:
            for seq in scratch:
                engine.slots.free(scratch_owner(seq.request.request_id))
        if self.governor is not None and all(s.phase in (Phase.DECODE, Phase.VERIFY) for s in plan.seqs):
            self.governor.record(verifies, time.perf_counter() - started,
                                 sum(len(out.new_token_ids) for out in stepped), len(decoding))
        return stepped

    def propose(self, requests: list[Request]) -> None:
        """Drafts for each of these decoding requests, within its length; under a grammar, cut
        where the grammar would refuse a draft (verification would reject it anyway)."""
        engine = self.engine
        limits = [min(r.sampling_params.max_tokens, engine.max_model_len - r.num_prompt_tokens) - r.num_output_tokens - 1
                  for r in requests]
        for request, drafts in zip(requests, self.proposer.propose_all(requests, limits)):
            if drafts and request.grammar is not None:
                drafts = drafts[:request.grammar.valid_prefix(drafts)]
            request.draft_token_ids = drafts

    def keep_state(self, seqs: list[ScheduledSeq]) -> None:
        """Before a VERIFY step: each row's state, copied to its scratch slot to roll back to."""
        engine = self.engine
        engine.runner.copy_state([(seq.slot, seq.scratch_slot) for seq in seqs])
        for seq in seqs:
            engine.slots.mark_written(scratch_owner(seq.request.request_id))

    def verified(self, verified: list[tuple[ScheduledSeq, torch.Tensor]]) -> list[RequestOutput]:
        """For each VERIFY row of a step (with its logits rows): keep the drafts the target picks
        itself, then the target's own next token. Where a draft is rejected and state layers
        folded it in, the slot's state goes back to what the scratch slot kept (one copy for the
        step's rows), and the accepted tokens run again first in the next step. The greedy rows'
        targets come from one argmax over them all: one read of the device a step, not one a row."""
        engine = self.engine
        greedy = [i for i, (seq, _) in enumerate(verified)
                  if seq.request.argmax_only and seq.request.grammar is None]
        targets = dict(zip(greedy, self._greedy_targets([verified[i][1] for i in greedy])))
        rollback, kept = [], []
        for i, (seq, logits) in enumerate(verified):
            request = seq.request
            drafts = request.draft_token_ids
            tokens, logprobs = targets[i] if i in targets else self.targets(request, drafts, logits)
            request.draft_token_ids = []
            accepted = accepted_prefix(drafts, tokens)
            pending = seq.num_new_tokens - len(drafts)
            if accepted == len(drafts) or seq.scratch_slot is None:
                request.num_computed_tokens += pending + accepted
                request.num_replay_tokens = 0
            else:
                engine.slots.check_readable(scratch_owner(request.request_id), seq.scratch_slot)
                rollback.append((seq.scratch_slot, seq.slot))
                request.num_replay_tokens = pending + accepted
            if drafts:
                self.counts.record(len(drafts), accepted)
            request.status = DECODING
            kept.append((seq, tokens[:accepted + 1], logprobs))
        engine.runner.copy_state(rollback)
        return [self._emit(seq, tokens, logprobs) for seq, tokens, logprobs in kept]

    def _greedy_targets(self, rows: list[torch.Tensor]) -> list[tuple[list[int], list]]:
        """Each greedy VERIFY row's argmax tokens (and no logprobs), from one pass over all."""
        if not rows:
            return []
        ids = self.engine.runner.sampler.greedy(torch.cat(rows) if len(rows) > 1 else rows[0]).token_ids
        out, at = [], 0
        for logits in rows:
            width = logits.shape[0]
            out.append((ids[at:at + width], [None] * width))
            at += width
        return out

    def _emit(self, seq: ScheduledSeq, tokens: list[int], logprobs: list) -> RequestOutput:
        """A verified row's kept tokens to its caller, its filled blocks to the prefix cache."""
        engine, request = self.engine, seq.request
        tracker = engine.trackers[request.request_id]
        for token_id, logprob in zip(tokens, logprobs):
            tracker.append(token_id, logprob)
            if request.finished:
                break
        # Index the blocks the accepted tokens filled (not past a stop among the drafts).
        if engine.prefix_cache is not None and request.num_computed_tokens <= request.num_tokens:
            engine._cache_prefixes([seq])
        out = tracker.output()
        if out.finished:
            engine._retire(request)
        return out

    def targets(self, request: Request, drafts: list[int], logits) -> tuple[list[int], list]:
        """The token the plain decode would draw at each of the verified positions, had the
        drafts before it been its own outputs, with its logprob entry. The sampler's noise for
        an output depends only on its (seed, index), so a seeded request keeps its tokens, and
        a draft is kept exactly when the draw at its position picks it: for a draft proposed
        with certainty (n-gram, a draft model's argmax) that is rejection sampling's acceptance,
        with probability p(draft)."""
        sampler = self.engine.runner.sampler
        outputs, rows = request.output_token_ids, logits.shape[0]
        grammars = request.grammar.after_each(drafts) if request.grammar is not None else None
        sampled = sampler(logits, [request.sampling_params] * rows, [request.prompt_token_ids] * rows,
                          [outputs + drafts[:j] for j in range(rows)], grammars)
        return sampled.token_ids, sampled.logprobs

    def stats(self) -> dict:
        rates = {"spec_governor_tokens_per_s": self.governor.rates()} if self.governor is not None else {}
        return {**self.counts.as_dict(), **rates}


def split_verify_rows(logits, seqs: list[ScheduledSeq]):
    """(the other rows' logits, [(VERIFY seq, its 1 + len(drafts) logits rows)], the other seqs)."""
    plain, verified, rows, at = [], [], [], 0
    for seq in seqs:
        if seq.phase is Phase.VERIFY:
            width = 1 + len(seq.request.draft_token_ids)
            verified.append((seq, logits[at:at + width]))
            at += width
        else:
            plain.append(seq)
            rows.append(at)
            at += 1
    return logits[rows], verified, plain
