"""Per-request sampling parameters, validated once at the API boundary.

The engine trusts these values blindly on the hot path (the sampler does no checking), so every
constraint lives here, expressed as pydantic ``Field`` bounds or validators so that an invalid request
is rejected with an error naming the offending field. The model is frozen: a request's parameters must
not change while the request is in flight, because the sampler and detokenizer cache derived state.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

# Below this temperature, dividing logits would overflow float32 and the result is argmax anyway.
GREEDY_TEMPERATURE_EPS = 1e-5
MAX_LOGPROBS = 20


class SamplingParams(BaseModel):
    """How to turn one request's logits into tokens, and when to stop.

    Field semantics follow vLLM / OpenAI: ``temperature=0`` is greedy; ``top_k`` of -1 or 0 disables
    top-k; ``repetition_penalty`` uses the transformers rule (divide positive logits, multiply negative
    ones) over prompt and output tokens; ``presence_penalty`` / ``frequency_penalty`` use the OpenAI rule
    over output tokens only; ``logprobs=N`` returns the sampled token's logprob plus the top N, computed
    from the raw model logits.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    n: int = Field(default=1, ge=1, description="Independent samples per prompt.")
    max_tokens: int = Field(default=16, ge=1, description="Most tokens generated per sample.")
    # Declared after max_tokens so its validator can compare against it.
    min_tokens: int = Field(default=0, ge=0, description="EOS/stop tokens are masked until this many.")
    temperature: float = Field(default=1.0, ge=0.0, description="0 means greedy.")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=-1, ge=-1, description="-1 or 0 disables top-k.")
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    seed: int | None = None
    # Accepts a single string or None on input; always a list afterwards (see _normalize_stop).
    stop: list[str] = Field(default_factory=list)
    stop_token_ids: list[Annotated[int, Field(ge=0)]] = Field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    skip_special_tokens: bool = True

    @field_validator("min_tokens")
    @classmethod
    def _min_le_max(cls, value: int, info: ValidationInfo) -> int:
        max_tokens = info.data.get("max_tokens")
        # max_tokens is absent from info.data when it failed its own validation; report only that.
        if max_tokens is not None and value > max_tokens:
            raise ValueError(f"min_tokens ({value}) must be <= max_tokens ({max_tokens})")
        return value

    @field_validator("stop", mode="before")
    @classmethod
    def _normalize_stop(cls, value: Any) -> Any:
        if value is None:
            return []
        if isinstance(value, str):
            return [value]
        return value

    @field_validator("stop")
    @classmethod
    def _no_empty_stop(cls, value: list[str]) -> list[str]:
        # An empty stop string would match at offset 0 and end every generation immediately.
        if any(s == "" for s in value):
            raise ValueError("stop strings must be non-empty")
        return value

    @property
    def greedy(self) -> bool:
        """True when sampling reduces to argmax: temperature ~0, or top_k=1 (only one candidate left).

        Treating top_k=1 as greedy makes it exactly equal to greedy even on tied logits, and skips the
        noise draw.
        """
        return self.temperature < GREEDY_TEMPERATURE_EPS or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        """Whether any logit penalty is active (the sampler skips the penalty stage otherwise)."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
