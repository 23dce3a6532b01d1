"""pagedq on the real default model (SmolLM2-135M-Instruct): parity with transformers, chat, streaming."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from engine import LLM, SamplingParams
from tests.conftest import Prepared

pytestmark = pytest.mark.realmodel


@pytest.fixture(scope="module")
def llm(prepared: Prepared) -> LLM:
    return LLM(str(prepared.path), kv_cache_bytes=256 * 1024**2)


def test_greedy_equals_transformers(prepared: Prepared, llm: LLM) -> None:
    tokenizer = AutoTokenizer.from_pretrained(str(prepared.path))
    model = AutoModelForCausalLM.from_pretrained(str(prepared.path), dtype=torch.float32).eval()
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]
    n = 40  # min_new_tokens on both sides masks EOS the same way, so all 40 tokens are compared
    ours = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, min_tokens=n))
    for prompt, out in zip(prompts, ours, strict=True):
        ids = tokenizer(prompt, return_tensors="pt")
        with torch.inference_mode():
            ref = model.generate(**ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        assert out.outputs[0].token_ids == ref[0, ids["input_ids"].shape[1] :].tolist(), prompt
    assert "Paris" in ours[0].outputs[0].text


def test_chat_answers_sensibly(llm: LLM) -> None:
    out = llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}], SamplingParams(temperature=0, max_tokens=32)
    )[0].outputs[0]
    assert "Paris" in out.text
    assert out.finish_reason == "stop"


def test_streaming_emoji_and_cjk(llm: LLM) -> None:
    """Raw prompts that make the model write emoji and CJK (multi-byte, split across byte-level tokens)."""
    engine = llm.engine
    prompts = {
        "emoji": "Emoji list: 😀 😃 😄 😁 😆 😅 😂",
        "cjk": "中文：你好，世界。我们",
        "ja": "Japanese: こんにちは、世界。私は",
    }
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=20))
    parts: dict[str, list[str]] = {rid: [] for rid in prompts}
    token_ids: dict[str, list[int]] = {rid: [] for rid in prompts}
    while engine.has_unfinished():
        for delta in engine.step():
            for o in delta.outputs:
                parts[delta.request_id].append(o.text)
                token_ids[delta.request_id].extend(o.token_ids)
    for rid in prompts:
        text = "".join(parts[rid])
        assert text == engine.tokenizer.decode(token_ids[rid], skip_special_tokens=True)
        assert any(ord(c) > 0x2E80 and c != "\ufffd" for c in text), text  # the model wrote CJK / emoji
        # A character cut off by max_tokens can only show up in the very last delta (the final flush).
        assert not any("\ufffd" in p for p in parts[rid][:-1]), parts[rid]
        assert "\ufffd" not in text.rstrip("\ufffd")
    stats = llm.stats()
    assert stats.num_free_blocks == stats.num_total_blocks
