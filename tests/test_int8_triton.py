"""The int8 weight-only Triton kernel against the torch reference (pagedq_kernels/int8_linear).

Without CUDA it runs through Triton's CPU interpreter (tests/conftest_kernels.py explains the switch), so
the shapes are small; they still cover partial row/column/K blocks, both group kinds (GGUF's 32 and
per-channel), offsets, bias, strided input and a merged layer's row count that is not a block multiple.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tests.conftest_kernels import use_interpreter_without_cuda

use_interpreter_without_cuda()  # also repairs triton if conftest's imports loaded it first

import pytest  # noqa: E402

from pagedq_kernels import int8_linear  # noqa: E402
from pagedq_kernels.int8_linear_triton import int8_linear as int8_linear_triton  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize(
    ("m", "n", "k", "group", "offsets", "bias"),
    [(1, 70, 64, 32, True, False), (5, 33, 96, 96, False, True), (20, 64, 40, 40, False, False)],
)
def test_int8_triton_matches_reference(m: int, n: int, k: int, group: int, offsets: bool, bias: bool) -> None:
    g = torch.Generator().manual_seed(m * n + k)
    values = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    scales = torch.rand(n, k // group, generator=g) / 64
    offs = torch.randn(n, k // group, generator=g) / 64 if offsets else None
    weight = int8_linear.Int8Weight(values, scales, offs, group)
    on_device = int8_linear.Int8Weight(
        values.to(DEVICE), scales.to(DEVICE), None if offs is None else offs.to(DEVICE), group
    )
    b = torch.randn(n, generator=g) if bias else None
    x = torch.randn(m, k + 3, generator=g)[:, :k]  # strided rows
    want = int8_linear.linear_reference(x, weight, b)
    got = int8_linear_triton(x.to(DEVICE), on_device, None if b is None else b.to(DEVICE))
    torch.testing.assert_close(got.cpu(), want, atol=2e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="features"):
        int8_linear_triton(torch.randn(2, k + 1, device=DEVICE), on_device, None)
