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

Two kernels multiply (:data:`Kind`), picked per weight at load by :func:`pack`:

- ``vnni``: pagedq's own (``csrc/cpu_w8a8.c``) on AVX512-VNNI's ``vpdpbusd``, where the avx512_bf16 level
  (whose probe runs VPDPBUSD too) runs under the ``PAGEDQ_CPU_ISA`` cap, ``in_features`` a multiple of 4, and
  AMX does not (``PAGEDQ_DISABLE_W8A8_KERNEL=1`` switches it off): x quantised per token inside the call, the
  per-channel and per-token scales and the bias (or, for a :func:`gated` gate_up, the SiLU-and-mul) applied in
  its epilogue, one call the whole-step CPU plan makes like the float kernels'. On a 2-vCPU AMD EPYC Zen 5
  (family 26 model 2) oneDNN's int8 linear ran its reference loop (:func:`_trial_fast`), so before this kernel
  W8A8 could not run there at all; there it multiplies at 1.3-2x the AVX512-bf16 kernel's rate (400-760 GOP/s
  at 8 rows, 1050-1530 at 256; the C file's table), and compass ran 1.46x bf16's tok/s.
- ``onednn``: ``torch.ops.onednn.qlinear_pointwise``, weights reordered once at load by ``qlinear_prepack``:
  int8 in, fp32 out, with the per-channel weight scale applied inside and the activation scale given as 1,
  since oneDNN takes one activation scale per tensor; :func:`linear` multiplies the rows by it after. It
  serves where AMX runs (its int8 tiles, measured above) or the VNNI kernel does not, once a start-up trial
  found it exact and fast.

A gated MLP's gate_up: on the VNNI kernel, re-laid by :func:`gated` for its SiLU-and-mul epilogue; on oneDNN a
plain product whose per-token scale the SiLU-and-mul that reads it applies (:func:`matmul_unscaled` +
``silu_and_mul_cpu(row_scale=)``).

Only symmetric per-channel weights qualify (a GGUF's 32-wide groups would need a rescale per group inside
the integer sum); :func:`pack` returns None for anything else and the caller keeps the weight-only kernel.
:func:`linear_reference` is the exact math in float64, what the kernels are tested against.
"""

from __future__ import annotations

import ctypes
import functools
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

from pagedq_kernels import c_build, cpu_isa, cpu_linear, cpu_ops, kernel_call
from pagedq_kernels.int8_linear import Int8Weight

Kind = Literal["vnni", "onednn"]
BLOCK = 32  # output columns per column block of the vnni layout (csrc/cpu_w8a8.c)


@dataclass(frozen=True, eq=False)
class PackedW8A8:
    """A per-channel int8 weight reordered for one of the kernels (:data:`Kind`; opaque to torch)."""

    kind: Kind
    data: torch.Tensor  # onednn: oneDNN's blocked int8 layout; vnni: u8 codes q + 128 [blocks, K / 4, 2, 16, 4]
    scales: torch.Tensor  # float32: the per-channel scales, [N] (onednn) or [blocks * 32], zero past N (vnni)
    zero_points: torch.Tensor | None  # onednn: int64 [N] zeros (symmetric; the op takes them as a tensor)
    out_features: int  # glu: the gated product's width (half the merged weight's rows)
    in_features: int
    kernels: ctypes.CDLL | None = None  # vnni: the library, held as loaded (a later ISA cap moves no weight)
    glu: bool = False  # vnni: a merged [gate; up] weight whose product is silu(gate) * up (:func:`gated`)

    @property
    def nbytes(self) -> int:
        extra = self.zero_points.nbytes if self.zero_points is not None else 0
        return self.data.nbytes + self.scales.nbytes + extra


def _bind(lib: ctypes.CDLL) -> None:
    i64, ptr, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    lib.gemm_w8a8_vnni.argtypes = [ptr, i64, i64, ptr, ptr, ptr, ptr, i64, i64, i64, i32, i32]
    lib.gemm_w8a8_vnni.restype = i32


def _vnni_lib() -> ctypes.CDLL | None:
    """The avx512 build of ``csrc/cpu_w8a8.c`` where the avx512_bf16 level (its probe runs VPDPBUSD) runs under
    the ``PAGEDQ_CPU_ISA`` cap, or None (also with ``PAGEDQ_DISABLE_W8A8_KERNEL`` set)."""
    if os.environ.get("PAGEDQ_DISABLE_W8A8_KERNEL") or "avx512_bf16" not in cpu_isa.current().levels:
        return None
    return c_build.load("cpu_w8a8", _bind) if c_build.variant() == "avx512" else None


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
def _onednn_ok() -> bool:
    """Probe by running: a small W8A8 product through oneDNN must equal the exact integer math, fast enough.

    Cached per process: oneDNN picks its kernels once, from the CPU it finds."""
    if not _ops_present():
        return False
    generator = torch.Generator().manual_seed(0)
    weight = _trial_weight(32, 64, generator)
    x = torch.randn((5, 64), generator=generator)
    try:
        packed = _pack_onednn(weight)
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
    packed = _pack_onednn(weight)

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


def available_kinds() -> list[Kind]:
    """The kernels that can multiply W8A8 here, preferred first: oneDNN first where AMX runs (its int8 tiles),
    else pagedq's VNNI kernel; none with ``PAGEDQ_DISABLE_W8A8`` set."""
    if os.environ.get("PAGEDQ_DISABLE_W8A8"):
        return []
    kinds: list[Kind] = ["vnni"] if _vnni_lib() is not None else []
    if _onednn_ok():
        kinds.insert(0 if "amx" in cpu_isa.current().levels else len(kinds), "onednn")
    return kinds


def available() -> bool:
    """This process can run W8A8 linears (:func:`available_kinds`; ``quantization="w8a8"`` fails with
    :func:`unavailable_reason` where it cannot)."""
    return bool(available_kinds())


def unavailable_reason() -> str:
    """One line for the error a user sees when they ask for W8A8 where it cannot run."""
    if os.environ.get("PAGEDQ_DISABLE_W8A8"):
        return "PAGEDQ_DISABLE_W8A8 is set"
    kernel = "no AVX512-VNNI kernel runs here (it needs the avx512_bf16 level, probed with VPDPBUSD, and a C compiler)"
    if not _ops_present():
        return f"{kernel}, and this torch build ({torch.__version__}) has no oneDNN int8 linear"
    onednn = "oneDNN's int8 linear did not reproduce the integer product on this CPU, or ran its reference loop"
    return f"{kernel}, and {onednn}"


def qualifies(weight: Int8Weight) -> bool:
    """Symmetric per-output-channel: the one form whose scale factors out of the integer sum."""
    return weight.offsets is None and weight.group_size == weight.in_features


def _pack_onednn(weight: Int8Weight) -> PackedW8A8:
    data = torch.ops.onednn.qlinear_prepack(weight.values.contiguous(), None)
    n = weight.out_features
    return PackedW8A8(
        "onednn", data, weight.scales.reshape(n).contiguous(), torch.zeros(n, dtype=torch.int64), n, weight.in_features
    )


def _pack_vnni(weight: Int8Weight, kernels: ctypes.CDLL) -> PackedW8A8:
    """The VNNI kernel's layout (``csrc/cpu_w8a8.c``): per column block of 32 and k-quad, columns 0-15 then 16-31,
    each 32-bit lane one column's 4 codes, stored as q + 128 (VPDPBUSD's unsigned factor); past N zero codes (128)
    and scale 0."""
    n, k = weight.out_features, weight.in_features
    padded = -(-n // BLOCK) * BLOCK
    codes = torch.full((padded, k), 128, dtype=torch.uint8)
    codes[:n] = (weight.values.to(torch.int16) + 128).to(torch.uint8)
    layout = codes.view(padded // BLOCK, 2, 16, k // 4, 4).permute(0, 3, 1, 2, 4).contiguous()
    scales = torch.nn.functional.pad(weight.scales.reshape(n).float(), (0, padded - n)).contiguous()
    return PackedW8A8("vnni", layout, scales, None, n, k, kernels)


def pack(weight: Int8Weight, kind: Kind | None = None) -> PackedW8A8 | None:
    """``weight`` reordered for :func:`linear` on ``kind`` (default: the first of :func:`available_kinds` that
    takes it); None where W8A8 cannot run or the weight does not qualify."""
    if weight.values.device.type != "cpu" or not qualifies(weight):
        return None
    for candidate in available_kinds():
        if kind not in (None, candidate):
            continue
        if candidate == "onednn":
            return _pack_onednn(weight)
        kernels = _vnni_lib()
        if kernels is not None and weight.in_features % 4 == 0:
            return _pack_vnni(weight, kernels)
    return None


def gated(packed: PackedW8A8) -> PackedW8A8 | None:
    """A VNNI-packed merged ``[gate; up]`` weight (``2i`` rows) re-laid so that :func:`linear` returns ``silu(gate)
    * up`` (``i`` wide) from the kernel's epilogue: per column block 16 gate columns, then the 16 matching up
    columns (zero codes and scale 0 past ``i``). Exact: the same codes and scales, moved. None for a oneDNN weight
    (its gate_up stays a plain product, the SiLU-and-mul applied after: :func:`matmul_unscaled`)."""
    if packed.kind != "vnni" or packed.glu or packed.out_features % 2:
        return None
    n, k, half = packed.out_features, packed.in_features, packed.out_features // 2
    codes = packed.data.permute(0, 2, 3, 1, 4).reshape(-1, k)[:n]  # back to [2i, k], row per output column
    scales = packed.scales[:n]
    width = -(-half // 16) * 16
    glu_codes = torch.full((2, width, k), 128, dtype=torch.uint8)
    glu_scales = torch.zeros((2, width))
    glu_codes[:, :half] = codes.view(2, half, k)
    glu_scales[:, :half] = scales.view(2, half)
    blocks = width // 16  # block b: gate columns 16b..16b+15, then up's
    rows = glu_codes.view(2, blocks, 16, k).permute(1, 0, 2, 3).reshape(blocks * BLOCK, k)
    layout = rows.view(blocks, 2, 16, k // 4, 4).permute(0, 3, 1, 2, 4).contiguous()
    order = glu_scales.view(2, blocks, 16).permute(1, 0, 2).reshape(-1).contiguous()
    return PackedW8A8("vnni", layout, order, None, half, k, packed.kernels, glu=True)


def linear_call(
    packed: PackedW8A8,
    x: torch.Tensor,
    out: torch.Tensor,
    bias: torch.Tensor | None,
    x_bf16: torch.Tensor | None,
    threads: int,
) -> kernel_call.KernelCall:
    """The one kernel call of :func:`linear` for a VNNI weight on buffers the caller holds, as
    :func:`pagedq_kernels.cpu_linear.linear_call` has them (``x_bf16`` unused: the kernel quantises x itself). A
    non-zero status: the kernel could not allocate its buffers, and wrote nothing."""
    assert packed.kind == "vnni" and packed.kernels is not None, "W8A8 kernel call for a oneDNN weight"
    args: tuple[object, ...] = (x.data_ptr(), x.stride(0), x.shape[0], packed.data.data_ptr())
    args += (packed.scales.data_ptr(), None if bias is None else bias.data_ptr(), out.data_ptr(), out.stride(0))
    args += (packed.out_features, packed.in_features, int(packed.glu), threads)
    return kernel_call.KernelCall(packed.kernels.gemm_w8a8_vnni, args, "W8A8 VNNI linear")


def matmul_unscaled(x: torch.Tensor, packed: PackedW8A8) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y', xs)`` with ``y' [rows, N]`` fp32 still to be multiplied by the per-token scales ``xs [rows]``: a
    oneDNN weight's product (its op takes one activation scale per tensor).

    ``x`` (fp32, any leading dimensions) is flattened to rows; the caller applies ``xs`` where it reads
    ``y'`` anyway (:func:`linear`, or a fused SiLU-and-mul)."""
    if packed.kind != "onednn":
        raise ValueError("matmul_unscaled takes a oneDNN W8A8 weight; the VNNI kernel scales in its epilogue")
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
    """``x @ W.T + bias`` through int8 (a :func:`gated` weight: ``silu(gate) * up``, no bias): fp32 in, fp32 out,
    ``x`` with any leading dimensions."""
    if packed.kind == "vnni":  # quantised, multiplied and scaled in one call
        n, k = packed.out_features, packed.in_features
        rows, out, b = cpu_linear.panel_operands(x, n, k, bias, packed.glu, "w8a8 linear")
        if rows.shape[0]:
            kernel_call.run((linear_call(packed, rows, out, b, None, torch.get_num_threads()),))
        return out.view(*x.shape[:-1], n)
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
