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

Under tensor parallelism the head is sharded like the target's layers, and every rank keeps its
shard of the head's KV and a whole g per slot: the proposer runs on rank 0 and tells the other
ranks each step of the head it takes (HeadSteps, the ranks' "mtp" command), so they meet in
the same collectives in the same order.

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


def load_head(model_dir: str, dtype: torch.dtype, device: str, group=None) -> tuple[MTPHead, object]:
    """The checkpoint's head as this rank runs it (its layer sharded over `group` like the
    target's, engine.tp.shard), and the un-sharded cache layer it adds (a LayerCacheSpec)."""
    from engine.models import load_mtp_head
    from engine.models.packed_linear import pack_linears

    head = load_mtp_head(model_dir, dtype, device)
    full = head.cache_spec(dtype)
    if group is not None and group.size > 1:
        from engine.tp.shard import shard_module

        try:
            head.layer = shard_module(head.layer, group)
        except ValueError as e:
            raise ValueError(f"speculative_config.method 'mtp': the head's layer at tensor_parallel_size "
                             f"{group.size}: {e}") from None
    if device == "cpu":
        pack_linears(head)
    return head, full


class HeadSteps:
    """What the head computes on one rank, on that rank's cache: rank 0's proposer takes these
    steps, and a tensor-parallel engine's other ranks take each of them too (engine.tp.ranks)."""

    def __init__(self, head: MTPHead, model, cache, runner, index: int):
        self.head, self.model, self.cache, self.runner, self.index = head, model, cache, runner, index
        self.g: torch.Tensor | None = None  # while proposing: g of each row still drafting

    @property
    def kept(self) -> torch.Tensor:
        """Each slot's g: the head's state tensor in the target's cache."""
        return self.cache.layers.state[self.index][0]

    def run(self, host, hidden: torch.Tensor) -> torch.Tensor:
        """g at every token of the head's rows `host` (a HostBatch), `hidden` the state each
        token follows."""
        batch = self.runner.device_batch(host)
        return self.head(self.model.embed_tokens(batch), hidden, batch, self.cache.layers, self.index)

    def observe(self, host, picked: torch.Tensor, lasts: torch.Tensor, slots: torch.Tensor) -> None:
        """The head over rows `picked` of the target's last pass (runner.last_hidden); g of
        rows `lasts` of it kept in `slots`."""
        hidden = self.runner.last_hidden
        g = self.run(host, hidden.index_select(0, picked.to(hidden.device)))
        g = g.index_select(0, lasts.to(g.device))
        self.kept.index_copy_(0, slots.to(g.device), g.to(self.kept.dtype))

    def start(self, slots: torch.Tensor) -> None:
        self.g = self.kept.index_select(0, slots.to(self.kept.device))

    def logits(self) -> torch.Tensor:
        return self.model.lm_logits(self.g)

    def step(self, host, on: torch.Tensor) -> None:
        """The next g of the rows `on` of the current ones, fed the drafts in `host`."""
        self.g = self.run(host, self.g.index_select(0, on.to(self.g.device)))


class MTPProposer(Proposer):
    def __init__(self, config: SpeculativeConfig, head: MTPHead, engine):
        """`engine`: the LLMEngine whose cache holds the head's layer (engine.cache.spec's last)."""
        super().__init__(config)
        self.engine = engine
        self.index = len(engine.model.layers)  # the head's layer in the target's cache
        self.steps = HeadSteps(head, engine.model, engine.cache, engine.runner, self.index)
        self.mirrors: dict[str, Request] = {}  # the head's view of each request: its tokens shifted by one

    def _take(self, step: str, *args):
        """One of the head's steps, on every rank (the others told first: they meet in its
        collectives)."""
        if self.engine.tp is not None:
            self.engine.tp.send("mtp", step, *args)
        return getattr(self.steps, step)(*args)

    # ------------------------------------------------------------------ after each target pass

    @torch.inference_mode()
    def observe(self, seqs: list[ScheduledSeq], begins: list[int]) -> None:
        """The head over the kept positions of a pass of the target: `begins` each row's first
        position; the pass's final hidden states (a row per token, rows in order) are in the
        runner's last_hidden."""
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
        lasts = torch.tensor([len(p) for p in picked]).cumsum(0) - 1
        self._take("observe", self.engine.runner.host_batch(seqs), torch.cat(picked), lasts,
                   torch.tensor([seq.slot for seq in seqs]))

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
        self._take("start", torch.tensor([engine.slots.slot_of[r.request_id] for r, _ in going]))
        for step in range(max(k for _, k in going)):
            for (request, _), token in zip(going, engine.runner.sampler.greedy(self._take("logits")).token_ids):
                drafts[request.request_id].append(token)
            on = [i for i, (_, k) in enumerate(going) if k > step + 1]
            if not on:
                break
            going = [going[i] for i in on]
            seqs = []
            for request, _ in going:
                self._mirror(request).draft_token_ids = drafts[request.request_id]
                seqs.append(self._seq(request, request.num_tokens - 2 + len(drafts[request.request_id]), 1))
            self._take("step", engine.runner.host_batch(seqs), torch.tensor(on))
        for request in requests:
            if request.request_id in self.mirrors:
                self.mirrors[request.request_id].draft_token_ids = []
        return [drafts[r.request_id] for r in requests]

    def forget(self, request_id: str) -> None:
        self.mirrors.pop(request_id, None)

    # ------------------------------------------------------------------ the head's rows

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
