"""Per-request sampling parameters, validated once at the API boundary.

The engine trusts these values on the hot path (the sampler checks nothing but that its arithmetic
stayed finite, as a last guard), so every constraint lives here, expressed as pydantic ``Field``
bounds or validators so that an invalid request is rejected with an error naming the offending
field. The model is frozen: a request's parameters must not change while the request is in flight,
because the sampler and detokenizer cache derived state.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

# Below this temperature, dividing logits would overflow float32 and the result is argmax anyway.
GREEDY_TEMPERATURE_EPS = 1e-5
MAX_LOGPROBS = 20
# max_tokens=None (vLLM's "up to the context"): past any model's context, and small enough for int32.
UNBOUNDED_MAX_TOKENS = 2**31 - 1
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for a logit_bias value, -100 (ban) to 100 (force)
MAX_LOGIT_BIAS_ENTRIES = 1024  # tokens one request may bias: the sampler's per-step work stays bounded
STRUCTURED_FIELDS = ("json_schema", "regex", "choice", "grammar")

# The sampler computes in float32, whose largest finite value is about 3.4e38 (written out here: the
# schemas never import torch). A parameter that does not fit turns into inf there, and inf arithmetic
# into NaN (0 * inf, inf - inf), which cannot be sampled (issue #17).
FLOAT32_MAX = 3.4028234663852886e38

# repetition_penalty p divides positive logits and multiplies negative ones; a sampled row's
# temperature then divides by at least GREEDY_TEMPERATURE_EPS, i.e. multiplies by up to 1e5. With
# logits up to ~1e3 in magnitude the largest value is 1e3 * max(p, 1/p) * 1e5, which must stay below
# FLOAT32_MAX: max(p, 1/p) < 3.4e38 / 1e8 = 3.4e30. The bounds 1e-6 and 1e6 give 1e3 * 1e6 * 1e5 =
# 1e14 instead, 24 orders of magnitude of margin for models with far larger logits, and are still
# far outside any useful penalty (transformers suggests ~1.2). Issue #17's 1e-300 is rounded to 0 by
# float32, which turns every positive seen logit into inf.
MIN_REPETITION_PENALTY = 1e-6
MAX_REPETITION_PENALTY = 1e6


class SamplingParams(BaseModel):
    """How to turn one request's logits into tokens, and when to stop.

    Field semantics follow vLLM / OpenAI: ``temperature=0`` is greedy; ``top_k`` of -1 or 0 disables
    top-k; ``repetition_penalty`` uses the transformers rule (divide positive logits, multiply negative
    ones) over prompt and output tokens; ``presence_penalty`` / ``frequency_penalty`` use the OpenAI rule
    over output tokens only; ``logprobs=N`` returns the sampled token's logprob plus the top N, computed
    from the raw model logits.
    """

    # allow_inf_nan=False: inf (and NaN) pass a bare ``ge`` bound, and an infinite temperature or
    # penalty makes NaN in the sampler (-inf / inf for a masked token, 0 * inf for a zero logit).
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    n: int = Field(default=1, ge=1, description="Independent samples per prompt.")
    max_tokens: int = Field(default=16, ge=1, description="Most tokens generated per sample.")
    # Declared after max_tokens so its validator can compare against it.
    min_tokens: int = Field(
        default=0,
        ge=0,
        description="EOS and stop tokens are masked, and stop strings not checked, until this many tokens.",
    )
    temperature: float = Field(default=1.0, ge=0.0, description="0 means greedy.")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=-1, ge=-1, description="-1 or 0 disables top-k.")
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(default=1.0, ge=MIN_REPETITION_PENALTY, le=MAX_REPETITION_PENALTY)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    seed: int | None = None
    # Accepts a single string or None on input; always a list afterwards (see _normalize_stop).
    stop: list[str] = Field(default_factory=list)
    stop_token_ids: list[Annotated[int, Field(ge=0)]] = Field(default_factory=list)
    # vLLM's: keep the stop string, or the text of the stop token (EOS or one of stop_token_ids) that ended
    # the output, in its text. Off by default: the text ends where the stop begins (the token stays in
    # the output's token ids either way).
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    logit_bias: dict[int, float] | None = Field(
        default=None,
        max_length=MAX_LOGIT_BIAS_ENTRIES,
        description="Token id -> value added to its logit before sampling (greedy included), -100 to 100.",
    )
    skip_special_tokens: bool = True
    # vLLM's, accepted so its code runs unchanged. Only slow (Python) tokenizers put spaces between special
    # tokens, and vLLM's fast-tokenizer path ignores the flag; pagedq's tokenizers are fast ones.
    spaces_between_special_tokens: bool = True
    # vLLM's: False leaves the offline LLM's texts (and logprobs' decoded tokens) empty, for callers that
    # want token ids only. Stop strings need the text, so they are refused with it (vLLM refuses them too).
    detokenize: bool = True
    # Structured output (at most one): the output must match a JSON schema (a dict, or its JSON text), a
    # regular expression, one of a list of strings, or an EBNF grammar (xgrammar's dialect). The engine
    # compiles the constraint when the request is added and refuses one it cannot compile.
    json_schema: dict[str, Any] | str | None = None
    regex: str | None = Field(default=None, min_length=1)
    choice: list[str] | None = Field(default=None, min_length=1)
    grammar: str | None = Field(default=None, min_length=1)

    @field_validator("max_tokens", mode="before")
    @classmethod
    def _unbounded_max_tokens(cls, value: Any) -> Any:
        # vLLM's max_tokens=None: as many as the context leaves. The engine ends every sample at the
        # model's context anyway (finish_reason "length"), so None becomes a bound it never reaches.
        return UNBOUNDED_MAX_TOKENS if value is None else value

    @field_validator("min_tokens")
    @classmethod
    def _min_le_max(cls, value: int, info: ValidationInfo) -> int:
        max_tokens = info.data.get("max_tokens")
        # max_tokens is absent from info.data when it failed its own validation; report only that.
        if max_tokens is not None and value > max_tokens:
            raise ValueError(f"min_tokens ({value}) must be <= max_tokens ({max_tokens})")
        return value

    @field_validator("choice")
    @classmethod
    def _no_empty_choice(cls, value: list[str] | None) -> list[str] | None:
        # An empty alternative would let the grammar end before the first token: an empty answer.
        if value is not None and any(c == "" for c in value):
            raise ValueError("choice strings must be non-empty")
        return value

    @model_validator(mode="after")
    def _stop_strings_need_text(self) -> SamplingParams:
        if self.stop and not self.detokenize:
            raise ValueError("stop strings need detokenize=True (they are matched in the text)")
        return self

    @model_validator(mode="after")
    def _one_constraint(self) -> SamplingParams:
        given = [f for f in STRUCTURED_FIELDS if getattr(self, f) is not None]
        if len(given) > 1:
            raise ValueError(f"at most one of {', '.join(STRUCTURED_FIELDS)} may be given, got {', '.join(given)}")
        return self

    @field_validator("temperature")
    @classmethod
    def _temperature_fits_float32(cls, value: float) -> float:
        # Beyond float32's range the sampler's division by inf makes NaN of masked (-inf) logits. A
        # validator rather than ``le``, whose message would spell FLOAT32_MAX out in 39 digits.
        if value > FLOAT32_MAX:
            raise ValueError(f"temperature must be <= {FLOAT32_MAX:.3g} (the largest finite float32)")
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

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias_in_range(cls, value: dict[int, float] | None) -> dict[int, float] | None:
        if value is None:
            return None
        for token, bias in value.items():
            if token < 0:
                raise ValueError(f"logit_bias token ids are >= 0, got {token}")
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:  # False for NaN too
                raise ValueError(f"logit_bias values lie in [-100, 100], got {bias} for token {token}")
        return value or None  # an empty map biases nothing

    @property
    def greedy(self) -> bool:
        """True when sampling reduces to argmax: temperature ~0, or top_k=1 (only one candidate left).

        Treating top_k=1 as greedy makes it exactly equal to greedy even on tied logits, and skips the
        noise draw.
        """
        return self.temperature < GREEDY_TEMPERATURE_EPS or self.top_k == 1

    @property
    def structured(self) -> bool:
        """Whether the output is constrained (json_schema, regex, choice or grammar)."""
        return any(getattr(self, f) is not None for f in STRUCTURED_FIELDS)

    @property
    def has_penalties(self) -> bool:
        """Whether any logit penalty is active (the sampler skips the penalty stage otherwise)."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
