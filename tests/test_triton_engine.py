"""The engine with the Triton backend forced (kernels through the interpreter on CPU) keeps greedy parity."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from engine import LLM, SamplingParams
from tests.tiny_models import make_hf_model


def test_triton_backend_greedy_parity(tiny_model: Callable[[str], Path]) -> None:
    path = tiny_model("llama_gqa")
    prompts = [[5, 17, 200, 33, 9], [7] * 21, [300, 2, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55]]
    new_tokens = 6
    llm = LLM(str(path), attention_backend="triton", num_kv_blocks=32, max_num_batched_tokens=24)
    assert llm.engine.runner.model.ops.name == "triton"
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True))
    model = make_hf_model(path)
    with torch.inference_mode():
        for prompt, out in zip(prompts, outs, strict=True):
            x = torch.tensor([prompt])
            ref = model.generate(  # type: ignore[operator]
                x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=0,
            )
            assert out.outputs[0].token_ids == ref[0, len(prompt) :].tolist()
    stats = llm.stats()
    assert stats.num_free_blocks == stats.num_total_blocks
