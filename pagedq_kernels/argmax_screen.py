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

``PAGEDQ_DISABLE_SCREENED_ARGMAX=1`` switches it off (the fp32 panels' argmax serves)."""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass

import torch

from pagedq_kernels import cpu_linear

BLOCK = 32  # output columns per dpbf16 column block: the norm arrays are padded to a multiple (zeros)


@dataclass(frozen=True, eq=False)
class ScreenedHead:
    """An fp32 weight's two packings and the norms that bound the bf16 one's error, built by :func:`build`."""

    exact: cpu_linear.PackedWeight  # the fp32 panels: the values the answer is
    screen: cpu_linear.PackedWeight  # the weight rounded to bf16, dpbf16 layout
    row_norm: torch.Tensor  # fp32 [blocks * 32]: ||w_v||, rounded up
    rounding_norm: torch.Tensor  # fp32 [blocks * 32]: ||bf16(w_v) - w_v||, rounded up
    max_row_norm: float
    kernels: ctypes.CDLL  # the AVX512-bf16 build, held as the dpbf16 weights hold it (a later ISA cap moves neither)


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


def build(weight: torch.Tensor, exact: cpu_linear.PackedWeight | None) -> ScreenedHead | None:
    """The screen for ``weight [vocab, hidden]`` fp32, whose fp32 panels are ``exact``; None where it cannot run
    (switched off, no AVX512-bf16, not fp32 panels, ``in_features`` not a multiple of 32, a non-finite weight)."""
    if os.environ.get("PAGEDQ_DISABLE_SCREENED_ARGMAX") or exact is None or exact.kind != "panels" or exact.glu:
        return None
    if weight.dtype != torch.float32 or tuple(weight.shape) != (exact.out_features, exact.in_features):
        return None
    if not bool(torch.isfinite(weight).all()):
        return None
    screen = cpu_linear.pack_dp(weight)
    kernels = cpu_linear.dp_library()
    if screen is None or kernels is None:
        return None
    wide = weight.detach().double()
    row_norm = wide.norm(dim=1)
    rounding_norm = (weight.detach().to(torch.bfloat16).double() - wide).norm(dim=1)
    padded = -(-weight.shape[0] // BLOCK) * BLOCK
    pad = (0, padded - weight.shape[0])
    return ScreenedHead(
        exact,
        screen,
        torch.nn.functional.pad(_rounded_up(row_norm), pad),
        torch.nn.functional.pad(_rounded_up(rounding_norm), pad),
        float(_rounded_up(row_norm.max()).item()),
        kernels,
    )


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
    rounded = torch.empty((m, k), dtype=torch.bfloat16)  # the kernel rounds x into it
    settled = torch.zeros((2,), dtype=torch.int64)
    status = head.kernels.gemm_bf16_dp_screen_argmax(
        x2.data_ptr(), x2.stride(0), rounded.data_ptr(), m, head.screen.data.data_ptr(), head.exact.data.data_ptr(),
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
