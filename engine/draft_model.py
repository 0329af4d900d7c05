"""Drafts from a smaller model that runs beside the target, on the worker that decodes.

The draft is any model splitserve loads (hybrid or not) with the target's vocabulary and
tokenizer; it proposes its own greedy tokens. It keeps a cache of its own: KV blocks, and
for each request a state slot plus a scratch slot. Each drafting step, for every request
together:

1. catch up: the request's tokens the draft has not run yet (the whole prompt the first time:
   the decode worker prefills the draft itself; a hand-off carries only the target's cache),
   giving the first draft;
2. k - 1 decode steps, each feeding the previous draft.

The draft folds its own drafts into its state, so it rolls back as the target does: after
the catch-up its state is copied to the scratch slot; at the next drafting step, the drafts
the target did not keep are found by comparing them with the request's tokens, and the state
goes back to the copy (the tokens kept then run again in the catch-up). An attention-only
draft only forgets the rejected rows.
"""

from __future__ import annotations

from engine.block_manager import BlockManager
from engine.cache import ModelCache, plan_cache
from engine.model_runner import ModelRunner
from engine.models import load_model
from engine.phase import Phase
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledSeq
from engine.speculative import Proposer, SpeculativeConfig
from engine.state_slots import StateSlotAllocator
from engine.tokenizer import Tokenizer


class DraftModelProposer(Proposer):
    def __init__(self, config: SpeculativeConfig, target):
        """`target`: the LLMEngine the drafts are for (its config, model spec, tokenizer, cache)."""
        super().__init__(config)
        engine_config = target.config
        self.model = load_model(config.model, engine_config.torch_dtype, engine_config.device)
        check_same_vocabulary(target.spec, target.tokenizer, self.model.spec, config.model)
        block_size = engine_config.block_size
        num_slots = 2 * target.slots.num_slots  # a slot and a scratch slot per request
        sizes = plan_cache(self.model.spec, engine_config.torch_dtype, block_size, num_slots, target.max_model_len,
                           engine_config.cache_memory_bytes, target.blocks.num_blocks)
        self.cache = ModelCache(self.model.spec, sizes, block_size, engine_config.torch_dtype, engine_config.device)
        self.blocks = BlockManager(sizes.num_blocks, block_size)
        self.slots = StateSlotAllocator(sizes.num_slots)
        self.runner = ModelRunner(self.model, self.cache, self.slots, engine_config.device, debug=False,
                                  enforce_eager=True, max_model_len=target.max_model_len)
        self.rolls_back = bool(self.model.spec.state_layers)
        self.mirrors: dict[str, Request] = {}  # the draft's view of each request
        self.last: dict[str, tuple[int, list[int]]] = {}  # request -> (its tokens then, the drafts made)

    # ------------------------------------------------------------------ the proposer contract

    def propose_all(self, requests: list[Request], limits: list[int]) -> list[list[int]]:
        drafts = {request.request_id: [] for request in requests}
        rows = []
        for request, limit in zip(requests, limits):
            k = min(self.config.num_speculative_tokens, limit)
            mirror = self._mirror(request) if k > 0 else None
            if mirror is None:
                continue
            num_tokens, made = self.last.get(request.request_id, (None, []))
            if num_tokens == request.num_tokens:  # not verified since (the budget was spent): still good
                drafts[request.request_id] = made[:k]
                continue
            self._roll_back(request, mirror)
            if not self.blocks.can_allocate(request.request_id, request.num_tokens + k - 1):
                continue
            self.blocks.allocate(request.request_id, request.num_tokens + k - 1)
            rows.append((request, mirror, k))
        if not rows:
            return [drafts[r.request_id] for r in requests]
        # 1. catch up: every token the draft has not run, the last one's logits give the first draft
        seqs = [self._seq(mirror, request.num_tokens - mirror.num_computed_tokens) for request, mirror, _ in rows]
        for (request, mirror, _), token in zip(rows, self._run(seqs)):
            mirror.num_computed_tokens = request.num_tokens
            drafts[request.request_id].append(token)
        if self.rolls_back:  # the state after the request's own tokens, to go back to
            self.runner.copy_state([(self.slots.slot_of[r.request_id], self.slots.slot_of[scratch(r.request_id)])
                                    for r, _, _ in rows])
            for request, _, _ in rows:
                self.slots.mark_written(scratch(request.request_id))
        # 2. k - 1 decode steps, each feeding the draft before
        for step in range(1, max(k for *_, k in rows)):
            going = [(request, mirror) for request, mirror, k in rows if k > step]
            seqs = []
            for request, mirror in going:
                mirror.draft_token_ids = drafts[request.request_id]
                seqs.append(self._seq(mirror, 1, Phase.DECODE))
            for (request, mirror), token in zip(going, self._run(seqs)):
                mirror.num_computed_tokens += 1
                drafts[request.request_id].append(token)
        for request, mirror, _ in rows:
            mirror.draft_token_ids = []
            self.last[request.request_id] = (request.num_tokens, drafts[request.request_id])
        return [drafts[r.request_id] for r in requests]

    def forget(self, request_id: str) -> None:
        self.mirrors.pop(request_id, None)
        self.last.pop(request_id, None)
        self.blocks.free(request_id)
        self.slots.free(request_id)
        self.slots.free(scratch(request_id))

    # ------------------------------------------------------------------ the draft's own cache

    def _mirror(self, request: Request) -> Request | None:
        """The draft's request for `request`: the same prompt and output lists (so it sees every
        token the target keeps), its own counters, a slot and a scratch slot; None: no room."""
        mirror = self.mirrors.get(request.request_id)
        if mirror is not None:
            return mirror
        if self.slots.num_free_slots < 2:
            return None
        mirror = Request(request.request_id, request.prompt_token_ids, SamplingParams(max_tokens=1))
        mirror.output_token_ids = request.output_token_ids
        self.slots.allocate(request.request_id)
        self.slots.allocate(scratch(request.request_id))
        self.mirrors[request.request_id] = mirror
        return mirror

    def _roll_back(self, request: Request, mirror: Request) -> None:
        """Forget what the draft ran past the tokens the target kept: the drafts it fed that are
        not the request's tokens at their positions."""
        num_tokens, made = self.last.pop(request.request_id, (None, []))
        if num_tokens is None:
            return
        fed = made[:mirror.num_computed_tokens - num_tokens]  # the last draft was never fed
        kept = 0
        for draft in fed:
            at = num_tokens + kept - request.num_prompt_tokens
            if at >= request.num_output_tokens or request.output_token_ids[at] != draft:
                break
            kept += 1
        if kept == len(fed):
            return
        if self.rolls_back:
            self.slots.check_readable(scratch(request.request_id), self.slots.slot_of[scratch(request.request_id)])
            self.runner.copy_state([(self.slots.slot_of[scratch(request.request_id)], self.slots.slot_of[request.request_id])])
            self.slots.mark_written(request.request_id)
            mirror.num_computed_tokens = num_tokens
        else:
            mirror.num_computed_tokens = num_tokens + kept

    def _seq(self, mirror: Request, num_tokens: int, phase: Phase | None = None) -> ScheduledSeq:
        computed = mirror.num_computed_tokens
        if phase is None:
            phase = Phase.FRESH_PREFILL if computed == 0 else \
                Phase.DECODE if num_tokens == 1 else Phase.CONTINUED_PREFILL
        return ScheduledSeq(mirror, phase, num_tokens, self.slots.slot_of[mirror.request_id],
                            self.blocks.table(mirror.request_id))

    def _run(self, seqs: list[ScheduledSeq]) -> list[int]:
        """One forward of the draft over these rows: each row's greedy next token."""
        return self.runner.sampler.greedy(self.runner.execute(seqs)).token_ids


def scratch(request_id: str) -> str:
    return f"{request_id}#draft-scratch"


def check_same_vocabulary(target_spec, target_tokenizer: Tokenizer | None, draft_spec, draft_path: str) -> None:
    """Refuse a draft whose token ids would not mean the target's, naming what differs."""
    where = f"speculative_config.model {draft_path!r}"
    if draft_spec.vocab_size != target_spec.vocab_size:
        raise ValueError(f"{where}: vocab_size {draft_spec.vocab_size} differs from the target's "
                         f"{target_spec.vocab_size}")
    try:
        draft_tokenizer = Tokenizer(draft_path)
    except FileNotFoundError:
        draft_tokenizer = None
    if (draft_tokenizer is None) != (target_tokenizer is None):
        has = "has" if draft_tokenizer is not None else "has no"
        raise ValueError(f"{where}: {has} tokenizer.json and the target {'has' if target_tokenizer else 'has no'}")
    mine, theirs = (draft_tokenizer.vocab(), target_tokenizer.vocab()) if draft_tokenizer else ({}, {})
    if mine != theirs:
        differ = sorted(token for token in mine.keys() | theirs.keys() if mine.get(token) != theirs.get(token))
        raise ValueError(f"{where}: its tokenizer maps {len(differ)} token(s) differently from the target's, "
                         f"e.g. {differ[:3]}")
