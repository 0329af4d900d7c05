"""What the front door (gRPC, HTTP) needs from whatever generates: the cluster or one engine.

The front door only sees this protocol, so the same servers run over a local engine (tests,
single machine) and over the disaggregated Ray cluster.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Protocol
from collections.abc import AsyncIterator

from engine.output import RequestOutput
from engine.sampling_params import SamplingParams


class Overloaded(RuntimeError):
    """The admission queue is full: answer RESOURCE_EXHAUSTED / HTTP 429 at once."""


class Unavailable(RuntimeError):
    """No live worker of a needed kind: answer UNAVAILABLE / HTTP 503."""


@dataclass
class ModelInfo:
    model_name: str  # what clients pass as `model`
    model_path: str
    model_type: str
    vocab_size: int
    max_model_len: int
    layer_kinds: list[str]
    eos_token_ids: list[int] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


class Backend(Protocol):
    info: ModelInfo

    @property
    def tokenizer(self):  # engine.tokenizer.Tokenizer | None
        ...

    def ready(self) -> bool:
        """True once a request could be served now (all worker kinds alive)."""
        ...

    def stream(self, request_id: str, prompt: str | list[int], params: SamplingParams, whole: bool = True
               ) -> AsyncIterator[RequestOutput]:
        """Stream outputs (deltas in new_token_ids / new_text); the last has finished=True.
        whole: every output also carries the prompt and the tokens, text and logprobs so far;
        False: only the last one must (the others may leave them empty, so a step's cost does
        not grow with the output).

        Raises engine.InvalidRequest for bad input (before anything is streamed), Overloaded,
        Unavailable. Closing the iterator early (or cancelling its task) aborts the request and
        frees everything it holds.
        """
        ...

    async def abort(self, request_id: str) -> bool:
        ...

    def status(self) -> dict:
        """Workers, their nodes, cache usage (blocks / slots used and free), queue depths."""
        ...
