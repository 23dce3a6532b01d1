"""The greedy argmax over an fp32 lm_head, screened in bf16 and settled in fp32: the fp32 answer, in about half
its time, where AVX512-bf16 runs.

Why: on the compass workload in fp32 the lm_head's argmax (``cpu_linear.argmax_linear`` on the fp32 panels) is
2.6 s of 35 (SmolLM2: 49152 x 576, a fifth of a token's FLOPs), and the AVX512-bf16 kernel runs the same shape at
twice the fp32 panels' rate (2-vCPU AMD EPYC Zen 4: 441 vs 210 GFLOP/s at 64 rows, 451 vs 215 at 256).
bf16 alone would change tokens; the screen does not. ``csrc/cpu_bf16_dp.c``'s ``gemm_bf16_dp_screen_argmax``
bounds, per row and column, how far the bf16 product can be from the fp32 panel kernel's value (from the norms
of the weight's rows and of their bf16 rounding error, given here, and of the row of x and its rounding, there),
keeps only the columns that could still be the largest (one at the median on SmolLM2, 38 at most on the compass
prompts), and recomputes those exactly as the panel kernel does. A row it cannot narrow (non-finite or huge
inputs, too many near-ties) goes to ``argmax_linear`` on the fp32 panels, every column. So the answer is
``argmax_linear``'s on the fp32 panels, bit for bit: values, first column on ties, NaN first.

Where AVX512-bf16 dot products run slower than fp32 FMAs (:attr:`cpu_isa.CpuIsa.bf16_products_on_fma`), the
screen's products run on the FMAs (the same floats), and it still wins at every row count, by the bytes it does not
stream: Intel Xeon family 6 model 207 (dot products at half the FMAs' rate), 2 threads, SmolLM2's head evicted from
the caches before each call, best of 7 interleaved, ms screened / fp32 panels: 1 row 2.66 / 4.48, 8: 3.51 / 5.55,
16: 4.44 / 5.74, 36: 7.90 / 8.56, 64: 13.24 / 13.56 (on the dot products it had lost from 12 rows: 36 rows
13.8-18.8 / 11.5-12.1).

The int8 screen (``gemm_int8_screen_argmax``; the default where it packs, ``in_features`` from 32 to 1024 (the
kernel needs a multiple of 4, both screens here a multiple of 32), on CPUs whose bf16 products run on their FMAs
and on AMD Zen 4 (:func:`_default_kind`)) is
the same contract with its products on AVX512-VNNI, 4 bytes per 32-bit lane, and a quarter of the fp32 weight's
bytes: x's rows in int8 per row, except the step's 32 channels of largest |x| (a hidden state's massive activations,
and each row's own largest), which stay fp32 (the bound and its measurements are in the C source's comment). Same
machine, same method, 110 real decode rows cycled, ms int8 / bf16 screen / fp32 panels: 1 row 1.74 / 2.37 / 3.93,
36: 5.57 / 9.78 / 11.34, 64: 8.06 / 15.87 / 17.91; in compass fp32 without drafts the head's argmax went from
2.58-2.70 s to 1.43-1.69 s (alternating processes).

``PAGEDQ_ARGMAX_SCREEN=bf16`` takes the bf16 screen instead; ``PAGEDQ_DISABLE_SCREENED_ARGMAX=1`` switches both
off (the fp32 panels' argmax serves)."""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from typing import Literal

import torch

from pagedq_kernels import cpu_isa, cpu_linear

BLOCK = 32  # output columns per column block (both screens): the per-column arrays are padded to a multiple (zeros)
KIND_ENV = "PAGEDQ_ARGMAX_SCREEN"
Kind = Literal["int8", "bf16"]
INT8_MAX_IN = 1024  # past it an int8 row's sum could leave fp32's exact integers (csrc: |S| < 2^24)
INT8_OUTLIERS = 32  # the C kernel's NOUT: in_features must be at least this
ZEN4_FAMILY = 25  # AMD's family number for Zen 3 and Zen 4 (Zen 3 has no AVX512-VNNI: no screen runs there)


@dataclass(frozen=True, eq=False)
class ScreenedHead:
    """An fp32 weight's panels, its screen's packing and the norms that bound the screen's error, built by
    :func:`build`."""

    exact: cpu_linear.PackedWeight  # the fp32 panels: the values the answer is
    kind: Kind
    screen: torch.Tensor  # int8: [blocks, k / 4, 2, 16, 4] int8; bf16: the weight rounded, dpbf16 layout
    scales: torch.Tensor | None  # int8: fp32 [blocks * 32] each column's scale (max |w_v| / 127)
    offsets: torch.Tensor | None  # int8: int32 [blocks * 32] 128 x each column's sum of its int8 values
    row_norm: torch.Tensor  # fp32 [blocks * 32]: ||w_v||, rounded up
    rounding_norm: torch.Tensor  # fp32 [blocks * 32]: ||screen(w_v) - w_v||, rounded up
    max_row_norm: float
    kernels: ctypes.CDLL  # the AVX512-bf16 build, held as the dpbf16 weights hold it (a later ISA cap moves neither)

    @property
    def nbytes(self) -> int:
        """What the screen holds beside the fp32 panels."""
        parts = (self.screen, self.scales, self.offsets, self.row_norm, self.rounding_norm)
        return sum(t.numel() * t.element_size() for t in parts if t is not None)


@dataclass
class ScreenCounts:
    """What the screens did (process-wide): columns recomputed in fp32, rows the fp32 panels' argmax settled over
    every column, rows asked for."""

    columns: int = 0
    full_rows: int = 0
    rows: int = 0


counts = ScreenCounts()


def _rounded_up(norms: torch.Tensor) -> torch.Tensor:
    """float64 norms as float32 no smaller than them (the cast rounds to nearest: 2^-24 relative at most)."""
    return (norms * (1 + 2**-20)).float()


def build(weight: torch.Tensor, exact: cpu_linear.PackedWeight | None, kind: Kind | None = None) -> ScreenedHead | None:
    """The screen for ``weight [vocab, hidden]`` fp32, whose fp32 panels are ``exact``: ``kind``, else
    ``PAGEDQ_ARGMAX_SCREEN``'s, else :func:`_default_kind`'s. None where it cannot run (switched off, no
    AVX512-bf16, not fp32 panels, ``in_features`` not a multiple of 32, a non-finite weight; int8: ``in_features``
    past 1024)."""
    requested = _requested_kind(kind)  # first: a misspelt value is an error on every CPU
    if os.environ.get("PAGEDQ_DISABLE_SCREENED_ARGMAX") or exact is None or exact.kind != "panels" or exact.glu:
        return None
    if weight.dtype != torch.float32 or tuple(weight.shape) != (exact.out_features, exact.in_features):
        return None
    if not bool(torch.isfinite(weight).all()) or weight.shape[1] % BLOCK:
        return None
    kernels = cpu_linear.dp_library()
    if kernels is None:
        return None
    chosen = requested or _default_kind(weight.shape[1])
    if chosen == "int8" and not _int8_packs(weight.shape[1]):
        return None
    wide = weight.detach().double()
    row_norm = wide.norm(dim=1)
    padded = -(-weight.shape[0] // BLOCK) * BLOCK
    pad = (0, padded - weight.shape[0])
    scales = offsets = None
    if chosen == "int8":
        screen, scales, offsets, screened = _pack_int8(weight.detach(), padded)
    else:
        packed = cpu_linear.pack_dp(weight)
        if packed is None:
            return None
        screen, screened = packed.data, weight.detach().to(torch.bfloat16).double()
    return ScreenedHead(
        exact,
        chosen,
        screen,
        scales,
        offsets,
        torch.nn.functional.pad(_rounded_up(row_norm), pad),
        torch.nn.functional.pad(_rounded_up((screened - wide).norm(dim=1)), pad),
        float(_rounded_up(row_norm.max()).item()),
        kernels,
    )


def _requested_kind(kind: Kind | None) -> Kind | None:
    """``kind``, else ``PAGEDQ_ARGMAX_SCREEN``'s (None: neither says); a ValueError for any other value."""
    requested = kind or os.environ.get(KIND_ENV) or None
    if requested is None:
        return None
    if requested == "int8":
        return "int8"
    if requested == "bf16":
        return "bf16"
    raise ValueError(f"{KIND_ENV}={requested!r}: the screens are int8 and bf16")


def _default_kind(in_features: int) -> Kind:
    """int8 where it packs and it was measured to win: where this CPU's bf16 products run on its FMAs (above), and
    on AMD Zen 4 (family 25, AVX-512 on 256-bit units): 2-vCPU AMD EPYC family 25 model 17, 2 threads, SmolLM2's
    head evicted before each call, 512 real decode rows, 7 rounds interleaved, ms int8 / bf16 screen / fp32 panels,
    best (median): 1 row 1.49 (3.24) / 2.48 (3.11) / 4.00 (5.74), 8: 1.92 (3.62) / 2.46 (3.34) / 3.75 (5.23), 16:
    2.42 (4.00) / 2.61 (3.89) / 5.41 (7.67), 36: 4.21 (4.79) / 5.38 (5.48) / 9.71 (9.80), 64: 6.95 (7.32) / 8.85
    (9.32) / 17.09 (17.19); compass fp32 without drafts, two engines alternated in one process, 3 rounds: int8
    34.91 s median against bf16 35.81. bf16 where VDPBF16PS runs at full rate on a wider core: there the two
    screens tie: 2-vCPU AMD EPYC Zen 5 (family 26 model 2), the same method with 384 rows, ms int8 / bf16 screen
    / fp32 panels: 1 row 1.11 / 1.06 / 2.27, 8: 1.34 / 1.24 / 2.64, 36: 3.20 / 3.21 / 5.32, 64: 4.88 / 5.19 /
    10.03; a bf16 model's own head (the dpbf16 argmax over its bf16 weight, no screen) 1.14 / 1.17 / 2.99 / 4.88,
    so an int8 screen would not pay for a bf16 head there either."""
    if not _int8_packs(in_features):
        return "bf16"
    model = cpu_isa.cpu_model()
    zen4 = model is not None and model.vendor == "AuthenticAMD" and model.family == ZEN4_FAMILY
    return "int8" if cpu_isa.current().bf16_products_on_fma or zen4 else "bf16"


def _int8_packs(in_features: int) -> bool:
    """in_features (a multiple of 32 here, as both screens need) within the int8 kernel's range."""
    return INT8_OUTLIERS <= in_features <= INT8_MAX_IN


def _pack_int8(weight: torch.Tensor, padded: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The int8 screen's packing of ``weight [n, k]``: each column v (a row of the weight) as q_v * sw_v, q_v int8
    in [-127, 127] and sw_v = max |w_v| / 127 (fp32); laid out per column block of 32 and k-quad as VPDPBUSD reads
    it (columns 0-15 then 16-31, 4 k per 32-bit lane); 128 x each column's sum of q (the u8 offset of x's rows
    comes off the int32 sums with it); and the dequantised weight in float64, for its rounding norms."""
    n, k = weight.shape
    scale = weight.abs().amax(dim=1) / 127
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero column (scale 0) stays all zeros
    q = torch.round(weight / safe[:, None]).clamp(-127, 127).to(torch.int8)
    rows = torch.zeros((padded, k), dtype=torch.int8)
    rows[:n] = q
    layout = rows.view(padded // BLOCK, 2, 16, k // 4, 4).permute(0, 3, 1, 2, 4).contiguous()
    pad = (0, padded - n)
    offsets = torch.nn.functional.pad(q.to(torch.int32).sum(dim=1) * 128, pad).to(torch.int32)
    dequantised = q.double() * scale.double()[:, None]
    return layout, torch.nn.functional.pad(scale, pad).contiguous(), offsets.contiguous(), dequantised


def argmax(x: torch.Tensor, head: ScreenedHead) -> tuple[torch.Tensor, torch.Tensor]:
    """``cpu_linear.argmax_linear(x, head.exact)``: each row's largest value of ``x @ W.T`` (fp32) and the first
    column holding it (int64), NaN first, for ``x [rows, in]``."""
    k = head.exact.in_features
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"argmax_screen: input of shape {tuple(x.shape)}, the weight expects [rows, {k}]")
    x2 = x if x.dtype == torch.float32 and x.stride(-1) == 1 else x.float().contiguous()
    m = x2.shape[0]
    best = torch.empty((m,), dtype=torch.float32)
    index = torch.empty((m,), dtype=torch.int64)
    if not m:
        return best, index
    settled = torch.zeros((2,), dtype=torch.int64)
    if head.kind == "int8":
        assert head.scales is not None and head.offsets is not None
        status = head.kernels.gemm_int8_screen_argmax(
            x2.data_ptr(), x2.stride(0), m, head.screen.data_ptr(), head.scales.data_ptr(), head.offsets.data_ptr(),
            head.exact.data.data_ptr(), head.row_norm.data_ptr(), head.rounding_norm.data_ptr(), head.max_row_norm,
            head.exact.out_features, k, best.data_ptr(), index.data_ptr(), settled.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip
    else:
        rounded = torch.empty((m, k), dtype=torch.bfloat16)  # the kernel rounds x into it
        status = head.kernels.gemm_bf16_dp_screen_argmax(
            x2.data_ptr(), x2.stride(0), rounded.data_ptr(), m, head.screen.data_ptr(), head.exact.data.data_ptr(),
            head.row_norm.data_ptr(), head.rounding_norm.data_ptr(), head.max_row_norm, head.exact.out_features, k,
            best.data_ptr(), index.data_ptr(), settled.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip
    if status != 0:
        raise RuntimeError(f"the screened argmax kernel could not run (status {status})")
    unsettled = (index < 0).nonzero().flatten()
    if unsettled.numel():  # rows the screen could not narrow: the fp32 panels over every column
        full = cpu_linear.argmax_linear(x2.index_select(0, unsettled), head.exact)
        if full is None:
            raise RuntimeError("argmax_screen: the fp32 panel kernel is not available for the rows left to it")
        best[unsettled], index[unsettled] = full
    counts.columns += int(settled[0])
    counts.full_rows += int(settled[1])
    counts.rows += m
    return best, index
