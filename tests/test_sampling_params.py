"""SamplingParams validation: bad requests are rejected with errors that name the field."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from schemas.sampling import SamplingParams


def _error_fields(kwargs: dict[str, Any]) -> list[str]:
    with pytest.raises(ValidationError) as info:
        SamplingParams.model_validate(kwargs)
    return [".".join(str(p) for p in err["loc"]) for err in info.value.errors()]


def test_defaults() -> None:
    p = SamplingParams()
    assert (p.n, p.max_tokens, p.min_tokens, p.temperature, p.top_p, p.top_k, p.min_p) == (
        1,
        16,
        0,
        1.0,
        1.0,
        -1,
        0.0,
    )
    assert p.repetition_penalty == 1.0 and p.presence_penalty == 0.0 and p.frequency_penalty == 0.0
    assert p.seed is None and p.stop == [] and p.stop_token_ids == [] and p.logprobs is None
    assert not p.ignore_eos and p.skip_special_tokens
    assert not p.greedy and not p.has_penalties


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"min_p": -0.1}, "min_p"),
        ({"n": 0}, "n"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 17}, "min_tokens"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"logprobs": 21}, "logprobs"),
        ({"logprobs": -1}, "logprobs"),
        ({"stop": ""}, "stop"),
        ({"stop": ["ok", ""]}, "stop"),
        ({"stop_token_ids": [5, -1]}, "stop_token_ids.1"),
        ({"temperature": "hot"}, "temperature"),
        ({"bogus_field": 1}, "bogus_field"),
    ],
)
def test_invalid_values_name_the_field(kwargs: dict[str, Any], field: str) -> None:
    assert _error_fields(kwargs) == [field]


def test_messages_say_why() -> None:
    with pytest.raises(ValidationError) as info:
        SamplingParams.model_validate({"min_tokens": 20, "max_tokens": 10})
    assert "min_tokens (20) must be <= max_tokens (10)" in str(info.value)
    with pytest.raises(ValidationError) as info:
        SamplingParams.model_validate({"temprature": 0.5})
    assert "temprature" in str(info.value) and "Extra inputs are not permitted" in str(info.value)
    with pytest.raises(ValidationError) as info:
        SamplingParams(temperature=-1)
    assert "greater than or equal to 0" in str(info.value)


def test_min_tokens_only_reports_max_tokens_when_that_is_invalid() -> None:
    assert _error_fields({"max_tokens": 0, "min_tokens": 5}) == ["max_tokens"]


def test_min_tokens_up_to_max_tokens() -> None:
    assert SamplingParams(min_tokens=16, max_tokens=16).min_tokens == 16


@pytest.mark.parametrize(("stop", "expected"), [(None, []), ("###", ["###"]), (["a", "bc"], ["a", "bc"])])
def test_stop_is_normalized_to_a_list(stop: Any, expected: list[str]) -> None:
    assert SamplingParams.model_validate({"stop": stop}).stop == expected


@pytest.mark.parametrize(
    ("kwargs", "greedy"),
    [
        ({"temperature": 0}, True),
        ({"temperature": 0.0, "top_p": 0.5}, True),
        ({"temperature": 1e-7}, True),
        ({"temperature": 0.7, "top_k": 1}, True),
        ({"temperature": 0.7}, False),
        ({"temperature": 0.7, "top_k": 2}, False),
    ],
)
def test_greedy(kwargs: dict[str, Any], greedy: bool) -> None:
    assert SamplingParams.model_validate(kwargs).greedy is greedy


def test_has_penalties() -> None:
    assert SamplingParams(repetition_penalty=1.2).has_penalties
    assert SamplingParams(presence_penalty=-0.5).has_penalties
    assert SamplingParams(frequency_penalty=0.1).has_penalties


def test_frozen() -> None:
    p = SamplingParams()
    with pytest.raises(ValidationError):
        p.temperature = 0.5


def test_json_round_trip() -> None:
    p = SamplingParams(n=2, temperature=0.3, stop=["\n"], seed=7, logprobs=3)
    assert SamplingParams.model_validate_json(p.model_dump_json()) == p
