"""Linear layers on CPU with the weight packed once at load time: C panel kernel, C bf16 kernels or oneDNN.

``F.linear`` on an x86 CPU build of torch calls MKL's sgemm, which re-packs the weight matrix on
every call: at decode batch sizes that re-packing costs as much as the arithmetic. Packed layouts fix it (three,
the two bf16 kernels sharing one), picked in this order:

- ``panels``: pagedq's own kernel (``csrc/cpu_gemm.c``, float32, AVX2/FMA): the weight as
  contiguous panels of 16 output columns, streamed once per call. A decode step is a stream of the
  weights from memory, and this is what keeps it one: measured on a 2-core AMD EPYC over SmolLM2's
  projections (30 layers, cold), 8 rows ran at 9 GB/s of weights vs oneDNN's 5.8, 16 rows at 62 vs
  42 GFLOP/s, 128 rows at 116 vs 90, and 2048 rows level (117 vs 113).
- ``amx`` (bf16 weights only): pagedq's AMX kernel (``csrc/cpu_bf16_amx.c``): the weight in the AMX
  B-tile order, per block of 32 output columns, loaded into the tiles as it lies; fp32 ``x`` rounded to
  bf16 inside the kernel's OpenMP region, fp32 sums, fp32 rows (bias added in fp32) written straight into
  the output, and for a merged gate/up weight (:func:`pack_gated`) ``silu(gate) * up`` in the epilogue.
  It replaces oneDNN's path, which paid three torch ops per call (``x.to(bf16)``, the matmul, ``.to(fp32)``)
  and a separate SiLU-and-mul pass. Where AMX runs (probed, allowed by ``PAGEDQ_CPU_ISA``, the avx512
  build, tile permission granted) and ``in_features`` is a multiple of 32; ``PAGEDQ_DISABLE_AMX_LINEAR=1``
  switches it off. Measured on a 2-vCPU Xeon (KVM, family 6 model 167) over SmolLM2-135M's projections,
  weights from memory: 1.2-2x oneDNN's GFLOP/s at 8-64 rows (qkv 277 / 859 / 1287 at 8 / 36 / 64 rows
  against 196 / 691 / 975; the fused gate_up 296 / 889 / 1318 against 149 / 538 / 698), 1.2-1.4x at 256
  rows, 0.95x at 2048 except gate_up (1.5x); the compass workload (bf16, no speculation) 510 tok/s
  against 400-442 on oneDNN, 560-568 against 417-445 with speculation (figures in the C file).
- ``dpbf16`` (bf16 weights only, where AMX does not run): pagedq's AVX512-bf16 kernel
  (``csrc/cpu_bf16_dp.c``) on the same packed weight as ``amx``: each 64-byte row of a B tile is one k-pair of
  16 columns, VDPBF16PS's weight operand, so one layout serves both instructions, with the same in-kernel
  rounding of x, fp32 rows out and fused SiLU-and-mul. Where AVX512-bf16 runs (probed, the cap, the avx512
  build), ``in_features`` a multiple of 32; ``PAGEDQ_DISABLE_DP_LINEAR=1`` switches it off. Measured on a
  2-vCPU AMD EPYC (Zen 5, family 26 model 2), weights from memory, against oneDNN's bf16 path: 1.5-2x its
  GFLOP/s at 8 rows (qkv 373 vs 183), 1.3-1.4x at 36-64 (gate_up 740 vs 534 at 36), 1.1-1.3x at 256.
- ``onednn``: the weight reordered into oneDNN's blocked layout
  (``torch.ops.mkldnn._reorder_linear_weight``), multiplied by ``_linear_pointwise``, where the C
  kernel cannot run (no compiler, no AVX2) or for dtypes it does not cover. It is also the bf16 path
  where neither bf16 kernel runs (switched off, ``in_features`` not a multiple of 32):
  on a CPU with AMX or AVX512-bf16 (:mod:`pagedq_kernels.cpu_isa`), oneDNN's bf16 kernels run on the tiles or
  the bf16 dot products with fp32 accumulation. Measured on a 2-vCPU Xeon with AMX over SmolLM2's
  projections and lm_head: 288 / 605 / 514 GFLOP/s at 8 / 64 / 512 rows against the fp32 AVX-512
  panels' 114 / 218 / 189, with half the weight bytes to stream. A bf16-packed weight takes fp32
  activations: they are rounded to bf16 on the way in and the product comes back in the caller's dtype,
  so the rest of the model (norms, rotary, attention, KV cache) stays in fp32.

A packed weight can only be multiplied, so the dense weight stays the source of truth until
:func:`pack` succeeds, and anything unsupported keeps ``F.linear``. The reference is ``F.linear``
itself; results agree to float32 rounding (summation order differs).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Literal

import torch

from pagedq_kernels import c_build, cpu_isa, host_memory, kernel_call

Kind = Literal["panels", "amx", "dpbf16", "onednn"]
BF16_KINDS: tuple[Kind, ...] = ("amx", "dpbf16")
CALL_KINDS: tuple[Kind, ...] = ("panels", *BF16_KINDS)  # pagedq's own kernels: what linear_call builds a call for
"""pagedq's own bf16-weight kernels: one packed layout (the AMX B-tile order, :func:`_pack_amx`), two
instructions; :func:`linear` runs both through :func:`_linear_bf16`."""

# The batch-size hint for oneDNN's reorder: it picks its blocking for this many rows; measured, the
# layout chosen for 64 rows served 1-2048 rows as well as one chosen for each size.
BATCH_HINT = 64
PANEL = 16  # output columns per panel (csrc/cpu_gemm.c NR)
AMX_BLOCK = 32  # output columns per AMX column block (two 16-column tiles); glu: 16 gate + 16 up
AMX_K = 32  # bf16 k-elements per tile row: in_features must be a multiple
AMX_ROWS = 16  # rows per x tile: the bf16 copy of x is padded to a multiple


@dataclass(frozen=True, eq=False)
class PackedWeight:
    """A weight ``[out_features, in_features]`` in one of the packed layouts (opaque to torch)."""

    kind: Kind
    data: torch.Tensor
    out_features: int
    in_features: int
    glu: bool = False  # a merged gate/up weight whose product is silu(gate) * up, out_features wide


def _bind(lib: ctypes.CDLL) -> None:
    i64, ptr, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    for fn in (lib.pack_panels_f32, lib.pack_glu_panels_f32):
        fn.argtypes = [ptr, i64, i64, ptr]
        fn.restype = None
    lib.gemm_panels_f32.argtypes = [ptr, i64, ptr, ptr, ptr, i64, i64, i64, i64, i32, i32]
    lib.gemm_panels_f32.restype = None
    lib.gemm_panels_argmax_f32.argtypes = [ptr, i64, ptr, i64, i64, i64, ptr, ptr, i32]
    lib.gemm_panels_argmax_f32.restype = i32
    f32 = ctypes.c_float
    lib.gemm_panels_add_norm_f32.argtypes = [ptr, i64, ptr, ptr, ptr, i64, i64, i64, ptr, ptr, f32, ptr, i32]
    lib.gemm_panels_add_norm_f32.restype = None
    lib.gemm_panels_triple_rows.argtypes = [i64]
    lib.gemm_panels_triple_rows.restype = i64
    max_rows = triple_tile_max_rows()
    if max_rows is not None:
        lib.gemm_panels_triple_rows(max_rows)


AMD_TRIPLE_MAX_ROWS = 0  # the pair tile at every size


def triple_tile_max_rows() -> int | None:
    """Up to how many rows the fp32 panel kernel's avx512 build multiplies through its three-panel tile (``csrc/
    cpu_gemm.c`` triple_max_rows; the pair tile above), None for every size from 16. The floats are the same either
    way; the speed is the core's: on an Intel Xeon (family 6 model 207) the triple won at every size from 16 rows;
    on AMD the pair serves every size: on a Zen 5 (family 26) it won at 96 rows and more by 2-9 % and tied at
    decode sizes (both measured in the C file), and on a Zen 4 (family 25 model 17, AVX-512 on 256-bit units) compass
    fp32 without drafts, one engine, the settings interleaved over 3 rounds, ran 36.05 s median with pairs against
    36.67 s with triples from 16 rows and 36.42 s with triples up to 63 rows. (AMD's AVX2-only cores run no
    triple: it is the avx512 build's.) Other vendors keep the default."""
    model = cpu_isa.cpu_model()
    if model is not None and model.vendor == "AuthenticAMD":
        return AMD_TRIPLE_MAX_ROWS
    return None


@contextlib.contextmanager
def panel_triple_rows(max_rows: int) -> Iterator[None]:
    """The panel kernel's three-panel tile up to ``max_rows`` rows inside the block (0: the pair tile at every
    size), whatever :func:`triple_tile_max_rows` chose, then back: for tests and timings of both tiles."""
    lib = _panels_lib()
    before = lib.gemm_panels_triple_rows(max_rows) if lib is not None else 0
    try:
        yield
    finally:
        if lib is not None:
            lib.gemm_panels_triple_rows(before)


def _panels_lib() -> ctypes.CDLL | None:
    """The panel kernel, or None: switched off, no compiler, or no AVX2/FMA (the source refuses to build)."""
    if os.environ.get("PAGEDQ_DISABLE_PANEL_LINEAR"):
        return None
    return c_build.load("cpu_gemm", _bind)


def _bind_bf16(function: str) -> Callable[[ctypes.CDLL], None]:
    """The ctypes binder of a bf16 kernel's entry point: ``gemm_bf16_amx`` and ``gemm_bf16_dp`` take the same
    arguments (x, its row stride, the bf16 rows' buffer, rows, weight, bias, out, its row stride, n, k, glu,
    threads) and return a status."""

    def bind(lib: ctypes.CDLL) -> None:
        i64, ptr, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
        entry = getattr(lib, function)
        entry.argtypes = [ptr, i64, ptr, i64, ptr, ptr, ptr, i64, i64, i64, i32, i32]
        entry.restype = i32
        if function == "gemm_bf16_dp":  # its twins: argmax only (argmax_linear), + residual and norm (linear_add_norm)
            lib.gemm_bf16_dp_argmax.argtypes = [ptr, i64, ptr, i64, ptr, i64, i64, ptr, ptr, i32]
            lib.gemm_bf16_dp_argmax.restype = i32
            f32 = ctypes.c_float
            lib.gemm_bf16_dp_add_norm.argtypes = [ptr, i64, ptr, i64, ptr, ptr, ptr, i64, i64, ptr, ptr, f32, ptr, i32]
            lib.gemm_bf16_dp_add_norm.restype = i32
            screen = lib.gemm_bf16_dp_screen_argmax  # pagedq_kernels/argmax_screen.py
            screen.argtypes = [ptr, i64, ptr, i64, ptr, ptr, ptr, ptr, f32, i64, i64, ptr, ptr, ptr, i32]
            screen.restype = i32
            int8_screen = lib.gemm_int8_screen_argmax  # its int8 (VNNI) twin
            int8_screen.argtypes = [ptr, i64, i64, ptr, ptr, ptr, ptr, ptr, ptr, f32, i64, i64, ptr, ptr, ptr, i32]
            int8_screen.restype = i32
            lib.bf16_dp_use_fma.argtypes = [i32]
            lib.bf16_dp_use_fma.restype = i32
            # int8 weights widened (pagedq_kernels/int8_linear): gemm_int8_amx's arguments, scales, offsets and the
            # group after w
            lib.gemm_int8_dp.argtypes = [ptr, i64, ptr, i64, ptr, ptr, ptr, i64, ptr, ptr, i64, i64, i64, i32, i32]
            lib.gemm_int8_dp.restype = i32

    return bind


@functools.cache
def _amx_lib() -> ctypes.CDLL | None:
    """The avx512 build of ``cpu_bf16_amx`` with AMX tile permission granted to this process, or None.
    Held once loaded: an AMX-packed weight keeps running on it if the ``PAGEDQ_CPU_ISA`` cap moves later."""
    return c_build.load_amx("cpu_bf16_amx", _bind_bf16("gemm_bf16_amx"), "bf16_amx_init")


def amx_available() -> bool:
    """Whether bf16 weights can run on pagedq's AMX kernel here: AMX probed runnable and allowed by the
    ``PAGEDQ_CPU_ISA`` cap, the avx512 kernel build, the kernel's permission for tile data, and not switched
    off by ``PAGEDQ_DISABLE_AMX_LINEAR`` (then oneDNN multiplies them, as before the kernel)."""
    return not os.environ.get("PAGEDQ_DISABLE_AMX_LINEAR") and c_build.amx_runnable() and _amx_lib() is not None


@functools.cache
def _dp_lib() -> ctypes.CDLL | None:
    """The avx512 build of ``cpu_bf16_dp`` (VDPBF16PS), or None; first asked for by :func:`dp_available` under
    that build. Held once loaded, as the AMX kernel is: a dpbf16-packed weight keeps running on it if the
    ``PAGEDQ_CPU_ISA`` cap moves later (the other builds hold only a stub that refuses)."""
    lib = c_build.load("cpu_bf16_dp", _bind_bf16("gemm_bf16_dp"))
    if lib is not None:  # where VDPBF16PS multiplies slower than fp32 FMAs, the same sums on the FMAs
        lib.bf16_dp_use_fma(int(cpu_isa.current().bf16_products_on_fma))
    return lib


def dp_available() -> bool:
    """Whether bf16 weights can run on pagedq's AVX512-bf16 dot-product kernel here: AVX512-bf16 probed
    runnable and allowed by the ``PAGEDQ_CPU_ISA`` cap, the avx512 kernel build, and not switched off by
    ``PAGEDQ_DISABLE_DP_LINEAR`` (then oneDNN multiplies them). Used where AMX does not run."""
    if os.environ.get("PAGEDQ_DISABLE_DP_LINEAR") or not cpu_isa.current().bf16_matmul:
        return False
    return c_build.variant() == "avx512" and _dp_lib() is not None


@contextlib.contextmanager
def dp_products(on_fma: bool) -> Iterator[None]:
    """The dpbf16 kernel's products on fp32 FMAs (True) or on VDPBF16PS (False) inside the block, whatever this CPU's
    rate chose (``CpuIsa.bf16_products_on_fma``), then back: for tests and timings of both; the floats are the same.
    Nothing to switch where :func:`dp_library` is None."""
    lib = dp_library()
    before = lib.bf16_dp_use_fma(int(on_fma)) if lib is not None else 0
    try:
        yield
    finally:
        if lib is not None:
            lib.bf16_dp_use_fma(before)


def dp_library() -> ctypes.CDLL | None:
    """The AVX512-bf16 kernel library where :func:`dp_available`, else None (for kernels beside the linear's own
    entry points that run on it: :mod:`pagedq_kernels.argmax_screen`)."""
    return _dp_lib() if dp_available() else None


def pack_dp(weight: torch.Tensor) -> PackedWeight | None:
    """``weight`` rounded to bf16 in the ``dpbf16`` layout, whatever kind :func:`pack` would prefer (on AMX
    machines too, whose CPUs also run VDPBF16PS): None where that kernel does not run or ``in_features`` is not
    a multiple of 32."""
    if dp_library() is None or weight.dim() != 2:
        return None
    data = _pack_amx(weight.detach().to(torch.bfloat16), glu=False)
    return None if data is None else PackedWeight("dpbf16", data, weight.shape[0], weight.shape[1])


def _onednn_available(dtype: torch.dtype) -> bool:
    if os.environ.get("PAGEDQ_DISABLE_ONEDNN_LINEAR"):
        return False
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16:
        if not cpu_isa.current().bf16_matmul:  # emulated bf16 would be slower than fp32
            return False
    elif dtype != torch.float32:
        return False
    return hasattr(torch.ops.mkldnn, "_reorder_linear_weight") and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def available_kinds(dtype: torch.dtype) -> list[Kind]:
    """The packed layouts this machine can run for ``dtype``, preferred first."""
    kinds: list[Kind] = []
    if dtype == torch.float32 and _panels_lib() is not None:
        kinds.append("panels")
    if dtype == torch.bfloat16 and amx_available():
        kinds.append("amx")  # in_features a multiple of 32 only: pack() falls through to oneDNN otherwise
    elif dtype == torch.bfloat16 and dp_available():
        kinds.append("dpbf16")  # the same layout and limit, where AMX does not run (or is switched off)
    if _onednn_available(dtype):
        kinds.append("onednn")
    return kinds


def pack(weight: torch.Tensor, kind: Kind | None = None, dtype: torch.dtype | None = None) -> PackedWeight | None:
    """``weight [out, in]`` packed for :func:`linear` (``kind`` or the preferred one), or None.

    ``dtype``: the dtype to store and multiply it in (default: its own), e.g. bf16 for an fp32 model
    whose matmuls run on bf16 hardware."""
    if weight.device.type != "cpu" or weight.dim() != 2:
        return None
    if dtype is not None and dtype != weight.dtype:
        if not available_kinds(dtype):
            return None
        weight = weight.detach().to(dtype)
    kinds = [k for k in available_kinds(weight.dtype) if kind in (None, k)]
    for k in kinds:
        if k == "panels":
            data: torch.Tensor | None = _pack_panels(weight, glu=False)
        elif k in BF16_KINDS:
            data = _pack_amx(weight, glu=False)
        else:
            data = _pack_onednn(weight)
        if data is not None:
            return PackedWeight(k, data, weight.shape[0], weight.shape[1])
    return None


def pack_gated(gate_up: torch.Tensor, dtype: torch.dtype | None = None) -> PackedWeight | None:
    """A merged ``[gate; up]`` weight ``[2i, in]`` packed so :func:`linear` returns ``silu(gate) * up``.

    The SiLU-and-mul runs in the matmul's epilogue, on values still in registers: the ``2i``-wide
    intermediate is never written or read back (at prefill sizes that pass cost ~4% of the step).
    ``dtype`` (default: the weight's own) as in :func:`pack`: fp32 on the panel kernel, bf16 on the AMX
    kernel (``in_features`` a multiple of 32); None where neither runs, and the caller keeps the unfused pair.
    """
    if gate_up.device.type != "cpu" or gate_up.dim() != 2 or gate_up.shape[0] % 2:
        return None
    dtype = dtype or gate_up.dtype
    out_features, in_features = gate_up.shape[0] // 2, gate_up.shape[1]
    own = [k for k in available_kinds(dtype) if k in BF16_KINDS] if dtype == torch.bfloat16 else []
    if own and in_features % AMX_K == 0:
        data = _pack_amx(gate_up.detach().to(dtype), glu=True)
        return None if data is None else PackedWeight(own[0], data, out_features, in_features, glu=True)
    if dtype != gate_up.dtype or "panels" not in available_kinds(dtype):
        return None
    return PackedWeight("panels", _pack_panels(gate_up, glu=True), out_features, in_features, glu=True)


def _pack_panels(weight: torch.Tensor, glu: bool) -> torch.Tensor:
    lib = _panels_lib()
    assert lib is not None
    n, k = weight.shape
    w = weight.detach().contiguous()
    out = host_memory.empty((-(-n // PANEL) * PANEL * k,), torch.float32)
    if glu:  # n // 2 outputs, PANEL // 2 per panel: the same number of panel floats
        lib.pack_glu_panels_f32(w.data_ptr(), n // 2, k, out.data_ptr())
    else:
        lib.pack_panels_f32(w.data_ptr(), n, k, out.data_ptr())
    return out


def amx_block_rows(out_features: int, glu: bool) -> torch.Tensor:
    """Source row of each AMX block column, ``2 * out_features`` (clamped onto a zero row) for padding.
    With glu, block b holds gate rows 16b..16b+15 in columns 0-15 and the matching up rows in 16-31.
    The block order of both AMX kernels (``csrc/amx_tile.h``; bf16 here, int8 in :mod:`pagedq_kernels.int8_linear`)."""
    if not glu:
        blocks = -(-out_features // AMX_BLOCK)
        rows = torch.arange(blocks * AMX_BLOCK)
        return torch.where(rows < out_features, rows, torch.full_like(rows, 2 * out_features))
    half = AMX_BLOCK // 2
    blocks = -(-out_features // half)
    col = torch.arange(blocks)[:, None] * half + torch.arange(half)[None, :]
    pad = torch.full_like(col, 2 * out_features)
    gate = torch.where(col < out_features, col, pad)
    up = torch.where(col < out_features, col + out_features, pad)
    return torch.cat((gate, up), dim=1).reshape(-1)


def _pack_amx(weight: torch.Tensor, glu: bool) -> torch.Tensor | None:
    """A bf16 weight in the AMX B-tile order ``csrc/cpu_bf16_amx.c`` loads directly: bf16
    ``[blocks, K, 32]`` = per block of 32 columns ``[K / 32][2 tiles][16 k-pairs][16 columns][2]``, padding
    columns zero. None where ``in_features`` is not a multiple of a tile row's 32 (oneDNN takes it)."""
    n, k = weight.shape
    if k % AMX_K or weight.dtype != torch.bfloat16:
        return None
    rows = amx_block_rows(n // 2 if glu else n, glu).clamp(max=n)
    padded = torch.cat((weight.detach(), torch.zeros(1, k, dtype=weight.dtype)))
    picked = padded.index_select(0, rows)  # [blocks * 32, K]: row b*32 + 16t + j
    # [b, t, j, c, p, e] (k = 32c + 2p + e) -> [b, c, t, p, j, e]
    tiles = picked.view(-1, 2, 16, k // AMX_K, AMX_K // 2, 2).permute(0, 3, 1, 4, 2, 5)
    out = host_memory.empty((picked.shape[0] // AMX_BLOCK, k, AMX_BLOCK), torch.bfloat16)
    out.view(tiles.shape).copy_(tiles)
    return out


def _pack_onednn(weight: torch.Tensor) -> torch.Tensor | None:
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), BATCH_HINT)
    except RuntimeError:  # e.g. an ISA oneDNN's reorder does not support for this dtype
        return None


def panel_operands(
    x: torch.Tensor, n: int, k: int, bias: torch.Tensor | None, glu: bool, what: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """What pagedq's C linear kernels (fp32 or int8 panels, bf16 or int8 on AMX) read and write: ``x`` as
    fp32 rows of ``k`` features (unit last stride), a fresh fp32 ``[rows, n]`` output (a glu weight's ``n`` is
    already the activated width), and the bias as contiguous fp32; a glu weight takes no bias (the
    activation comes after the matmul). Copies only what is not in that form already: a decode step makes
    ~120 such calls of a few tens of microseconds each."""
    if x.shape[-1] != k:
        raise ValueError(f"{what}: input has {x.shape[-1]} features, the weight expects {k}")
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1 or x2.dtype != torch.float32:
        x2 = x2.contiguous().float()
    out = torch.empty((x2.shape[0], n), dtype=torch.float32)
    if bias is not None:
        if glu:
            raise ValueError(f"{what}: a gated (glu) packed weight takes no bias")
        if bias.dtype != torch.float32 or not bias.is_contiguous():
            bias = bias.detach().float().contiguous()
    return x2, out, bias


def linear(x: torch.Tensor, packed: PackedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ W.T + bias`` with ``packed`` from :func:`pack`; ``x`` may have any leading dimensions."""
    if packed.kind == "onednn":
        if x.dtype == packed.data.dtype:
            return torch.ops.mkldnn._linear_pointwise(x, packed.data, bias, "none", [], "")
        # A bf16 weight under fp32 activations: the input rounded to bf16, the product (fp32-accumulated)
        # handed back in the activations' dtype.
        low = packed.data.dtype
        b = bias.detach().to(low) if bias is not None else None
        return torch.ops.mkldnn._linear_pointwise(x.to(low), packed.data, b, "none", [], "").to(x.dtype)
    if packed.kind in BF16_KINDS:
        return _linear_bf16(x, packed, bias)
    n = packed.out_features
    x2, out, bias = panel_operands(x, n, packed.in_features, bias, packed.glu, "linear")
    if x2.shape[0]:
        kernel_call.run((linear_call(packed, x2, out, bias, None, torch.get_num_threads()),))
    return out.view(*x.shape[:-1], n)


def bf16_rows(kind: Kind, rows: int) -> int:
    """Rows of the bf16 buffer a ``kind`` kernel rounds ``rows`` rows of x into: AMX pads to its tile's 16."""
    return -(-rows // AMX_ROWS) * AMX_ROWS if kind == "amx" else rows


def has_add_norm(packed: PackedWeight) -> bool:
    """Whether ``packed``'s kernel has the residual-add-and-RMSNorm epilogue (:func:`linear_add_norm_call`)."""
    return packed.kind in ("dpbf16", "panels") and not packed.glu


def linear_call(
    packed: PackedWeight,
    x: torch.Tensor,
    out: torch.Tensor,
    bias: torch.Tensor | None,
    x_bf16: torch.Tensor | None,
    threads: int,
) -> kernel_call.KernelCall:
    """The one kernel call of :func:`linear` for a ``panels``, ``amx`` or ``dpbf16`` weight, on buffers the caller
    holds: ``x`` fp32 ``[m, in]`` and ``out`` fp32 ``[m, out]`` (rows at any stride, unit last stride), ``bias``
    contiguous fp32 or None, ``x_bf16`` (the bf16 kinds; else ignored, may be None) a contiguous bf16 buffer of at
    least :func:`bf16_rows` x ``in`` elements that the kernel rounds x into."""
    n, k, m = packed.out_features, packed.in_features, x.shape[0]
    bias_ptr = bias.data_ptr() if bias is not None else None
    glu_and_threads = (int(packed.glu), threads)
    if packed.kind == "panels":
        lib = c_build.load("cpu_gemm", _bind)  # loaded when the weight was packed: a dict lookup here
        assert lib is not None, "panel-packed weight without its kernel"
        args = (x.data_ptr(), x.stride(0), packed.data.data_ptr(), bias_ptr, out.data_ptr(), out.stride(0), m, n, k)
        return kernel_call.KernelCall(lib.gemm_panels_f32, (*args, *glu_and_threads), "panels linear")
    if packed.kind not in CALL_KINDS:
        raise ValueError(f"no C kernel call for a {packed.kind!r} weight")
    assert x_bf16 is not None and x_bf16.numel() >= bf16_rows(packed.kind, m) * k, "bf16 rows' buffer too small"
    amx = packed.kind == "amx"
    lib = _amx_lib() if amx else _dp_lib()
    assert lib is not None, f"{packed.kind}-packed bf16 weight without its kernel"
    bf16_args = (x.data_ptr(), x.stride(0), x_bf16.data_ptr(), m, packed.data.data_ptr(), bias_ptr, out.data_ptr())
    return kernel_call.KernelCall(
        lib.gemm_bf16_amx if amx else lib.gemm_bf16_dp,
        (*bf16_args, out.stride(0), n, k, *glu_and_threads),
        f"{packed.kind} bf16",
    )


def linear_add_norm_call(
    packed: PackedWeight,
    x: torch.Tensor,
    out: torch.Tensor,
    bias: torch.Tensor | None,
    x_bf16: torch.Tensor | None,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    normed: torch.Tensor,
    threads: int,
) -> kernel_call.KernelCall:
    """The one kernel call of :func:`linear_add_norm` where :func:`has_add_norm`, on buffers the caller holds:
    operands as for :func:`linear_call`, except that ``out``, ``residual`` and ``normed`` are contiguous fp32
    ``[m, out]`` (three distinct buffers) and ``norm_weight`` contiguous fp32 ``[out]``."""
    if not has_add_norm(packed):
        raise ValueError(f"no add-and-norm kernel for a {packed.kind!r} weight")
    n, k, m = packed.out_features, packed.in_features, x.shape[0]
    bias_ptr = bias.data_ptr() if bias is not None else None
    norm = (residual.data_ptr(), norm_weight.data_ptr(), eps, normed.data_ptr(), threads)
    if packed.kind == "panels":
        lib = c_build.load("cpu_gemm", _bind)
        assert lib is not None, "panel-packed weight without its kernel"
        args = (x.data_ptr(), x.stride(0), packed.data.data_ptr(), bias_ptr, out.data_ptr(), m, n, k)
        return kernel_call.KernelCall(lib.gemm_panels_add_norm_f32, (*args, *norm), "panels add-and-norm")
    dp = _dp_lib()
    assert dp is not None and x_bf16 is not None and x_bf16.numel() >= m * k
    dp_args = (x.data_ptr(), x.stride(0), x_bf16.data_ptr(), m, packed.data.data_ptr(), bias_ptr, out.data_ptr(), n, k)
    return kernel_call.KernelCall(dp.gemm_bf16_dp_add_norm, (*dp_args, *norm), "dpbf16 add-and-norm")


def argmax_linear(x: torch.Tensor, packed: PackedWeight) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(x @ W.T).max(dim=1)`` without the product: each row's largest value (fp32) and the index of its
    first occurrence (int64), NaN first as torch's ``max`` has it, for ``x [rows, in]``; None where the
    packed kind has none (then: :func:`linear`, and the argmax over its output): the dpbf16 kernel keeps a
    running maximum in its tile epilogue, the fp32 panel kernel reads its tiles back from an L1-sized block.

    The greedy sampler's question about the lm_head (``LlamaForCausalLM.compute_greedy``): the logits are
    rows x vocab fp32 (49152 wide for SmolLM2: 12.6 MB at 64 rows, 113 MB in a speculative step's 576),
    which the matmul wrote and the argmax read back. The values are those :func:`linear` computes (the same
    kernel and order of sums), so the answer is the one the argmax over its output gives."""
    if packed.kind not in ("dpbf16", "panels") or packed.glu or x.dim() != 2 or x.shape[1] != packed.in_features:
        return None
    lib = _dp_lib() if packed.kind == "dpbf16" else c_build.load("cpu_gemm", _bind)
    if lib is None:
        return None
    x2 = x if x.dtype == torch.float32 and x.stride(-1) == 1 else x.float().contiguous()
    m, k = x2.shape
    best = torch.empty((m,), dtype=torch.float32)
    index = torch.empty((m,), dtype=torch.int64)
    if not m:
        return best, index
    threads = torch.get_num_threads()
    if packed.kind == "dpbf16":
        xb = torch.empty((m, k), dtype=torch.bfloat16)  # x rounded into it, as for linear()
        status = lib.gemm_bf16_dp_argmax(
            x2.data_ptr(), x2.stride(0), xb.data_ptr(), m, packed.data.data_ptr(), packed.out_features, k,
            best.data_ptr(), index.data_ptr(), threads,
        )  # fmt: skip
    else:
        status = lib.gemm_panels_argmax_f32(
            x2.data_ptr(), x2.stride(0), packed.data.data_ptr(), m, packed.out_features, k,
            best.data_ptr(), index.data_ptr(), threads,
        )  # fmt: skip
    if status != 0:
        raise RuntimeError(f"the {packed.kind} argmax kernel could not run (status {status})")
    return best, index


def linear_add_norm(
    x: torch.Tensor,
    packed: PackedWeight,
    bias: torch.Tensor | None,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(rms_norm(y) * norm_weight, y)`` with ``y = x @ W.T + bias + residual``: a projection, the residual add
    after it and the RMSNorm before the next block, in one kernel call (the norm in the matmul's parallel
    region, row by row as :func:`pagedq_kernels.cpu_ops.rms_norm_cpu` computes it: the same floats). None where the
    kind has no such epilogue or the operands are not fp32 rows (then: :func:`linear`, then the norm).

    Why: a decode step runs two of these norms per layer, each a call of ~10-30 us (Python, ctypes, a
    parallel region's start and end) for a few microseconds of work."""
    n, k = packed.out_features, packed.in_features
    if not has_add_norm(packed) or x.dim() != 2 or x.shape[1] != k:
        return None
    m = x.shape[0]
    fp32_rows = all(t.dtype == torch.float32 and t.is_contiguous() for t in (residual, norm_weight))
    if not fp32_rows or residual.shape != (m, n) or norm_weight.shape != (n,) or not m:
        return None
    if (_dp_lib() if packed.kind == "dpbf16" else c_build.load("cpu_gemm", _bind)) is None:
        return None
    x2, out, bias = panel_operands(x, n, k, bias, False, "linear_add_norm")
    normed = torch.empty((m, n), dtype=torch.float32)
    x_bf16 = torch.empty((m, k), dtype=torch.bfloat16) if packed.kind == "dpbf16" else None  # x rounded into it
    call = linear_add_norm_call(
        packed, x2, out, bias, x_bf16, residual, norm_weight, eps, normed, torch.get_num_threads()
    )
    kernel_call.run((call,))
    return normed, out


def _linear_bf16(x: torch.Tensor, packed: PackedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """:func:`linear` for a bf16 weight on pagedq's AMX or AVX512-bf16 kernel: ``x`` (fp32; a bf16 ``x`` is
    widened first, exactly) rounded to bf16 inside the kernel, products summed in fp32, the fp32 result
    (bias added in fp32) returned in ``x``'s dtype."""
    n, k = packed.out_features, packed.in_features
    x2, out, bias = panel_operands(x, n, k, bias, packed.glu, "linear")
    m = x2.shape[0]
    if m:
        # The kernel rounds x to bf16 into this (for AMX, rows padded to a tile's 16 with zeros). A build without
        # the kernel holds a stub that refuses (a non-zero status) rather than leave out unwritten.
        x_bf16 = torch.empty((bf16_rows(packed.kind, m), k), dtype=torch.bfloat16)
        kernel_call.run((linear_call(packed, x2, out, bias, x_bf16, torch.get_num_threads()),))
    if x.dim() != 2:
        out = out.view(*x.shape[:-1], n)
    return out if x.dtype == torch.float32 else out.to(x.dtype)
