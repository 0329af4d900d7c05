"""Per-request sampling parameters, validated on construction (errors name the field)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from engine.errors import InvalidRequest

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_LOGPROBS = 20
MAX_STOP_TOKEN_IDS = 1024


def describe(value, limit: int = 80) -> str:
    """A short repr for error messages: a caller's 10 MB string or 10**5000 is not echoed back."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        return f"an integer of {value.bit_length()} bits"
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({type(value).__name__})"


def _number(name, value, *, integer=False):
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidRequest(name, f"must be a number, got {type(value).__name__}")
    if isinstance(value, float) and not math.isfinite(value):
        raise InvalidRequest(name, f"must be finite, got {value!r}")
    if integer:
        if isinstance(value, float) and not value.is_integer():
            raise InvalidRequest(name, f"must be an integer, got {value!r}")
        return int(value)
    try:
        return float(value)
    except OverflowError:  # an int past float's range
        raise InvalidRequest(name, f"must be finite, got {describe(value)}") from None


def _flag(name, value) -> bool:
    if not isinstance(value, bool):
        raise InvalidRequest(name, f"must be a boolean, got {type(value).__name__}")
    return value


def is_unicode(text: str) -> bool:
    """False for a str with a lone surrogate: JSON lets one through, tokenizers and UTF-8 do not."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 means greedy
    top_k: int = -1  # -1 or 0: off
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; 0: the chosen token's; n: also the top n
    # None: none; 0: each prompt token's logprob given the tokens before it (and its rank); n:
    # also the top n there. The first output carries them; the first prompt token has none.
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    # engine.structured.StructuredOutput: the output must match it (checked when that is built)
    structured_output: object | None = None

    def __post_init__(self):
        self.max_tokens = _number("max_tokens", self.max_tokens, integer=True)
        if self.max_tokens < 1:
            raise InvalidRequest("max_tokens", f"must be >= 1, got {describe(self.max_tokens)}")
        self.temperature = _number("temperature", self.temperature)
        if not 0.0 <= self.temperature <= 100.0:
            raise InvalidRequest("temperature", f"must be in [0, 100], got {self.temperature}")
        self.top_k = _number("top_k", self.top_k, integer=True)
        # The sampler puts every row's k in one int64 tensor: one absurd k would fail the batch.
        if not -1 <= self.top_k < 2**31:
            raise InvalidRequest("top_k", f"must be -1 (off), 0 (off) or in [1, 2**31), "
                                 f"got {describe(self.top_k)}")
        self.top_p = _number("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequest("top_p", f"must be in (0, 1], got {self.top_p}")
        self.min_p = _number("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequest("min_p", f"must be in [0, 1], got {self.min_p}")
        if self.seed is not None:
            self.seed = _number("seed", self.seed, integer=True)
            if not 0 <= self.seed < 2**63:
                raise InvalidRequest("seed", f"must be in [0, 2**63), got {describe(self.seed)}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = _number(name, getattr(self, name))
            if not -2.0 <= value <= 2.0:
                raise InvalidRequest(name, f"must be in [-2, 2], got {value}")
            setattr(self, name, value)
        self.repetition_penalty = _number("repetition_penalty", self.repetition_penalty)
        if not 0.0 < self.repetition_penalty <= 10.0:
            raise InvalidRequest("repetition_penalty", f"must be in (0, 10], got {self.repetition_penalty}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop, (list, tuple)) or not all(isinstance(s, str) for s in self.stop):
            raise InvalidRequest("stop", "must be a string or a list of strings")
        self.stop = list(self.stop)
        if len(self.stop) > MAX_STOP_STRINGS:
            raise InvalidRequest("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
        for s in self.stop:
            if not s:
                raise InvalidRequest("stop", "stop strings must not be empty")
            if len(s) > MAX_STOP_STRING_CHARS:
                raise InvalidRequest("stop", f"a stop string is {len(s)} chars, max {MAX_STOP_STRING_CHARS}")
            if not is_unicode(s):
                raise InvalidRequest("stop", "a stop string is not valid Unicode (a lone surrogate)")
        if not isinstance(self.stop_token_ids, (list, tuple)):
            raise InvalidRequest("stop_token_ids", "must be a list of integers")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidRequest("stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} token ids, "
                                 f"got {len(self.stop_token_ids)}")
        self.stop_token_ids = [_number("stop_token_ids", t, integer=True) for t in self.stop_token_ids]
        if any(t < 0 for t in self.stop_token_ids):
            raise InvalidRequest("stop_token_ids", "token ids must be >= 0")
        self.ignore_eos = _flag("ignore_eos", self.ignore_eos)
        self.skip_special_tokens = _flag("skip_special_tokens", self.skip_special_tokens)
        if self.logprobs is not None:
            self.logprobs = _number("logprobs", self.logprobs, integer=True)
            if not 0 <= self.logprobs <= MAX_LOGPROBS:
                raise InvalidRequest("logprobs", f"must be in [0, {MAX_LOGPROBS}], "
                                     f"got {describe(self.logprobs)}")
        if self.prompt_logprobs is not None:
            self.prompt_logprobs = _number("prompt_logprobs", self.prompt_logprobs, integer=True)
            if not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
                raise InvalidRequest("prompt_logprobs", f"must be in [0, {MAX_LOGPROBS}], "
                                     f"got {describe(self.prompt_logprobs)}")
        if self.structured_output is not None:
            # here, not at the top: the scheduler imports this module and must not import torch
            from engine.structured import StructuredOutput

            if not isinstance(self.structured_output, StructuredOutput):
                raise InvalidRequest("structured_output", "must be an engine.structured.StructuredOutput")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def uses_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)
