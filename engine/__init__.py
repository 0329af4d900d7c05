"""splitserve's inference core, shared by the colocated LLM and both worker kinds."""

from engine.config import EngineConfig
from engine.llm import LLM, demo_model_path
from engine.llm_engine import LLMEngine
from engine.output import RequestOutput
from engine.request import Request, RequestStatus
from engine.sampling_params import InvalidRequest, SamplingParams

__all__ = ["LLM", "EngineConfig", "InvalidRequest", "LLMEngine", "Request", "RequestOutput",
           "RequestStatus", "SamplingParams", "demo_model_path"]
