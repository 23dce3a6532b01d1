"""Fused RMSNorm, rotary and SiLU-and-mul for float32 on the CPU (``csrc/cpu_ops.c``), through ctypes.

Same signatures as the torch references beside them (``rms_norm.py``, ``rotary.py``,
``activation.py``), which they fall back to for anything they do not cover: other dtypes or
devices, layouts without a unit last stride, or no C compiler. Why they exist: at decode batch
sizes torch spends more time dispatching the 3-7 elementwise kernels of each op than computing,
and at prefill sizes the extra passes over the activations cost memory bandwidth.
"""

from __future__ import annotations

import ctypes

import torch

from pagedq_kernels import c_build, kernel_call
from pagedq_kernels.activation import silu_and_mul_torch
from pagedq_kernels.rms_norm import rms_norm_torch
from pagedq_kernels.rotary import rotary_embedding_torch


def _bind(lib: ctypes.CDLL) -> None:
    i64, ptr, f32, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int
    lib.rms_norm_f32.argtypes = [ptr, i64, ptr, ptr, ptr, ptr, i64, i64, f32, i32]
    lib.rotary_neox_f32.argtypes = [ptr, i64, i64, i64, ptr, i64, i64, i64, ptr, ptr, i64, i64, i32]
    lib.silu_and_mul_f32.argtypes = [ptr, i64, ptr, ptr, i64, i64, i32]
    lib.quantize_rows_s8.argtypes = [ptr, i64, ptr, ptr, i64, i64, i32]
    lib.argmax_rows_f32.argtypes = [ptr, i64, i64, i64, ptr, ptr, i32]
    for fn in (lib.rms_norm_f32, lib.rotary_neox_f32, lib.silu_and_mul_f32, lib.quantize_rows_s8, lib.argmax_rows_f32):
        fn.restype = None


def _load() -> ctypes.CDLL | None:
    return c_build.load("cpu_ops", _bind)


def available() -> bool:
    return _load() is not None


def _f32_cpu(*tensors: torch.Tensor) -> bool:
    return all(t.dtype == torch.float32 and t.device.type == "cpu" for t in tensors)


def rms_norm_cpu(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`pagedq_kernels.rms_norm.rms_norm_torch` in one pass per row."""
    lib = _load()
    ok = (
        lib is not None
        and x.dim() == 2
        and _f32_cpu(x, weight)
        and x.stride(-1) == 1
        and weight.is_contiguous()
        and (residual is None or (_f32_cpu(residual) and residual.is_contiguous() and residual.shape == x.shape))
    )
    if not ok:
        return rms_norm_torch(x, weight, eps, residual)
    n, h = x.shape
    out = torch.empty((n, h), dtype=x.dtype)
    res_out = torch.empty((n, h), dtype=x.dtype) if residual is not None else None
    kernel_call.run((rms_norm_call(x, weight, eps, residual, out, res_out, torch.get_num_threads()),))
    return out, res_out


def rms_norm_call(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None,
    out: torch.Tensor,
    res_out: torch.Tensor | None,
    threads: int,
) -> kernel_call.KernelCall:
    """The kernel call of :func:`rms_norm_cpu` on buffers the caller holds (``x`` fp32 ``[n, h]`` rows at any
    stride with a unit last stride; ``weight``, ``residual``, ``out`` and ``res_out`` contiguous fp32; ``res_out``
    given exactly when ``residual`` is). Raises RuntimeError where the C kernels did not build."""
    lib = _load()
    if lib is None:
        raise RuntimeError("the C ops kernels are not available here")
    n, h = x.shape
    return kernel_call.KernelCall(
        lib.rms_norm_f32,
        (
            x.data_ptr(),
            x.stride(0),
            residual.data_ptr() if residual is not None else None,
            weight.data_ptr(),
            out.data_ptr(),
            res_out.data_ptr() if res_out is not None else None,
            n,
            h,
            eps,
            threads,
        ),
        "rms_norm",
    )


def rotary_embedding_cpu(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`pagedq_kernels.rotary.rotary_embedding_torch`, rotating ``q`` and ``k`` **in place** (returns them).

    In place is what makes it one pass: the model's q and k are views into the fresh qkv projection
    output, which nothing else reads.
    """
    lib = _load()
    ok = (
        lib is not None
        and _f32_cpu(q, k, cos_sin_cache)
        and positions.dtype == torch.int64
        and positions.is_contiguous()
        and cos_sin_cache.is_contiguous()
        and q.stride(-1) == 1
        and k.stride(-1) == 1
        and q.shape[-1] == k.shape[-1] == cos_sin_cache.shape[-1]
    )
    if not ok:
        return rotary_embedding_torch(positions, q, k, cos_sin_cache)
    kernel_call.run((rotary_call(positions, q, k, cos_sin_cache, torch.get_num_threads()),))
    return q, k


def rotary_call(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor, threads: int
) -> kernel_call.KernelCall:
    """The kernel call of :func:`rotary_embedding_cpu` (in place) on tensors the caller holds: ``q [N, H, D]`` and
    ``k [N, KVH, D]`` fp32 with a unit last stride, ``positions`` contiguous int64, the cache contiguous fp32.
    Raises RuntimeError where the C kernels did not build."""
    lib = _load()
    if lib is None:
        raise RuntimeError("the C ops kernels are not available here")
    n, nh, d = q.shape
    return kernel_call.KernelCall(
        lib.rotary_neox_f32,
        (
            q.data_ptr(),
            q.stride(0),
            q.stride(1),
            nh,
            k.data_ptr(),
            k.stride(0),
            k.stride(1),
            k.shape[1],
            positions.data_ptr(),
            cos_sin_cache.data_ptr(),
            n,
            d,
            threads,
        ),
        "rotary",
    )


def silu_and_mul_cpu(x: torch.Tensor, row_scale: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`pagedq_kernels.activation.silu_and_mul_torch` in one pass; ``row_scale`` ``[rows]`` (fp32), if given,
    multiplies each row of ``x`` first (a W8A8 gate_up's per-token scale, folded in instead of a pass)."""
    lib = _load()
    scale_ok = row_scale is None or (
        _f32_cpu(row_scale) and row_scale.is_contiguous() and row_scale.numel() == x.shape[0]
    )
    if lib is None or x.dim() != 2 or not _f32_cpu(x) or x.stride(-1) != 1 or not scale_ok:
        return silu_and_mul_torch(x if row_scale is None else x * row_scale.reshape(-1, 1))
    n, m = x.shape[0], x.shape[1] // 2
    out = torch.empty((n, m), dtype=x.dtype)
    lib.silu_and_mul_f32(
        x.data_ptr(),
        x.stride(0),
        row_scale.data_ptr() if row_scale is not None else None,
        out.data_ptr(),
        n,
        m,
        torch.get_num_threads(),
    )
    return out


def quantize_rows_torch(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8 of ``x [rows, k]``: ``(q int8 [rows, k], scales fp32 [rows])`` with
    ``x ~= q * scales[:, None]``; the reference for :func:`quantize_rows_cpu` (same fp32 ops, same rounding:
    one multiply by ``127 / amax``, then round half to even). A zero row gets scale 0."""
    x = x.float()
    amax = x.abs().amax(dim=-1)
    # A true division (torch's ``127.0 / tensor`` is ``reciprocal() * 127``: a second rounding the C kernel
    # does not make, which moved a product from -47.499996 to -47.5 and its code by one).
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    q = torch.round(x * inv[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, amax / 127.0


def quantize_rows_cpu(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize_rows_torch` in two reads of each row (its max, then the rounding from L1)."""
    lib = _load()
    if lib is None or x.dim() != 2 or not _f32_cpu(x) or x.stride(-1) != 1:
        return quantize_rows_torch(x)
    n, k = x.shape
    q = torch.empty((n, k), dtype=torch.int8)
    scales = torch.empty((n,), dtype=torch.float32)
    if n:
        lib.quantize_rows_s8(x.data_ptr(), x.stride(0), q.data_ptr(), scales.data_ptr(), n, k, torch.get_num_threads())
    return q, scales


def max_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x.max(dim=1)`` for ``x [rows, v]``: each row's largest value and the index of its first occurrence (a
    NaN anywhere makes the row's maximum NaN, at the first NaN), as ``(values fp32, indices int64)``.

    The greedy sampler's argmax over the logits; in C one pass per row, rows over the threads (torch's
    reduction took ~30 us a 49152-wide row, 1.17 ms a 64-row decode step on 2 threads of an AMD EPYC Zen 5).
    """
    lib = _load()
    if lib is None or x.dim() != 2 or not _f32_cpu(x) or x.stride(-1) != 1 or x.shape[1] == 0:
        values, indices = x.max(dim=1)
        return values, indices
    n, v = x.shape
    values = torch.empty((n,), dtype=torch.float32)
    indices = torch.empty((n,), dtype=torch.int64)
    if n:
        lib.argmax_rows_f32(
            x.data_ptr(), x.stride(0), n, v, values.data_ptr(), indices.data_ptr(), torch.get_num_threads()
        )
    return values, indices
