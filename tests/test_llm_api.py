"""The offline ``LLM`` as a vLLM user drives it: vLLM's prompt dicts and argument names, ``RequestOutput`` /
``CompletionOutput`` fields (``stop_reason``, ``cumulative_logprob``, logprobs as ``{token_id: Logprob}``),
``chat``'s template options, ``detokenize`` and ``max_tokens=None``, and bad input refused before anything
runs without leaving anything behind. One tiny engine for the module; every test is a few short generations."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from engine.llm import Prompt, TextPrompt, TokensPrompt
from engine.outputs import CompletionOutput

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
CHAT = [{"role": "user", "content": "Hello, how are you?"}]


@pytest.fixture(scope="module")
def llm(tiny_model: Callable[[str], Path]) -> LLM:
    return LLM(str(tiny_model("llama_gqa")), max_num_seqs=16, max_num_batched_tokens=256)


def assert_idle(llm: LLM) -> None:
    stats = llm.stats()
    assert not llm.engine.requests and stats.running == 0 and stats.waiting == 0
    assert stats.num_free_blocks == stats.num_total_blocks


def only(llm: LLM, prompt: str | list[int], params: SamplingParams) -> CompletionOutput:
    (out,) = llm.generate(prompt, params)
    (sample,) = out.outputs
    return sample


def test_prompt_dicts_are_vllm_text_and_tokens_prompts(llm: LLM) -> None:
    """A lone ``{"prompt": ...}`` used to be iterated as a list of its keys (the text "prompt" ran), and a
    list of dicts was refused as token ids."""
    ids = llm.tokenizer("The quick brown fox")["input_ids"]
    plain = llm.generate(["The quick brown fox", ids], GREEDY)
    (one,) = llm.generate({"prompt": "The quick brown fox"}, GREEDY)
    dicts: list[Prompt] = [TextPrompt(prompt="The quick brown fox"), TokensPrompt(prompt_token_ids=ids)]
    as_dicts = llm.generate(dicts, GREEDY)
    for out in (one, as_dicts[0]):
        assert out.prompt == "The quick brown fox" and out.prompt_token_ids == ids
        assert out.outputs[0].token_ids == plain[0].outputs[0].token_ids
    assert as_dicts[1].prompt is None and as_dicts[1].prompt_token_ids == ids
    assert as_dicts[1].outputs[0].token_ids == plain[1].outputs[0].token_ids
    with pytest.raises(ValueError, match="multi_modal_data"):
        llm.generate({"prompt": "hi", "multi_modal_data": {}}, GREEDY)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="'prompt' or 'prompt_token_ids'"):
        llm.generate([{}], GREEDY)  # type: ignore[arg-type]
    assert_idle(llm)


def test_vllm_argument_names(llm: LLM) -> None:
    """``sampling_params=`` and ``priority=`` (vLLM's keywords) were TypeErrors; ``get_tokenizer()`` missing."""
    by_position = llm.generate(["Hello", "World"], GREEDY)
    by_name = llm.generate(["Hello", "World"], sampling_params=GREEDY, priority=[0, 1], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in by_name] == [o.outputs[0].token_ids for o in by_position]
    assert (
        llm.chat(CHAT, sampling_params=GREEDY)[0].outputs[0].token_ids == llm.chat(CHAT, GREEDY)[0].outputs[0].token_ids
    )
    assert llm.get_tokenizer() is llm.tokenizer
    with pytest.raises(TypeError, match="not both"):
        llm.generate("Hello", GREEDY, params=GREEDY)


def test_stop_reason_names_the_stop_string_or_token(llm: LLM) -> None:
    base = only(llm, "Hello", GREEDY)
    assert base.finish_reason == "length" and base.stop_reason is None and base.finished()
    # A 3-character stop string first found at offset at >= 1, in whole characters.
    at = next(i for i in range(1, len(base.text) - 3) if base.text.find(base.text[i : i + 3]) == i)
    stop = base.text[at : at + 3]
    assert "\ufffd" not in stop
    for include in (False, True):
        out = only(llm, "Hello", GREEDY.model_copy(update={"stop": [stop], "include_stop_str_in_output": include}))
        assert (out.finish_reason, out.stop_reason) == ("stop", stop)
        assert out.text == base.text[: at + 3 if include else at]
    token = base.token_ids[5]
    out = only(llm, "Hello", GREEDY.model_copy(update={"stop_token_ids": [token]}))
    assert (out.finish_reason, out.stop_reason) == ("stop", token)
    assert out.token_ids == base.token_ids[: base.token_ids.index(token) + 1]
    # EOS (forced here) ends with stop_reason None, as in vLLM, even when also a listed stop token;
    # under ignore_eos it is only a stop token, and is named.
    eos = min(llm.engine.eos_token_ids)
    to_eos = SamplingParams(temperature=0, max_tokens=4, logit_bias={eos: 100}, stop_token_ids=[eos])
    out = only(llm, "Hello", to_eos)
    assert (out.token_ids, out.finish_reason, out.stop_reason) == ([eos], "stop", None)
    out = only(llm, "Hello", to_eos.model_copy(update={"ignore_eos": True}))
    assert (out.token_ids, out.finish_reason, out.stop_reason) == ([eos], "stop", eos)


def test_logprobs_are_vllm_dicts_with_cumulative_logprob(llm: LLM) -> None:
    """``lp[token_id].logprob`` used to raise (not subscriptable); ``cumulative_logprob`` was missing."""
    tokenizer = llm.tokenizer
    for k in (0, 3):
        out = only(llm, "Hello", GREEDY.model_copy(update={"logprobs": k}))
        assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids)
        total = 0.0
        for token, lp in zip(out.token_ids, out.logprobs, strict=True):
            assert next(iter(lp)) == token  # the chosen token first, always there
            assert lp[token].logprob == lp.logprob
            assert len(lp) in (k, k + 1) if k else len(lp) == 1
            assert [lp[t].rank for t, _ in lp.top] == list(range(1, k + 1))
            # Greedy: the chosen token is the most likely one (unranked with no top list: k = 0).
            assert lp[token].rank == (1 if k else None)
            assert all(lp[t].decoded_token == tokenizer.decode([t]) for t in lp)
            total += lp.logprob
        assert out.cumulative_logprob == pytest.approx(total)
    assert only(llm, "Hello", GREEDY).cumulative_logprob is None  # as vLLM: only with logprobs


def test_chat_takes_vllm_template_options(llm: LLM) -> None:
    engine = llm.engine
    (out,) = llm.chat(CHAT, GREEDY)
    assert out.prompt_token_ids == engine.chat_prompt_ids(CHAT)  # the worker's rendering, unchanged
    assert out.prompt == "<|im_start|>user\nHello, how are you?<|im_end|>\n<|im_start|>assistant\n"
    (bare,) = llm.chat(CHAT, GREEDY, add_generation_prompt=False)
    assert bare.prompt == "<|im_start|>user\nHello, how are you?<|im_end|>\n"
    template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    two = llm.chat([CHAT, [{"role": "user", "content": "Hi"}]], GREEDY, chat_template=template)
    assert [o.prompt for o in two] == ["user: Hello, how are you?\n", "user: Hi\n"]
    assert two[0].prompt_token_ids == llm.tokenizer(two[0].prompt, add_special_tokens=False)["input_ids"]
    partial = [*CHAT, {"role": "assistant", "content": "I am"}]
    (cont,) = llm.chat(partial, GREEDY, add_generation_prompt=False, continue_final_message=True)
    assert cont.prompt is not None and cont.prompt.endswith("<|im_start|>assistant\nI am")
    with pytest.raises(ValueError, match="continue_final_message"):
        llm.chat(partial, GREEDY, continue_final_message=True)
    assert_idle(llm)


def test_detokenize_false_and_spaces_between_special_tokens(llm: LLM) -> None:
    base = only(llm, "Hello", GREEDY)
    raw = only(llm, "Hello", GREEDY.model_copy(update={"detokenize": False, "logprobs": 1}))
    assert raw.text == "" and raw.token_ids == base.token_ids
    assert raw.logprobs is not None and all(lp[t].decoded_token is None for lp in raw.logprobs for t in lp)
    with pytest.raises(ValueError, match="detokenize"):
        SamplingParams(stop=["x"], detokenize=False)
    # Fast tokenizers ignore it (vLLM's fast path too): accepted, same text.
    assert only(llm, "Hello", GREEDY.model_copy(update={"spaces_between_special_tokens": False})).text == base.text


def test_max_tokens_none_runs_to_the_context(llm: LLM) -> None:
    room = 5
    prompt = [7] * (llm.engine.max_model_len - room)
    params = SamplingParams.model_validate({"max_tokens": None, "temperature": 0, "ignore_eos": True})
    out = only(llm, prompt, params)
    assert (len(out.token_ids), out.finish_reason) == (room, "length")
    assert_idle(llm)


def test_a_bad_prompt_in_a_list_is_named_and_leaves_nothing_behind(llm: LLM) -> None:
    before = llm.generate(["Hello", "World"], GREEDY)
    with pytest.raises(ValueError, match="empty") as info:
        llm.generate(["Hello", "", "World"], GREEDY)
    assert "prompt 1 of the 3 given" in "".join(info.value.__notes__)
    with pytest.raises(ValueError, match="vocabulary") as info:
        llm.generate([[5, 6], [5, 10**6]], GREEDY)
    assert "prompt 1 of the 2 given" in "".join(info.value.__notes__)
    with pytest.raises(TypeError, match=r"sampling_params\[1\] must be a SamplingParams, got dict"):
        llm.generate(["Hello", "World"], [GREEDY, {"temperature": 0}])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="2 priorities for 1 prompts"):
        llm.generate(["Hello"], GREEDY, priority=[0, 1])
    assert_idle(llm)
    after = llm.generate(["Hello", "World"], GREEDY)
    assert [o.outputs[0].token_ids for o in after] == [o.outputs[0].token_ids for o in before]
