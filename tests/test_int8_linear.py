"""int8 weights (pagedq_kernels/int8_linear): the C kernel per ISA variant against the torch reference, the layout's
exactness, quantization="int8" through the config, and a tiny model end to end against its fp32 self."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from engine import LLM, EngineConfig
from pagedq_kernels import int8_linear
from tests.quantised_agreement import agreement_and_perplexities
from tests.tiny_models import random_linear


def _weight(n: int, k: int, group: int, offsets: bool, seed: int) -> int8_linear.Int8Weight:
    """A random group-wise weight; Q4-like 4-bit codes when it has offsets, full int8 range otherwise."""
    g = torch.Generator().manual_seed(seed)
    low, high = (0, 16) if offsets else (-127, 128)
    values = torch.randint(low, high, (n, k), generator=g, dtype=torch.int8)
    scales = torch.rand(n, k // group, generator=g) / 64
    offs = -8 * torch.rand(n, k // group, generator=g) / 64 if offsets else None
    return int8_linear.Int8Weight(values, scales, offs, group)


@pytest.mark.usefixtures("isa_variant")
@pytest.mark.parametrize(
    ("n", "k", "group", "offsets"),
    [
        (200, 96, 96, False),
        (49, 64, 32, True),
        (17, 1536, 32, False),
        (1, 32, 32, True),
        (64, 576, 576, False),
        (33, 512, 16, True),  # a GGUF Q4_K_M qkv: Q4_K and Q6_K merged at groups of 16
        (20, 256, 16, False),  # Q6_K, Q3_K
    ],
)
def test_c_kernel_matches_reference(n: int, k: int, group: int, offsets: bool) -> None:
    # 200 and 17 outputs: partial last panels; rows 1..13: every tile height of both SIMD builds; 400: two blocks
    if not int8_linear.kernel_available():
        pytest.skip("no C compiler: the reference runs here")
    weight = _weight(n, k, group, offsets, seed=n * k)
    bias = torch.randn(n)
    packed = int8_linear.pack(weight)
    assert packed is not None
    assert packed.values.nbytes == -(-n // 16) * 16 * k  # one byte per weight (panels padded to 16 columns)
    for rows in (1, 5, 6, 7, 12, 13, 400):
        x = torch.randn(rows, k)
        ref = int8_linear.linear_reference(x, weight, bias)
        torch.testing.assert_close(int8_linear.linear(x, packed, bias), ref, atol=2e-4, rtol=1e-4)
    assert int8_linear.linear(torch.empty(0, k), packed, None).shape == (0, n)
    strided = torch.randn(3, k + 10)[:, 5 : 5 + k]  # a column slice, like the model's split views
    want = int8_linear.linear_reference(strided, weight, None)
    torch.testing.assert_close(int8_linear.linear(strided, packed, None), want, atol=2e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="features"):
        int8_linear.linear(torch.randn(2, k + 1), packed, None)


@pytest.mark.usefixtures("isa_variant")
@pytest.mark.parametrize(("group", "offsets", "glu"), [(32, True, False), (16, False, False), (32, True, True)])
def test_decode_sized_calls_give_the_same_floats_as_larger_ones(group: int, offsets: bool, glu: bool) -> None:
    """Up to fused_rows() rows (six on AVX2, twelve on AVX-512) take the fused path (dequantised in registers, no
    fp32 panel buffer); more rows the buffered one. Same weights, same order of sums: each row's output is the
    same float either way."""
    if not int8_linear.kernel_available():
        pytest.skip("no C compiler: the reference runs here")
    weight = _weight(72, 512, group, offsets, seed=11)  # 4.5 panels (9 of the glu layout's half-panels)
    packed = int8_linear.pack(weight, glu=glu)
    assert packed is not None
    bias = None if glu else torch.randn(72)
    fused = int8_linear.fused_rows()
    x = torch.randn(max(fused, 8) + 1, 512)
    many = int8_linear.linear(x, packed, bias)  # past the fused path: buffered
    for rows in range(1, max(fused, 1) + 1):
        assert torch.equal(int8_linear.linear(x[:rows], packed, bias), many[:rows]), rows
    strided = torch.randn(2, 530)[:, 7:519]  # a column slice, as the model's split views
    assert torch.equal(
        int8_linear.linear(strided, packed, bias), int8_linear.linear(strided.contiguous(), packed, bias)
    )


@pytest.mark.usefixtures("isa_variant")
def test_c_kernel_gated_matches_reference() -> None:
    if not int8_linear.kernel_available():
        pytest.skip("no C compiler: the reference runs here")
    inter = 40  # 5 half-panels of 8: the glu layout's own panel width
    weight = _weight(2 * inter, 64, 32, True, seed=3)
    packed = int8_linear.pack(weight, glu=True)
    assert packed is not None and packed.out_features == inter
    for rows in (1, 7, 30):
        x = torch.randn(rows, 64)
        ref = int8_linear.linear_reference(x, weight, None)
        want = F.silu(ref[:, :inter]) * ref[:, inter:]
        torch.testing.assert_close(int8_linear.linear(x, packed, None), want, atol=2e-4, rtol=1e-4)


def test_per_channel_quantisation_error_and_layout() -> None:
    torch.manual_seed(0)
    w = torch.randn(33, 80)
    w[5] = 0.0  # an all-zero row stays zero
    q = int8_linear.quantize_per_channel(w)
    assert q.group_size == 80 and q.offsets is None and q.values.dtype == torch.int8
    assert int(q.values.abs().max()) == 127  # each row's absmax maps onto the full range
    err = (q.dequantize() - w).abs()
    assert torch.all(err <= q.scales / 2 + 1e-7)  # rounding: at most half a step per element
    assert torch.equal(q.dequantize()[5], torch.zeros(80))
    perm = torch.randperm(33)
    assert torch.equal(q.rows(perm).dequantize(), q.dequantize()[perm])  # row moves are exact
    merged = int8_linear.Int8Weight.concat([q, q.rows(perm)])
    assert torch.equal(merged.dequantize(), torch.cat([q.dequantize(), q.dequantize()[perm]]))
    with pytest.raises(ValueError, match="group size"):
        int8_linear.Int8Weight(q.values, q.scales, None, 7)
    with pytest.raises(ValueError, match="scales"):
        int8_linear.Int8Weight(q.values, q.scales[:, :0], None, 80)


def test_linear_layer_holds_int8_and_frees_the_dense_weight() -> None:
    torch.manual_seed(1)
    layer = random_linear(64, 48, True)
    dense_bytes = layer.weight_bytes
    layer.quantize_int8()
    assert layer.weight.numel() == 0 and layer.int8 is not None
    x = torch.randn(5, 64)
    ref = int8_linear.linear_reference(x, layer.int8, layer.bias)
    torch.testing.assert_close(layer(x), ref)  # unpacked: the reference path itself
    packed = layer.prepack()
    if packed:
        torch.testing.assert_close(layer(x), ref, atol=2e-4, rtol=1e-4)
    assert layer.weight_bytes < dense_bytes / 2
    with pytest.raises(ValueError, match="int8 weight"):
        layer.set_int8(int8_linear.quantize_per_channel(torch.randn(3, 64)))


def test_unsupported_quantization_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="quantization must be one of none, int8, w8a8; got 'int4'"):
        EngineConfig(quantization="int4")
    assert EngineConfig(quantization="INT8").quantization == "int8"
    assert EngineConfig(quantization="none").quantization is None


def test_tiny_model_int8_against_fp32(tiny_model: Callable[[str], Path]) -> None:
    """Greedy next tokens mostly agree and perplexity stays within 1 %: a random-weight model has thin
    argmax gaps, so the agreement share is the measure, not exactness."""
    path = tiny_model("llama_gqa")
    fp32 = LLM(str(path), dtype="float32", num_kv_blocks=64)
    int8 = LLM(str(path), dtype="float32", num_kv_blocks=64, quantization="int8")
    agreement, ppl, ppl_int8 = agreement_and_perplexities(fp32, int8)
    assert agreement >= 0.9, agreement
    assert math.isfinite(ppl) and abs(ppl_int8 / ppl - 1) < 0.01, (ppl, ppl_int8)
    stats, stats_int8 = fp32.stats(), int8.stats()
    assert stats_int8.quantization == "int8" and stats.quantization is None
    assert stats_int8.weight_bytes < 0.7 * stats.weight_bytes  # embeddings and lm_head stay fp32
    assert stats_int8.kv_cache_bytes == stats.kv_cache_bytes > 0
    assert int8.engine.num_running() == 0 and int8.engine.kv.num_free_blocks == 64  # perplexity gave blocks back


def test_worker_setting_and_cli_flag() -> None:
    from ops.cli import build_parser
    from worker.settings import SettingsError, load_settings

    assert load_settings(quantization="int8").quantization == "int8"
    assert load_settings(quantization="none").quantization is None
    with pytest.raises(SettingsError, match=r"quantization.*must be none or one of int8, w8a8"):
        load_settings(quantization="q4_k")
    args = build_parser("generate").parse_args(["generate", "--quantization", "int8", "hi"])
    assert args.quantization == "int8"
