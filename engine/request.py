"""A request's lifecycle: one ordered status and plain counters. No torch."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from engine.phase import Phase, classify
from engine.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    WAITING_FOR_STATE = 1  # blocks and slot reserved; KV + state coming from a prefill worker
    PREFILLING = 2
    DECODING = 3
    PREEMPTED = 4  # blocks and slot dropped; waits to be recomputed from zero
    HANDED_OFF = 5  # prefill worker: first token sampled, state being sent away
    FINISHED_STOPPED = 6
    FINISHED_LENGTH = 7
    FINISHED_ABORTED = 8
    FINISHED_ERROR = 9

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED


FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass(frozen=True)
class Resume:
    """A request continued on another worker after a failure: what the caller already has.

    Its tokens become the request's first outputs (they count for max_tokens, penalties and
    seeded draws) and are recomputed with the prompt; `sent_chars` of their text were shown.
    """

    output_token_ids: tuple[int, ...]
    sent_chars: int = 0


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose KV / state this request's cache holds
    num_prefill_tokens: int = 0  # tokens the current (re)prefill covers; set when it starts
    num_preemptions: int = 0
    error: str | None = None
    scheduled_time: float | None = None  # first prefill step here (engine.trace: queued, then prefill)
    first_token_time: float | None = None
    finish_time: float | None = None
    # engine.structured.GrammarState when the output is constrained: fed every output token
    grammar: object | None = None
    # Prefix caching (engine.prefix_cache): hashes of the full blocks of all_token_ids as far as
    # computed so far, how many are indexed, the block boundaries this prefill stops at to
    # checkpoint the state, and the tokens the first admission found cached.
    block_hashes: list[bytes] = field(default_factory=list)
    num_indexed_blocks: int = 0
    save_points: list[int] = field(default_factory=list)
    rolling_checkpoint: bytes | None = None  # the decode-boundary checkpoint this request saved last
    num_cached_tokens: int | None = None
    tier_checked: bool = False  # its prefix was looked up in the lower tiers (engine.tiered_cache)
    tier_prefetched: bool = False  # its disk entry was asked for ahead, while it queued
    # sampling_params.prompt_logprobs: an entry per prompt token as far as computed (the first
    # None); a resumed request's caller has them already, so it gets None here.
    prompt_logprobs: list[dict | None] | None = None
    # Speculative decoding (engine.speculative): drafts to verify after the last token this step,
    # and outputs accepted in a verify whose state was rolled back, to run again first.
    draft_token_ids: list[int] = field(default_factory=list)
    num_replay_tokens: int = 0
    # Greedy, without logprobs or penalties: its token is the logits' argmax unless a grammar
    # masks them (engine.model_runner's sampling fast path; sampling_params do not change).
    argmax_only: bool = field(init=False)

    def __post_init__(self):
        params = self.sampling_params
        self.argmax_only = params.greedy and params.logprobs is None and not params.uses_penalties

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def finished(self) -> bool:
        return self.status.finished

    @property
    def finish_reason(self) -> str | None:
        return FINISH_REASONS.get(self.status)

    def phase(self) -> Phase:
        return classify(self.num_computed_tokens, self.num_prefill_tokens, self.num_tokens,
                        self.num_replay_tokens, len(self.draft_token_ids))

    def start_prefill(self, num_cached_tokens: int = 0) -> None:
        """(Re)start from nothing, or from a cached prefix: every other token must be computed."""
        self.num_computed_tokens = num_cached_tokens
        self.num_prefill_tokens = self.num_tokens
        self.num_replay_tokens, self.draft_token_ids = 0, []
        self.status = RequestStatus.PREFILLING

    def finish(self, status: RequestStatus, error: str | None = None) -> None:
        assert status.finished
        self.status = status
        self.error = error
        self.finish_time = time.monotonic()
