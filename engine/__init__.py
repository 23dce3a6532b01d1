"""pagedq's inference engine: paged KV cache, prefix caching, continuous batching."""

from engine.config import EngineConfig
from engine.engine import Engine
from engine.errors import PromptTooLongError
from engine.llm import LLM
from engine.outputs import CompletionOutput, EngineStats, RequestDelta, RequestOutput
from engine.step_stats import StepStats
from schemas.sampling import SamplingParams

__all__ = [
    "LLM",
    "CompletionOutput",
    "Engine",
    "EngineConfig",
    "EngineStats",
    "PromptTooLongError",
    "RequestDelta",
    "RequestOutput",
    "SamplingParams",
    "StepStats",
]
