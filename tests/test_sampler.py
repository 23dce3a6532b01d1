"""Sampler: stage numerics against plain references, distributions, seeded batch-independence, and rows
whose arithmetic goes non-finite failing alone."""

from __future__ import annotations

import math
import random
from typing import Any

import pytest
import torch

from engine.sampler import (
    FAILED_TOKEN,
    NAN_LOGITS,
    NO_CANDIDATE,
    NONFINITE_PROBS,
    GreedyChoice,
    Sampler,
    SamplerOutput,
    SamplingRow,
    apply_penalties,
    make_generator,
    min_tokens_blocked,
    plain_greedy,
)
from schemas.sampling import SamplingParams

V = 64
EOS = 0


def _row(
    generator: torch.Generator | None = None,
    prompt: list[int] | None = None,
    output: list[int] | None = None,
    **params: Any,
) -> SamplingRow:
    return SamplingRow(SamplingParams(**params), generator, prompt or [], output or [])


def _chi2_critical(df: int, z: float = 3.09) -> float:
    """Upper quantile of chi-square (Wilson-Hilferty); z=3.09 is the 0.999 quantile."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def _check_distribution(tokens: list[int], expected: torch.Tensor) -> None:
    """Tokens never fall outside the support of ``expected``, and a chi-square test passes on it."""
    n = len(tokens)
    counts = torch.bincount(torch.tensor(tokens), minlength=expected.numel()).double()
    support = expected > 0
    assert counts[~support].sum() == 0, f"sampled excluded tokens: {counts[~support].nonzero().tolist()}"
    exp = expected[support].double() * n
    stat = float(((counts[support] - exp) ** 2 / exp).sum())
    assert stat < _chi2_critical(int(support.sum()) - 1), (stat, (counts / n).tolist(), expected.tolist())


def _draw_many(logits_row: torch.Tensor, n: int, seed: int = 0, **params: Any) -> list[int]:
    """``n`` independent unseeded draws from one logits row, as one batch (the shared generator)."""
    sampler = Sampler({EOS}, generator=torch.Generator().manual_seed(seed))
    shared = SamplingParams(**params)  # one object: building 20k pydantic models would dominate
    rows = [SamplingRow(shared, None, [], []) for _ in range(n)]
    return sampler.sample(logits_row.expand(n, -1).contiguous(), rows).token_ids


# ---------------------------------------------------------------- greedy and top-k=1


def test_all_greedy_is_argmax() -> None:
    logits = torch.randn(8, V, generator=torch.Generator().manual_seed(0))
    out = Sampler({EOS}).sample(logits, [_row(temperature=0) for _ in range(8)])
    assert out.token_ids == logits.argmax(dim=1).tolist()
    assert out.logprobs == [None] * 8


def test_top_k_1_equals_greedy_including_ties() -> None:
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(16, V, generator=gen)
    logits[3, 10] = logits[3, 20] = logits[3].max() + 1  # a tie: both must pick the first index
    greedy = Sampler({EOS}).sample(logits, [_row(temperature=0) for _ in range(16)]).token_ids
    rows = [_row(make_generator(i) if i % 2 else None, temperature=0.5 + i / 4, top_k=1, top_p=0.9) for i in range(16)]
    assert Sampler({EOS}).sample(logits, rows).token_ids == greedy
    assert greedy[3] == 10


def test_sample_does_not_modify_logits() -> None:
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(2))
    before = logits.clone()
    rows = [
        _row(output=[1, 2, 2], repetition_penalty=1.5, frequency_penalty=0.5),
        _row(min_tokens=3, temperature=0.7, top_k=5),
        _row(top_p=0.5, min_p=0.1),
        _row(temperature=0),
    ]
    Sampler({EOS}).sample(logits, rows)
    assert torch.equal(logits, before)


# ---------------------------------------------------------------- seeded reproducibility


def _random_params(rng: random.Random) -> dict[str, Any]:
    return {
        "temperature": rng.choice([0.0, 0.5, 1.0, 1.3]),
        "top_k": rng.choice([-1, 0, 1, 5, 20]),
        "top_p": rng.choice([1.0, 0.9, 0.5]),
        "min_p": rng.choice([0.0, 0.05]),
        "repetition_penalty": rng.choice([1.0, 1.0, 1.3]),
        "presence_penalty": rng.choice([0.0, 0.0, 0.5]),
        "frequency_penalty": rng.choice([0.0, -0.4]),
        "min_tokens": rng.choice([0, 3]),
    }


@pytest.mark.parametrize(
    "target",
    [
        {"temperature": 1.0},
        {"temperature": 0.8, "top_p": 0.9, "top_k": 30},
        {
            "temperature": 1.2,
            "min_p": 0.05,
            "repetition_penalty": 1.3,
            "frequency_penalty": 0.4,
            "min_tokens": 5,
        },
    ],
)
def test_seed_gives_same_tokens_alone_or_in_a_batch(target: dict[str, Any]) -> None:
    """A seeded row draws only from its own generator: 30 other rows change nothing."""
    steps, vocab = 40, 256
    prompt = list(range(5, 25))
    logits_gen = torch.Generator().manual_seed(123)
    step_logits = [torch.randn(vocab, generator=logits_gen) * 3 for _ in range(steps)]

    def run(batch: bool) -> list[int]:
        rng = random.Random(7)
        sampler = Sampler({EOS}, generator=torch.Generator().manual_seed(99))
        gen = make_generator(1234)
        out: list[int] = []
        others = []
        if batch:
            for j in range(30):
                seed = rng.choice([None, j, 1234])  # including another row with the same seed
                others.append(_row(make_generator(seed, j), prompt=[j, j + 1], **_random_params(rng)))
        for t in range(steps):
            position = rng.randrange(len(others) + 1) if batch else 0
            rows = list(others)
            rows.insert(position, SamplingRow(SamplingParams(**target), gen, prompt, list(out)))
            logits = torch.randn(len(rows), vocab, generator=logits_gen) * 3
            logits[position] = step_logits[t]
            tokens = sampler.sample(logits, rows).token_ids
            out.append(tokens[position])
            for row, tok in zip(rows, tokens, strict=True):
                if row is not rows[position]:
                    row.output_token_ids.append(tok)
        return out

    alone = run(batch=False)
    assert run(batch=True) == alone
    assert len(set(alone)) > 5  # actually sampling, not stuck on argmax


def test_make_generator() -> None:
    assert make_generator(None) is None
    assert make_generator(None, 3) is None

    def draws(g: torch.Generator | None) -> list[float]:
        assert g is not None
        return torch.rand(4, generator=g).tolist()

    assert draws(make_generator(42)) == torch.rand(4, generator=torch.Generator().manual_seed(42)).tolist()
    assert draws(make_generator(42, 1)) == draws(make_generator(42, 1))
    samples = {tuple(draws(make_generator(42, i))) for i in range(8)}
    assert len(samples) == 8  # distinct streams for the n samples of one request
    assert draws(make_generator(-5)) == draws(make_generator(-5))  # negative seeds are accepted


def test_seeded_rows_with_different_indices_differ() -> None:
    logits = torch.zeros(4, V)  # uniform: only the noise decides
    rows = [_row(make_generator(11, i)) for i in range(4)]
    tokens = Sampler({EOS}).sample(logits, rows).token_ids
    assert len(set(tokens)) > 1


# ---------------------------------------------------------------- penalties


def _reference_penalties(logits: torch.Tensor, row: SamplingRow) -> torch.Tensor:
    """Straightforward per-token loops: transformers repetition penalty, then OpenAI penalties."""
    out = logits.clone()
    p = row.params
    for tok in set(row.prompt_token_ids) | set(row.output_token_ids):
        value = float(out[tok])
        out[tok] = value / p.repetition_penalty if value > 0 else value * p.repetition_penalty
    for tok in set(row.output_token_ids):
        count = row.output_token_ids.count(tok)
        out[tok] -= p.frequency_penalty * count + p.presence_penalty
    return out


def test_penalties_match_reference() -> None:
    gen = torch.Generator().manual_seed(3)
    vocab = 12
    logits = torch.randn(5, vocab, generator=gen) * 2
    rows = [
        _row(prompt=[1, 2, 3], output=[3, 4, 4, 4], repetition_penalty=1.5),
        _row(prompt=[1], output=[5, 5, 6], frequency_penalty=0.7, presence_penalty=0.3),
        _row(
            prompt=[7, 8],
            output=[8, 9, 9, 11],
            repetition_penalty=0.8,
            frequency_penalty=-0.5,
            presence_penalty=1.0,
        ),
        _row(prompt=[1, 2], output=[2]),  # no penalties: untouched
        _row(prompt=[], output=[], repetition_penalty=2.0),  # nothing to penalise
    ]
    expected = torch.stack([_reference_penalties(logits[i], r) for i, r in enumerate(rows)])
    penalised = logits.clone()
    apply_penalties(penalised, rows)
    torch.testing.assert_close(penalised, expected)
    # Through the Sampler (greedy copies of the rows): the argmax is taken on the penalised logits.
    greedy_rows = [
        SamplingRow(r.params.model_copy(update={"temperature": 0.0}), None, r.prompt_token_ids, r.output_token_ids)
        for r in rows
    ]
    assert Sampler({EOS}).sample(logits, greedy_rows).token_ids == expected.argmax(dim=1).tolist()


def test_penalties_change_the_greedy_choice() -> None:
    logits = torch.tensor([[0.0, 5.0, 4.0, 1.0]])
    assert Sampler({EOS}).sample(logits, [_row(temperature=0)]).token_ids == [1]
    rows = [_row(temperature=0, output=[1], repetition_penalty=2.0)]  # 5 -> 2.5 < 4
    assert Sampler({EOS}).sample(logits, rows).token_ids == [2]
    rows = [_row(temperature=0, output=[1, 1], frequency_penalty=1.0)]  # 5 -> 3 < 4
    assert Sampler({EOS}).sample(logits, rows).token_ids == [2]
    rows = [_row(temperature=0, output=[1, 1, 1, 1], presence_penalty=1.5)]  # once: 5 -> 3.5
    assert Sampler({EOS}).sample(logits, rows).token_ids == [2]


def test_logit_bias_bans_forces_and_shifts_only_its_own_row() -> None:
    logits = torch.tensor([[0.0, 5.0, 4.0, 1.0], [0.0, 5.0, 4.0, 1.0], [0.0, 5.0, 4.0, 1.0]])
    before = logits.clone()
    rows = [
        _row(temperature=0, logit_bias={1: -100}),  # the argmax banned: the runner-up wins
        _row(temperature=0, logit_bias={3: 4.5}),  # 1 + 4.5 > 5
        _row(temperature=0),  # no bias: untouched by the others'
    ]
    out = Sampler({EOS}).sample(logits, rows)
    assert out.token_ids == [2, 3, 1]
    assert torch.equal(logits, before)  # the caller's logits are not modified
    forced = _draw_many(torch.tensor([3.0, 2.0, 1.0, 0.0]), 500, temperature=1.0, logit_bias={3: 100})
    assert set(forced) == {3}  # +100 all but forces a token when sampling too
    banned = _draw_many(torch.tensor([3.0, 2.0, 1.0, 0.0]), 500, temperature=1.0, logit_bias={0: -100})
    assert 0 not in banned and set(banned) <= {1, 2, 3}
    assert not plain_greedy(SamplingParams(temperature=0, logit_bias={1: 1.0}), 0)  # needs the logits


def test_logit_bias_is_validated() -> None:
    assert SamplingParams(logit_bias={}).logit_bias is None
    for bad in ({-1: 1.0}, {5: 100.5}, {5: float("nan")}, {i: 1.0 for i in range(1025)}):
        with pytest.raises(ValueError, match="logit_bias"):
            SamplingParams(logit_bias=bad)


# ---------------------------------------------------------------- min_tokens


def test_min_tokens_masks_eos_and_stop_tokens() -> None:
    logits = torch.tensor([[9.0, 1.0, 8.0, 7.0, 0.0]])
    sampler = Sampler({EOS})
    params: dict[str, Any] = {"temperature": 0, "min_tokens": 2, "stop_token_ids": [2]}
    assert sampler.sample(logits, [_row(output=[4], **params)]).token_ids == [3]
    assert sampler.sample(logits, [_row(output=[4, 4], **params)]).token_ids == [0]  # reached
    # ignore_eos only affects stopping: EOS is still masked below min_tokens
    assert sampler.sample(logits, [_row(output=[], ignore_eos=True, **params)]).token_ids == [3]


def test_min_tokens_masks_eos_when_sampling() -> None:
    logits = torch.tensor([10.0, 0.0, 0.0, 9.0])
    tokens = _draw_many(logits, 2000, min_tokens=1)
    assert EOS not in tokens
    assert set(tokens) <= {1, 2, 3}


def test_multiple_eos_ids_are_masked() -> None:
    logits = torch.tensor([[9.0, 8.0, 1.0, 2.0]])
    out = Sampler({0, 1}).sample(logits, [_row(temperature=0, min_tokens=1)])
    assert out.token_ids == [3]


# ---------------------------------------------------------------- distributions (20k draws, fixed seed)

BASE = torch.log(torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05]))
N = 20_000


def test_temperature_distribution() -> None:
    for temperature in (0.5, 1.0, 1.7):
        expected = torch.softmax(BASE / temperature, dim=0)
        _check_distribution(_draw_many(BASE, N, temperature=temperature), expected)


def test_top_k_distribution() -> None:
    expected = torch.tensor([0.4, 0.3, 0, 0, 0]) / 0.7
    _check_distribution(_draw_many(BASE, N, top_k=2), expected)


def test_top_p_distribution() -> None:
    # mass before token 2 is 0.70 < 0.8 (kept), before token 3 it is 0.85 >= 0.8 (dropped)
    expected = torch.tensor([0.4, 0.3, 0.15, 0, 0]) / 0.85
    _check_distribution(_draw_many(BASE, N, top_p=0.8), expected)


def test_top_p_keeps_the_top_token() -> None:
    assert set(_draw_many(BASE, 500, top_p=0.01)) == {0}


def test_min_p_distribution() -> None:
    # threshold 0.3 * 0.4 = 0.12: tokens 0, 1, 2 survive
    expected = torch.tensor([0.4, 0.3, 0.15, 0, 0]) / 0.85
    _check_distribution(_draw_many(BASE, N, min_p=0.3), expected)


def test_stage_order_temperature_then_top_k_then_top_p() -> None:
    # T=0.5 squares and renormalises; top_k=4 drops token 4; top_p=0.9 then acts on that distribution.
    tempered = torch.softmax(BASE / 0.5, dim=0)
    tempered[4] = 0
    tempered /= tempered.sum()
    keep = (torch.cumsum(tempered, 0) - tempered) < 0.9
    expected = torch.where(keep, tempered, torch.zeros_like(tempered))
    expected /= expected.sum()
    assert int(keep.sum()) == 3  # the case is discriminating: top_p cuts token 3
    _check_distribution(_draw_many(BASE, N, temperature=0.5, top_k=4, top_p=0.9), expected)


def test_seeded_row_distribution() -> None:
    """Draws from one seeded generator over many steps follow the distribution too."""
    sampler = Sampler({EOS})
    gen = make_generator(5)
    row = SamplingRow(SamplingParams(temperature=1.0), gen, [], [])
    logits = BASE.unsqueeze(0)
    tokens = [sampler.sample(logits, [row]).token_ids[0] for _ in range(3000)]
    _check_distribution(tokens, torch.softmax(BASE, dim=0))


def test_mixed_batch_rows_use_their_own_params() -> None:
    n = 6000
    logits = BASE.expand(3 * n, -1).contiguous()
    rows = [
        SamplingRow(params, None, [], [])
        for params in (SamplingParams(temperature=0), SamplingParams(top_k=2), SamplingParams(min_p=0.3))
        for _ in range(n)
    ]
    tokens = Sampler({EOS}, generator=torch.Generator().manual_seed(4)).sample(logits, rows).token_ids
    assert set(tokens[:n]) == {0}
    _check_distribution(tokens[n : 2 * n], torch.tensor([0.4, 0.3, 0, 0, 0]) / 0.7)
    _check_distribution(tokens[2 * n :], torch.tensor([0.4, 0.3, 0.15, 0, 0]) / 0.85)


# ---------------------------------------------------------------- logprobs


def test_logprobs_are_from_raw_logits() -> None:
    gen = torch.Generator().manual_seed(6)
    logits = torch.randn(4, V, generator=gen)
    rows = [
        _row(temperature=0, logprobs=5),
        _row(make_generator(1), temperature=0.3, repetition_penalty=1.5, output=[1, 2], logprobs=0),
        _row(temperature=0.9),  # did not ask
        _row(make_generator(2), top_k=3, logprobs=20),
    ]
    out = Sampler({EOS}).sample(logits, rows)
    reference = torch.log_softmax(logits, dim=1)
    assert out.logprobs[2] is None
    for i in (0, 1, 3):
        lp = out.logprobs[i]
        assert lp is not None
        assert lp.token_id == out.token_ids[i]
        assert lp.logprob == pytest.approx(float(reference[i, out.token_ids[i]]), abs=1e-6)
        n = rows[i].params.logprobs
        assert n is not None and len(lp.top) == n
        top = torch.topk(reference[i], n) if n else None
        if top is not None:
            assert [t for t, _ in lp.top] == top.indices.tolist()
            assert [v for _, v in lp.top] == pytest.approx(top.values.tolist(), abs=1e-6)
            assert all(a[1] >= b[1] for a, b in zip(lp.top, lp.top[1:], strict=False))
    first = out.logprobs[0]
    assert first is not None and first.top[0][0] == first.token_id  # greedy picks the top-1


def test_non_float32_logits() -> None:
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16)
    rows = [_row(temperature=0, logprobs=2), _row(make_generator(3)), _row(top_p=0.5)]
    out = Sampler({EOS}).sample(logits, rows)
    assert out.token_ids[0] == int(logits.float().argmax(dim=1)[0])
    assert all(0 <= t < V for t in out.token_ids)


def test_shape_mismatch_is_an_error() -> None:
    with pytest.raises(ValueError, match="does not match"):
        Sampler({EOS}).sample(torch.zeros(2, V), [_row()])


# ---------------------------------------------------------------- rows that cannot be sampled fail alone


def _unchecked_row(generator: torch.Generator | None, prompt: list[int], **params: Any) -> SamplingRow:
    """A row whose params skip validation: admission rejects these values, the sampler must survive them."""
    return SamplingRow(SamplingParams.model_construct(**params), generator, prompt, [])


def _mixed_rows(prompt: list[int] | None = None) -> list[SamplingRow]:
    """Greedy, seeded and unseeded sampled rows, some with logprobs: what a real batch holds. Fresh
    generators on every call, so two calls draw the same numbers."""
    return [
        _row(None, prompt, temperature=0, logprobs=2),
        _row(make_generator(1), prompt, temperature=0.9, logprobs=1),
        _row(None, prompt, temperature=1.0),
        _row(make_generator(2), prompt, temperature=0.7, top_p=0.9),
        _row(None, prompt, temperature=0),
        _row(None, prompt, temperature=1.2, top_k=10),
    ]


def _sample(logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
    return Sampler({EOS}, generator=torch.Generator().manual_seed(5)).sample(logits, rows)


def _assert_only_these_failed(clean: SamplerOutput, out: SamplerOutput, failed: dict[int, str]) -> None:
    """``out`` failed exactly the ``failed`` rows; every other row has ``clean``'s token and logprobs."""
    assert out.failed == failed
    for i, token in enumerate(out.token_ids):
        if i in failed:
            assert token == FAILED_TOKEN and out.logprobs[i] is None
        else:
            assert (token, out.logprobs[i]) == (clean.token_ids[i], clean.logprobs[i]), i


def test_nan_logits_fail_only_their_rows() -> None:
    """A NaN in a greedy row is found by the argmax pass itself (max propagates NaN); in a sampled row,
    by the probabilities' sum. Every other row draws what it draws without the poison, the unseeded
    ones included: a failed unseeded row stays in the shared multinomial call."""
    logits = torch.randn(6, V, generator=torch.Generator().manual_seed(20))
    poisoned = logits.clone()
    poisoned[4, 7] = float("nan")  # greedy
    poisoned[2, 3] = float("nan")  # sampled, unseeded
    poisoned[3, 9] = float("nan")  # sampled, seeded
    out = _sample(poisoned, _mixed_rows())
    _assert_only_these_failed(
        _sample(logits, _mixed_rows()), out, {4: NAN_LOGITS, 2: NONFINITE_PROBS, 3: NONFINITE_PROBS}
    )


def test_all_minus_inf_rows_fail() -> None:
    """Nothing left to choose: a greedy row would silently take token 0, a sampled row would raise."""
    logits = torch.randn(6, V, generator=torch.Generator().manual_seed(21))
    poisoned = logits.clone()
    poisoned[0] = float("-inf")
    poisoned[5] = float("-inf")
    out = _sample(poisoned, _mixed_rows())
    _assert_only_these_failed(_sample(logits, _mixed_rows()), out, {0: NO_CANDIDATE, 5: NONFINITE_PROBS})


def test_all_greedy_batch_fails_only_its_nan_row() -> None:
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(23))
    logits[1, 0] = float("nan")
    out = Sampler({EOS}).sample(logits, [_row(temperature=0) for _ in range(4)])
    assert out.failed == {1: NAN_LOGITS}
    expected = logits.argmax(dim=1).tolist()
    assert out.token_ids == [expected[0], FAILED_TOKEN, expected[2], expected[3]]


def test_min_tokens_masking_every_token_fails_the_row() -> None:
    """The reason names min_tokens, not penalties: EOS and the stop tokens were all that was left."""
    logits = torch.tensor([[1.0, 2.0], [3.0, 1.0]])
    rows = [_row(temperature=0, min_tokens=1), _row(temperature=0)]
    out = Sampler({0, 1}).sample(logits, rows)
    assert out.failed == {0: min_tokens_blocked(rows[0].params, 0, constrained=False)}
    assert out.failed[0].startswith("no token left to choose: only EOS or stop tokens are possible, but min_tokens=1")
    assert out.token_ids == [FAILED_TOKEN, 0]


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_grammar_that_must_end_under_min_tokens_fails_alone_and_says_why(temperature: float) -> None:
    """A structured-output row whose bitmask left only EOS (a complete ``choice``) while min_tokens bans
    it: greedy and sampled rows get the same reason naming both causes (not "non-finite probabilities"),
    and the other rows sample what they sample without it."""
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(24))
    masked = logits.clone()
    masked[1, 1:] = float("-inf")  # the grammar allows EOS (token 0) alone
    rows = _mixed_rows()[:4]
    rows[1] = SamplingRow(
        SamplingParams(temperature=temperature, min_tokens=5, seed=3),
        make_generator(3),
        [7],
        [11, 12],
        constrained=True,
    )
    out = _sample(masked, rows)
    reason = min_tokens_blocked(rows[1].params, 2, constrained=True)
    assert reason.startswith("structured output: the grammar allows only ending here")
    assert "min_tokens=5" in reason and "(it has 2)" in reason
    clean_rows = _mixed_rows()[:4]
    _assert_only_these_failed(_sample(logits, clean_rows), out, {1: reason})


def test_rows_empty_before_the_bans_keep_their_reason() -> None:
    """A row with nothing above -inf before min_tokens' bans, or NaN, was not emptied by them."""
    logits = torch.full((2, V), float("-inf"))
    logits[1, 3] = float("nan")
    rows = [_row(temperature=0, min_tokens=2), _row(temperature=0, min_tokens=2)]
    assert _sample(logits, rows).failed == {0: NO_CANDIDATE, 1: NAN_LOGITS}


def test_infinite_logits_after_a_penalty_fail_sampled_rows() -> None:
    """Issue #17's producer: repetition_penalty=1e-300 (0 in float32) turns every positive seen logit
    into +inf, and softmax turns +inf into NaN. A greedy row with the same penalty still has a
    well-defined argmax (the first +inf), so only the sampled rows fail."""
    logits = torch.randn(6, V, generator=torch.Generator().manual_seed(22))
    logits[:, 5] = 4.0  # a positive logit on a prompt token of every row
    prompt = [5, 6, 7]
    poisoned = _mixed_rows(prompt)
    poisoned[1] = _unchecked_row(make_generator(1), prompt, temperature=0.9, repetition_penalty=1e-300, logprobs=1)
    poisoned[2] = _unchecked_row(None, prompt, temperature=1.0, repetition_penalty=1e-300)
    poisoned[4] = _unchecked_row(None, prompt, temperature=0.0, repetition_penalty=1e-300)
    out = _sample(logits, poisoned)
    assert out.token_ids[4] == 5  # the greedy row: argmax lands on the +inf
    clean = _sample(logits, _mixed_rows(prompt))
    clean.token_ids[4] = 5
    _assert_only_these_failed(clean, out, {1: NONFINITE_PROBS, 2: NONFINITE_PROBS})


def test_a_failed_seeded_row_does_not_draw() -> None:
    """Its generator is left as it was: nothing was sampled, so nothing was consumed."""
    gen = make_generator(9)
    assert gen is not None
    before = gen.get_state()
    out = Sampler({EOS}).sample(torch.full((1, V), float("nan")), [_row(gen, temperature=1.0)])
    assert out.failed == {0: NONFINITE_PROBS}
    assert torch.equal(gen.get_state(), before)


def test_greedy_choice_samples_what_the_logits_sample() -> None:
    """A GreedyChoice (the head's argmax without its logits) gives the tokens and failures the logits give."""
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(3))
    logits[1] = float("-inf")  # nothing to choose
    logits[2, 7] = float("nan")
    params = SamplingParams(temperature=0.0)
    rows = [SamplingRow(params, None, [1, 2], []) for _ in range(4)]
    sampler = Sampler(eos_token_ids={0})
    want = sampler.sample(logits, rows)
    values, indices = logits.max(dim=1)
    got = sampler.sample(GreedyChoice(values, indices), rows)
    assert got.token_ids == want.token_ids and got.failed == want.failed and got.logprobs == [None] * 4
    asked = [SamplingRow(SamplingParams(temperature=0.0, logprobs=1), None, [1], []), *rows[1:]]
    with pytest.raises(ValueError, match="plain greedy"):
        sampler.sample(GreedyChoice(values, indices), asked)
