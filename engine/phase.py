"""The explicit per-step phase of a scheduled sequence. No torch.

Mamba decode reads the slot's state before updating it; attention decode writes first. So the
phase is never guessed from the number of tokens in the step: it is derived from the request's
counters, and `classify` refuses counter combinations that would make a read unsafe.
"""

from __future__ import annotations

import enum


class Phase(enum.Enum):
    FRESH_PREFILL = "fresh_prefill"  # no state yet: Mamba conv/ssm start from explicit zeros
    CONTINUED_PREFILL = "continued_prefill"  # later chunk: starts from the state its own slot holds
    DECODE = "decode"  # exactly one new token after a finished prefill: read, then update
    # A decoding request's pending tokens and its drafts (engine.speculative) in one step: it
    # reads the slot like a decode and runs several tokens like a continued prefill, and the
    # logits of its last token and of every draft are sampled.
    VERIFY = "verify"

    @property
    def reads_state(self) -> bool:
        return self is not Phase.FRESH_PREFILL


class PhaseError(RuntimeError):
    pass


def classify(num_computed_tokens: int, num_prefill_tokens: int, num_tokens: int,
             num_replay_tokens: int = 0, num_draft_tokens: int = 0) -> Phase:
    """Phase of a sequence about to run its next tokens.

    num_computed_tokens: tokens whose KV/state are already in this request's cache.
    num_prefill_tokens: tokens the current prefill must cover (the prompt, or prompt plus already
        generated tokens when recomputing after preemption; for a request whose state arrived from
        a prefill worker, the prompt it was prefilled with).
    num_tokens: all tokens the request has (prompt + generated).
    num_replay_tokens: outputs accepted in a VERIFY step whose state was rolled back with the
        rejected drafts': they run again before the last token (engine.speculative).
    num_draft_tokens: drafts proposed to follow the last token this step.
    """
    if not 0 <= num_computed_tokens < num_tokens:
        raise PhaseError(
            f"nothing to run: {num_computed_tokens} of {num_tokens} tokens already computed"
        )
    if num_computed_tokens == 0:
        return Phase.FRESH_PREFILL
    if num_computed_tokens < num_prefill_tokens:
        return Phase.CONTINUED_PREFILL
    if num_computed_tokens != num_tokens - 1 - num_replay_tokens:
        feeds = "exactly one token" if not num_replay_tokens else \
            f"exactly {1 + num_replay_tokens} tokens ({num_replay_tokens} replayed)"
        raise PhaseError(f"decode must feed {feeds}, but {num_tokens - num_computed_tokens} are pending")
    return Phase.VERIFY if num_replay_tokens or num_draft_tokens else Phase.DECODE
