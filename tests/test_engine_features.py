"""Engine behaviour beyond parity: prefix caching, abort/no leaks, seeds in batches, n > 1, stops, priorities."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest

from engine import LLM, Engine, EngineConfig, PromptTooLongError, RequestOutput, SamplingParams


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


def test_a_cached_prefix_changes_no_logprob(tiny_model: Callable[[str], Path], isa_variant: str) -> None:
    """The same request gives the same floats whether its prompt came from the prefix cache or not, whatever
    the length of the tail the cache leaves (1 to 16 tokens: on the avx512 build short chunks of a token and its
    drafts go to the decode kernel, a prompt's tail must not, or its logprobs moved in the last bit), bit for bit
    in every build: the generic one prefills a row at a time as it decodes (torch's SDPA, which it used before,
    gave floats that depended on the query chunk's length on an AMD EPYC Zen 5)."""
    rng = random.Random(7)
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=2, ignore_eos=True)
    prompts = [[rng.randrange(1, 500) for _ in range(32 + tail)] for tail in (1, 2, 5, 9, 16)]
    warm = LLM(str(tiny_model("llama_gqa")))
    first = warm.generate(prompts, params)
    again = [warm.generate([prompt], params)[0] for prompt in prompts]  # alone, from the cache
    assert all(o.num_cached_tokens >= 32 for o in again), [o.num_cached_tokens for o in again]

    def floats(outs: list[RequestOutput]) -> list[list[tuple[int, float, list[tuple[int, float]]]]]:
        return [[(lp.token_id, lp.logprob, lp.top) for lp in o.outputs[0].logprobs or []] for o in outs]

    assert floats(again) == floats(first)
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


def test_max_tokens_past_the_context_stops_there_unless_strict(llm: LLM) -> None:
    """vLLM's offline rule by default (the choice stops at the context, ``length``); OpenAI's with
    ``strict_max_tokens`` (refused before it runs, the numbers in OpenAI's own message)."""
    engine = llm.engine
    room = 5
    prompt = [7] * (engine.max_model_len - room)
    params = SamplingParams(temperature=0, max_tokens=room + 1, ignore_eos=True)
    with pytest.raises(PromptTooLongError, match=rf"requested {engine.max_model_len + 1} tokens \({len(prompt)} in"):
        engine.add_request("strict", prompt, params, strict_max_tokens=True)
    assert not engine.has_unfinished()
    engine.add_request(
        "fits", prompt, SamplingParams(temperature=0, max_tokens=room, ignore_eos=True), strict_max_tokens=True
    )
    engine.add_request("capped", prompt, params)
    outputs: dict[str, list[int]] = {}
    reasons: dict[str, str | None] = {}
    while engine.has_unfinished():
        for delta in engine.step():
            outputs.setdefault(delta.request_id, []).extend(delta.outputs[0].token_ids)
            if delta.finished:
                reasons[delta.request_id] = delta.outputs[0].finish_reason
    assert reasons == {"fits": "length", "capped": "length"}
    assert len(outputs["fits"]) == room and outputs["capped"] == outputs["fits"]


# ---------------------------------------------------------------- found by exploratory testing


def test_n_above_max_num_seqs_is_refused_not_wedged(tiny_model: Callable[[str], Path]) -> None:
    """Its samples are admitted together, so n > max_num_seqs could never be scheduled: step() returned
    [] forever and every request behind it waited too. Refused at add_request instead, leaving nothing
    behind; the same LLM then serves the requests that fit."""
    llm = LLM(str(tiny_model("llama_gqa")), max_num_seqs=2)
    engine = llm.engine
    with pytest.raises(ValueError, match=r"n=3 is larger than max_num_seqs=2"):
        engine.add_request("wide", [1, 2, 3], SamplingParams(n=3, max_tokens=3))
    assert not engine.has_unfinished() and engine.num_waiting() == 0
    with pytest.raises(ValueError, match=r"n=3 is larger than max_num_seqs=2"):
        llm.generate([[4, 5, 6], [1, 2, 3]], [SamplingParams(max_tokens=3), SamplingParams(n=3, max_tokens=3)])
    assert_no_leak(llm)
    out = llm.generate([[1, 2, 3], [4, 5, 6]], SamplingParams(n=2, max_tokens=3, ignore_eos=True))
    assert [[len(c.token_ids) for c in o.outputs] for o in out] == [[3, 3], [3, 3]]
    assert_no_leak(llm)


def test_scheduler_refuses_a_sequence_it_could_never_admit(llm: LLM) -> None:
    """The guard sits in Scheduler.add, the one way into the waiting queue, whoever calls it."""
    engine = llm.engine
    params = SamplingParams(n=engine.config.max_num_seqs + 1)
    seq = engine._new_sequence("direct", 0, [1, 2, 3], 3, params, 0)
    seq.pending_fork = True
    try:
        with pytest.raises(ValueError, match="max_num_seqs"):
            engine.scheduler.add(seq)
    finally:  # had it been queued, it would wedge every later test on this module's engine
        if seq in engine.scheduler.waiting:
            engine.scheduler.remove(seq)
    assert engine.num_waiting() == 0


def _decoder(llm: LLM) -> Callable[[list[int]], str]:
    def decode(ids: list[int]) -> str:
        text = llm.tokenizer.decode(ids)
        assert isinstance(text, str)  # a flat id list decodes to one string
        return text

    return decode


def _greedy(llm: LLM, prompt: list[int], **params: object) -> tuple[str, list[int], str | None]:
    out = llm.generate([prompt], SamplingParams(temperature=0, **params))[0].outputs[0]  # type: ignore[arg-type]
    return out.text, out.token_ids, out.finish_reason


def test_min_tokens_holds_back_stop_strings(llm: LLM) -> None:
    """vLLM checks stop strings only once the output has more than min_tokens tokens, and only where one
    ends after the min_tokens-th token's text: a stop inside that text is no stop."""
    decode = _decoder(llm)
    m = 10
    rng = random.Random(4)
    prompts = [[rng.randrange(3, 500) for _ in range(6)] for _ in range(16)]
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    # A random model's text is full of stray UTF-8 bytes; take an output whose first m tokens decode to
    # whole characters, so that their text is exactly what the detokenizer had released at the m-th.
    prompt, out = next(
        (p, o.outputs[0])
        for p, o in zip(prompts, llm.generate(prompts, greedy), strict=True)
        if "\ufffd" not in decode(o.outputs[0].token_ids[: m + 1])
    )
    text, ids = out.text, out.token_ids
    exempt = decode(ids[:m])
    assert decode(ids) == text and len(ids) == 40
    # The ASCII character that occurs most often both inside the exempt text and after it.
    stop = max({c for c in exempt if c.isascii()} & set(text[len(exempt) :]), key=text.count)
    assert text.index(stop) < len(exempt)
    cut_text, cut_ids, reason = _greedy(llm, prompt, max_tokens=40, ignore_eos=True, min_tokens=m, stop=[stop])
    assert cut_text == text[: text.index(stop, len(exempt))]
    assert len(cut_ids) > m and cut_ids == ids[: len(cut_ids)] and reason == "stop"
    # Without min_tokens the first occurrence stops it, as before.
    assert _greedy(llm, prompt, max_tokens=40, ignore_eos=True, stop=[stop])[0] == text[: text.index(stop)]


def test_min_tokens_holds_back_stop_tokens_and_eos(llm: LLM) -> None:
    """Stop tokens and EOS are masked until min_tokens: a sampled output with half the vocabulary as stop
    tokens has none of them before its min_tokens-th token, and stops on the first one after."""
    eos = sorted(llm.engine.eos_token_ids)
    stops = list(range(0, 512, 2))
    for seed in range(4):
        params = SamplingParams(temperature=1.5, seed=seed, max_tokens=30, min_tokens=6, stop_token_ids=stops)
        out = llm.generate([[7, 8, 9]], params)[0].outputs[0]
        ids = out.token_ids
        assert len(ids) >= 6
        assert not set(ids[:5]) & set(stops + eos), ids
        if out.finish_reason == "stop":
            assert ids[-1] in set(stops + eos) and not set(ids[:-1]) & set(stops + eos), ids


def test_stop_token_text_is_left_out_of_the_text(llm: LLM) -> None:
    """vLLM drops the text of the token that stopped the output (it stays in token_ids) unless
    include_stop_str_in_output, and no streamed delta ever carried it."""
    prompt = [11, 22, 33, 44]
    text, ids, _ = _greedy(llm, prompt, max_tokens=20, ignore_eos=True)
    decode = _decoder(llm)
    assert text == decode(ids)
    k = next(i for i in range(3, len(ids)) if decode(ids[i : i + 1]).strip() and ids[i] not in ids[:i])
    stop = ids[k]
    cut_text, cut_ids, reason = _greedy(llm, prompt, max_tokens=20, ignore_eos=True, stop_token_ids=[stop])
    assert cut_ids == ids[: k + 1] and reason == "stop"
    assert cut_text == decode(ids[:k]) != decode(ids[: k + 1])
    kept = _greedy(llm, prompt, max_tokens=20, ignore_eos=True, stop_token_ids=[stop], include_stop_str_in_output=True)
    assert kept[0] == decode(ids[: k + 1]) and kept[1] == cut_ids
    # Streamed: the deltas join to the same text, the stop token's id arrives without its text.
    engine = llm.engine
    engine.add_request("streamed", prompt, SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stop]))
    parts: list[str] = []
    streamed_ids: list[int] = []
    while engine.has_unfinished():
        for d in engine.step():
            for o in d.outputs:
                parts.append(o.text)
                streamed_ids.extend(o.token_ids)
    assert "".join(parts) == cut_text and streamed_ids == cut_ids
    assert_no_leak(llm)


def test_eos_text_is_left_out_like_a_stop_token(llm: LLM) -> None:
    """EOS is a stop token too: with skip_special_tokens=False its text (<|im_end|>) is not in the output
    unless include_stop_str_in_output. A one-answer choice makes the model end with EOS."""
    params = {"temperature": 0, "max_tokens": 10, "choice": ["ab"], "skip_special_tokens": False}
    out = llm.generate([[5, 6]], SamplingParams(**params))[0].outputs[0]  # type: ignore[arg-type]
    assert out.token_ids[-1] in llm.engine.eos_token_ids and out.finish_reason == "stop"
    assert out.text == "ab"
    kept = llm.generate([[5, 6]], SamplingParams(**params, include_stop_str_in_output=True))[0].outputs[0]  # type: ignore[arg-type]
    assert kept.text == "ab" + str(llm.tokenizer.decode(out.token_ids[-1:], skip_special_tokens=False))
    assert kept.text == "ab<|im_end|>"


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_grammar_that_must_end_under_min_tokens_fails_alone(llm: LLM, temperature: float) -> None:
    """choice=["yes", "no"] is complete after a few tokens and then allows only EOS, which min_tokens=5
    forbids: the request fails with a message naming both causes (not "every logit is -inf after
    penalties", nor "non-finite probabilities"), and the request beside it gets what it gets alone."""
    bad = SamplingParams(temperature=temperature, seed=1, max_tokens=10, min_tokens=5, choice=["yes", "no"])
    good = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = llm.generate([[9, 10, 11]], good)[0].outputs[0].token_ids
    outs = llm.generate([[5, 6, 7], [9, 10, 11]], [bad, good])
    failed = outs[0]
    assert failed.error is not None
    assert failed.error.startswith("structured output: the grammar allows only ending here"), failed.error
    assert "min_tokens=5" in failed.error
    assert failed.outputs[0].finish_reason == "error" and failed.outputs[0].text in ("yes", "no")
    assert outs[1].error is None and outs[1].outputs[0].token_ids == alone
    assert_no_leak(llm)


@pytest.mark.parametrize("prompt", [[1.5, 2], [True, 2], [2, "3"], [2, None]])
def test_non_integer_token_ids_are_refused(llm: LLM, prompt: list[object]) -> None:
    """int(1.5) would quietly have run token 1 (and True, token 1)."""
    with pytest.raises(ValueError, match="prompt token ids must be integers; position"):
        llm.generate([prompt])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="prompt token ids must be integers"):
        llm.generate(prompt)  # type: ignore[arg-type]
    assert_no_leak(llm)


def test_numpy_integer_token_ids_are_token_ids(llm: LLM) -> None:
    import numpy as np

    params = SamplingParams(temperature=0, max_tokens=4)
    ids = [3, 1, 4, 1, 5]
    want = llm.generate([ids], params)[0].outputs[0].token_ids
    assert llm.generate([[np.int64(t) for t in ids]], params)[0].outputs[0].token_ids == want  # type: ignore[arg-type]


def test_chat_accepts_text_content_parts(llm: LLM) -> None:
    """OpenAI's content parts: text parts joined by newlines (vLLM's rule for text-only models), the same
    prompt as the joined string; other parts refused by name, not dropped."""
    engine = llm.engine
    parts = [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]
    as_parts = engine.chat_prompt_ids([{"role": "system", "content": "Be brief."}, {"role": "user", "content": parts}])
    as_text = engine.chat_prompt_ids(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello\nthere"}]
    )
    assert as_parts == as_text
    params = SamplingParams(temperature=0, max_tokens=4)
    assert (
        llm.chat([{"role": "user", "content": parts}], params)[0].outputs[0].token_ids
        == llm.chat([{"role": "user", "content": "Hello\nthere"}], params)[0].outputs[0].token_ids
    )
    image = {"type": "image_url", "image_url": {"url": "http://x/y.png"}}
    refused = r"messages\[0\]\.content: pagedq supports text content parts only, got 'image_url'"
    with pytest.raises(ValueError, match=refused):
        llm.chat([{"role": "user", "content": [parts[0], image]}])
    with pytest.raises(ValueError, match=r"messages\[0\]\.content: must be a string or a list of text parts"):
        llm.chat([{"role": "user", "content": None}])
    assert_no_leak(llm)


def test_logit_bias_forces_and_bans_tokens(llm: LLM) -> None:
    """OpenAI's logit_bias on the engine: +100 makes a token the greedy choice at every step, -100 takes the
    unbiased first choice away; an id past the vocabulary is refused at submission, nothing admitted."""
    prompt = [5, 9, 14, 3, 77]
    plain = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0].outputs[0]
    forced = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logit_bias={42: 100.0})
    assert llm.generate([prompt], forced)[0].outputs[0].token_ids == [42] * 6
    first = plain.token_ids[0]
    banned = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logit_bias={first: -100.0})
    assert llm.generate([prompt], banned)[0].outputs[0].token_ids[0] != first
    vocab = llm.engine.model_config.vocab_size
    with pytest.raises(ValueError, match="logit_bias: token ids out of the vocabulary"):
        llm.engine.add_request("too-far", prompt, SamplingParams(logit_bias={vocab: 1.0}))
    assert not llm.engine.has_unfinished()


@pytest.mark.parametrize("stop", [[], ["zzzzzzzzzz"]])
def test_each_token_delta_says_where_its_text_starts(llm: LLM, stop: list[str]) -> None:
    """With logprobs, a step's delta places each of its tokens in the sample's text (text_offsets), which a
    stop string makes lag behind its tokens (text that could begin it is held back): the places must not
    move with it. Each is the length of the text the tokens before it decode to, less a character they have
    only begun (byte-level BPE: its text starts where it will be complete)."""
    engine: Engine = llm.engine
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=0, stop=stop)
    engine.add_request("offsets", [5, 6, 7, 8], params)
    ids: list[int] = []
    offsets: list[int] = []
    while engine.has_unfinished():
        for delta in engine.step():
            for out in delta.outputs:
                assert out.text_offsets is not None and len(out.text_offsets) == len(out.token_ids)
                ids += out.token_ids
                offsets += out.text_offsets
    assert len(ids) == 12

    def begun(count: int) -> int:
        text = engine.tokenizer.decode(ids[:count], skip_special_tokens=True)
        assert isinstance(text, str)
        return len(text.rstrip("\ufffd"))

    assert offsets == [begun(i) for i in range(len(ids))]
    assert_no_leak(llm)
