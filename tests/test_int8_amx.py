"""int8 weights of a bf16 model widened to bf16 in the AMX tile order, on each kernel that runs here: AMX tiles
(pagedq_kernels/csrc/cpu_int8_amx.c) and, where AMX does not run, AVX512-bf16 dot products (csrc/cpu_bf16_dp.c
gemm_int8_dp): against the torch reference on bf16-rounded inputs, every partial tile, the cases that keep the exact
fp32 kernel, and a bf16 tiny model end to end."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from engine import LLM
from engine.layers import Linear
from engine.models.llama import LlamaMLP
from pagedq_kernels import cpu_isa, cpu_linear, int8_linear
from schemas.sampling import SamplingParams
from tests.tiny_models import random_linear


@pytest.fixture(autouse=True, params=["amx", "dpbf16"])
def kernel(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The suite caps the ISA below bf16 (tests/conftest.py): lifted here, as tests/test_bf16.py does; for the
    dot-product kernel capped at avx512_bf16, which keeps AMX off where it runs."""
    monkeypatch.delenv(cpu_isa.ENV_CAP, raising=False)
    probed = list(cpu_isa.current().probed)
    if request.param == "amx" and not int8_linear.amx_available():
        pytest.skip(f"AMX not runnable here (probed: {probed})")
    if request.param == "dpbf16":
        monkeypatch.setenv(cpu_isa.ENV_CAP, "avx512_bf16")
        if cpu_linear.dp_library() is None:
            pytest.skip(f"AVX512-bf16 not runnable here (probed: {probed}): int8 weights keep the fp32 kernel")
    return str(request.param)


# one tile row, partial 16-row tiles (AMX), one and two 32-row blocks, several; on the dot products both sides of
# where widening moves from registers to the buffer (cpu_bf16_dp.c): 24 | 25 rows group-wise, 128 | 129 per channel
ROWS = (1, 5, 16, 17, 24, 25, 33, 128, 129, 300)


def _weight(n: int, k: int, seed: int) -> int8_linear.Int8Weight:
    g = torch.Generator().manual_seed(seed)
    return int8_linear.quantize_per_channel(torch.randn(n, k, generator=g))


def _on_tiles(weight: int8_linear.Int8Weight, matmul_dtype: torch.dtype | None = None) -> bool:
    packed = int8_linear.pack(weight, matmul_dtype=matmul_dtype)
    assert packed is not None
    return packed.amx


def _packed(kernel: str, weight: int8_linear.Int8Weight, glu: bool = False) -> int8_linear.PackedInt8:
    """``weight`` packed for a bf16 model, checked to be on ``kernel``."""
    packed = int8_linear.pack(weight, glu=glu, matmul_dtype=torch.bfloat16)
    assert packed is not None and packed.amx and (packed.dp_kernels is not None) == (kernel == "dpbf16")
    return packed


def _close(got: torch.Tensor, want: torch.Tensor, k: int) -> None:
    """Only the fp32 summation order differs (products of bf16 by int8 are exact in fp32): the error grows
    with the sum's length and the terms' size, not the result's."""
    torch.testing.assert_close(got, want, atol=2e-6 * k, rtol=1e-5)


@pytest.mark.parametrize(("n", "k"), [(40, 64), (200, 96), (33, 576), (70, 1536)])
def test_tiles_match_reference_on_bf16_inputs(kernel: str, n: int, k: int) -> None:
    # n: one partial block, several with a partial last one, a last block of one column
    weight = _weight(n, k, seed=n * k)
    bias = torch.randn(n)
    packed = _packed(kernel, weight)
    assert packed.values.nbytes == -(-n // 32) * 32 * k  # still one byte per weight
    g = torch.Generator().manual_seed(k)
    for rows in ROWS:
        x = torch.randn(rows, k, generator=g)
        rounded = x.bfloat16().float()
        _close(int8_linear.linear(x, packed, bias), int8_linear.linear_reference(rounded, weight, bias), k)
        _close(int8_linear.linear(x, packed, None), int8_linear.linear_reference(rounded, weight, None), k)
    assert int8_linear.linear(torch.empty(0, k), packed, None).shape == (0, n)
    strided = torch.randn(3, 2, k + 10, generator=g)[..., 5 : 5 + k]  # leading dims and a column slice
    want = int8_linear.linear_reference(strided.bfloat16().float(), weight, None)
    _close(int8_linear.linear(strided, packed, None), want, k)
    with pytest.raises(ValueError, match="features"):
        int8_linear.linear(torch.randn(2, k + 1), packed, None)


@pytest.mark.parametrize(("inter", "k"), [(40, 64), (24, 576)])
def test_tiles_gated_match_reference(kernel: str, inter: int, k: int) -> None:
    weight = _weight(2 * inter, k, seed=inter)
    packed = _packed(kernel, weight, glu=True)
    assert packed.out_features == inter
    g = torch.Generator().manual_seed(inter)
    for rows in ROWS:
        x = torch.randn(rows, k, generator=g)
        ref = int8_linear.linear_reference(x.bfloat16().float(), weight, None)
        want = F.silu(ref[:, :inter]) * ref[:, inter:]
        torch.testing.assert_close(int8_linear.linear(x, packed, None), want, atol=1e-4 * k, rtol=1e-4)
    with pytest.raises(ValueError, match="glu"):
        int8_linear.linear(torch.randn(2, k), packed, torch.zeros(inter))


@pytest.mark.parametrize(
    ("n", "k", "group", "offsets"),
    [(40, 64, 32, True), (200, 96, 32, False), (33, 576, 64, True), (40, 64, 64, True)],  # last: one group with offsets
)
def test_group_wise_weights_are_the_bf16_model_of_their_dequantisation(
    kernel: str, n: int, k: int, group: int, offsets: bool
) -> None:
    """A GGUF-like group-wise weight (Q4_1: codes 0-15, a scale and an offset per group of 32) under a bf16 model on
    the dot-product kernel: each weight dequantised as ``Int8Weight.dequantize`` does it, rounded to bf16, so the
    product is the bf16 kernel's on ``dequantize()`` bit for bit; gated too. AMX keeps such weights off its
    tiles (the fp32 kernel)."""
    g = torch.Generator().manual_seed(n + k + group)
    weight = int8_linear.Int8Weight(
        torch.randint(0, 16, (n, k), generator=g, dtype=torch.int8),
        torch.rand(n, k // group, generator=g) * 0.01 + 1e-3,
        -torch.rand(n, k // group, generator=g) * 0.08 if offsets else None,
        group,
    )
    if kernel == "amx":
        assert not _on_tiles(weight, torch.bfloat16)
        return
    packed = _packed(kernel, weight)
    dense = cpu_linear.pack(weight.dequantize(), "dpbf16", dtype=torch.bfloat16)
    gated = _packed(kernel, int8_linear.Int8Weight.concat([weight, weight.rows(torch.arange(n).flip(0))]), glu=True)
    dense_gated = cpu_linear.pack_gated(torch.cat([weight.dequantize(), weight.dequantize().flip(0)]), torch.bfloat16)
    assert dense is not None and dense_gated is not None
    for rows in ROWS:
        x = torch.randn(rows, k, generator=g)
        assert torch.equal(int8_linear.linear(x, packed, None), cpu_linear.linear(x, dense, None))
        assert torch.equal(int8_linear.linear(x, gated, None), cpu_linear.linear(x, dense_gated, None))


def test_tiles_only_where_the_matmul_is_bf16_and_the_weight_per_channel(
    kernel: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    per_channel = _weight(48, 64, seed=1)
    assert _on_tiles(per_channel, torch.bfloat16)
    assert not _on_tiles(per_channel) and not _on_tiles(per_channel, torch.float32)  # fp32: the exact kernel
    group_wise = int8_linear.Int8Weight(per_channel.values, per_channel.scales.repeat(1, 2), None, 32)  # GGUF-like
    assert _on_tiles(group_wise, torch.bfloat16) == (kernel == "dpbf16")  # dequantised to bf16 there
    sixteen = int8_linear.Int8Weight(per_channel.values, per_channel.scales.repeat(1, 4), None, 16)  # a K-quant's
    assert not _on_tiles(sixteen, torch.bfloat16)
    assert not _on_tiles(_weight(48, 48, seed=2), torch.bfloat16)  # K not a multiple of a tile row's 32
    monkeypatch.setenv(cpu_isa.ENV_CAP, "avx512")  # the operator's cap below bf16 keeps both off
    assert not int8_linear.amx_available() and cpu_linear.dp_library() is None
    assert not _on_tiles(per_channel, torch.bfloat16)


def test_linear_layer_packs_for_the_tiles_under_bf16(kernel: str) -> None:
    torch.manual_seed(3)
    layer = random_linear(96, 50, True)
    layer.quantize_int8()
    assert layer.int8 is not None
    x = torch.randn(7, 96)
    want = int8_linear.linear_reference(x.bfloat16().float(), layer.int8, layer.bias)
    assert layer.prepack(torch.bfloat16)
    assert layer.int8_packed is not None and layer.int8_packed.amx
    assert (layer.int8_packed.dp_kernels is not None) == (kernel == "dpbf16")
    _close(layer(x), want, 96)


def test_tiny_model_bf16_int8_runs_on_the_tiles(kernel: str, tiny_model: Callable[[str], Path]) -> None:
    """Every decoder linear of a bf16 model with int8 weights is packed in the tile order (on ``kernel``), and
    greedy first tokens mostly agree with fp32 (a random-weight model has thin argmax gaps: the share is the
    measure)."""
    path = tiny_model("llama_gqa")
    fp32 = LLM(str(path), dtype="float32", num_kv_blocks=64)
    int8 = LLM(str(path), dtype="bfloat16", num_kv_blocks=64, quantization="int8")
    layers = int8.engine.runner.model.layers
    linears = [m for m in layers.modules() if isinstance(m, Linear) and m.int8_packed is not None]
    mlps = [m for m in layers.modules() if isinstance(m, LlamaMLP)]
    assert len(linears) == 3 * len(mlps) and all(m.int8_packed.amx for m in linears)  # type: ignore[union-attr]
    assert all(m.gated_int8 is not None and m.gated_int8.amx for m in mlps)  # SiLU-and-mul fused
    on_dp = [m.int8_packed.dp_kernels is not None for m in linears]  # type: ignore[union-attr]
    assert all(on_dp) if kernel == "dpbf16" else not any(on_dp)
    g = torch.Generator().manual_seed(0)
    prompts: list[list[int]] = [torch.randint(3, 500, (12,), generator=g).tolist() for _ in range(48)]
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    first = [o.outputs[0].token_ids for o in fp32.generate(prompts, params)]
    first_int8 = [o.outputs[0].token_ids for o in int8.generate(prompts, params)]
    agreement = sum(a == b for a, b in zip(first, first_int8, strict=True)) / len(prompts)
    assert agreement >= 0.85, agreement
