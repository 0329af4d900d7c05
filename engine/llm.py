"""engine.LLM: the whole engine in-process (the colocated mode), no Ray."""

from __future__ import annotations

from pathlib import Path

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.output import RequestOutput
from engine.prompts import as_batch
from engine.sampling_params import SamplingParams


def demo_model_path() -> Path:
    """The small Jamba-architecture checkpoint bundled with the package."""
    return Path(__file__).resolve().parent / "demo_model"


class LLM:
    def __init__(self, model: str | Path | None = None, **engine_options):
        model = str(model if model is not None else demo_model_path())
        self.engine = LLMEngine(EngineConfig(model=model, **engine_options))

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None
                 ) -> list[RequestOutput]:
        """Run every prompt to completion; results come back in prompt order."""
        prompts, sampling_params = as_batch(prompts, sampling_params)
        ids = [self.engine.add_request(p, sp) for p, sp in zip(prompts, sampling_params)]
        final: dict[str, RequestOutput] = {}
        while len(final) < len(ids):
            for out in self.engine.step():
                if out.finished:
                    final[out.request_id] = out
        return [final[i] for i in ids]
