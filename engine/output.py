"""Turning sampled tokens into results: stop conditions, text, streaming deltas."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from engine.request import Request, RequestStatus
from engine.sampling_params import InvalidRequest
from engine.tokenizer import Tokenizer
from engine.trace import engine_spans


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None
    new_token_ids: list[int] = field(default_factory=list)  # since the previous output
    new_text: str = ""  # since the previous output; held back while it may start a stop string
    logprobs: list[dict] | None = None
    new_logprobs: list[dict] | None = None  # since the previous output
    num_cached_tokens: int = 0
    error: str | None = None
    arrival_time: float = 0.0
    first_token_time: float | None = None
    finish_time: float | None = None
    # SamplingParams.prompt_logprobs: an entry per prompt token (the first None). A request's
    # first output carries them; cumulative outputs carry them every time.
    prompt_logprobs: list[dict | None] | None = None
    spans: tuple = ()  # the final output: where the request's time went (engine.trace)

    def delta(self, **changes) -> RequestOutput:
        """This output without what the request's earlier outputs carried (the prompt, and the
        tokens, text and logprobs so far): what a worker ships each step, so a step's message
        does not grow with the output.
        Cumulative puts the rest back."""
        return replace(self, prompt_token_ids=[], token_ids=[], text="", logprobs=None, **changes)


class Cumulative:
    """One request's outputs rebuilt whole from deltas: the tokens, text and (when asked for)
    logprobs so far, plus each output's new ones."""

    def __init__(self, prompt_token_ids: list[int], with_logprobs: bool = False):
        self.prompt_token_ids = prompt_token_ids
        self.token_ids: list[int] = []
        self._text = GrowingText()
        self.logprobs: list[dict] | None = [] if with_logprobs else None
        self.prompt_logprobs: list[dict | None] | None = None

    @property
    def text(self) -> str:
        return self._text.whole()

    def add(self, out: RequestOutput, first_logprob: dict | None = None, whole: bool = True,
            prompt_logprobs: list | None = None) -> RequestOutput:
        """`out` whole, or (whole=False) as a delta until the final output, which is whole: each
        step then costs what is new, not the output so far. An error adds nothing.
        first_logprob, prompt_logprobs: the first new token's entry and the prompt's when they
        were computed elsewhere (a split request's, on the prefill worker)."""
        if self.prompt_logprobs is None:
            self.prompt_logprobs = prompt_logprobs or out.prompt_logprobs
        new_logprobs = out.new_logprobs
        if out.error is None:
            self.token_ids += out.new_token_ids
            self._text.add(out.new_text)
            self._text.settle(len(self._text))  # only ever read whole
            if self.logprobs is not None:
                new_logprobs = ([first_logprob] if first_logprob is not None else []) + list(new_logprobs or [])
                self.logprobs += new_logprobs
        if not (whole or out.finished):
            return out.delta(new_logprobs=new_logprobs, prompt_logprobs=prompt_logprobs or out.prompt_logprobs)
        return replace(out, prompt_token_ids=self.prompt_token_ids, token_ids=list(self.token_ids),
                       text=self.text, new_logprobs=new_logprobs, prompt_logprobs=self.prompt_logprobs,
                       logprobs=list(self.logprobs) if self.logprobs is not None else None)


class GrowingText:
    """A request's text so far, grown at the end. `str +=` on an attribute copies the whole
    string each time (quadratic over a long output);
    here a piece costs about its own length. Only the tail is a live string; what lies before
    the position `settle` was last given moves out of it, to be joined when the whole text is
    asked for (whole(), for outputs that carry it)."""

    SETTLE_AT = 2048  # characters that may gather before the settled ones move out of the tail

    def __init__(self):
        self._settled: list[str] = []
        self._tail_start = 0
        self._tail = ""

    def __len__(self) -> int:
        return self._tail_start + len(self._tail)

    def add(self, piece: str) -> None:
        self._tail += piece

    def find(self, sub: str, start: int) -> int:
        self._reach(start)
        at = self._tail.find(sub, start - self._tail_start)
        return at if at == -1 else at + self._tail_start

    def slice(self, begin: int, end: int) -> str:
        self._reach(begin)
        return self._tail[begin - self._tail_start:end - self._tail_start]

    def cut(self, end: int) -> None:
        """Keep text[:end]."""
        self._reach(end)
        self._tail = self._tail[:end - self._tail_start]

    def settle(self, before: int) -> None:
        """Nothing before `before` will be found, sliced or cut again (if it is, the text is
        joined whole first: slower, never wrong)."""
        cut = before - self._tail_start
        if cut > self.SETTLE_AT:
            self._settled.append(self._tail[:cut])
            self._tail, self._tail_start = self._tail[cut:], before

    def whole(self) -> str:
        if len(self._settled) > 1:
            self._settled = ["".join(self._settled)]
        return (self._settled[0] if self._settled else "") + self._tail

    def _reach(self, position: int) -> None:
        if position < self._tail_start:
            self._tail, self._settled, self._tail_start = self.whole(), [], 0


class OutputTracker:
    """Per-request text state and the stop rules applied after each new token."""

    def __init__(self, request: Request, tokenizer: Tokenizer | None, eos_token_ids: list[int],
                 max_model_len: int, sent_chars: int = 0, deltas: bool = False, where: str = "engine"):
        self.request = request
        self.where = where  # names the engine in the final output's spans
        self.deltas = deltas  # outputs as RequestOutput.delta() gives them (EngineConfig.output_kind)
        params = request.sampling_params
        self.stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            self.stop_ids.update(eos_token_ids)
        self.detok = tokenizer.stream(params.skip_special_tokens) if tokenizer else None
        # The length stop in one comparison: outputs reach max_tokens, or prompt + outputs max_model_len.
        self._output_limit = min(params.max_tokens, max_model_len - request.num_prompt_tokens)
        self._text = GrowingText()
        self.logprobs: list[dict] | None = [] if params.logprobs is not None else None
        self._holdback = max((len(s) for s in params.stop), default=1) - 1
        # A resumed request: replay the outputs the caller already has, so text and deltas
        # continue exactly where the caller's stream stopped.
        for token_id in request.output_token_ids:
            if self.detok is not None:
                self._text.add(self.detok.step(token_id))
            if request.grammar is not None and not request.grammar.consume(token_id):
                raise InvalidRequest("resume", f"token {token_id} does not follow the request's "
                                     f"structured output: {request.grammar.error}")
        self.sent_tokens = request.num_output_tokens
        self.sent_text = min(max(sent_chars, 0), len(self._text))
        self.sent_logprobs = 0
        self.sent_prompt_logprobs = False

    def append(self, token_id: int, logprob: dict | None) -> None:
        request = self.request
        outputs = request.output_token_ids
        outputs.append(token_id)
        if self.logprobs is not None and logprob is not None:
            self.logprobs.append(logprob)
        if self.detok is not None:
            stops = request.sampling_params.stop
            before = len(self._text) if stops else 0
            self._text.add(self.detok.step(token_id))
            for stop in stops:
                at = self._text.find(stop, max(0, before - len(stop) + 1))
                if at != -1:
                    self._text.cut(at)
                    request.finish(RequestStatus.FINISHED_STOPPED)
                    return
        if request.grammar is not None:
            if not request.grammar.consume(token_id):
                request.finish(RequestStatus.FINISHED_ERROR,
                               f"structured output: token {token_id} refused: {request.grammar.error}")
                return
            if request.grammar.finished:  # complete: only an end-of-sequence token could follow
                request.finish(RequestStatus.FINISHED_STOPPED)
                return
        if token_id in self.stop_ids:
            request.finish(RequestStatus.FINISHED_STOPPED)
        elif len(outputs) >= self._output_limit:
            request.finish(RequestStatus.FINISHED_LENGTH)

    def output(self) -> RequestOutput:
        # Called for every row of every decode step, on caches the forward just flushed: the text
        # work is skipped where there is none.
        request = self.request
        finished = request.finished
        new_text = ""
        if self.detok is not None:  # without one the text stays empty
            length = len(self._text)
            visible = length if finished else max(self.sent_text, length - self._holdback)
            if visible != self.sent_text:  # each step of a long output: nothing new held back, no slicing
                new_text = self._text.slice(self.sent_text, visible)
                # A stop string's search starts at most _holdback characters back; deltas start at sent_text.
                self._text.settle(max(0, min(visible, length - self._holdback)))
                self.sent_text = visible
        outputs = request.output_token_ids
        new_tokens = outputs[self.sent_tokens:]
        self.sent_tokens = len(outputs)
        new_logprobs = None
        if self.logprobs is not None:
            new_logprobs = self.logprobs[self.sent_logprobs:]
            self.sent_logprobs += len(new_logprobs)
        prompt_logprobs = request.prompt_logprobs
        if self.deltas:
            prompt, tokens, text, logprobs = [], [], "", None
            if self.sent_prompt_logprobs:  # the first output carries them, once
                prompt_logprobs = None
            self.sent_prompt_logprobs = self.sent_prompt_logprobs or prompt_logprobs is not None
        else:
            prompt, tokens, text, logprobs = request.prompt_token_ids, list(outputs), self._text.whole(), self.logprobs
        return RequestOutput(
            request.request_id, prompt, tokens, text, finished, request.finish_reason,
            new_tokens, new_text, logprobs, new_logprobs, request.num_cached_tokens or 0, request.error,
            request.arrival_time, request.first_token_time, request.finish_time, prompt_logprobs,
            engine_spans(request, self.where) if finished else (),
        )
