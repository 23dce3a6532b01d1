"""The engine with the Triton backend forced keeps greedy parity with transformers: natively on a CUDA
machine, through Triton's interpreter on a CPU-only one (tests/conftest.py sets ``TRITON_INTERPRET``)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from tests.tiny_models import hf_greedy_tokens, make_hf_model

# Compiled Triton launches only on the GPU; on a CPU-only machine its interpreter takes CPU tensors.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_triton_backend_greedy_parity(tiny_model: Callable[[str], Path]) -> None:
    path = tiny_model("llama_gqa")
    prompts = [[5, 17, 200, 33, 9], [7] * 21, [300, 2, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55]]
    new_tokens = 6
    llm = LLM(
        str(path),
        device=DEVICE,
        dtype="float32",
        attention_backend="triton",
        num_kv_blocks=32,
        max_num_batched_tokens=24,
    )
    assert llm.engine.runner.model.ops.name == "triton"
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True))
    model: Any = make_hf_model(path)
    refs = hf_greedy_tokens(model.to(DEVICE), prompts, new_tokens)
    for out, ref in zip(outs, refs, strict=True):
        assert out.outputs[0].token_ids == ref
    stats = llm.stats()
    assert stats.num_free_blocks == stats.num_total_blocks


def test_triton_backend_on_cpu_needs_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    """Forced onto CPU tensors, compiled Triton would fail at the first launch, deep in a step: the
    config refuses it up front and names the way out."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        EngineConfig(model="unused", device="cpu", attention_backend="triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert EngineConfig(model="unused", device="cpu", attention_backend="triton").backend == "triton"
