"""Issue #17, hostile producers and poison jobs: a request whose sampling cannot work fails alone.

Admission rejects sampling values whose float32 arithmetic cannot stay finite. Requests that get past
it anyway (built here with ``SamplingParams.model_construct``, as a hole in validation would let them)
or whose rows make the sampler raise for any other reason end with ``RequestDelta.error``; ``step()``
never raises for them, and every other request gets exactly the tokens it gets alone.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from engine import LLM, SamplingParams
from engine.engine import Engine
from engine.sampler import NAN_LOGITS, NONFINITE_PROBS, GreedyChoice, Sampler, SamplerOutput, SamplingRow
from schemas.jobs import InvalidJob, JobRequest
from schemas.sampling import MAX_REPETITION_PENALTY, MIN_REPETITION_PENALTY

KV_BYTES = 64 << 20  # plenty for these tests, and quick to allocate


@pytest.fixture(scope="module")
def llm(tiny_model: Callable[[str], Path]) -> LLM:
    return LLM(str(tiny_model("llama_gqa")), max_num_seqs=64, max_num_batched_tokens=512, kv_cache_bytes=KV_BYTES)


def assert_no_leak(engine: Engine) -> None:
    stats = engine.stats()
    assert stats.num_free_blocks == stats.num_total_blocks
    assert stats.running == 0 and stats.waiting == 0 and not engine.requests


def _prompt(rng: random.Random) -> list[int]:
    return [rng.randrange(1, 500) for _ in range(rng.randrange(12, 40))]


def _innocents(rng: random.Random) -> list[tuple[list[int], SamplingParams]]:
    """Greedy (some speculating when alone, some with logprobs) and seeded sampled requests, n up to 2:
    the kinds whose tokens do not depend on their batch."""
    out = []
    for i in range(12):
        if i % 2 == 0:
            params = SamplingParams(temperature=0, max_tokens=rng.randrange(8, 20), logprobs=2 if i % 4 == 0 else None)
        else:
            params = SamplingParams(
                temperature=rng.choice([0.7, 1.0, 1.3]),
                top_p=rng.choice([1.0, 0.9]),
                seed=100 + i,
                n=1 + i % 3 // 2,
                max_tokens=rng.randrange(8, 20),
                ignore_eos=True,
            )
        out.append((_prompt(rng), params))
    return out


def _poison(kind: int) -> SamplingParams:
    """Values admission rejects, each making the arithmetic non-finite its own way."""
    if kind == 0:  # issue #17 itself: 1e-300 is 0 in float32, positive seen logits / 0 = inf
        return SamplingParams.model_construct(temperature=1.0, repetition_penalty=1e-300, max_tokens=8)
    if kind == 1:  # the same, seeded, n = 2: the whole request fails, both samples
        return SamplingParams.model_construct(temperature=1.0, repetition_penalty=1e-300, seed=5, n=2, max_tokens=8)
    if kind == 2:  # greedy: NaN * count makes every logit NaN
        return SamplingParams.model_construct(temperature=0.0, frequency_penalty=math.nan, logprobs=3, max_tokens=8)
    # an infinite temperature divides the min_tokens-masked -inf logits into NaN
    return SamplingParams.model_construct(temperature=math.inf, min_tokens=4, max_tokens=8)


def _alone(llm: LLM, prompt: list[int], params: SamplingParams) -> list[list[int]]:
    return [c.token_ids for c in llm.generate([prompt], params)[0].outputs]


def _drive(
    engine: Engine,
    start: list[tuple[str, list[int], SamplingParams]],
    later: list[tuple[str, list[int], SamplingParams]],
) -> tuple[dict[str, dict[int, list[int]]], dict[str, dict[int, str | None]], dict[str, str]]:
    """Step ``engine`` to the end, adding ``start`` at once and ``later`` two every other step (as poison
    jobs arriving while the others decode). Returns tokens and finish reasons per request and sample,
    and the errors."""
    tokens: dict[str, dict[int, list[int]]] = {}
    reasons: dict[str, dict[int, str | None]] = {}
    errors: dict[str, str] = {}
    for rid, prompt, params in start:
        engine.add_request(rid, prompt, params)
    pending = list(later)
    step = 0
    while engine.has_unfinished() or pending:
        if step % 2 == 0:
            for rid, prompt, params in pending[:2]:
                engine.add_request(rid, prompt, params)
            del pending[:2]
        for delta in engine.step():  # never raises: that is the point
            for d in delta.outputs:
                tokens.setdefault(delta.request_id, {}).setdefault(d.index, []).extend(d.token_ids)
                reasons.setdefault(delta.request_id, {})[d.index] = d.finish_reason
            if delta.error is not None:
                assert delta.finished
                errors[delta.request_id] = delta.error
        step += 1
    return tokens, reasons, errors


# ---------------------------------------------------------------- admission


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"repetition_penalty": 1e-300}, "repetition_penalty"),
        ({"repetition_penalty": MIN_REPETITION_PENALTY / 2}, "repetition_penalty"),
        ({"repetition_penalty": MAX_REPETITION_PENALTY * 2}, "repetition_penalty"),
        ({"repetition_penalty": math.inf}, "repetition_penalty"),
        ({"temperature": math.inf}, "temperature"),
        ({"temperature": 1e39}, "temperature"),  # finite in float64, inf in float32
        ({"temperature": math.nan}, "temperature"),
        ({"presence_penalty": math.nan}, "presence_penalty"),
    ],
)
def test_admission_rejects_values_whose_arithmetic_cannot_be_finite(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_admission_keeps_the_range_up_to_the_bounds() -> None:
    assert SamplingParams(repetition_penalty=MIN_REPETITION_PENALTY).repetition_penalty == MIN_REPETITION_PENALTY
    assert SamplingParams(repetition_penalty=MAX_REPETITION_PENALTY).repetition_penalty == MAX_REPETITION_PENALTY
    assert SamplingParams(temperature=3e38).temperature == 3e38


def test_a_job_with_the_issue_penalty_is_an_invalid_job() -> None:
    """The wire allows (0, 100]; the engine's bound turns the job into a typed rejection at admission."""
    job = JobRequest.model_validate({"id": "j1", "prompt": "hi", "temperature": 1.0, "repetition_penalty": 1e-300})
    with pytest.raises(InvalidJob, match="repetition_penalty"):
        job.sampling_params()


# ---------------------------------------------------------------- the engine


def test_innocent_requests_keep_their_tokens_beside_20_poison_requests(llm: LLM) -> None:
    rng = random.Random(17)
    innocents = [(f"ok{i}", prompt, params) for i, (prompt, params) in enumerate(_innocents(rng))]
    poisons = [(f"poison{i}", _prompt(rng), _poison(i % 4)) for i in range(20)]
    alone = {rid: _alone(llm, prompt, params) for rid, prompt, params in innocents}

    tokens, reasons, errors = _drive(llm.engine, innocents, poisons)

    for rid, _, params in innocents:
        assert [tokens[rid][i] for i in range(params.n)] == alone[rid], rid
        assert rid not in errors
    assert set(errors) == {rid for rid, _, _ in poisons}
    for i, (rid, _, params) in enumerate(poisons):
        assert errors[rid] == (NAN_LOGITS if i % 4 == 2 else NONFINITE_PROBS), rid
        assert reasons[rid] == dict.fromkeys(range(params.n), "error"), rid  # every sample ended "error"
        assert tokens[rid] == {i: [] for i in range(params.n)}, rid  # they failed at their first token
    assert_no_leak(llm.engine)


def test_offline_generate_returns_a_failed_request_instead_of_raising(llm: LLM) -> None:
    """vLLM's LLM.generate returns every request's output; one that failed says so in finish_reason."""
    rng = random.Random(18)
    prompt, good = _prompt(rng), SamplingParams(temperature=0.8, seed=3, max_tokens=10, ignore_eos=True)
    outs = llm.generate([prompt, _prompt(rng)], [good, _poison(1)])
    assert outs[0].error is None and [c.token_ids for c in outs[0].outputs] == _alone(llm, prompt, good)
    assert outs[1].error == NONFINITE_PROBS
    assert [(c.finish_reason, c.token_ids) for c in outs[1].outputs] == [("error", []), ("error", [])]
    assert_no_leak(llm.engine)


MARKER = 499  # first prompt token of the requests RaisingSampler refuses


class RaisingSampler(Sampler):
    """Raises for any batch holding a row whose prompt starts with ``MARKER``: a failure the sampler's
    own guard does not know. It draws first, so the batch's seeded generators have moved on when it
    raises, as they would after a failure midway; the engine must put them back."""

    def sample(self, logits: torch.Tensor | GreedyChoice, rows: list[SamplingRow]) -> SamplerOutput:
        out = super().sample(logits, rows)
        if any(row.prompt_token_ids[:1] == [MARKER] for row in rows):
            raise RuntimeError("this row's sampling broke")
        return out


def test_a_sampler_that_raises_fails_only_the_sequences_that_raise_alone(tiny_model: Callable[[str], Path]) -> None:
    llm = LLM(str(tiny_model("llama_gqa")), max_num_seqs=64, max_num_batched_tokens=512, kv_cache_bytes=KV_BYTES)
    engine = llm.engine
    engine.sampler = RaisingSampler(engine.eos_token_ids)
    rng = random.Random(19)
    innocents = [(f"ok{i}", prompt, params) for i, (prompt, params) in enumerate(_innocents(rng))]
    marked = [
        (f"marked{i}", [MARKER, *_prompt(rng)], SamplingParams(temperature=0.9, seed=i, n=1 + i % 2, max_tokens=6))
        for i in range(6)
    ]
    alone = {rid: _alone(llm, prompt, params) for rid, prompt, params in innocents}

    tokens, reasons, errors = _drive(engine, innocents, marked)

    for rid, _, params in innocents:
        assert [tokens[rid][i] for i in range(params.n)] == alone[rid], rid
    assert errors == {rid: "sampling failed: this row's sampling broke" for rid, _, _ in marked}
    for rid, _, params in marked:
        assert reasons[rid] == dict.fromkeys(range(params.n), "error"), rid
    assert_no_leak(engine)
