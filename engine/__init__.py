"""pagedq's inference engine: paged KV cache, prefix caching, continuous batching."""

# First, before anything imports torch (and libgomp reads its environment): importing cpu_runtime sets
# how idle OpenMP threads wait, which shared cores punish when they spin (engine/cpu_runtime.py).
from engine import cpu_runtime  # noqa: F401  # isort: skip
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
