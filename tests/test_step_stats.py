"""The engine's own step statistics (``Engine.step_stats``): counts that add up to the work asked for, phase
times that fit inside the step time, KV usage as seen after each step, block fill only when asked for.

Each test drives a tiny random-weight model and checks the counters against what it can work out on its
own (prompt and output lengths, the number of ``step()`` calls, the KV usage it reads between steps).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from engine import LLM, Engine, EngineConfig, SamplingParams, StepStats

NAMED_PHASES = ("schedule", "prepare_inputs", "forward", "sample", "append_tokens")  # detokenize is inside append


@dataclass
class Run:
    """What a test saw while it stepped the engine itself."""

    calls: int  # step() calls
    wall_s: float  # around the whole loop
    usages: list[float]  # KV usage after each step
    fills: list[tuple[int, int]]  # (filled, allocated) slots of the running sequences after each step


def make_engine(model: Path, max_num_batched_tokens: int = 2048) -> Engine:
    """No drafts and no prefix cache: every token the engine schedules is a prompt or an output token."""
    config = EngineConfig(
        model=str(model),
        max_num_batched_tokens=max_num_batched_tokens,
        num_speculative_tokens=0,
        enable_prefix_caching=False,
    )
    return Engine(config)


def submit(engine: Engine, prompt_lens: list[int], max_tokens: list[int], seed: int) -> None:
    rng = random.Random(seed)
    for i, (length, count) in enumerate(zip(prompt_lens, max_tokens, strict=True)):
        prompt = [rng.randrange(3, 500) for _ in range(length)]
        engine.add_request(f"r{seed}-{i}", prompt, SamplingParams(temperature=0, max_tokens=count, ignore_eos=True))


def step_until_done(engine: Engine) -> Run:
    calls = 0
    usages: list[float] = []
    fills: list[tuple[int, int]] = []
    started = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
        calls += 1
        usages.append(engine.kv.usage())
        fills.append(engine.kv.filled_slots(engine.scheduler.running))
    return Run(calls, time.perf_counter() - started, usages, fills)


def assert_phases_fit(stats: StepStats, wall_s: float) -> None:
    assert set(stats.phase_s) == {*NAMED_PHASES, "detokenize"}
    assert stats.step_s >= 0.0 and all(seconds >= 0.0 for seconds in stats.phase_s.values()), stats.phase_s
    assert stats.phase_s["forward"] > 0 and stats.phase_s["detokenize"] > 0 and stats.phase_s["schedule"] > 0
    assert stats.phase_s["detokenize"] <= stats.phase_s["append_tokens"]
    named = sum(stats.phase_s[phase] for phase in NAMED_PHASES)
    assert named <= stats.step_s <= wall_s
    assert stats.other_s == pytest.approx(stats.step_s - named)
    assert stats.stop_checks_s == pytest.approx(stats.phase_s["append_tokens"] - stats.phase_s["detokenize"])


def test_one_prefill_step_then_decode_steps(tiny_model: Callable[[str], Path]) -> None:
    """Every prompt fits the first step's budget: one mixed step, then one decode-only step per token."""
    engine = make_engine(tiny_model("llama_gqa"), max_num_batched_tokens=2048)
    prompt_lens, max_tokens = [5, 23, 40, 9], [4, 9, 1, 6]
    submit(engine, prompt_lens, max_tokens, seed=1)
    run = step_until_done(engine)
    stats = engine.step_stats

    assert run.calls == max(max_tokens)
    assert stats.steps == run.calls
    assert stats.scheduled_tokens == sum(prompt_lens) + sum(max_tokens) - len(prompt_lens)
    assert stats.scheduled_seqs == sum(max_tokens)  # each sequence: its prefill step, then one per further token
    assert stats.decode_only_steps == run.calls - 1
    assert_phases_fit(stats, run.wall_s)


def test_chunked_prefill_counts_every_scheduled_token(tiny_model: Callable[[str], Path]) -> None:
    """A small token budget splits the prompts over several steps; the tokens still add up exactly."""
    engine = make_engine(tiny_model("llama_gqa"), max_num_batched_tokens=32)
    prompt_lens, max_tokens = [70, 12, 45, 3, 31], [5, 8, 2, 11, 1]
    submit(engine, prompt_lens, max_tokens, seed=2)
    run = step_until_done(engine)
    stats = engine.step_stats

    assert engine.scheduler.num_preemptions == 0
    assert stats.steps == run.calls
    assert stats.scheduled_tokens == sum(prompt_lens) + sum(max_tokens) - len(prompt_lens)
    assert stats.scheduled_tokens <= 32 * stats.steps
    assert stats.scheduled_seqs >= sum(max_tokens)  # chunked prompts take more than one step
    assert 0 < stats.decode_only_steps < stats.steps
    assert_phases_fit(stats, run.wall_s)


def test_kv_usage_peak_and_block_fill_only_when_tracked(tiny_model: Callable[[str], Path]) -> None:
    engine = make_engine(tiny_model("llama_gqa"), max_num_batched_tokens=64)
    submit(engine, [30, 50, 17], [6, 12, 9], seed=3)
    run = step_until_done(engine)
    stats = engine.step_stats
    assert stats.peak_kv_usage == max(run.usages) > 0
    assert (stats.filled_slots, stats.allocated_slots, stats.block_fill_s) == (0, 0, 0.0)  # off by default

    stats.reset()
    stats.track_block_fill = True
    submit(engine, [30, 50, 17], [6, 12, 9], seed=4)
    run = step_until_done(engine)
    peak_step = run.usages.index(max(run.usages))
    filled, allocated = run.fills[peak_step]
    assert stats.peak_kv_usage == run.usages[peak_step]
    assert stats.block_fill_at_peak == pytest.approx(filled / allocated)
    assert 0 < stats.block_fill_at_peak <= 1
    assert 0 < stats.mean_block_fill <= 1 and stats.allocated_slots >= allocated
    assert stats.block_fill_s > 0


def test_reset_zeroes_the_counters_and_keeps_tracking(tiny_model: Callable[[str], Path]) -> None:
    engine = make_engine(tiny_model("llama_gqa"))
    submit(engine, [8, 8], [3, 3], seed=5)
    step_until_done(engine)
    stats = engine.step_stats
    assert stats.steps > 0
    stats.track_block_fill = True
    stats.reset()
    assert stats == StepStats(track_block_fill=True)
    assert engine.runner.stats is stats  # the runner's forward times land in the same, reset, object

    submit(engine, [8], [2], seed=6)
    run = step_until_done(engine)
    assert stats.steps == run.calls == 2 and stats.phase_s["forward"] > 0


def test_scheduled_tokens_include_rejected_drafts(tiny_model: Callable[[str], Path]) -> None:
    """With speculative decoding each step also verifies drafts: the rejected ones are extra work."""
    rng = random.Random(7)
    prompts = []
    for _ in range(6):
        phrase = [rng.randrange(3, 400) for _ in range(rng.randrange(3, 8))]
        prompts.append([rng.randrange(3, 400) for _ in range(rng.randrange(0, 10))] + phrase * rng.randrange(2, 5))
    llm = LLM(str(tiny_model("llama_gqa")), num_speculative_tokens=4, prompt_lookup_min=1, enable_prefix_caching=False)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    stats, engine = llm.engine.step_stats, llm.engine
    assert engine.num_draft_tokens > 0
    outputs = sum(len(o.outputs[0].token_ids) for o in outs)
    rejected = engine.num_draft_tokens - engine.num_accepted_tokens
    assert stats.scheduled_tokens == sum(map(len, prompts)) + outputs - len(prompts) + rejected
    assert stats.steps < outputs  # accepted drafts are tokens without steps of their own
