"""Group-wise int8 weights: the one quantised layout pagedq serves, its torch reference and its CPU kernel.

A weight ``W [N, K]`` is held as int8 ``values [N, K]``, fp32 ``scales [N, K / group_size]`` and, for
asymmetric formats, fp32 ``offsets`` of the same shape: ``w[n, k] = scale[n, g] * q[n, k] + offset[n, g]``
with ``g = k // group_size``. One layout covers every source exactly:

- ``quantization="int8"`` on an fp checkpoint: symmetric per-output-channel (``group_size = K``,
  ``scale = absmax / 127``, no offset), :func:`quantize_per_channel`;
- GGUF ``Q8_0`` (``w = d * q``), ``Q4_0`` (``w = d * (q - 8)``, stored as ``q - 8``) and ``Q4_1``
  (``w = d * q + m``), blocks of 32 along K, and likewise Q5_0/Q5_1, the K-quants (groups of 16 or 32 with
  ``scale = d * sc``, ``offset = -(dmin * m)``) and IQ4 (:mod:`engine.gguf_quants`). Their fp16 ``d``/``m``
  widen to fp32 exactly, and every code fits int8, so the repacking loses nothing:
  :meth:`Int8Weight.dequantize` equals gguf's own ``dequantize()`` bit for bit (both compute ``scale * q``
  then ``+ offset`` in fp32).

Holding 4-bit codes in a byte costs Q4 files twice their bytes in memory; in exchange one kernel serves
every format, and a decode step still streams a quarter of fp32's weight bytes.

The matmul is weight-only: activations stay in their dtype (fp32 on CPU), the weight is dequantised inside
the tile and products accumulate in fp32 (``csrc/cpu_int8_gemm.c``, built per ISA variant; the Triton
kernel for CUDA is :mod:`pagedq_kernels.int8_linear_triton`). Where the model multiplies in bf16 anyway
(``EngineConfig.matmul_weight_dtype``) and the CPU runs AMX, a per-channel weight runs on AMX bf16 tiles
instead (``csrc/cpu_int8_amx.c``): the activations rounded to bf16, as the bf16 path rounds them, the int8
values widened to bf16 exactly, the scale applied to the fp32 sum. :func:`linear_reference` (dequantise,
then ``F.linear``) is the reference every kernel is tested against.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import math
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagedq_kernels import c_build, cpu_linear, host_memory, kernel_call

PANEL = 16  # output columns per panel (gemm_tile.h NR)
AMX_BLOCK, AMX_K = cpu_linear.AMX_BLOCK, cpu_linear.AMX_K  # csrc/amx_tile.h
INT8_MAX = 127


@dataclass(frozen=True, eq=False)
class Int8Weight:
    """``W [out_features, in_features]`` as group-wise int8 (see the module docstring)."""

    values: torch.Tensor  # int8 [N, K]
    scales: torch.Tensor  # float32 [N, K // group_size]
    offsets: torch.Tensor | None  # float32 [N, K // group_size], or None (symmetric)
    group_size: int

    def __post_init__(self) -> None:
        n, k = self.values.shape
        if self.values.dtype != torch.int8:
            raise ValueError(f"int8 weight values must be int8, got {self.values.dtype}")
        if self.group_size < 1 or k % self.group_size:
            raise ValueError(f"group size {self.group_size} does not divide in_features {k}")
        groups = (n, k // self.group_size)
        if tuple(self.scales.shape) != groups or self.scales.dtype != torch.float32:
            raise ValueError(f"scales must be float32 {groups}, got {self.scales.dtype} {tuple(self.scales.shape)}")
        if self.offsets is not None and (tuple(self.offsets.shape) != groups or self.offsets.dtype != torch.float32):
            raise ValueError(f"offsets must be float32 {groups}, got {self.offsets.dtype} {tuple(self.offsets.shape)}")

    @property
    def out_features(self) -> int:
        return int(self.values.shape[0])

    @property
    def in_features(self) -> int:
        return int(self.values.shape[1])

    @property
    def nbytes(self) -> int:
        total = self.values.nbytes + self.scales.nbytes
        return total + (self.offsets.nbytes if self.offsets is not None else 0)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The dense weight: ``scale * q`` then ``+ offset``, each rounded to fp32 (gguf's order)."""
        n, k = self.values.shape
        grouped = self.values.float().view(n, k // self.group_size, self.group_size) * self.scales[..., None]
        if self.offsets is not None:
            grouped = grouped + self.offsets[..., None]
        return grouped.view(n, k).to(dtype)

    def to(self, device: torch.device) -> Int8Weight:
        """The same weight on ``device`` (CUDA: for the Triton kernel)."""
        if self.values.device == device:
            return self
        offsets = None if self.offsets is None else self.offsets.to(device)
        return Int8Weight(self.values.to(device), self.scales.to(device), offsets, self.group_size)

    def rows(self, index: torch.Tensor) -> Int8Weight:
        """The output rows ``index`` (a permutation or selection), every part moved together: exact."""
        return Int8Weight(
            self.values.index_select(0, index),
            self.scales.index_select(0, index),
            None if self.offsets is None else self.offsets.index_select(0, index),
            self.group_size,
        )

    def regrouped(self, group_size: int) -> Int8Weight:
        """The same weight in groups of ``group_size`` (which divides this one's): each scale and offset
        repeated over its finer groups, so every element keeps its value exactly."""
        if self.group_size % group_size:
            raise ValueError(f"group size {group_size} does not divide {self.group_size}")
        if group_size == self.group_size:
            return self
        repeat = self.group_size // group_size
        offsets = None if self.offsets is None else self.offsets.repeat_interleave(repeat, dim=1)
        return Int8Weight(self.values, self.scales.repeat_interleave(repeat, dim=1), offsets, group_size)

    @staticmethod
    def concat(parts: list[Int8Weight]) -> Int8Weight:
        """Row-wise concatenation (merged qkv / gate_up). Parts of different groups (a GGUF's Q4_K q and k
        beside a Q6_K v) are held at the finest group that divides them all, and a symmetric part beside
        asymmetric ones gets zero offsets: ``scale * q + 0`` is ``scale * q``, so the merge is exact."""
        if len({p.in_features for p in parts}) != 1:
            raise ValueError("cannot merge int8 weights of different in_features")
        group = math.gcd(*(p.group_size for p in parts))
        parts = [p.regrouped(group) for p in parts]
        offsets = None
        if any(p.offsets is not None for p in parts):
            offsets = torch.cat([p.offsets if p.offsets is not None else torch.zeros_like(p.scales) for p in parts])
        return Int8Weight(torch.cat([p.values for p in parts]), torch.cat([p.scales for p in parts]), offsets, group)


def quantize_per_channel(weight: torch.Tensor) -> Int8Weight:
    """Symmetric per-output-channel int8: ``scale = absmax(row) / 127``, ``q = round(w / scale)``.

    An all-zero row gets scale 1 (any scale reproduces it; 1 keeps the division finite)."""
    w = weight.detach().float()
    absmax = w.abs().amax(dim=1, keepdim=True)
    scales = torch.where(absmax > 0, absmax / INT8_MAX, torch.ones_like(absmax))
    values = torch.round(w / scales).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return Int8Weight(values.contiguous(), scales.contiguous(), None, w.shape[1])


def linear_reference(x: torch.Tensor, weight: Int8Weight, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ dequantize(W).T + bias`` in fp32, returned in ``x``'s dtype: what every kernel must match."""
    b = bias.float() if bias is not None else None
    return F.linear(x.float(), weight.dequantize().to(x.device), b).to(x.dtype)


# ------------------------------------------------------------------------------------------ C kernel


@dataclass(frozen=True, eq=False)
class PackedInt8:
    """An :class:`Int8Weight` in the C kernel's panels (opaque to torch); ``glu``: a merged gate/up weight
    whose product is ``silu(gate) * up``, ``out_features`` wide. ``amx``: in the AMX kernel's tile order
    (``values`` int8 [blocks, K, 32], ``scales`` and ``offsets`` float32 [blocks, K // group_size, 32]; see
    ``csrc/cpu_int8_amx.c``), x rounded to bf16; multiplied on AMX tiles, or, where ``dp_kernels`` is set (AMX
    does not run), on that library's AVX512-bf16 dot products (``csrc/cpu_bf16_dp.c`` gemm_int8_dp, the same
    sums; group-wise weights there too, dequantised to bf16)."""

    values: torch.Tensor  # int8 [panels, K, 16] (amx: [blocks, K, 32])
    scales: torch.Tensor  # float32 [panels, K // group_size, 16] (amx: [blocks, K // group_size, 32])
    offsets: torch.Tensor | None
    group_size: int
    out_features: int
    in_features: int
    glu: bool = False
    amx: bool = False
    dp_kernels: ctypes.CDLL | None = None  # held as loaded: a later ISA cap moves no packed weight

    @property
    def nbytes(self) -> int:
        total = self.values.nbytes + self.scales.nbytes
        return total + (self.offsets.nbytes if self.offsets is not None else 0)


def _bind(lib: ctypes.CDLL) -> None:
    i64, ptr, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    lib.gemm_int8_panels.argtypes = [ptr, i64, ptr, ptr, ptr, i64, ptr, ptr, i64, i64, i64, i64, i32, i32]
    lib.gemm_int8_panels.restype = ctypes.c_int
    lib.gemm_int8_fused_rows.argtypes = []
    lib.gemm_int8_fused_rows.restype = ctypes.c_int


def _bind_amx(lib: ctypes.CDLL) -> None:
    i64, ptr, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    lib.gemm_int8_amx.argtypes = [ptr, i64, ptr, i64, ptr, ptr, ptr, ptr, i64, i64, i64, i32, i32]
    lib.gemm_int8_amx.restype = i32


@functools.cache
def _amx_lib() -> ctypes.CDLL | None:
    """The avx512 build of ``cpu_int8_amx`` with AMX tile permission granted to this process, or None.
    Held once loaded: an AMX-packed weight keeps running on it if the ``PAGEDQ_CPU_ISA`` cap moves later."""
    return c_build.load_amx("cpu_int8_amx", _bind_amx, "int8_amx_init")


def amx_available() -> bool:
    """Whether per-channel int8 weights can run on AMX bf16 tiles here: AMX probed runnable and allowed by
    the ``PAGEDQ_CPU_ISA`` cap, the avx512 kernel build, and the kernel's permission for tile data."""
    return not os.environ.get("PAGEDQ_DISABLE_INT8_KERNEL") and c_build.amx_runnable() and _amx_lib() is not None


def fused_rows() -> int:
    """The most rows a :func:`linear` call dequantises in registers, with no fp32 panel buffer: 6 in the AVX2
    build, 12 in the AVX-512 one (0: never, as in the generic build or without the kernel). Up to there a row's
    int8 product streams a quarter of fp32's bytes at no extra arithmetic: a caller holding both forms of a weight
    picks int8 then."""
    lib = _library()
    return int(lib.gemm_int8_fused_rows()) if lib is not None else 0


def kernel_available() -> bool:
    """Whether the C kernel runs here (a compiler, and not switched off by ``PAGEDQ_DISABLE_INT8_KERNEL``)."""
    return _library() is not None


def _library() -> ctypes.CDLL | None:
    """The loaded kernel library (cached by c_build), or None where it does not run or is switched off."""
    if os.environ.get("PAGEDQ_DISABLE_INT8_KERNEL"):
        return None
    return c_build.load("cpu_int8_gemm", _bind)


def _panel_rows(out_features: int, glu: bool) -> torch.Tensor:
    """Source row of each panel lane, ``out_features`` (a zero row) for padding. With glu, panel p holds
    gate rows 8p..8p+7 in lanes 0-7 and the matching up rows (``out_features`` further) in lanes 8-15."""
    if not glu:
        panels = -(-out_features // PANEL)
        rows = torch.arange(panels * PANEL)
        return torch.where(rows < out_features, rows, torch.full_like(rows, 2 * out_features))
    half = PANEL // 2
    panels = -(-out_features // half)
    col = torch.arange(panels)[:, None] * half + torch.arange(half)[None, :]
    gate = torch.where(col < out_features, col, torch.full_like(col, 2 * out_features))
    up = torch.where(col < out_features, col + out_features, torch.full_like(col, 2 * out_features))
    return torch.cat((gate, up), dim=1).reshape(-1)


def _to_panels(t: torch.Tensor, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t [R, C]`` -> ``[panels, C, 16]`` with lane rows ``rows`` (index R is a zero row), in host memory."""
    padded = torch.cat((t, torch.zeros(1, t.shape[1], dtype=t.dtype)))
    # Every row index up to 2 * out_features may name the zero row: clamp those onto it.
    picked = padded.index_select(0, rows.clamp(max=t.shape[0]))
    panels = picked.view(-1, PANEL, t.shape[1]).transpose(1, 2)
    out = host_memory.empty(tuple(panels.shape), dtype)
    out.copy_(panels)
    return out


def amx_supported(weight: Int8Weight) -> bool:
    """Whether ``weight`` fits the AMX kernel: symmetric per-output-channel (the scale factors out of the
    K sum) and ``in_features`` a multiple of a tile row's 32 bf16. GGUF's group-wise weights are not."""
    return weight.offsets is None and weight.group_size == weight.in_features and weight.in_features % AMX_K == 0


def dp_supported(weight: Int8Weight) -> bool:
    """Whether ``weight`` fits the AVX512-bf16 kernel's int8 path (``csrc/cpu_bf16_dp.c`` gemm_int8_dp): what
    :func:`amx_supported` takes, and group-wise weights (GGUF's) whose groups are multiples of a tile row's 32."""
    return weight.in_features % AMX_K == 0 and weight.group_size % AMX_K == 0


def _pack_amx(weight: Int8Weight, out_features: int, glu: bool) -> PackedInt8:
    """The weight in AMX tile order: per block of 32 columns and chunk of 32 k, two B tiles of 16 rows of
    k-pairs, each row the pairs' 16 first elements then their 16 second ones (``csrc/cpu_int8_amx.c``
    widens a row into the tile's [16 columns][2] bf16 without a cross-lane shuffle). Scales (and offsets) per
    block and group: [blocks, K / group, 32] (a per-channel weight: one group)."""
    n, k = weight.values.shape
    rows = cpu_linear.amx_block_rows(out_features, glu).clamp(max=n)
    padded = torch.cat((weight.values, torch.zeros(1, k, dtype=torch.int8)))
    picked = padded.index_select(0, rows)  # [blocks * 32, K]: row b*32 + 16t + j
    # [b, t, j, c, p, e] (k = 32c + 2p + e) -> [b, c, t, p, e, j]
    tiles = picked.view(-1, 2, 16, k // AMX_K, AMX_K // 2, 2).permute(0, 3, 1, 4, 5, 2)
    values = host_memory.empty((picked.shape[0] // AMX_BLOCK, k, AMX_BLOCK), torch.int8)
    values.view(tiles.shape).copy_(tiles)
    groups = weight.scales.shape[1]

    def per_block(table: torch.Tensor, pad: float) -> torch.Tensor:
        source = torch.cat((table, torch.full((1, groups), pad)))  # the padding row: scale 1, offset 0
        return source.index_select(0, rows).view(-1, AMX_BLOCK, groups).transpose(1, 2).contiguous()

    scales = per_block(weight.scales, 1.0)
    offsets = None if weight.offsets is None else per_block(weight.offsets, 0.0)
    return PackedInt8(values, scales, offsets, weight.group_size, out_features, k, glu, amx=True)


def pack(weight: Int8Weight, glu: bool = False, matmul_dtype: torch.dtype | None = None) -> PackedInt8 | None:
    """``weight`` in panels for :func:`linear`, or None where the C kernel cannot run (callers keep
    :func:`linear_reference`). ``glu``: ``weight`` is a merged ``[gate; up]`` (``2i`` rows).

    ``matmul_dtype`` bf16 (the model multiplies in bf16: activations are rounded to bf16 anyway) puts a
    per-channel weight on AMX tiles where the CPU runs them, else on the AVX512-bf16 dot products where those run
    (the same packing and sums); otherwise (fp32: the exact kernel) panels. On a 2-vCPU AMD EPYC Zen 5 the fp32
    panels ran an int8 model's compass at 0.9x the fp32 model's speed (int8 -> fp32 widening on fp32 FMAs, at
    compute-bound step sizes): see ``csrc/cpu_bf16_dp.c`` gemm_int8_dp for the change."""
    if weight.values.device.type != "cpu" or not kernel_available():
        return None
    n = weight.out_features
    if glu and n % 2:
        return None
    out_features = n // 2 if glu else n
    if matmul_dtype == torch.bfloat16 and amx_supported(weight) and amx_available():
        return _pack_amx(weight, out_features, glu)
    if matmul_dtype == torch.bfloat16 and dp_supported(weight) and not amx_available():
        dp_kernels = cpu_linear.dp_library()  # PAGEDQ_DISABLE_INT8_KERNEL: kernel_available() refused above
        if dp_kernels is not None:
            return dataclasses.replace(_pack_amx(weight, out_features, glu), dp_kernels=dp_kernels)
    # A merged gate/up has 2 * out_features rows: the padding index of _panel_rows is >= n, clamped to n.
    rows = _panel_rows(out_features, glu)
    return PackedInt8(
        _to_panels(weight.values, rows, torch.int8),
        _to_panels(weight.scales, rows, torch.float32),
        None if weight.offsets is None else _to_panels(weight.offsets, rows, torch.float32),
        weight.group_size,
        out_features,
        weight.in_features,
        glu,
    )


def linear(x: torch.Tensor, packed: PackedInt8, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ W.T + bias`` (or ``silu(gate) * up`` for glu) with ``packed`` from :func:`pack`: ``x`` rounded to bf16
    on the AMX kernel (rows padded to a tile's 16 with zeros), products summed in fp32, the fp32 result returned in
    ``x``'s dtype."""
    n, k = packed.out_features, packed.in_features
    x2, out, bias = cpu_linear.panel_operands(x, n, k, bias, packed.glu, "int8 linear")
    m = x2.shape[0]
    if m:
        x_bf16 = torch.empty((cpu_linear.bf16_rows("amx", m), k), dtype=torch.bfloat16) if packed.amx else None
        function, args, _ = linear_call(packed, x2, out, bias, x_bf16, torch.get_num_threads())
        if function(*args):
            buffer = "widened weight" if packed.amx else "dequantisation"
            raise MemoryError(f"int8 linear: no memory for the {buffer} buffer")
    return out.view(*x.shape[:-1], n).to(x.dtype)


def linear_call(
    packed: PackedInt8,
    x: torch.Tensor,
    out: torch.Tensor,
    bias: torch.Tensor | None,
    x_bf16: torch.Tensor | None,
    threads: int,
) -> kernel_call.KernelCall:
    """The one kernel call of :func:`linear` on buffers the caller holds, as :func:`cpu_linear.linear_call` has
    them (``x_bf16``: AMX only, at least ``cpu_linear.bf16_rows("amx", m)`` x ``in`` elements). A non-zero status:
    the kernel could not allocate its buffer, and wrote nothing."""
    n, k, m = packed.out_features, packed.in_features, x.shape[0]
    bias_ptr = bias.data_ptr() if bias is not None else None
    values, scales = packed.values.data_ptr(), packed.scales.data_ptr()
    if packed.amx:
        assert x_bf16 is not None and x_bf16.numel() >= cpu_linear.bf16_rows("amx", m) * k, "bf16 buffer too small"
        rows = (x.data_ptr(), x.stride(0), x_bf16.data_ptr(), m, values, scales)
        into = (bias_ptr, out.data_ptr(), out.stride(0), n, k, int(packed.glu), threads)
        if packed.dp_kernels is not None:  # gemm_int8_amx's arguments with the offsets and the group after scales
            offsets = packed.offsets.data_ptr() if packed.offsets is not None else None
            grouped = (*rows, offsets, packed.group_size, *into)
            return kernel_call.KernelCall(packed.dp_kernels.gemm_int8_dp, grouped, "int8 AVX512-bf16 linear")
        amx = _amx_lib()
        assert amx is not None, "AMX-packed int8 weight without its kernel"
        return kernel_call.KernelCall(amx.gemm_int8_amx, (*rows, *into), "int8 AMX linear")
    lib = c_build.load("cpu_int8_gemm", _bind)
    assert lib is not None, "int8-packed weight without its kernel"
    offsets = packed.offsets.data_ptr() if packed.offsets is not None else None
    panels = (x.data_ptr(), x.stride(0), values, scales, offsets, packed.group_size, bias_ptr, out.data_ptr())
    return kernel_call.KernelCall(
        lib.gemm_int8_panels, (*panels, out.stride(0), m, n, k, int(packed.glu), threads), "int8 linear"
    )


def linear_any(x: torch.Tensor, weight: Int8Weight, bias: torch.Tensor | None) -> torch.Tensor:
    """An int8 weight that is not in C panels: the Triton kernel on CUDA, else the reference (a CPU without a
    C compiler: it dequantises per call, slow but exact)."""
    if x.device.type == "cuda":
        from pagedq_kernels.int8_linear_triton import int8_linear  # imports triton: only where CUDA runs

        return int8_linear(x, weight, bias)
    return linear_reference(x, weight, bias)
