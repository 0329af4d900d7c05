"""Structured outputs: grammar-constrained sampling with llguidance.

A request's `StructuredOutput` (a JSON schema, any JSON object, a regex, a choice list or a
Lark/GBNF grammar) is checked when it is built, compiled once per (grammar, tokenizer) into a
template matcher, and each request gets a copy of it (`GrammarState`).

The invariant that makes the prefill/decode split and retries exact: a grammar state is a pure
function of the tokens consumed under it. Every engine (colocated, prefill, decode, a retry on
another worker) builds a fresh state and feeds it the request's output tokens as they are
appended, including the ones it did not sample itself (the resumed tokens, the prefill worker's
first token); nothing about the grammar crosses the hand-off but the request's spec.
"""

from __future__ import annotations

import functools
import hashlib
import json
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field

import llguidance
import llguidance.numpy  # not llguidance.torch: it runs torch.compile at import (~6 s a process)
import torch

from engine.errors import InvalidRequest

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
MAX_SPEC_CHARS = 1 << 20
COMPILED_CACHE_SIZE = 256
FIELD = "structured_output"
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class StructuredOutput:
    """What the output must match. `spec` is the schema as JSON text (json_schema), the regex,
    the choices as a JSON list (choice), the Lark or GBNF text (grammar), "" for json_object."""

    kind: str
    spec: str = ""
    # The validated llguidance grammar, filled on construction: it travels with the spec, so a
    # worker builds its matcher from it without validating the spec again.
    grammar: str = field(default="", compare=False, repr=False)

    def __post_init__(self):
        if self.kind not in KINDS:
            raise InvalidRequest(FIELD, f"kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if not isinstance(self.spec, str):
            raise InvalidRequest(FIELD, f"spec must be a string, got {type(self.spec).__name__}")
        if len(self.spec) > MAX_SPEC_CHARS:
            raise InvalidRequest(FIELD, f"{self.kind} is {len(self.spec)} chars, max {MAX_SPEC_CHARS}")
        # bad schema / regex / grammar: refused here, before any queue
        object.__setattr__(self, "grammar", grammar_text(self.kind, self.spec))

    @classmethod
    def json_schema(cls, schema: dict | bool) -> StructuredOutput:
        return cls("json_schema", json.dumps(schema))  # key order kept: it is the output order

    @classmethod
    def choice(cls, choices: list[str]) -> StructuredOutput:
        return cls("choice", json.dumps(choices))


@functools.lru_cache(maxsize=COMPILED_CACHE_SIZE)
def grammar_text(kind: str, spec: str) -> str:
    """The llguidance grammar for a spec, validated without a tokenizer; InvalidRequest if bad."""
    if kind in ("json_schema", "json_object"):
        try:
            schema = json.loads(spec) if kind == "json_schema" else {"type": "object"}
        except ValueError as e:
            raise InvalidRequest(FIELD, f"json_schema is not valid JSON: {_short(str(e))}") from None
        if not isinstance(schema, (dict, bool)):
            raise InvalidRequest(FIELD, f"json_schema must be an object, got {type(schema).__name__}")
        # Compact separators, no free whitespace: a model cannot pad a structure out to max_tokens.
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)
    elif kind == "choice":
        try:
            choices = json.loads(spec)
        except ValueError:
            choices = None
        if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
            raise InvalidRequest(FIELD, "choice must be a non-empty list of non-empty strings")
        grammar = llguidance.grammar_from("choice", spec)
    elif kind == "regex":
        grammar = llguidance.LLMatcher.grammar_from_regex(spec)
    else:
        grammar = llguidance.grammar_from("grammar", spec)  # Lark, or GBNF converted to Lark
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise InvalidRequest(FIELD, f"invalid {kind}: {_short(messages[0])}")
    return grammar


def _short(message: str, limit: int = 240) -> str:
    """llguidance's message, cut to fit an error reply (it may quote the whole grammar)."""
    message = " ".join(message.split())
    return message if len(message) <= limit else message[:limit] + "..."


class GrammarState:
    """One request's matcher. Advanced only by `consume`, so its state is the tokens it saw."""

    def __init__(self, matcher: llguidance.LLMatcher):
        self.matcher = matcher

    def consume(self, token_id: int) -> bool:
        """False (and the state is broken for good) when the grammar does not allow the token."""
        return self.matcher.consume_token(token_id)

    def valid_prefix(self, token_ids: list[int]) -> int:
        """How many leading tokens the grammar would accept from here (nothing is consumed)."""
        return self.matcher.validate_tokens(token_ids)

    def after_each(self, token_ids: list[int]) -> list[GrammarState]:
        """Copies of this state after token_ids[:j] for j = 0..len(token_ids): the masks of a
        verify step's positions (engine.speculative). The tokens must be a valid prefix."""
        states, matcher = [], self.matcher.deep_copy()
        for token_id in token_ids:
            states.append(GrammarState(matcher.deep_copy()))
            if not matcher.consume_token(token_id):
                raise ValueError(f"token {token_id} is not valid here: {matcher.get_error()}")
        return states + [GrammarState(matcher)]

    @property
    def finished(self) -> bool:
        """The structure is complete: nothing but an end-of-sequence token may follow."""
        return self.matcher.is_stopped()

    @property
    def error(self) -> str:
        return self.matcher.get_error()


_tokenizers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_compiled: OrderedDict = OrderedDict()
_lock = threading.Lock()


def _ll_tokenizer(tokenizer, vocab_size: int, eos_ids: tuple[int, ...]):
    """(cache key, llguidance tokenizer) for one of our tokenizers, built once per process."""
    with _lock:
        per_tok = _tokenizers.setdefault(tokenizer, {})
        if (vocab_size, eos_ids) not in per_tok:
            source = tokenizer._tok.to_str()
            key = (hashlib.sha256(source.encode()).hexdigest(), vocab_size, eos_ids)
            ll = llguidance.LLTokenizer(source, n_vocab=vocab_size, eos_token=list(eos_ids) or None)
            per_tok[(vocab_size, eos_ids)] = (key, ll)
        return per_tok[(vocab_size, eos_ids)]


class GrammarCompiler:
    """Compiles specs for one tokenizer and vocabulary; compiled templates are shared process-wide
    by (tokenizer, grammar), so the router's check warms the cache of a colocated engine."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: list[int]):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)

    def _template(self, spec: StructuredOutput) -> llguidance.LLMatcher:
        if self.tokenizer is None:
            raise InvalidRequest(FIELD, "this model has no tokenizer.json; structured outputs need one")
        key, ll = _ll_tokenizer(self.tokenizer, self.vocab_size, self.eos_token_ids)
        grammar = spec.grammar
        with _lock:
            template = _compiled.get((key, grammar))
            if template is not None:
                _compiled.move_to_end((key, grammar))
                return template
        template = llguidance.LLMatcher(ll, grammar, log_level=0)  # outside the lock: may take a while
        if template.is_error():
            raise InvalidRequest(FIELD, f"invalid {spec.kind}: {_short(template.get_error())}")
        with _lock:
            _compiled[(key, grammar)] = template
            while len(_compiled) > COMPILED_CACHE_SIZE:
                _compiled.popitem(last=False)
        return template

    def compile(self, spec: StructuredOutput | None) -> None:
        """Warm the cache (any thread): call it before queuing so admission finds it compiled."""
        if spec is not None:
            self._template(spec)

    def state(self, spec: StructuredOutput | None) -> GrammarState | None:
        return None if spec is None else GrammarState(self._template(spec).deep_copy())


def apply_grammar_masks(logits: torch.Tensor, grammars: list[GrammarState | None]) -> torch.Tensor:
    """Disallowed tokens of constrained rows to -inf; other rows are returned bit for bit."""
    rows = [i for i, g in enumerate(grammars) if g is not None]
    if not rows:
        return logits
    vocab = logits.shape[1]
    bitmask = torch.zeros(len(rows), (vocab + 31) // 32, dtype=torch.int32)
    for j, i in enumerate(rows):
        llguidance.numpy.fill_next_token_bitmask(grammars[i].matcher, bitmask.numpy(), j)
    bits = (bitmask[:, :, None] >> torch.arange(32, dtype=torch.int32)) & 1
    allowed = bits.view(len(rows), -1)[:, :vocab].bool().to(logits.device)
    index = torch.tensor(rows, device=logits.device)
    logits = logits.clone()
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))
    return logits
