"""Speculative decoding by prompt lookup: the drafts, and greedy output unchanged by them."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine import LLM, EngineConfig, SamplingParams
from engine.draft_pace import SHADOW_HITS_TO_TRUST, DraftPace
from engine.ngram_proposer import NgramIndex
from engine.outputs import RequestOutput
from engine.scheduler import ScheduledBatch


def brute_force_propose(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The definition: the longest suffix (max_n down to min_n) seen earlier; what followed its
    latest earlier occurrence, continued as the text would go on if it repeated with the period
    between the two occurrences."""
    for n in range(min(max_n, len(tokens)), min_n - 1, -1):
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                period = len(tokens) - (start + n)
                extended = list(tokens)
                while len(extended) < len(tokens) + k:
                    extended.append(extended[-period])
                return extended[start + n : start + n + k]
    return []


@settings(max_examples=200, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 4), min_size=1, max_size=60),
    k=st.integers(0, 6),
    min_n=st.integers(1, 3),
    extra=st.integers(0, 2),
    cut=st.integers(0, 60),
)
def test_ngram_index_matches_brute_force(tokens: list[int], k: int, min_n: int, extra: int, cut: int) -> None:
    """Built incrementally (a prefix first, then the rest, as a sequence grows), the index proposes
    exactly what a full rescan would."""
    index = NgramIndex(min_n, min_n + extra)
    head = tokens[: min(cut, len(tokens))]
    if head:
        assert index.propose(head, k) == brute_force_propose(head, k, min_n, min_n + extra)
    assert index.propose(tokens, k) == brute_force_propose(tokens, k, min_n, min_n + extra)


def test_ngram_index_prefers_longer_and_later_matches() -> None:
    index = NgramIndex(1, 3)
    #        0  1  2  3  4  5  6  7  8  9
    tokens = [5, 1, 2, 9, 7, 1, 2, 8, 4, 2]
    # suffix [2] last followed by 8 (position 6), not 9 (position 2)
    assert index.propose(tokens, 3) == [8, 4, 2]
    tokens += [1, 2]  # suffix [2, 1, 2]: no earlier match; [1, 2] latest at 5-6 -> 8
    assert index.propose(tokens, 2) == [8, 4]
    assert index.propose([7, 7], 3) == []  # a fresh index: nothing but the suffix itself
    assert NgramIndex(1, 2).propose([3], 4) == []


def test_ngram_drafts_continue_a_loop_past_the_end_of_the_context() -> None:
    """A suffix that recurs a few tokens back is a loop: the drafts go round it k times over, not only
    to the end of the context (what greedy decoding of a small model falls into)."""
    assert NgramIndex(2, 4).propose([9, 3, 5, 3, 5], 5) == [3, 5, 3, 5, 3]  # period 2
    assert NgramIndex(1, 1).propose([4, 6, 6], 3) == [6, 6, 6]  # period 1
    assert NgramIndex(2, 2).propose([1, 2, 3, 1, 2, 3, 1, 2], 4) == [3, 1, 2, 3]  # period 3
    # a match far back with enough continuation is cut at k as before
    assert NgramIndex(2, 2).propose([1, 2, 7, 8, 9, 0, 1, 2], 3) == [7, 8, 9]


def test_config_rejects_bad_speculation_knobs() -> None:
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        EngineConfig(num_speculative_tokens=-1)
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        EngineConfig(prompt_lookup_min=3, prompt_lookup_max=2)
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        EngineConfig(prompt_lookup_min=0)
    with pytest.raises(ValueError, match="speculative_disable_by_batch_size"):
        EngineConfig(speculative_disable_by_batch_size=0)


@pytest.mark.parametrize(
    ("dtype", "device", "probed", "limit"),
    [
        ("float32", "cpu", ("avx2", "avx512", "avx512_bf16", "amx"), 32),
        ("bfloat16", "cpu", ("avx2", "avx512", "avx512_bf16"), 32),  # AVX512-bf16 without AMX (Zen 4/5)
        ("bfloat16", "cpu", ("avx2", "avx512", "avx512_bf16", "amx"), 128),
        ("bfloat16", "cuda", (), 128),
    ],
)
def test_draft_batch_limit_follows_where_the_matmuls_run(
    monkeypatch: pytest.MonkeyPatch, dtype: str, device: str, probed: tuple[str, ...], limit: int
) -> None:
    """Drafts ride free only while a step streams weights: AMX and GPUs turn to arithmetic past ~150 rows,
    every other CPU near 32 (bf16 on AVX512-bf16 dot products as fp32: measured in the docstring)."""
    from pagedq_kernels import cpu_isa

    monkeypatch.setattr(cpu_isa, "current", lambda: cpu_isa.CpuIsa(probed=probed, cap=None))
    assert EngineConfig(dtype=dtype, device=device).draft_batch_limit == limit
    assert EngineConfig(dtype=dtype, device=device, speculative_disable_by_batch_size=5).draft_batch_limit == 5


def test_draft_pace_trusts_a_sequence_by_its_record() -> None:
    """Past the batch limit a sequence drafts only on its record: every draft of its last drafted step
    accepted, or SHADOW_HITS_TO_TRUST undrafted proposals in a row that named the sampled token."""
    pace = DraftPace()
    assert not pace.trusted
    for _ in range(SHADOW_HITS_TO_TRUST - 1):
        pace.propose_in_shadow(7)
        pace.record_token(7)
    pace.propose_in_shadow(7)
    pace.record_token(8)  # a miss: the streak starts over
    assert not pace.trusted and pace.shadow_hits == 0
    pace.record_token(7)  # no proposal this step: neither a hit nor a miss
    assert pace.shadow_hits == 0
    for _ in range(SHADOW_HITS_TO_TRUST):
        pace.propose_in_shadow(3)
        pace.record_token(3)
    assert pace.trusted
    pace.record_drafts(5, 5)
    assert pace.trusted
    pace.record_drafts(5, 4)  # one rejected draft ends the trust, shadow streak included
    assert not pace.trusted and pace.shadow_hits == 0
    pace.record_drafts(2, 2)  # a drafted step (below the limit) earns it back whole
    assert pace.trusted


@pytest.mark.parametrize("hard_limit", [False, True])
def test_only_trusted_sequences_draft_past_the_batch_limit(
    tiny_model: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch, hard_limit: bool
) -> None:
    """Past the default limit only sequences whose drafts (or shadow proposals) kept coming true draft,
    and greedy output is what it is without drafts; a limit the user set stops every draft past it."""
    limit = 2
    if not hard_limit:
        monkeypatch.setattr(EngineConfig, "draft_batch_limit", property(lambda self: limit))
    model = tiny_model("qwen2")
    prompts = repetitive_prompts(12, seed=3)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    llm = speculating_llm(model, speculative_disable_by_batch_size=limit if hard_limit else None)
    engine = llm.engine
    propose = engine._propose_drafts
    drafted_past_limit = []

    def checked() -> None:
        propose()
        running = engine.scheduler.running
        if len(running) > limit:
            drafting = [seq for seq in running if seq.spec_token_ids]
            assert all(seq.draft_pace.trusted for seq in drafting)
            drafted_past_limit.append(len(drafting))

    engine._propose_drafts = checked  # type: ignore[method-assign]
    outputs = llm.generate(prompts, params)
    _, plain = generate(model, prompts, params, num_speculative_tokens=0)
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in plain]
    if hard_limit:
        assert drafted_past_limit and not any(drafted_past_limit)
    else:
        assert any(drafted_past_limit), drafted_past_limit  # loops earn trust and draft past the limit
        assert llm.stats().spec_accepted_tokens > 0


def repetitive_prompts(count: int, seed: int) -> list[list[int]]:
    """Prompts that repeat a phrase, so their suffixes always have an earlier match (drafts are
    proposed from the first decode step on)."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(count):
        phrase = [rng.randrange(3, 400) for _ in range(rng.randrange(3, 9))]
        prompts.append([rng.randrange(3, 400) for _ in range(rng.randrange(0, 20))] + phrase * rng.randrange(2, 6))
    return prompts


def generate(
    model: Path, prompts: list[list[int]], params: SamplingParams | list[SamplingParams], **kwargs: Any
) -> tuple[LLM, list[RequestOutput]]:
    llm = LLM(str(model), max_num_seqs=64, max_num_batched_tokens=512, **kwargs)
    return llm, llm.generate(prompts, params)


def speculating_llm(model: Path, **kwargs: Any) -> LLM:
    """An engine drafting up to 5 tokens from 1-token matches on, prefix caching off (every token computed)."""
    return LLM(
        str(model),
        max_num_seqs=64,
        max_num_batched_tokens=512,
        num_speculative_tokens=5,
        prompt_lookup_min=1,
        enable_prefix_caching=False,
        **kwargs,
    )


def count_scheduled_tokens(llm: LLM) -> list[int]:
    """Record how many tokens each step of ``llm``'s engine schedules (into the returned list)."""
    seen: list[int] = []
    schedule = llm.engine.scheduler.schedule

    def spy() -> ScheduledBatch:
        batch = schedule()
        seen.append(batch.total_tokens)
        return batch

    llm.engine.scheduler.schedule = spy  # type: ignore[method-assign]
    return seen


# qwen2 (biased projections) in the default tier; llama_gqa, the longer run (~9 s), in the slow one.
@pytest.mark.parametrize("arch", [pytest.param("llama_gqa", marks=pytest.mark.slow), "qwen2"])
def test_greedy_output_is_unchanged_by_speculation(tiny_model: Callable[[str], Path], arch: str) -> None:
    """Same tokens, text, finish reasons and logprobs with drafts as without, across the stops that
    can land inside a run of accepted drafts (max_tokens, stop tokens, stop strings) and the
    sampling stages that depend on earlier output (penalties, min_tokens), or rewrite logits (logit_bias)."""
    model = tiny_model(arch)
    prompts = repetitive_prompts(12, seed=3)
    variants = [
        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=40, logprobs=3, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=40, repetition_penalty=1.3, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=40, frequency_penalty=0.5, min_tokens=20),
        SamplingParams(top_k=1, max_tokens=33),
        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logit_bias={5: 2.0, 17: -100.0, 200: 1.0}),
    ]
    params = [variants[i % len(variants)] for i in range(len(prompts))]
    spec = speculating_llm(model)
    scheduled = count_scheduled_tokens(spec)
    with_drafts = spec.generate(prompts, params)
    _, plain = generate(model, prompts, params, num_speculative_tokens=0)
    stats = spec.stats()
    assert stats.spec_draft_tokens > 0 and stats.spec_accepted_tokens > 0, stats
    # Every token but each output's last is computed once, plus the rejected drafts: an accepted
    # draft's KV is kept, never recomputed.
    outputs = sum(len(o.outputs[0].token_ids) for o in with_drafts)
    rejected = stats.spec_draft_tokens - stats.spec_accepted_tokens
    assert sum(scheduled) == sum(map(len, prompts)) + outputs - len(prompts) + rejected
    for a, b in zip(with_drafts, plain, strict=True):
        x, y = a.outputs[0], b.outputs[0]
        assert x.token_ids == y.token_ids
        assert x.text == y.text and x.finish_reason == y.finish_reason
        if y.logprobs is not None:
            assert x.logprobs is not None and len(x.logprobs) == len(y.logprobs)
            for p, q in zip(x.logprobs, y.logprobs, strict=True):
                assert p.token_id == q.token_id and [t for t, _ in p.top] == [t for t, _ in q.top]
                assert p.logprob == pytest.approx(q.logprob, abs=1e-4)
    assert stats.num_free_blocks == stats.num_total_blocks  # rejected drafts' blocks went back too


@pytest.mark.slow  # long greedy runs with and without drafts (~9 s)
def test_stop_token_inside_accepted_drafts(tiny_model: Callable[[str], Path]) -> None:
    """A stop token among the tokens of one verified run ends the output there, as it would have
    one step at a time."""
    model = tiny_model("llama_gqa")
    prompts = repetitive_prompts(6, seed=5)
    _, plain = generate(
        model, prompts, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True), num_speculative_tokens=0
    )
    # Stop on each output's 10th token: wherever it falls in a verified run, the output must end there.
    params = [
        SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[o.outputs[0].token_ids[9]], ignore_eos=True)
        for o in plain
    ]
    spec, with_drafts = generate(model, prompts, params, num_speculative_tokens=6, prompt_lookup_min=1)
    _, expected = generate(model, prompts, params, num_speculative_tokens=0)
    assert spec.stats().spec_accepted_tokens > 0
    for a, b in zip(with_drafts, expected, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].finish_reason == b.outputs[0].finish_reason == "stop"
        assert len(a.outputs[0].token_ids) <= 10


def test_sampled_requests_are_not_speculated_and_keep_their_seeds(tiny_model: Callable[[str], Path]) -> None:
    """Drafts are for greedy requests only: a seeded sampled request next to speculating greedy
    ones yields the tokens it yields without speculation."""
    model = tiny_model("llama_gqa")
    prompts = repetitive_prompts(8, seed=7)
    sampled = [SamplingParams(temperature=0.8, seed=11 + i, max_tokens=24) for i in range(len(prompts))]
    greedy = SamplingParams(temperature=0, max_tokens=24)
    params = [sampled[i] if i % 2 else greedy for i in range(len(prompts))]
    spec, with_drafts = generate(model, prompts, params, prompt_lookup_min=1)
    _, plain = generate(model, prompts, params, num_speculative_tokens=0)
    assert spec.stats().spec_draft_tokens > 0
    assert [o.outputs[0].token_ids for o in with_drafts] == [o.outputs[0].token_ids for o in plain]


def test_no_drafts_above_the_batch_size_limit(tiny_model: Callable[[str], Path]) -> None:
    model = tiny_model("llama_gqa")
    prompts = repetitive_prompts(8, seed=9)
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    llm, _ = generate(model, prompts, greedy, speculative_disable_by_batch_size=7, prompt_lookup_min=1)
    engine = llm.engine
    assert engine.num_draft_tokens == 0  # all 8 ran together to the end
    llm.generate(prompts[:7], greedy)
    assert engine.num_draft_tokens > 0


def test_drafts_trimmed_to_the_token_budget_and_dropped_before_preempting(tiny_model: Callable[[str], Path]) -> None:
    """With a step budget of 3 tokens a sequence verifies at most 2 drafts; with the KV cache so
    small that drafts do not fit, they are dropped instead of evicting another sequence."""
    model = tiny_model("llama_gqa")
    prompts = repetitive_prompts(3, seed=11)
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    _, expected = generate(model, prompts, greedy, num_speculative_tokens=0)

    tight = LLM(str(model), max_num_batched_tokens=3, prompt_lookup_min=1)
    seen = count_scheduled_tokens(tight)
    outs = tight.generate([prompts[0]], greedy)
    assert outs[0].outputs[0].token_ids == expected[0].outputs[0].token_ids
    assert tight.engine.num_accepted_tokens > 0 and max(seen) == 3

    # Blocks for exactly the three sequences' contexts, none to spare for drafts.
    block_size = 16
    need = sum(-(-(len(p) + 24) // block_size) for p in prompts)
    small = LLM(str(model), num_kv_blocks=need, block_size=block_size, prompt_lookup_min=1, enable_prefix_caching=False)
    outs = small.generate(prompts, greedy)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in expected]
    assert small.stats().num_preemptions == 0


def test_prefix_cache_after_speculation(tiny_model: Callable[[str], Path]) -> None:
    """Blocks filled by accepted drafts are offered to the prefix cache with the right tokens: a
    second request over one's prompt + output hits them and continues as an uncached run does."""
    model = tiny_model("llama_gqa")
    prompt = repetitive_prompts(1, seed=13)[0]
    greedy = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    llm = LLM(str(model), prompt_lookup_min=1)
    first = llm.generate([prompt], greedy)[0].outputs[0].token_ids
    assert llm.stats().spec_accepted_tokens > 0
    follow = prompt + first
    hot = llm.generate([follow], greedy)[0]
    assert hot.num_cached_tokens >= (len(follow) - 1) // 16 * 16 - 16
    cold = LLM(str(model), enable_prefix_caching=False, num_speculative_tokens=0).generate([follow], greedy)[0]
    assert hot.outputs[0].token_ids == cold.outputs[0].token_ids


def test_a_lone_sequence_over_int8_linears_drafts_within_the_fused_rows(tiny_model: Callable[[str], Path]) -> None:
    """Over int8 linears whose kernel dequantises up to ``fused_rows`` rows in registers, a lone sequence drafts
    at most ``fused_rows - 1`` tokens a step (its verification stays on that path), with the same greedy output;
    several sequences keep ``num_speculative_tokens``."""
    from pagedq_kernels import int8_linear

    model = tiny_model("llama_gqa")
    llm = LLM(
        str(model),
        max_num_batched_tokens=512,
        # more than a lone sequence may take (fused_rows - 1: 5 on AVX2, 11 on AVX-512)
        num_speculative_tokens=max(int8_linear.fused_rows(), 6) + 2,
        prompt_lookup_min=1,
        enable_prefix_caching=False,
        quantization="int8",
    )
    fused = llm.engine.int8_fused_rows
    assert fused == int8_linear.fused_rows()
    if fused < 2:
        pytest.skip("this kernel build has no fused int8 path (the generic one): drafts are not capped")
    engine = llm.engine
    propose = engine._propose_drafts
    seen: list[tuple[int, int]] = []  # (running sequences, most drafts of one)

    def spy() -> None:
        propose()
        running = engine.scheduler.running
        seen.append((len(running), max((len(s.spec_token_ids) for s in running), default=0)))

    engine._propose_drafts = spy  # type: ignore[method-assign]
    prompts = repetitive_prompts(3, seed=5)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    alone = [llm.generate([p], params)[0].outputs[0].token_ids for p in prompts]
    lone = [most for running, most in seen if running == 1]
    assert lone and max(lone) == fused - 1  # drafted, and capped
    seen.clear()
    together = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert max(most for running, most in seen if running > 1) > fused - 1  # not capped for several
    _, plain = generate(model, prompts, params, num_speculative_tokens=0, quantization="int8")
    assert alone == together == [o.outputs[0].token_ids for o in plain]
