"""The CPU matmul (packed weights: C panels, oneDNN) and fused C row ops against their torch references."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from engine.layers import Linear, build_cos_sin_cache
from pagedq_kernels import cpu_isa, cpu_linear, cpu_ops
from pagedq_kernels.activation import silu_and_mul_torch
from pagedq_kernels.rms_norm import rms_norm_torch
from pagedq_kernels.rotary import rotary_embedding_torch
from tests.epilogue_checks import check_add_norm_epilogue, check_argmax_epilogue
from tests.tiny_models import random_linear

# Every test here runs once per C-kernel variant the machine can run (tests/conftest.py, isa_variant).
pytestmark = pytest.mark.usefixtures("isa_variant")
KINDS: list[cpu_linear.Kind] = ["panels", "onednn"]


def needs_c(fn: Any) -> Any:
    """Skip where the C ops cannot be built (no compiler): the torch references run there instead."""

    def check(*args: Any, **kwargs: Any) -> None:
        if not cpu_ops.available():
            pytest.skip("no C compiler: the torch references run here")
        fn(*args, **kwargs)

    return functools.wraps(fn)(check)


def need_kind(kind: cpu_linear.Kind) -> None:
    if kind not in cpu_linear.available_kinds(torch.float32):
        pytest.skip(f"{kind} does not run in this variant (no compiler, or the generic build has no panel kernel)")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rows", [1, 5, 7, 64, 300, 400])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_f_linear(kind: cpu_linear.Kind, rows: int, bias: bool) -> None:
    # 200 outputs: a partial last panel; 400 rows: two row blocks of the panel kernel.
    need_kind(kind)
    torch.manual_seed(rows)
    layer = random_linear(96, 200, bias)
    dense_w = layer.weight.detach().clone()
    x = torch.randn(rows, 96)
    ref = F.linear(x, dense_w, layer.bias)
    packed = cpu_linear.pack(layer.weight, kind)
    assert packed is not None and packed.kind == kind
    torch.testing.assert_close(cpu_linear.linear(x, packed, layer.bias), ref, atol=1e-4, rtol=1e-5)
    assert layer.prepack()
    assert layer.weight.numel() == 0  # the dense copy is freed, not kept twice
    assert layer.packed is not None and layer.packed.kind == cpu_linear.available_kinds(torch.float32)[0]
    torch.testing.assert_close(layer(x), ref, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(layer(x.view(1, rows, 96)), ref.view(1, rows, 200), atol=1e-4, rtol=1e-5)
    strided = torch.randn(rows, 150)[:, 10:106]  # a column slice, like the model's split views
    torch.testing.assert_close(layer(strided), F.linear(strided, dense_w, layer.bias), atol=1e-4, rtol=1e-5)
    assert layer(torch.empty(0, 96)).shape == (0, 200)


@pytest.mark.parametrize(("n", "k"), [(1, 1), (15, 3), (17, 33), (49, 1536)])
def test_panel_kernel_odd_shapes(n: int, k: int) -> None:
    need_kind("panels")
    torch.manual_seed(n * k)
    w, b = torch.randn(n, k), torch.randn(n)
    packed = cpu_linear.pack(w, "panels")
    assert packed is not None
    for rows in (1, 5, 6, 11, 12, 13, 25):  # every tile height of both variants (6 rows AVX2, 12 AVX-512)
        x = torch.randn(rows, k)
        torch.testing.assert_close(cpu_linear.linear(x, packed, b), F.linear(x, w, b), atol=2e-4, rtol=1e-5)
    with pytest.raises(ValueError, match="features"):
        cpu_linear.linear(torch.randn(2, k + 1), packed, None)


@pytest.mark.parametrize(("inter", "rows"), [(1, 1), (7, 5), (40, 13), (64, 400)])
def test_gated_panels_fuse_silu_and_mul(inter: int, rows: int) -> None:
    need_kind("panels")
    # inter not a multiple of 8: a partial last panel of the gated layout.
    torch.manual_seed(inter)
    gate_up = torch.randn(2 * inter, 48)
    x = torch.randn(rows, 48) * 2  # gate values well into both tails of the SiLU
    packed = cpu_linear.pack_gated(gate_up)
    assert packed is not None and packed.glu and packed.out_features == inter
    ref = silu_and_mul_torch(F.linear(x, gate_up))
    torch.testing.assert_close(cpu_linear.linear(x, packed, None), ref, atol=2e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="bias"):
        cpu_linear.linear(x, packed, torch.zeros(inter))


@pytest.mark.parametrize("triple_max_rows", [0, 1 << 40], ids=["pair-tile", "triple-tile"])
@pytest.mark.parametrize(("out", "glu"), [(200, False), (1000, False), (100, True), (300, True)])
def test_a_rows_panel_product_is_the_same_floats_in_any_batch(out: int, glu: bool, triple_max_rows: int) -> None:
    """Each row gets the same chain of fused multiply-adds whatever the step's row count picks (single and paired
    12-row tiles, three-panel 8-row tiles from 16 rows, with the next item's panels prefetched up to 128; 13 / 63 /
    13 / 38 panels: items with one or two panels left over), and whichever tile the CPU's rule serves many rows with
    (cpu_linear.triple_tile_max_rows): a request's floats do not depend on what it is batched with."""
    need_kind("panels")
    torch.manual_seed(out)
    k = 72
    weight = torch.randn(2 * out if glu else out, k)
    bias = None if glu else torch.randn(out)
    packed = cpu_linear.pack_gated(weight) if glu else cpu_linear.pack(weight, "panels")
    assert packed is not None
    x = torch.randn(301, k)
    alone = torch.cat([cpu_linear.linear(x[i : i + 1], packed, bias) for i in range(x.shape[0])])
    with cpu_linear.panel_triple_rows(triple_max_rows):
        for rows in (2, 13, 15, 16, 63, 64, 95, 128, 129, 301):
            assert torch.equal(cpu_linear.linear(x[:rows], packed, bias), alone[:rows]), rows
    torch.testing.assert_close(
        alone, silu_and_mul_torch(F.linear(x, weight)) if glu else F.linear(x, weight, bias), atol=2e-4, rtol=1e-4
    )


@pytest.mark.parametrize(
    ("vendor", "family", "max_rows"),
    [
        ("AuthenticAMD", 26, cpu_linear.AMD_TRIPLE_MAX_ROWS),
        ("AuthenticAMD", 25, cpu_linear.AMD_TRIPLE_MAX_ROWS),
        ("GenuineIntel", 6, None),
    ],
)
def test_the_tile_rule_follows_the_core_it_was_measured_on(
    vendor: str, family: int, max_rows: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pair tile at every size on AMD, where it was measured faster (Zen 5 in csrc/cpu_gemm.c, Zen 4 in
    cpu_linear.triple_tile_max_rows); Intel keeps the triple from 16 rows."""
    monkeypatch.setattr(cpu_isa, "cpu_model", lambda: cpu_isa.CpuModel(vendor, family, 2))
    assert cpu_linear.triple_tile_max_rows() == max_rows


def test_pack_declines_what_it_cannot_run() -> None:
    assert cpu_linear.pack(torch.randn(8, 8, dtype=torch.float16)) is None
    layer = Linear(8, 8, False, torch.bfloat16)
    with torch.no_grad():
        layer.weight.normal_()
    if cpu_linear.pack(layer.weight) is None:  # bf16 reorder needs AVX512-BF16/AVX-NE-CONVERT
        assert not layer.prepack()
        assert layer.weight.shape == (8, 8)  # untouched: F.linear keeps running


@needs_c
@pytest.mark.parametrize("rows", [1, 3, 70, 600])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_cpu(rows: int, with_residual: bool) -> None:
    torch.manual_seed(rows)
    x = torch.randn(rows, 300)[:, :200]  # rows with a stride, like a split view
    residual = torch.randn(rows, 200) if with_residual else None
    w = torch.randn(200)
    out, res = cpu_ops.rms_norm_cpu(x, w, 1e-6, residual)
    ref, ref_res = rms_norm_torch(x, w, 1e-6, residual)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-5)
    if with_residual:
        assert res is not None and ref_res is not None
        torch.testing.assert_close(res, ref_res, atol=0, rtol=0)
    else:
        assert res is None


@needs_c
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(9, 3, 64), (4, 1, 20), (2, 2, 128)])
def test_rotary_cpu_in_place(heads: int, kv_heads: int, head_dim: int) -> None:
    torch.manual_seed(head_dim)
    n = 37
    qkv = torch.randn(n, (heads + 2 * kv_heads) * head_dim)
    q = qkv[:, : heads * head_dim].view(n, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(n, kv_heads, head_dim)
    cache = build_cos_sin_cache(head_dim, 4096, 10000.0, None)
    positions = torch.randint(0, 4096, (n,))
    ref_q, ref_k = rotary_embedding_torch(positions, q.clone(), k.clone(), cache)
    v_before = qkv[:, (heads + kv_heads) * head_dim :].clone()
    out_q, out_k = cpu_ops.rotary_embedding_cpu(positions, q, k, cache)
    assert out_q.data_ptr() == qkv.data_ptr()  # rotated where it lies
    torch.testing.assert_close(out_q, ref_q, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out_k, ref_k, atol=1e-5, rtol=1e-5)
    assert torch.equal(qkv[:, (heads + kv_heads) * head_dim :], v_before)  # v untouched


@needs_c
@pytest.mark.parametrize(("rows", "width"), [(1, 16), (9, 1536), (130, 100)])  # 100: not a multiple of 8
def test_silu_and_mul_cpu(rows: int, width: int) -> None:
    torch.manual_seed(width)
    x = torch.randn(rows, 2 * width) * 6  # wide range: exp saturates at both ends
    x[0, 0], x[0, 1] = -100.0, 100.0
    torch.testing.assert_close(cpu_ops.silu_and_mul_cpu(x), silu_and_mul_torch(x), atol=1e-5, rtol=2e-6)


@needs_c
@pytest.mark.parametrize(("rows", "width"), [(1, 49152), (7, 1000), (40, 37), (3, 5)])  # 1000, 37, 5: tails
def test_max_rows_is_torch_max(rows: int, width: int) -> None:
    # torch.max(dim=1)'s answer: the value and the index of its first occurrence, NaN first of all.
    torch.manual_seed(rows * width)
    x = torch.randn(rows, width + 3)[:, 1 : width + 1]  # rows with a stride of their own
    ties = torch.randint(0, 4, (rows, width)).float()  # few distinct values: ties everywhere
    x[rows // 2 :] = ties[rows // 2 :]
    if rows > 2:
        x[0] = float("-inf")  # nothing to choose
        x[1, width - 1] = float("nan")
        x[2, min(3, width - 1)] = float("nan")
        x[2, width - 1] = float("inf")
    values, indices = cpu_ops.max_rows(x)
    ref_values, ref_indices = x.max(dim=1)
    assert indices.dtype == torch.int64
    assert torch.equal(indices, ref_indices)
    torch.testing.assert_close(values, ref_values, equal_nan=True, rtol=0, atol=0)


@pytest.mark.parametrize("threads", [1, 2])
def test_panel_argmax_epilogue_is_the_argmax_of_the_product(threads: int) -> None:
    """The fp32 panel kernel's argmax (tests/epilogue_checks.py); oneDNN's packed weights have none."""
    onednn = cpu_linear.pack(torch.randn(64, 64), "onednn")
    assert onednn is None or cpu_linear.argmax_linear(torch.randn(2, 64), onednn) is None
    need_kind("panels")
    check_argmax_epilogue(lambda w: cpu_linear.pack(w, "panels"), threads)


@pytest.mark.parametrize("threads", [1, 2])
def test_panel_add_norm_epilogue_is_the_projection_then_the_norm(threads: int) -> None:
    """The fp32 panel kernel's residual add and RMSNorm after the product (tests/epilogue_checks.py)."""
    need_kind("panels")
    check_add_norm_epilogue(lambda w: cpu_linear.pack(w, "panels"), threads)


def test_max_rows_falls_back_to_torch_for_other_dtypes() -> None:
    x = torch.randn(3, 50, dtype=torch.bfloat16)
    values, indices = cpu_ops.max_rows(x)
    assert values.dtype == torch.bfloat16 and torch.equal(indices, x.max(dim=1).indices)


def test_cpu_ops_fall_back_for_other_dtypes() -> None:
    x = torch.randn(4, 16, dtype=torch.bfloat16)
    w = torch.randn(16, dtype=torch.bfloat16)
    assert torch.equal(cpu_ops.rms_norm_cpu(x, w, 1e-6)[0], rms_norm_torch(x, w, 1e-6)[0])
    assert torch.equal(cpu_ops.silu_and_mul_cpu(x), silu_and_mul_torch(x))


def test_host_memory_buffers_are_ordinary_tensors() -> None:
    from pagedq_kernels import host_memory

    big = host_memory.zeros((3, 1 << 20), torch.float32)  # 12 MB: madvised interior
    assert big.shape == (3, 1 << 20) and big.dtype == torch.float32 and not big.any()
    small = host_memory.empty((5,), torch.float16)  # too small to advise: plain torch.empty
    assert small.shape == (5,) and small.dtype == torch.float16


def test_host_memory_stops_asking_for_huge_pages_that_fault_slowly(monkeypatch: pytest.MonkeyPatch) -> None:
    """Huge pages that the kernel must compact memory for cost more than they save: a large buffer's 64 MB
    chunks are timed, and below the threshold the next chunk is touched in ordinary pages; when those are
    COMPACTION_RATIO times faster the rest (and later buffers) take ordinary pages, else huge pages stay
    (a slow first touch that every page size pays, as a hypervisor's)."""
    from pagedq_kernels import host_memory

    if host_memory._madvise_fn is None:
        pytest.skip("no madvise here: buffers are ordinary memory")
    monkeypatch.setattr(host_memory, "_huge_pages_slow", False)
    monkeypatch.setattr(host_memory, "SLOW_BYTES_PER_S", 0)  # nothing is slower than 0 B/s: keeps asking
    buffer = host_memory.zeros((200 << 20,), torch.uint8)
    assert not host_memory.huge_pages_measured_slow() and not buffer.any()
    monkeypatch.setattr(host_memory, "SLOW_BYTES_PER_S", 1 << 60)  # every fault measures "slow"
    monkeypatch.setattr(host_memory, "COMPACTION_RATIO", float("inf"))  # ... and ordinary pages never cure it
    buffer = host_memory.zeros((200 << 20,), torch.uint8)
    assert not host_memory.huge_pages_measured_slow() and not buffer.any()
    monkeypatch.setattr(host_memory, "COMPACTION_RATIO", 0.0)  # ordinary pages always count as the cure
    buffer = host_memory.zeros((200 << 20,), torch.uint8)
    assert host_memory.huge_pages_measured_slow() and not buffer.any()
    later = host_memory.empty((160 << 20,), torch.uint8)  # asks for nothing now: touched by nobody
    assert later.shape == (160 << 20,)
