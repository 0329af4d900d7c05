"""Drafts from the checkpoint's multi-token-prediction head (engine.models.mtp_head).

The head's cache is one more layer of the target's cache, under the target's block tables
and state slots, so it needs no bookkeeping of its own and a hand-off carries it as it
carries the target's layers. Two things happen:

- `observe`, after every forward pass of the target on every worker (a prefill worker's
  too): the head runs over each position the pass ran whose token is kept and whose next
  token is known (a prompt token, the token just sampled, an accepted draft), with the
  target's hidden state there. That fills the head's KV at those positions and leaves in the
  request's slot g of the last one: the prediction of the token after the request's pending
  token. A prefill worker's last chunk ends with the first token sampled, so what it hands
  off holds both, and the decode worker drafts at once.
- `propose_all`, on a speculating worker before a step: the first draft from g in the slot,
  then k - 1 steps of the head, each feeding the draft before and its own g.

The head is attention only, so nothing rolls back: KV the drafts wrote past the kept
positions is overwritten by the next observation, which rewrites g as well. The positions a
VERIFY row ran past its accepted drafts are not observed; the accepted ones are, even where
the target's state rolled back and runs them again (the hidden states were right: each
position saw only the tokens before it).
"""

from __future__ import annotations

import torch

from engine.models.mtp_head import MTPHead
from engine.phase import Phase
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledSeq
from engine.speculative import Proposer, SpeculativeConfig


class MTPProposer(Proposer):
    def __init__(self, config: SpeculativeConfig, head: MTPHead, engine):
        """`engine`: the LLMEngine whose cache holds the head's layer (engine.cache.spec's last)."""
        super().__init__(config)
        self.head = head
        self.engine = engine
        self.index = len(engine.model.layers)  # the head's layer in the target's cache
        self.mirrors: dict[str, Request] = {}  # the head's view of each request: its tokens shifted by one

    # ------------------------------------------------------------------ after each target pass

    @torch.inference_mode()
    def observe(self, seqs: list[ScheduledSeq], begins: list[int], hidden: torch.Tensor) -> None:
        """The head over the kept positions of a pass of the target: `begins` each row's first
        position, `hidden` the pass's final hidden states, a row per token, rows in order."""
        rows, picked, at = [], [], 0
        for seq, begin in zip(seqs, begins):
            request = seq.request
            end = min(begin + seq.num_new_tokens, request.num_tokens - 1)  # the next token is known
            if end > begin and request.request_id in self.engine.requests:
                rows.append((request, begin, end))
                picked.append(torch.arange(at, at + end - begin))
            at += seq.num_new_tokens
        if not rows:
            return
        seqs = [self._seq(request, begin, end - begin) for request, begin, end in rows]
        g = self._run(seqs, hidden.index_select(0, torch.cat(picked).to(hidden.device)))
        lasts = torch.tensor([len(p) for p in picked]).cumsum(0) - 1
        self._keep(seqs, g.index_select(0, lasts.to(g.device)))

    # ------------------------------------------------------------------ the proposer contract

    @torch.inference_mode()
    def propose_all(self, requests: list[Request], limits: list[int]) -> list[list[int]]:
        engine = self.engine
        drafts = {request.request_id: [] for request in requests}
        going = []
        for request, limit in zip(requests, limits):
            k = min(self.config.num_speculative_tokens, limit)
            # The head's drafting steps write KV up to position num_tokens + k - 3, within the
            # blocks the VERIFY step will need anyway.
            if k > 0 and engine.blocks.can_allocate(request.request_id, request.num_tokens + k):
                engine.blocks.allocate(request.request_id, request.num_tokens + k)
                engine.slots.check_readable(request.request_id, engine.slots.slot_of[request.request_id])
                going.append((request, k))
        if not going:
            return [drafts[r.request_id] for r in requests]
        slots = torch.tensor([engine.slots.slot_of[r.request_id] for r, _ in going], device=self._kept.device)
        g = self._kept.index_select(0, slots)
        for step in range(max(k for _, k in going)):
            for (request, _), token in zip(going, self._greedy(g)):
                drafts[request.request_id].append(token)
            on = [i for i, (_, k) in enumerate(going) if k > step + 1]
            if not on:
                break
            going = [going[i] for i in on]
            seqs = []
            for request, _ in going:
                self._mirror(request).draft_token_ids = drafts[request.request_id]
                seqs.append(self._seq(request, request.num_tokens - 2 + len(drafts[request.request_id]), 1))
            g = self._run(seqs, g.index_select(0, torch.tensor(on, device=g.device)))
        for request in requests:
            if request.request_id in self.mirrors:
                self.mirrors[request.request_id].draft_token_ids = []
        return [drafts[r.request_id] for r in requests]

    def forget(self, request_id: str) -> None:
        self.mirrors.pop(request_id, None)

    # ------------------------------------------------------------------ the head's rows

    @property
    def _kept(self) -> torch.Tensor:
        """Each slot's g: the head's state tensor in the target's cache."""
        return self.engine.cache.layers.state[self.index][0]

    def _keep(self, seqs: list[ScheduledSeq], g: torch.Tensor) -> None:
        slots = torch.tensor([seq.slot for seq in seqs], device=g.device)
        self._kept.index_copy_(0, slots, g.to(self._kept.dtype))

    def _mirror(self, request: Request) -> Request:
        """The head's request for `request`: token p of it is the request's token p + 1 (the
        output list shared, so it sees every token the target keeps)."""
        mirror = self.mirrors.get(request.request_id)
        if mirror is None:
            mirror = Request(request.request_id, request.prompt_token_ids[1:], SamplingParams(max_tokens=1))
            mirror.output_token_ids = request.output_token_ids
            self.mirrors[request.request_id] = mirror
        return mirror

    def _seq(self, request: Request, begin: int, num_tokens: int) -> ScheduledSeq:
        """A row of the head: positions [begin, begin + num_tokens) of `request`."""
        mirror = self._mirror(request)
        mirror.num_computed_tokens = begin
        phase = Phase.FRESH_PREFILL if begin == 0 else Phase.DECODE if num_tokens == 1 else Phase.CONTINUED_PREFILL
        engine = self.engine
        return ScheduledSeq(mirror, phase, num_tokens, engine.slots.slot_of[request.request_id],
                            engine.blocks.table(request.request_id))

    def _run(self, seqs: list[ScheduledSeq], hidden: torch.Tensor) -> torch.Tensor:
        """g at every token of these rows of the head, `hidden` the state each token follows."""
        runner = self.engine.runner
        batch = runner.device_batch(runner.host_batch(seqs))
        embedded = self.engine.model.embed_tokens(batch)
        return self.head(embedded, hidden, batch, self.engine.cache.layers, self.index)

    def _greedy(self, g: torch.Tensor) -> list[int]:
        return self.engine.runner.sampler.greedy(self.engine.model.lm_logits(g)).token_ids
