"""Engine behaviour beyond parity: prefix caching, abort/no leaks, seeds in batches, n > 1, stops, priorities."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest

from engine import LLM, Engine, EngineConfig, PromptTooLongError, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_model: Callable[[str], Path]) -> LLM:
    return LLM(str(tiny_model("llama_gqa")), max_num_seqs=64, max_num_batched_tokens=256)


def assert_no_leak(llm: LLM) -> None:
    stats = llm.stats()
    assert stats.num_free_blocks == stats.num_total_blocks
    assert stats.running == 0 and stats.waiting == 0


def test_prefix_cache_hits_and_same_tokens(tiny_model: Callable[[str], Path]) -> None:
    rng = random.Random(1)
    prefix = [rng.randrange(1, 500) for _ in range(200)]
    first = [prefix + [rng.randrange(1, 500) for _ in range(rng.randrange(5, 40))] for _ in range(6)]
    second = [prefix + [rng.randrange(1, 500) for _ in range(rng.randrange(5, 40))] for _ in range(6)]
    greedy = SamplingParams(temperature=0, max_tokens=12)
    warm = LLM(str(tiny_model("llama_gqa")))
    warm.generate(first, greedy)
    hot = warm.generate(second, greedy)
    assert all(o.num_cached_tokens >= 192 for o in hot), [o.num_cached_tokens for o in hot]
    assert warm.stats().prefix_cache_hits > 0
    cold = LLM(str(tiny_model("llama_gqa")), enable_prefix_caching=False).generate(second, greedy)
    assert [o.outputs[0].token_ids for o in hot] == [o.outputs[0].token_ids for o in cold]
    assert all(o.num_cached_tokens == 0 for o in cold)
    assert_no_leak(warm)


def test_requests_arriving_together_compute_a_shared_prefix_once(tiny_model: Callable[[str], Path]) -> None:
    """Six prompts behind one 200-token prefix, submitted at once with room for all in one step:
    the first prefills the prefix, the others wait for it to land in the cache instead of each
    computing a private copy alongside, and their tokens are those of an uncached run."""
    rng = random.Random(2)
    prefix = [rng.randrange(1, 500) for _ in range(200)]
    prompts = [prefix + [rng.randrange(1, 500) for _ in range(rng.randrange(5, 40))] for _ in range(6)]
    greedy = SamplingParams(temperature=0, max_tokens=8)
    together = LLM(str(tiny_model("llama_gqa")), max_num_batched_tokens=2048)
    outs = together.generate(prompts, greedy)
    assert outs[0].num_cached_tokens == 0
    assert all(o.num_cached_tokens == 192 for o in outs[1:]), [o.num_cached_tokens for o in outs]
    stats = together.stats()
    assert stats.prefix_cache_hits == 5 * 192
    assert stats.prefix_cache_queries == sum(len(p) for p in prompts)  # each admission counted once
    cold = LLM(str(tiny_model("llama_gqa")), enable_prefix_caching=False).generate(prompts, greedy)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in cold]
    assert_no_leak(together)


def test_abort_frees_blocks_at_once(llm: LLM) -> None:
    engine = llm.engine
    for i in range(8):
        engine.add_request(f"a{i}", list(range(1, 40 + i)), SamplingParams(max_tokens=50, ignore_eos=True))
    for _ in range(3):
        engine.step()
    assert engine.stats().num_free_blocks < engine.stats().num_total_blocks
    engine.abort("a0")
    engine.abort("a7")
    assert "a0" not in engine.requests
    for i in range(1, 7):
        engine.abort(f"a{i}")
    assert not engine.has_unfinished()
    assert_no_leak(llm)
    assert engine.abort("never-added") is False


def test_seed_is_reproducible_inside_any_batch(llm: LLM) -> None:
    target = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=24, ignore_eos=True)
    alone = llm.generate([[5, 6, 7, 8, 9]], target)[0].outputs[0].token_ids
    rng = random.Random(3)
    others = [[rng.randrange(1, 500) for _ in range(rng.randrange(3, 60))] for _ in range(30)]
    params = [
        SamplingParams(
            temperature=rng.choice([0, 0.7, 1.3]), seed=rng.choice([None, 7]), max_tokens=rng.randrange(5, 30)
        )
        for _ in others
    ]
    outs = llm.generate([*others[:15], [5, 6, 7, 8, 9], *others[15:]], [*params[:15], target, *params[15:]])
    assert outs[15].outputs[0].token_ids == alone
    assert_no_leak(llm)


def test_top_k_one_equals_greedy(llm: LLM) -> None:
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8, 2, 8]]
    greedy = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=20))
    topk = llm.generate(prompts, SamplingParams(temperature=0.8, top_k=1, seed=5, max_tokens=20))
    assert [o.outputs[0].token_ids for o in greedy] == [o.outputs[0].token_ids for o in topk]


def test_n_samples_share_prompt_blocks(llm: LLM) -> None:
    prompt = list(range(1, 40))  # 39 tokens: 2 full blocks + a partial one
    greedy1 = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=10))[0]
    greedy3 = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=10, n=3))[0]
    assert [c.token_ids for c in greedy3.outputs] == [greedy1.outputs[0].token_ids] * 3
    sampled = llm.generate([prompt], SamplingParams(temperature=1.5, max_tokens=16, n=4, seed=11, ignore_eos=True))[0]
    assert sorted(c.index for c in sampled.outputs) == [0, 1, 2, 3]
    assert len({tuple(c.token_ids) for c in sampled.outputs}) > 1
    again = llm.generate([prompt], SamplingParams(temperature=1.5, max_tokens=16, n=4, seed=11, ignore_eos=True))[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in sampled.outputs]
    assert_no_leak(llm)


def test_fork_shares_blocks_while_running(llm: LLM) -> None:
    engine = llm.engine
    engine.add_request("fork", list(range(1, 40)), SamplingParams(n=3, max_tokens=5, ignore_eos=True))
    engine.step()  # prefill + first tokens: the samples now exist and share the two full blocks
    seqs = engine.requests["fork"].seqs
    assert len(seqs) == 3
    assert seqs[0].block_table[:2] == seqs[1].block_table[:2] == seqs[2].block_table[:2]
    assert len({s.block_table[2] for s in seqs}) == 3
    while engine.has_unfinished():
        engine.step()
    assert_no_leak(llm)


def test_stop_strings_cut_exactly(llm: LLM) -> None:
    prompt = [11, 22, 33, 44]
    base = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))[0].outputs[0]
    text = base.text
    assert len(text) > 10
    stop = text[5:9]
    cut = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop]))
    out = cut[0].outputs[0]
    assert out.text == text[: text.index(stop)]
    assert out.finish_reason == "stop"


def test_streaming_deltas_concatenate(llm: LLM) -> None:
    engine = llm.engine
    rng = random.Random(9)
    for i in range(6):
        engine.add_request(
            f"s{i}", [rng.randrange(1, 500) for _ in range(10)], SamplingParams(temperature=1.0, seed=i, max_tokens=30)
        )
    deltas: dict[str, list[str]] = {}
    ids: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for d in engine.step():
            for o in d.outputs:
                deltas.setdefault(d.request_id, []).append(o.text)
                ids.setdefault(d.request_id, []).extend(o.token_ids)
    for rid, parts in deltas.items():
        text = "".join(parts)
        assert text == engine.tokenizer.decode(ids[rid], skip_special_tokens=True)
        if "\ufffd" not in text:
            assert not any("\ufffd" in p for p in parts)


def test_priority_orders_admission(tiny_model: Callable[[str], Path]) -> None:
    engine = Engine(EngineConfig(model=str(tiny_model("llama_gqa")), max_num_seqs=1))
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    engine.add_request("low-old", [1, 2, 3], params, priority=0)
    engine.add_request("low-new", [1, 2, 4], params, priority=0)
    engine.add_request("high", [1, 2, 5], params, priority=5)
    finished = []
    while engine.has_unfinished():
        finished += [d.request_id for d in engine.step() if d.finished]
    assert finished == ["high", "low-old", "low-new"]


def test_bad_prompts_are_rejected(llm: LLM) -> None:
    with pytest.raises(PromptTooLongError):
        llm.engine.add_request("long", [1] * (llm.engine.max_model_len + 1), SamplingParams())
    with pytest.raises(ValueError, match="vocabulary"):
        llm.engine.add_request("oov", [1, 10**6], SamplingParams())
    with pytest.raises(ValueError, match="empty"):
        llm.engine.add_request("empty", [], SamplingParams())
    assert not llm.engine.has_unfinished()
