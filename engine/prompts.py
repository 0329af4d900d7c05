"""Turning a prompt into checked token ids: shared by the engine and the cluster's router."""

from __future__ import annotations

from engine.sampling_params import InvalidRequest, SamplingParams, describe, is_unicode


class PromptIds(list):
    """Token ids already checked, at the front door, against a vocabulary of `vocab_size`
    (and a context). The router and the workers take them as they are, checking only their
    bounds, in C, against their own vocabulary: what a wrong router could break."""

    def __init__(self, ids, vocab_size: int):
        super().__init__(ids)
        self.vocab_size = vocab_size


def prompt_token_ids(prompt, tokenizer, vocab_size: int) -> list[int]:
    """Token ids of a text or token-id prompt; InvalidRequest("prompt", ...) if unusable."""
    if isinstance(prompt, PromptIds) and prompt and prompt.vocab_size <= vocab_size:
        if min(prompt) < 0 or max(prompt) >= vocab_size:
            raise InvalidRequest("prompt", f"token ids must be in [0, {vocab_size}) (the vocabulary)")
        return prompt
    if isinstance(prompt, str):
        if tokenizer is None:
            raise InvalidRequest("prompt", "this model has no tokenizer.json; send token ids")
        if not is_unicode(prompt):
            raise InvalidRequest("prompt", "not valid Unicode (a lone surrogate)")
        ids = tokenizer.encode(prompt)
    elif isinstance(prompt, (list, tuple)):
        ids = list(prompt)
    else:
        raise InvalidRequest("prompt", f"must be a string or a list of token ids, got {type(prompt).__name__}")
    if not ids:
        raise InvalidRequest("prompt", "must not be empty")
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
            raise InvalidRequest("prompt", f"token ids must be integers in [0, {vocab_size}) "
                                           f"(the vocabulary), got {describe(t)}")
    return ids


def check_prompt_length(num_prompt_tokens: int, max_model_len: int) -> None:
    if num_prompt_tokens >= max_model_len:
        raise InvalidRequest("prompt", f"{num_prompt_tokens} tokens; the context holds "
                             f"{max_model_len} and at least one must be generated")


def check_max_tokens(num_prompt_tokens: int, max_tokens: int, max_model_len: int) -> None:
    """Refuse what could never be generated, as vLLM does, rather than cut it short silently."""
    if num_prompt_tokens + max_tokens > max_model_len:
        raise InvalidRequest("max_tokens", f"{describe(max_tokens)} new tokens after a "
                             f"{num_prompt_tokens}-token prompt pass the context of {max_model_len}; "
                             f"at most {max(max_model_len - num_prompt_tokens, 0)} fit")


def fitting_prompt_ids(prompt, tokenizer, vocab_size: int, max_model_len: int, max_tokens: int
                       ) -> list[int]:
    """prompt_token_ids, checked to leave room in the context for max_tokens new tokens: the
    front door's check, whose result (PromptIds) nothing after it checks again in full."""
    ids = prompt_token_ids(prompt, tokenizer, vocab_size)
    check_prompt_length(len(ids), max_model_len)
    check_max_tokens(len(ids), max_tokens, max_model_len)
    return PromptIds(ids, vocab_size)


def as_batch(prompts, params: SamplingParams | list[SamplingParams] | None):
    """(prompts, params) as two equal-length lists: one prompt or one params object is widened."""
    if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
        prompts = [prompts]
    if params is None or isinstance(params, SamplingParams):
        params = [params or SamplingParams()] * len(prompts)
    if len(params) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
    return prompts, params
