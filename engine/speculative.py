"""Speculative decoding: the configuration, the proposers' contract and the n-gram proposer,
the acceptance rule, the governor that decides when drafting pays, and the counts. No torch.

A speculating request feeds its pending token and k drafted tokens in one VERIFY step
(engine.phase) and keeps the drafts the target model would have produced itself. Attention
drops a rejected draft's KV simply by not counting it (the rows are overwritten later). A
recurrent layer has already folded the rejected drafts into its state, so the engine copies
the slot's state into a scratch slot before the step and copies it back after a rejection;
the accepted tokens are then run again, first thing in the request's next step
(`Request.num_replay_tokens`), and their outputs are already final. One scratch slot per
speculating request in the step, taken from the free slots and given back after it (a
request finds none free: it decodes plainly that step), rather than a state row per
position, which would be k extra slots per request.
"""

from __future__ import annotations

import json
from array import array
from dataclasses import dataclass, field

METHODS = ("ngram", "draft_model", "mtp")
NOT_YET = {  # methods vLLM users name that this engine refuses with a reason, not a KeyError
    "eagle": "EAGLE heads are not supported yet",
    "eagle3": "EAGLE-3 heads are not supported yet",
}


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's `speculative_config` dict, as far as the methods built here go."""

    method: str
    num_speculative_tokens: int
    model: str | None = None  # draft_model: the draft's folder or Hub id (engine.draft_model)
    prompt_lookup_max: int = 5  # ngram: the longest suffix looked up in the request's context
    prompt_lookup_min: int = 2  # ngram: the shortest; a 1-token match drafts too eagerly
    # Draft only while drafting measures faster than plain decoding (SpeculationGovernor);
    # False drafts in every step (tests, and measuring speculation itself).
    adaptive: bool = True

    def __post_init__(self):
        if self.method in NOT_YET:
            raise ValueError(f"speculative_config.method: {self.method!r}: {NOT_YET[self.method]}; "
                             f"supported: {list(METHODS)}")
        if self.method not in METHODS:
            raise ValueError(f"speculative_config.method: {self.method!r} not in {list(METHODS)}")
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"speculative_config.{name}: must be a positive integer, got {value!r}")
        if (self.method == "draft_model") != (self.model is not None):
            raise ValueError("speculative_config.model: " + ("required by method 'draft_model'" if self.model is None
                                                              else f"only method 'draft_model' takes one, not {self.method!r}"))
        if self.model is not None and not isinstance(self.model, str):
            raise ValueError(f"speculative_config.model: must be a path or Hub id, got {self.model!r}")
        if not isinstance(self.adaptive, bool):
            raise ValueError(f"speculative_config.adaptive: must be a bool, got {self.adaptive!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config.prompt_lookup_min {self.prompt_lookup_min} is above "
                             f"prompt_lookup_max {self.prompt_lookup_max}")

    @classmethod
    def of(cls, value) -> SpeculativeConfig | None:
        """From a dict (as `--speculative-config` JSON parses), an instance, or None."""
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config: must be a dict, got {type(value).__name__}")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown field(s) {unknown}; known: {sorted(known)}")
        for name in ("method", "num_speculative_tokens"):
            if name not in value:
                raise ValueError(f"speculative_config.{name}: required")
        return cls(**value)

    def to_dict(self) -> dict:
        return {name: getattr(self, name) for name in self.__dataclass_fields__}

    def canonical(self) -> str:
        """The setting as one string two workers compare (kvtransfer's layout handshake): all
        of it but `adaptive`, which only decides when a worker drafts."""
        setting = {name: value for name, value in self.to_dict().items() if name != "adaptive"}
        return json.dumps(setting, sort_keys=True, separators=(",", ":"))


class Proposer:
    """Where drafts come from: `propose_all` once a step for every request that may draft,
    `forget` when a request ends."""

    def __init__(self, config: SpeculativeConfig):
        self.config = config

    def propose(self, request_id: str, prompt: list[int], outputs: list[int], limit: int) -> list[int]:
        raise NotImplementedError

    def propose_all(self, requests: list, limits: list[int]) -> list[list[int]]:
        """Up to min(k, limit) drafts for each request (engine.request.Request), in order."""
        return [self.propose(r.request_id, r.prompt_token_ids, r.output_token_ids, limit)
                for r, limit in zip(requests, limits)]

    def forget(self, request_id: str) -> None:
        pass


class NgramProposer(Proposer):
    """Prompt lookup: find the latest earlier occurrence of the context's last n tokens (longest
    n first) and draft the tokens that followed it. The context is kept per request as packed
    int32 bytes, so a lookup is a C-speed `bytes.rfind`, not a Python loop over the tokens."""

    def __init__(self, config: SpeculativeConfig):
        super().__init__(config)
        self._contexts: dict[str, array] = {}

    def propose(self, request_id: str, prompt: list[int], outputs: list[int], limit: int) -> list[int]:
        """Up to min(k, limit) drafts to follow the request's prompt and outputs."""
        k = min(self.config.num_speculative_tokens, limit)
        context = self._context(request_id, prompt, outputs)
        if k <= 0:
            return []
        data, count = context.tobytes(), len(context)
        for n in range(min(self.config.prompt_lookup_max, count - 1), self.config.prompt_lookup_min - 1, -1):
            pattern = data[(count - n) * 4:]
            end = (count - 1) * 4  # an earlier occurrence, with at least one token after it
            while (at := data.rfind(pattern, 0, end)) >= 0:
                if at % 4 == 0:  # on a token boundary
                    start = at // 4 + n
                    return context[start:start + k].tolist()
                end = at + len(pattern) - 1  # the next candidate starts further left
        return []

    def _context(self, request_id: str, prompt: list[int], outputs: list[int]) -> array:
        """The request's tokens so far: outputs only grow, so each call appends the new ones."""
        context = self._contexts.get(request_id)
        have = -1 if context is None else len(context) - len(prompt)
        if not 0 <= have <= len(outputs):
            context = self._contexts[request_id] = array("i", prompt)
            have = 0
        if have < len(outputs):
            context.extend(outputs[have:])
        return context

    def forget(self, request_id: str) -> None:
        self._contexts.pop(request_id, None)


class SpeculationGovernor:
    """Whether drafting pays on this engine now, measured rather than assumed: a verify step
    costs more than a decode step (on the CPU a decode of k + 1 rows a request; on a GPU a
    slot's state updates one after another, in a larger graph), and drafts that miss only add
    that cost. So the engine drafts in some steps and not in others, keeps the output tokens
    per second of steps that verified drafts and of steps that did not (a step that looked for
    drafts and found none is one of those) as moving averages, and drafts where that is the
    faster: each `period` steps begin with `probe_steps` of the slower kind, to notice when the
    workload changes. What pays at one batch size need not at another, so each load (decoding
    rows 1, 2-3, 4-7, 8-15, ...) keeps its own. Only steps in which every row decodes count.
    Outputs never depend on it: only speed does."""

    def __init__(self, probe_steps: int = 4, period: int = 64, smoothing: float = 0.2):
        self.probe_steps, self.period, self.smoothing = probe_steps, period, smoothing
        self.loads: dict[int, _Load] = {}

    def drafting(self, rows: int = 1) -> bool:
        """Whether a step of `rows` decoding requests drafts."""
        load = self.loads.setdefault(rows.bit_length(), _Load())
        for mode in (True, False):  # measure both first, drafting first
            if load.samples[mode] < self.probe_steps:
                return mode
        faster = load.rates[True] >= load.rates[False]
        return (not faster) if load.steps % self.period < self.probe_steps else faster

    def record(self, verified: bool, seconds: float, tokens: int, rows: int = 1) -> None:
        """A step of `rows` decoding rows only: whether it verified drafts, its time, the tokens
        it emitted."""
        if seconds <= 0:
            return
        load = self.loads.setdefault(rows.bit_length(), _Load())
        load.steps += 1
        rate = tokens / seconds
        old = load.rates.get(verified)
        load.rates[verified] = rate if old is None else old + self.smoothing * (rate - old)
        load.samples[verified] += 1

    def rates(self) -> dict[str, dict[str, float]]:
        """Per load ("rows 4-7"): output tokens per second of drafting and of plain steps."""
        return {f"rows {1 << (bucket - 1)}-{(1 << bucket) - 1}" if bucket > 1 else "rows 1":
                {"drafting" if mode else "plain": rate for mode, rate in load.rates.items()}
                for bucket, load in sorted(self.loads.items()) if load.rates}


class _Load:
    def __init__(self):
        self.rates: dict[bool, float] = {}  # verified drafts? -> output tokens per second
        self.samples = {True: 0, False: 0}
        self.steps = 0


def accepted_prefix(drafts: list[int], targets: list[int]) -> int:
    """How many leading drafts equal the target's own tokens at their positions (greedy
    verification: targets[i] is the token the target model picks after drafts[:i])."""
    for i, draft in enumerate(drafts):
        if targets[i] != draft:
            return i
    return len(drafts)


@dataclass
class SpeculationStats:
    """Counters in the sense vLLM's metrics give them: a draft is one proposal of a step."""

    num_speculative_tokens: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(init=False)

    def __post_init__(self):
        self.accepted_per_position = [0] * self.num_speculative_tokens

    def record(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        for position in range(num_accepted):
            self.accepted_per_position[position] += 1

    def as_dict(self) -> dict:
        rate = self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0
        return {"spec_drafts": self.num_drafts, "spec_draft_tokens": self.num_draft_tokens,
                "spec_accepted_tokens": self.num_accepted_tokens, "spec_acceptance_rate": rate,
                "spec_accepted_per_position": list(self.accepted_per_position)}
