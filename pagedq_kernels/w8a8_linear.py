"""W8A8 linears on CPU: int8 weights times int8 activations, on the CPU's int8 dot products (AMX, VNNI).

``quantization="w8a8"``: each decoder linear's weight is symmetric per-output-channel int8 (the same
:class:`~pagedq_kernels.int8_linear.Int8Weight` as weight-only ``int8``), and its input is quantised on the fly,
per token: ``x[m, :] ~= xq[m, :] * xs[m]`` with ``xs[m] = absmax(x[m, :]) / 127``
(:func:`pagedq_kernels.cpu_ops.quantize_rows_cpu`). The product is integer, accumulated in int32 without loss:

    y[m, n] = xs[m] * ws[n] * sum_k xq[m, k] * wq[n, k]

Why: weight-only int8 removes weight bytes but not multiplies (each weight is widened to fp32 in the tile),
and compass-sized batches are compute-bound, so it gained 1.16x over fp32 and lost to bf16 on AMX. The
int8 tiles of AMX (``tdpbssd``) and VNNI's ``vpdpbusd`` multiply 4x as many pairs per instruction as fp32
FMAs. Measured on a 2-vCPU Intel Xeon with AMX (family 6 model 167), SmolLM2-135M's shapes, microseconds:

    K x N        rows  bf16 (oneDNN)  W8A8 (oneDNN)   per-token quantisation (torch / C)
    576 x 3072     64      162            95            34 / see csrc/cpu_ops.c
    576 x 3072    256      426           264            63
    576 x 3072   2048     4065          1758           955
    1536 x 576    256      427           130           232

The matmul is oneDNN's (``torch.ops.onednn.qlinear_pointwise``, weights reordered once at load by
``qlinear_prepack``): int8 in, fp32 out, with the per-channel weight scale applied inside and the
activation scale given as 1, since oneDNN takes one activation scale per tensor. The per-token scale is
applied after: :func:`linear` multiplies the rows in place, and a gated MLP's gate_up leaves it to the
SiLU-and-mul that reads the product anyway (:func:`matmul_unscaled` + ``silu_and_mul_cpu(row_scale=)``).

Only symmetric per-channel weights qualify (a GGUF's 32-wide groups would need a rescale per group inside
the integer sum); :func:`pack` returns None for anything else and the caller keeps the weight-only kernel.
:func:`linear_reference` is the exact math in float64, what the kernels are tested against.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pagedq_kernels import cpu_ops
from pagedq_kernels.int8_linear import Int8Weight


@dataclass(frozen=True, eq=False)
class PackedW8A8:
    """A per-channel int8 weight reordered for oneDNN's int8 matmul (opaque to torch)."""

    data: torch.Tensor  # oneDNN's blocked int8 layout
    scales: torch.Tensor  # float32 [N]: the weight's per-channel scales
    zero_points: torch.Tensor  # int64 [N] zeros (symmetric; the op takes them as a tensor)
    out_features: int
    in_features: int

    @property
    def nbytes(self) -> int:
        return self.data.nbytes + self.scales.nbytes + self.zero_points.nbytes


def _ops_present() -> bool:
    onednn = getattr(torch.ops, "onednn", None)
    return (
        torch.backends.mkldnn.is_available()
        and onednn is not None
        and hasattr(onednn, "qlinear_prepack")
        and hasattr(onednn, "qlinear_pointwise")
    )


def _trial_weight(out_features: int, in_features: int, generator: torch.Generator) -> Int8Weight:
    """A random symmetric per-channel int8 weight for the start-up trials."""
    return Int8Weight(
        torch.randint(-127, 128, (out_features, in_features), generator=generator, dtype=torch.int8),
        torch.rand((out_features, 1), generator=generator) + 0.5,
        None,
        in_features,
    )


@functools.cache
def _trial_ok() -> bool:
    """Probe by running: a small W8A8 product through oneDNN must equal the exact integer math.

    Cached per process: oneDNN picks its kernels once, from the CPU it finds."""
    generator = torch.Generator().manual_seed(0)
    weight = _trial_weight(32, 64, generator)
    x = torch.randn((5, 64), generator=generator)
    try:
        packed = _pack(weight)
        got = linear(x, packed, None)
    except (RuntimeError, NotImplementedError):
        return False
    exact = torch.allclose(got.double(), linear_reference(x, weight, None).double(), rtol=1e-5, atol=1e-5)
    return exact and _trial_fast()


def _trial_fast() -> bool:
    """oneDNN's int8 product runs a real kernel, not its reference loop: within 4x the time of the same-sized
    fp32 matmul (a real int8 kernel is faster than fp32). On a 2-vCPU AMD EPYC Zen 5 (AVX512-VNNI, no AMX)
    oneDNN answered s8 x s8 exactly but at 0.08 GOP/s, ~1500x slower than fp32 (a 1024 x 576 x 1536 product:
    23.7 s against 15 ms): a model there would take hours for what fp32 does in seconds."""
    generator = torch.Generator().manual_seed(1)
    weight = _trial_weight(256, 256, generator)
    x = torch.randn((64, 256), generator=generator)
    dense = torch.randn((256, 256), generator=generator)
    packed = _pack(weight)

    def best(fn: Callable[[], object]) -> float:
        times = []
        for _ in range(3):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return min(times)

    fp32 = best(lambda: x @ dense.T)
    int8 = best(lambda: linear(x, packed, None))
    return int8 <= 4 * fp32 + 1e-4  # + 0.1 ms: both are microseconds; the reference loop takes ~30 ms here


def available() -> bool:
    """This process can run W8A8 linears: oneDNN's int8 ops are in this torch build and a trial product is
    exact. ``PAGEDQ_DISABLE_W8A8=1`` switches them off (``quantization="w8a8"`` then fails with that reason)."""
    if os.environ.get("PAGEDQ_DISABLE_W8A8"):
        return False
    return _ops_present() and _trial_ok()


def unavailable_reason() -> str:
    """One line for the error a user sees when they ask for W8A8 where it cannot run."""
    if os.environ.get("PAGEDQ_DISABLE_W8A8"):
        return "PAGEDQ_DISABLE_W8A8 is set"
    if not _ops_present():
        return f"this torch build ({torch.__version__}) has no oneDNN int8 linear (torch.ops.onednn.qlinear_*)"
    return "oneDNN's int8 linear did not reproduce the integer product on this CPU, or ran its reference loop"


def qualifies(weight: Int8Weight) -> bool:
    """Symmetric per-output-channel: the one form whose scale factors out of the integer sum."""
    return weight.offsets is None and weight.group_size == weight.in_features


def _pack(weight: Int8Weight) -> PackedW8A8:
    data = torch.ops.onednn.qlinear_prepack(weight.values.contiguous(), None)
    n = weight.out_features
    return PackedW8A8(
        data, weight.scales.reshape(n).contiguous(), torch.zeros(n, dtype=torch.int64), n, weight.in_features
    )


def pack(weight: Int8Weight) -> PackedW8A8 | None:
    """``weight`` reordered for :func:`linear`; None where W8A8 cannot run or the weight does not qualify."""
    if weight.values.device.type != "cpu" or not qualifies(weight) or not available():
        return None
    return _pack(weight)


def matmul_unscaled(x: torch.Tensor, packed: PackedW8A8) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y', xs)`` with ``y' [rows, N]`` fp32 still to be multiplied by the per-token scales ``xs [rows]``.

    ``x`` (fp32, any leading dimensions) is flattened to rows; the caller applies ``xs`` where it reads
    ``y'`` anyway (:func:`linear`, or a fused SiLU-and-mul)."""
    k = packed.in_features
    if x.shape[-1] != k:
        raise ValueError(f"w8a8 linear: input has {x.shape[-1]} features, the weight expects {k}")
    rows = x.reshape(-1, k)
    if rows.dtype != torch.float32:
        rows = rows.float()
    if rows.shape[0] == 0:
        return torch.empty((0, packed.out_features)), torch.empty((0,))
    xq, xs = cpu_ops.quantize_rows_cpu(rows)
    out = torch.ops.onednn.qlinear_pointwise(
        xq, 1.0, 0, packed.data, packed.scales, packed.zero_points, None, 1.0, 0, torch.float32, "none", [], ""
    )
    return out, xs


def linear(x: torch.Tensor, packed: PackedW8A8, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ W.T + bias`` through int8: fp32 in, fp32 out, ``x`` with any leading dimensions."""
    out, xs = matmul_unscaled(x, packed)
    out.mul_(xs.unsqueeze(1))
    if bias is not None:
        out.add_(bias.float())
    return out.view(*x.shape[:-1], packed.out_features)


def linear_reference(x: torch.Tensor, weight: Int8Weight, bias: torch.Tensor | None) -> torch.Tensor:
    """The exact W8A8 math: the reference per-token quantisation, the integer sum in float64 (exact for any
    realistic K: |sum| <= 127 * 127 * K < 2**53), scaled by both scales; fp32 out."""
    if not qualifies(weight):
        raise ValueError("w8a8 needs a symmetric per-output-channel int8 weight")
    rows = x.reshape(-1, weight.in_features)
    xq, xs = cpu_ops.quantize_rows_torch(rows)
    acc = xq.double() @ weight.values.double().T
    out = acc * xs.double()[:, None] * weight.scales.double().reshape(1, -1)
    if bias is not None:
        out = out + bias.double()
    return out.float().view(*x.shape[:-1], weight.out_features)
