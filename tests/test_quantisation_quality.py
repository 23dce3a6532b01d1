"""Quantisation quality on the real default model (README, "Quantisation"): perplexity on a fixed English
text of 20,480 tokens (tests/perplexity_text.py) and greedy agreement on the compass workload.

- int8 weight-only (``quantization="int8"`` on the fp32 checkpoint, and under bf16 matmuls where the CPU has
  them): perplexity within 1 % of fp32;
- the Q4_1 GGUF loaded natively (int8 repacking, C kernel): within 0.5 % of transformers' perplexity on
  the same GGUF dequantised by transformers (the prepared fp32 folder *is* that dequantisation, loaded
  here straight from the GGUF to leave no doubt);
- W8A8 (``quantization="w8a8"``, where the CPU runs it): per-token int8 activations cost more; measured
  +1.1 % with the activation smoothing (engine/smoothing.py; +3.3 % without), bound at 2 %.

Run with ``-s`` to print the figures the README records.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable
from typing import Any, TypeVar

import pytest
import torch

from engine import LLM
from engine.default_model import find_default_gguf, prepare_default_model
from engine.perplexity import perplexity, windows
from ops.bench.workloads import compass
from pagedq_kernels import cpu_isa, w8a8_linear
from schemas.sampling import SamplingParams
from tests.perplexity_text import build_tokens

# Loads SmolLM2-135M four ways and scores 20k tokens each (minutes). The module fixture's time counts against
# the first test's timeout: on a 2-core AMD EPYC (fp32 everywhere, int8 on AVX2) it ran past the suite's 600 s.
pytestmark = [pytest.mark.realmodel, pytest.mark.timeout(1800)]

T = TypeVar("T")
TOKENS = 20_480
WINDOW = 1024
AGREEMENT_TOKENS = 32


def _hf_perplexity(model: Any, ids: list[int]) -> float:
    total, count = 0.0, 0
    with torch.no_grad():
        for chunk in windows(ids, WINDOW):
            logits = model(torch.tensor([chunk])).logits[0, :-1].double()
            lp = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(chunk[1:])[:, None])
            total -= float(lp.sum())
            count += lp.numel()
    return math.exp(total / count)


def _w8a8_uncapped(call: Callable[[], T]) -> T:
    """``call()`` with the suite's ISA cap (tests/conftest.py, below bf16) lifted: pagedq's W8A8 kernel needs the
    avx512_bf16 level (its probe runs VPDPBUSD). The model loaded under it keeps its kernels once packed. The
    lm_head's argmax screen, a bf16 copy of the head (56 MB) that the lifted level would add, stays off (it
    changes no answer), so the weight bytes compare with the other loaders'."""
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv(cpu_isa.ENV_CAP, raising=False)
        patch.setenv("PAGEDQ_DISABLE_SCREENED_ARGMAX", "1")
        return call()


def _greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(max_tokens=AGREEMENT_TOKENS, temperature=0.0, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


@pytest.fixture(scope="module")
def figures() -> dict[str, float]:
    """The figures, computed on every usable core: the suite runs one intra-op thread (tests/conftest.py sets
    OMP_NUM_THREADS=1, which the engine takes as the operator's thread count, for tests that start worker
    processes beside it), and this module starts none. Single-threaded, the fixture ran past 23 minutes on a
    2-core AMD EPYC Zen 5, where five loaders run."""
    threads, cores = torch.get_num_threads(), len(os.sched_getaffinity(0))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OMP_NUM_THREADS", str(cores))
        torch.set_num_threads(cores)
        try:
            return _figures()
        finally:
            torch.set_num_threads(threads)


def _figures() -> dict[str, float]:
    from transformers import AutoModelForCausalLM

    folder = prepare_default_model()
    gguf = find_default_gguf()
    out: dict[str, float] = {}
    fp32 = LLM(str(folder), dtype="float32")
    ids = build_tokens(fp32.tokenizer)[:TOKENS]
    prompts = [r.prompt_ids for r in compass(0, fp32.engine.model_config.vocab_size).requests]
    out["pagedq_fp32"] = perplexity(fp32.engine, ids, WINDOW)
    reference = _greedy(fp32, prompts)
    out["pagedq_fp32_weight_bytes"] = fp32.stats().weight_bytes
    del fp32
    loaders = [
        ("pagedq_int8", lambda: LLM(str(folder), dtype="float32", quantization="int8")),
        ("pagedq_gguf_q4_1", lambda: LLM(str(gguf), dtype="float32")),
    ]
    if _w8a8_uncapped(w8a8_linear.available):
        w8a8 = functools.partial(LLM, str(folder), dtype="float32", quantization="w8a8")
        loaders.append(("pagedq_w8a8", lambda: _w8a8_uncapped(w8a8)))
    if cpu_isa.current().bf16_matmul:  # int8 weights under bf16 matmuls: the AMX tile kernel where AMX runs
        loaders.append(("pagedq_int8_bf16", lambda: LLM(str(folder), dtype="bfloat16", quantization="int8")))
    for name, llm in loaders:
        engine = llm()
        out[name] = perplexity(engine.engine, ids, WINDOW)
        got = _greedy(engine, prompts)
        out[f"{name}_agreement"] = sum(a == b for a, b in zip(reference, got, strict=True)) / len(prompts)
        out[f"{name}_weight_bytes"] = engine.stats().weight_bytes
        del engine
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    out["transformers_fp32"] = _hf_perplexity(hf, ids)
    hf = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32, local_files_only=True
    ).eval()
    out["transformers_gguf_dequantised"] = _hf_perplexity(hf, ids)
    print("\nquantisation quality (SmolLM2-135M-Instruct, 20480 tokens, windows of 1024):")
    for key, value in out.items():
        print(f"  {key}: {value:.6f}" if isinstance(value, float) else f"  {key}: {value}")
    return out


def test_pagedq_fp32_matches_transformers(figures: dict[str, float]) -> None:
    assert abs(figures["pagedq_fp32"] / figures["transformers_fp32"] - 1) < 1e-3


def test_int8_weight_only_within_one_percent_of_fp32(figures: dict[str, float]) -> None:
    assert abs(figures["pagedq_int8"] / figures["pagedq_fp32"] - 1) < 0.01
    assert figures["pagedq_int8_weight_bytes"] < 0.6 * figures["pagedq_fp32_weight_bytes"]
    if "pagedq_int8_bf16" in figures:  # the same weights with bf16-rounded activations (AMX tiles)
        assert abs(figures["pagedq_int8_bf16"] / figures["pagedq_fp32"] - 1) < 0.01


def test_gguf_native_within_half_percent_of_transformers(figures: dict[str, float]) -> None:
    assert abs(figures["pagedq_gguf_q4_1"] / figures["transformers_gguf_dequantised"] - 1) < 0.005


def test_greedy_agreement(figures: dict[str, float]) -> None:
    # The GGUF's int8 kernel dequantises into the very fp32 values of the prepared folder and runs the same
    # register tile: measured identical (64 of 64). int8 weight-only on random-token prompts (compass, the
    # hardest case: flat distributions, and one changed token changes the rest) measured 26 of 64 identical
    # 32-token continuations; the floor catches a broken kernel, the README records the share.
    assert figures["pagedq_gguf_q4_1_agreement"] >= 0.95
    assert figures["pagedq_int8_agreement"] >= 0.25


def test_w8a8_within_two_percent_of_fp32(figures: dict[str, float]) -> None:
    if "pagedq_w8a8" not in figures:
        pytest.skip(_w8a8_uncapped(w8a8_linear.unavailable_reason))
    # Measured 8.8886 against fp32's 8.7912 (+1.1 %) and 16 of 64 identical continuations (int8 weight-only:
    # 26); without smoothing 9.0851 (+3.3 %) and 7 of 64.
    assert abs(figures["pagedq_w8a8"] / figures["pagedq_fp32"] - 1) < 0.02
    assert figures["pagedq_w8a8_weight_bytes"] < 0.6 * figures["pagedq_fp32_weight_bytes"]
    assert figures["pagedq_w8a8_agreement"] >= 0.15
