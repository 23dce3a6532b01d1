"""W8A8 (pagedq_kernels/w8a8_linear, ``quantization="w8a8"``): the per-token activation quantisation in C per ISA
variant against its torch reference (bit for bit), the SiLU-and-mul that folds the row scale in, each kernel that
runs here (pagedq's VNNI kernel, oneDNN's int8 linear) against the exact integer math, and a tiny model end to end
against its fp32 self.

The suite caps the ISA below bf16 (tests/conftest.py); the VNNI kernel needs the avx512_bf16 level (its probe runs
VPDPBUSD), so the tests that need W8A8 lift the cap (``w8a8_kinds``), as tests/test_bf16.py does."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from engine import LLM, EngineConfig, smoothing
from engine.layers import Linear
from engine.models.llama import LlamaMLP
from engine.perplexity import perplexity
from pagedq_kernels import cpu_isa, cpu_ops, int8_linear, w8a8_linear
from pagedq_kernels.activation import silu_and_mul_torch
from tests.quantised_agreement import agreement_and_perplexities


@pytest.fixture
def w8a8_kinds(monkeypatch: pytest.MonkeyPatch) -> list[w8a8_linear.Kind]:
    """The W8A8 kernels that run here with the suite's ISA cap lifted (the test skips where none does)."""
    monkeypatch.delenv(cpu_isa.ENV_CAP, raising=False)
    kinds = w8a8_linear.available_kinds()
    if not kinds:
        pytest.skip(w8a8_linear.unavailable_reason())
    return kinds


@pytest.mark.usefixtures("isa_variant")
@pytest.mark.parametrize(("rows", "width"), [(1, 1), (3, 7), (5, 33), (64, 576), (130, 1536)])
def test_quantize_rows_is_the_reference_bit_for_bit(rows: int, width: int) -> None:
    if not cpu_ops.available():
        pytest.skip("no C compiler: the reference runs here")
    g = torch.Generator().manual_seed(rows * width)
    x = torch.randn(rows, width, generator=g) * torch.logspace(-3, 3, rows)[:, None]
    x[0] = 0.0  # a zero row: scale 0, codes 0
    q, scales = cpu_ops.quantize_rows_cpu(x)
    q_ref, scales_ref = cpu_ops.quantize_rows_torch(x)
    assert torch.equal(q, q_ref) and torch.equal(scales, scales_ref)
    assert q.dtype == torch.int8 and int(q.abs().max()) <= 127 and scales[0] == 0 and not q[0].any()
    nonzero = x[1:] if rows > 1 else x[:0]
    if nonzero.numel():  # every other row uses the full range: its max maps to +-127
        assert torch.equal(q[1:].abs().amax(dim=1), torch.full((rows - 1,), 127, dtype=torch.int8))
    # within half a step of the input
    assert torch.all((q.float() * scales[:, None] - x).abs() <= scales[:, None] * 0.5 + 1e-6)
    strided = torch.randn(4, width + 6, generator=g)[:, 3 : 3 + width]  # a column slice, like the model's views
    assert all(
        torch.equal(a, b)
        for a, b in zip(cpu_ops.quantize_rows_cpu(strided), cpu_ops.quantize_rows_torch(strided), strict=True)
    )


@pytest.mark.usefixtures("isa_variant")
@pytest.mark.parametrize("width", [5, 16, 37, 1536])
def test_silu_and_mul_folds_the_row_scale(width: int) -> None:
    g = torch.Generator().manual_seed(width)
    x, row_scale = torch.randn(9, 2 * width, generator=g), torch.rand(9, generator=g) * 4
    want = silu_and_mul_torch(x * row_scale[:, None])
    torch.testing.assert_close(cpu_ops.silu_and_mul_cpu(x, row_scale=row_scale), want, atol=2e-5, rtol=2e-6)


@pytest.mark.parametrize(("n", "k"), [(32, 64), (200, 96), (960, 576), (576, 1536), (45, 100)])
def test_w8a8_linear_is_the_exact_integer_product(w8a8_kinds: list[w8a8_linear.Kind], n: int, k: int) -> None:
    g = torch.Generator().manual_seed(n + k)
    weight = int8_linear.quantize_per_channel(torch.randn(n, k, generator=g))
    for kind in w8a8_kinds:
        packed = w8a8_linear.pack(weight, kind)
        assert packed is not None and packed.kind == kind
        assert packed.out_features == n and packed.in_features == k
        bias = torch.randn(n, generator=g)
        for rows in (1, 7, 13, 64, 300):  # one tile row, a tile and a part, rows spread over tiles, two row passes
            x = torch.randn(rows, k, generator=g) * 3
            torch.testing.assert_close(
                w8a8_linear.linear(x, packed, bias), w8a8_linear.linear_reference(x, weight, bias), atol=1e-4, rtol=1e-5
            )
        x3 = torch.randn(2, 3, k, generator=g)  # any leading dimensions
        assert w8a8_linear.linear(x3, packed, None).shape == (2, 3, n)
        assert w8a8_linear.linear(torch.empty(0, k), packed, None).shape == (0, n)
        with pytest.raises(ValueError, match="features"):
            w8a8_linear.linear(torch.randn(2, k + 1), packed, None)
        # close to the float product: per-token int8 activations cost ~1 % relative error per linear
        x = torch.randn(64, k, generator=g)
        exact = x @ weight.dequantize().T
        rel = float((w8a8_linear.linear(x, packed, None) - exact).norm() / exact.norm())
        assert rel < 0.02, rel


@pytest.mark.parametrize(("half", "k"), [(16, 64), (40, 96), (1536, 576)])
def test_vnni_gated_is_silu_and_mul_of_the_product(w8a8_kinds: list[w8a8_linear.Kind], half: int, k: int) -> None:
    """gate_up re-laid for the kernel's glu epilogue (16 gate columns, then the matching up columns, per block; 40:
    a partial last block) gives the SiLU-and-mul of the exact product; a oneDNN weight keeps the plain product."""
    g = torch.Generator().manual_seed(half + k)
    weight = int8_linear.quantize_per_channel(torch.randn(2 * half, k, generator=g))
    if "onednn" in w8a8_kinds:
        onednn = w8a8_linear.pack(weight, "onednn")
        assert onednn is not None and w8a8_linear.gated(onednn) is None
    if "vnni" not in w8a8_kinds:
        pytest.skip("the VNNI kernel does not run here")
    plain = w8a8_linear.pack(weight, "vnni")
    assert plain is not None
    gated = w8a8_linear.gated(plain)
    assert gated is not None and gated.glu and gated.out_features == half and w8a8_linear.gated(gated) is None
    for rows in (1, 13, 300):
        x = torch.randn(rows, k, generator=g)
        want = silu_and_mul_torch(w8a8_linear.linear_reference(x, weight, None))
        torch.testing.assert_close(w8a8_linear.linear(x, gated, None), want, atol=1e-4, rtol=2e-5)


def test_vnni_kernel_dispatch(monkeypatch: pytest.MonkeyPatch) -> None:
    """The VNNI kernel runs only at the avx512_bf16 level (its probe runs VPDPBUSD) and in_features a multiple of 4;
    under a lower cap, as the suite runs, it is not offered; oneDNN comes first only where AMX runs."""
    g = torch.Generator().manual_seed(5)
    odd = int8_linear.quantize_per_channel(torch.randn(8, 30, generator=g))
    monkeypatch.setenv(cpu_isa.ENV_CAP, "avx512")
    assert "vnni" not in w8a8_linear.available_kinds()
    monkeypatch.delenv(cpu_isa.ENV_CAP)
    kinds = w8a8_linear.available_kinds()
    levels = cpu_isa.current().levels
    assert ("vnni" in kinds) == ("avx512_bf16" in levels and w8a8_linear._vnni_lib() is not None)
    if "vnni" in kinds:
        assert w8a8_linear.pack(odd, "vnni") is None  # 30 is no multiple of 4
        assert kinds[0] == ("onednn" if "amx" in levels and "onednn" in kinds else "vnni")
        monkeypatch.setenv("PAGEDQ_DISABLE_W8A8_KERNEL", "1")
        assert "vnni" not in w8a8_linear.available_kinds()


@pytest.mark.usefixtures("w8a8_kinds")
def test_only_symmetric_per_channel_weights_qualify() -> None:
    g = torch.Generator().manual_seed(1)
    grouped = int8_linear.Int8Weight(
        torch.randint(-127, 128, (16, 64), generator=g, dtype=torch.int8), torch.rand(16, 2, generator=g), None, 32
    )
    assert not w8a8_linear.qualifies(grouped) and w8a8_linear.pack(grouped) is None
    with pytest.raises(ValueError, match="per-output-channel"):
        w8a8_linear.linear_reference(torch.randn(2, 64), grouped, None)


@pytest.mark.usefixtures("w8a8_kinds")
def test_tiny_model_w8a8_against_fp32(tiny_model: Callable[[str], Path]) -> None:
    """Every decoder linear runs W8A8 (gate_up through the row-scaled SiLU-and-mul on oneDNN, the kernel's glu
    epilogue on VNNI), and the model stays close to its fp32 self: random weights have thin argmax gaps, so
    agreement and perplexity are the measures."""
    path = tiny_model("llama_gqa")
    fp32 = LLM(str(path), dtype="float32", num_kv_blocks=64)
    w8a8 = LLM(str(path), dtype="float32", num_kv_blocks=64, quantization="w8a8")
    model = w8a8.engine.runner.model
    linears = [m for m in model.layers.modules() if isinstance(m, Linear)]
    mlps = [m for m in model.layers.modules() if isinstance(m, LlamaMLP)]
    assert linears and all(m.int8 is None and not m.weight.numel() for m in linears)
    for mlp in mlps:  # gate_up fused where the VNNI kernel packs it, a plain W8A8 linear otherwise
        assert (mlp.gated_w8a8 is not None) != (mlp.gate_up_proj.w8a8 is not None)
    assert all(m.w8a8 is not None for m in linears if not any(m is mlp.gate_up_proj for mlp in mlps))
    assert "w8a8" in repr(linears[0])
    agreement, ppl, ppl_w8a8 = agreement_and_perplexities(fp32, w8a8)
    assert agreement >= 0.8, agreement
    assert math.isfinite(ppl) and abs(ppl_w8a8 / ppl - 1) < 0.03, (ppl, ppl_w8a8)
    stats = w8a8.stats()
    assert stats.quantization == "w8a8" and stats.weight_bytes < 0.7 * fp32.stats().weight_bytes


def test_w8a8_where_it_cannot_run_is_a_clear_error(
    tiny_model: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    assert EngineConfig(quantization="W8A8").quantization == "w8a8"
    monkeypatch.setenv("PAGEDQ_DISABLE_W8A8", "1")
    with pytest.raises(ValueError, match="quantization='w8a8' cannot run here: PAGEDQ_DISABLE_W8A8 is set"):
        LLM(str(tiny_model("llama_gqa")), dtype="float32", num_kv_blocks=16, quantization="w8a8")


def test_worker_setting_and_cli_flag() -> None:
    from ops.cli import build_parser
    from worker.settings import load_settings

    assert load_settings(quantization="W8A8").quantization == "w8a8"
    assert build_parser("generate").parse_args(["generate", "--quantization", "w8a8", "hi"]).quantization == "w8a8"


def test_smoothing_leaves_the_dense_model_unchanged(tiny_model: Callable[[str], Path]) -> None:
    """SmoothQuant's folds (1/s into the norms and the up rows, s into the weights' columns) are exact in real
    arithmetic: the unquantised model scores a text as before, to fp32 rounding, while its activations' range
    per channel evens out."""
    path = tiny_model("llama_gqa")
    llm = LLM(str(path), dtype="float32", num_kv_blocks=64, cpu_weight_prepack=False)
    model = llm.engine.runner.model
    g = torch.Generator().manual_seed(3)
    text: list[int] = torch.randint(3, 500, (300,), generator=g).tolist()
    before = perplexity(llm.engine, text, 100)
    ids = smoothing.calibration_ids(lambda t: list(llm.tokenizer(t, add_special_tokens=False)["input_ids"]))
    assert len(ids) == smoothing.CALIBRATION_TOKENS
    amax = smoothing.input_amax(model, ids, torch.float32)
    linears = [m for m in model.layers.modules() if isinstance(m, Linear)]
    assert set(amax) == set(linears) and all(a.shape == (m.in_features,) for m, a in amax.items())
    assert smoothing.smooth(model, amax) == 4 * len(model.layers)  # qkv, gate_up, down, o_proj per layer
    after = perplexity(llm.engine, text, 100)
    assert abs(after / before - 1) < 1e-4, (before, after)
    spread = [float(a.max() / a.clamp(min=1e-6).median()) for a in amax.values()]
    smoothed = smoothing.input_amax(model, ids, torch.float32)
    qkv = next(m for m in model.layers.modules() if isinstance(m, Linear))  # layer 0's qkv_proj
    assert float(smoothed[qkv].max() / smoothed[qkv].median()) < float(amax[qkv].max() / amax[qkv].median())
    assert all(math.isfinite(x) for x in spread)
