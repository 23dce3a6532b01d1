"""bf16 weights on pagedq's AMX kernel (kernels/csrc/cpu_bf16_amx.c, kind "amx" of kernels/cpu_linear): against
a float64 reference on bf16-rounded inputs, every partial tile and block, bias, the fused SiLU-and-mul; oneDNN
kept under the ISA cap, the switch and for in_features the tiles cannot take; a bf16 tiny model end to end."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from engine import LLM
from engine.layers import Linear
from engine.models.llama import LlamaMLP
from kernels import cpu_isa, cpu_linear
from schemas.sampling import SamplingParams
from tests.tiny_models import random_linear
from worker.__main__ import kernel_path
from worker.settings import Settings

ROWS = (1, 5, 16, 17, 31, 33, 36, 100, 300)  # tile heights 1, 5, 16, 9, 16, 11, 12, 15, 16; one to ten row blocks


@pytest.fixture(autouse=True)
def amx(monkeypatch: pytest.MonkeyPatch) -> None:
    """The suite caps the ISA below bf16 (tests/conftest.py): lifted here, as tests/test_bf16.py does."""
    monkeypatch.delenv(cpu_isa.ENV_CAP, raising=False)
    monkeypatch.delenv("PAGEDQ_DISABLE_AMX_LINEAR", raising=False)
    if not cpu_linear.amx_available():
        probed = list(cpu_isa.current().probed)
        pytest.skip(f"AMX not runnable here (probed: {probed}): bf16 weights keep oneDNN")


def _reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The exact product of bf16-rounded x and weight (float64), plus the fp32 bias."""
    b = bias.double() if bias is not None else None
    return F.linear(x.bfloat16().double(), w.bfloat16().double(), b)


def _close(got: torch.Tensor, want: torch.Tensor, k: int) -> None:
    """Products of two bf16 are exact in fp32: only the fp32 sum's rounding and order differ, an error that
    grows with the sum's length and the terms' size (unit normal here), not with the result's."""
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, atol=2e-6 * k, rtol=1e-5)


@pytest.mark.parametrize(("n", "k"), [(40, 32), (200, 576), (33, 576)])
def test_amx_matches_float64_on_bf16_inputs(n: int, k: int) -> None:
    # n: one partial block, several with a partial last one, a last block of one column (none a multiple of 32)
    g = torch.Generator().manual_seed(n * k)
    w, bias = torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    packed = cpu_linear.pack(w, dtype=torch.bfloat16)
    assert packed is not None and packed.kind == "amx" and not packed.glu
    assert packed.data.dtype == torch.bfloat16 and packed.data.numel() == -(-n // 32) * 32 * k  # padded block
    for rows in ROWS:
        x = torch.randn(rows, k, generator=g)
        _close(cpu_linear.linear(x, packed, bias), _reference(x, w, bias), k)
        _close(cpu_linear.linear(x, packed, None), _reference(x, w, None), k)
    assert cpu_linear.linear(torch.empty(0, k), packed, None).shape == (0, n)
    strided = torch.randn(3, 2, k + 10, generator=g)[..., 5 : 5 + k]  # leading dims and a column slice
    _close(cpu_linear.linear(strided, packed, None), _reference(strided, w, None), k)
    as_bf16 = torch.randn(7, k, generator=g).bfloat16()  # bf16 activations: widened, the result handed back in bf16
    out = cpu_linear.linear(as_bf16, packed, bias)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), _reference(as_bf16, w, bias), atol=2e-6 * k, rtol=1 / 128)
    with pytest.raises(ValueError, match="features"):
        cpu_linear.linear(torch.randn(2, k + 1), packed, None)


@pytest.mark.parametrize(("inter", "k"), [(40, 32), (24, 576)])
def test_amx_gated_matches_silu_gate_times_up(inter: int, k: int) -> None:
    g = torch.Generator().manual_seed(inter * k)
    gate_up = torch.randn(2 * inter, k, generator=g)
    packed = cpu_linear.pack_gated(gate_up, torch.bfloat16)
    assert packed is not None and packed.kind == "amx" and packed.glu and packed.out_features == inter
    assert packed.data.numel() == -(-inter // 16) * 32 * k  # 16 gate + 16 up columns per block
    for rows in ROWS:
        x = torch.randn(rows, k, generator=g)
        product = _reference(x, gate_up, None)
        want = F.silu(product[:, :inter]) * product[:, inter:]
        got = cpu_linear.linear(x, packed, None)
        assert got.dtype == torch.float32 and got.shape == (rows, inter)
        # |silu(g) * u| ~ k: the sums' error (~1e-6 k) scaled by the other factor, and exp16's few ulp
        torch.testing.assert_close(got.double(), want, atol=1e-5 * k, rtol=1e-5)
    with pytest.raises(ValueError, match="glu"):
        cpu_linear.linear(torch.randn(2, k), packed, torch.zeros(inter))


def test_onednn_where_amx_may_not_or_cannot_run(monkeypatch: pytest.MonkeyPatch) -> None:
    w = torch.randn(48, 64)
    assert cpu_linear.available_kinds(torch.bfloat16)[0] == "amx"
    packed = cpu_linear.pack(w, dtype=torch.bfloat16)
    assert packed is not None and packed.kind == "amx"
    odd_k = cpu_linear.pack(torch.randn(48, 48), dtype=torch.bfloat16)  # K not a multiple of a tile row's 32
    assert odd_k is not None and odd_k.kind == "onednn"
    assert cpu_linear.pack_gated(torch.randn(48, 48), torch.bfloat16) is None  # the caller keeps the unfused pair
    fp32 = cpu_linear.pack(w)
    assert fp32 is not None and fp32.kind != "amx"  # fp32 weights: the exact fp32 kernels
    monkeypatch.setenv(cpu_isa.ENV_CAP, "avx512_bf16")  # the operator's cap keeps AMX off: oneDNN's bf16
    assert not cpu_linear.amx_available() and cpu_linear.available_kinds(torch.bfloat16) == ["onednn"]
    capped = cpu_linear.pack(w, dtype=torch.bfloat16)
    assert capped is not None and capped.kind == "onednn"
    assert cpu_linear.pack_gated(torch.randn(96, 64), torch.bfloat16) is None
    monkeypatch.delenv(cpu_isa.ENV_CAP)
    monkeypatch.setenv("PAGEDQ_DISABLE_AMX_LINEAR", "1")  # the switch, for comparisons
    assert cpu_linear.available_kinds(torch.bfloat16) == ["onednn"]


def test_worker_reports_the_amx_matmul_as_the_c_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker.kernels line names the kernel bf16 matmuls run on, and counts it as the fast (C) path."""
    bf16_cpu = Settings.model_validate({"dtype": "bfloat16", "device": "cpu"})
    fast, fields = kernel_path(bf16_cpu)
    assert fast and fields["matmul"] == "amx-bf16" and fields["path"] == "c", fields  # the C kernels built here
    monkeypatch.setenv("PAGEDQ_DISABLE_AMX_LINEAR", "1")
    assert kernel_path(bf16_cpu)[1]["matmul"] == "onednn-bf16"


def test_linear_layer_packs_for_amx_under_bf16() -> None:
    torch.manual_seed(3)
    layer = random_linear(96, 50, True)
    x = torch.randn(7, 96)
    want = _reference(x, layer.weight, layer.bias)
    assert layer.prepack(torch.bfloat16)
    assert layer.packed is not None and layer.packed.kind == "amx"
    assert layer.weight_bytes == 2 * 32 * 96 * 2 + 50 * 4  # two padded bf16 blocks and the fp32 bias
    _close(layer(x), want, 96)


def test_tiny_bf16_model_on_amx_generates_as_on_onednn(
    tiny_model: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every decoder linear, the fused gate_up and the lm_head of a bf16 model run on the kernel, and greedy
    tokens match the same model on oneDNN (same bf16 weights and rounded inputs; only the fp32 sums' order,
    the bias's rounding and the fused SiLU's exp differ, so a thin argmax gap may flip: the share is the
    measure)."""
    path = tiny_model("llama_gqa")
    amx = LLM(str(path), dtype="bfloat16", num_kv_blocks=64)
    model = amx.engine.runner.model
    linears = [m for m in model.layers.modules() if isinstance(m, Linear) and m.packed is not None]
    mlps = [m for m in model.layers.modules() if isinstance(m, LlamaMLP)]
    assert len(linears) == 3 * len(mlps) and all(m.packed.kind == "amx" for m in linears)  # type: ignore[union-attr]
    assert all(m.gated is not None and m.gated.kind == "amx" for m in mlps)  # SiLU-and-mul fused
    assert model.lm_head_packed is not None and model.lm_head_packed.kind == "amx"
    monkeypatch.setenv("PAGEDQ_DISABLE_AMX_LINEAR", "1")
    onednn = LLM(str(path), dtype="bfloat16", num_kv_blocks=64)
    assert onednn.engine.runner.model.lm_head_packed.kind == "onednn"  # type: ignore[union-attr]
    g = torch.Generator().manual_seed(0)
    prompts: list[list[int]] = [torch.randint(3, 500, (12,), generator=g).tolist() for _ in range(32)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    on_amx = [o.outputs[0].token_ids for o in amx.generate(prompts, params)]
    on_onednn = [o.outputs[0].token_ids for o in onednn.generate(prompts, params)]
    # tokens up to each sequence's first disagreement (after one, the contexts differ)
    same = 0
    for a, b in zip(on_amx, on_onednn, strict=True):
        same += next((i for i, (s, t) in enumerate(zip(a, b, strict=True)) if s != t), len(a))
    share = same / (8 * len(prompts))
    print(f"AMX vs oneDNN: {share:.3f} of greedy tokens agree before a sequence's first difference")
    assert share >= 0.85, share
