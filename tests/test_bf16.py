"""bf16 as a CPU dtype (issue #18): bf16 matmul weights on AMX / AVX512-bf16 and a bf16 KV cache, under fp32
activations.

The suite caps the instruction set below bf16 (tests/conftest.py) so that ``dtype="auto"`` stays fp32 for
the exact-parity tests; these tests lift the cap. bf16 changes rounding, so the engine is held to
agreement with its fp32 self, not to equality.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from pagedq_kernels import cpu_isa, cpu_linear
from tests.test_engine_parity import make_workload


@pytest.fixture
def uncapped(monkeypatch: pytest.MonkeyPatch) -> Iterator[cpu_isa.CpuIsa]:
    monkeypatch.delenv(cpu_isa.ENV_CAP, raising=False)
    yield cpu_isa.current()


def needs_bf16(isa: cpu_isa.CpuIsa) -> None:
    if not isa.bf16_matmul:
        pytest.skip(f"this CPU multiplies no bf16 in hardware (probed: {list(isa.probed)})")


def test_auto_picks_bf16_where_the_cpu_multiplies_it_in_hardware(
    uncapped: cpu_isa.CpuIsa, monkeypatch: pytest.MonkeyPatch
) -> None:
    auto = EngineConfig(dtype="auto")
    assert auto.torch_dtype == (torch.bfloat16 if uncapped.bf16_matmul else torch.float32)
    assert auto.activation_dtype == torch.float32  # bf16 on CPU is a matmul-weight and KV-cache format
    assert auto.kv_cache_dtype == auto.torch_dtype
    bf16 = EngineConfig(dtype="bf16")
    hw = torch.float32 if uncapped.bf16_matmul else torch.bfloat16  # no bf16 products: all of it in torch bf16
    assert (bf16.torch_dtype, bf16.activation_dtype, bf16.matmul_weight_dtype) == (torch.bfloat16, hw, torch.bfloat16)
    unpacked = EngineConfig(dtype="bfloat16", cpu_weight_prepack=False)
    assert unpacked.activation_dtype == torch.bfloat16  # no packed bf16 matmul: all of it in torch bf16
    assert bf16.kv_cache_dtype == torch.bfloat16 and EngineConfig(dtype="float32").kv_cache_dtype == torch.float32
    if uncapped.bf16_matmul and "amx" not in uncapped.levels:  # dot products, fast or slow: bf16 (on FMAs if slow)
        for rate, on_fma in ((0.5, True), (2.0, False), (None, False)):
            monkeypatch.setattr(cpu_isa, "bf16_dot_rate", lambda rate=rate: rate)
            assert EngineConfig(dtype="auto").torch_dtype == torch.bfloat16, rate
            assert cpu_isa.current().bf16_products_on_fma == on_fma, rate
        monkeypatch.undo()
    monkeypatch.setenv(cpu_isa.ENV_CAP, "avx512")  # below bf16: fp32, whatever the CPU
    assert EngineConfig(dtype="auto").torch_dtype == torch.float32
    assert EngineConfig(dtype="auto").kv_cache_dtype == torch.float32
    assert EngineConfig(dtype="bfloat16").activation_dtype == torch.bfloat16


@pytest.mark.parametrize("rows", [1, 7, 64, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_bf16_packed_linear_under_fp32_activations(uncapped: cpu_isa.CpuIsa, rows: int, bias: bool) -> None:
    """The product of bf16-rounded inputs and weights, accumulated in fp32 (the reference computes that
    exactly in fp32), handed back in fp32; the output is rounded to bf16 once."""
    needs_bf16(uncapped)
    torch.manual_seed(rows)
    w, x = torch.randn(200, 96), torch.randn(rows, 96)
    b = torch.randn(200) if bias else None
    packed = cpu_linear.pack(w, "onednn", dtype=torch.bfloat16)
    assert packed is not None and packed.data.dtype == torch.bfloat16
    out = cpu_linear.linear(x, packed, b)
    assert out.dtype == torch.float32 and out.shape == (rows, 200)
    rounded_b = b.bfloat16().float() if b is not None else None
    ref = F.linear(x.bfloat16().float(), w.bfloat16().float(), rounded_b)
    torch.testing.assert_close(out, ref, atol=0.05, rtol=1 / 128)  # bf16's 8-bit mantissa on the output
    assert (out - F.linear(x, w, b)).abs().max() < 0.5  # and near the fp32 product


def test_bf16_is_declined_where_the_cpu_has_no_bf16_products(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cpu_isa.ENV_CAP, "avx512")
    assert cpu_linear.available_kinds(torch.bfloat16) == []
    assert cpu_linear.pack(torch.randn(8, 8), dtype=torch.bfloat16) is None


def test_bf16_engine_agrees_with_fp32(uncapped: cpu_isa.CpuIsa, tiny_model: Callable[[str], Path]) -> None:
    """Greedy tokens of the bf16 engine against the fp32 engine on the parity workload (20 prompts,
    chunked prefill and prefix caching on): most sequences agree through their first 8 tokens. A broken
    bf16 path (wrong layout, wrong scale) agrees on none."""
    needs_bf16(uncapped)
    path = tiny_model("llama_gqa")
    prompts, max_new = make_workload()
    params = [SamplingParams(temperature=0, max_tokens=n) for n in max_new]
    outs: dict[str, list[list[int]]] = {}
    stats = {}
    for dtype in ("float32", "bfloat16"):
        llm = LLM(str(path), dtype=dtype, max_num_seqs=64, max_num_batched_tokens=48, kv_cache_bytes=8 << 20)
        outs[dtype] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        stats[dtype] = llm.stats()
        assert stats[dtype].num_free_blocks == stats[dtype].num_total_blocks
    # The bf16 KV cache: half the bytes per block, so twice the blocks in the same budget.
    assert (stats["float32"].kv_cache_dtype, stats["bfloat16"].kv_cache_dtype) == ("float32", "bfloat16")
    assert stats["bfloat16"].num_total_blocks // 2 == stats["float32"].num_total_blocks  # (budget // half) // 2
    per_block = stats["float32"].kv_cache_bytes // stats["float32"].num_total_blocks
    for s in stats.values():
        assert 8 << 20 >= s.kv_cache_bytes > (8 << 20) - per_block
    same = sum(a[:8] == b[:8] for a, b in zip(outs["float32"], outs["bfloat16"], strict=True))
    print(f"bf16 vs fp32: {same}/{len(prompts)} sequences agree on their first 8 greedy tokens")
    assert same >= len(prompts) * 0.6
