"""Large host buffers (the CPU KV cache, packed weights) backed by transparent huge pages.

A decode step streams the whole KV cache of the batch and every weight once; with 4 KB pages that
is one TLB miss and page walk per 4 KB, and the KV blocks of a sequence are scattered over the
cache, so the prefetchers cannot hide them. Measured on a 2-core EPYC VM with THP in ``madvise``
mode (the common default), decode attention over 30 cold layers streamed ~8 GB/s with 2 MB pages
against ~6.5 without. Linux only; elsewhere, or if the kernel refuses, the buffer is ordinary memory.

Huge pages can also cost far more than they save: where free memory is fragmented, the kernel compacts
memory on every huge-page fault (THP ``defrag`` = ``madvise``). On a KVM guest on 2026-12-02 zeroing a
2 GiB KV cache took 8.8 s with huge pages against 0.43 s without (0.24 vs 5 GB/s), which every engine
start paid. So the first 32 MB of a large buffer are touched right away and timed: slower than 1 GB/s, the
rest of the buffer, and every later one in this process, goes back to ordinary pages.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
import time
from collections.abc import Callable

import torch

_HUGE = 2 << 20
_MADV_HUGEPAGE = 14
_MADV_NOHUGEPAGE = 15
PROBE_BYTES = 32 << 20  # touched and timed first: 16 huge pages
SLOW_BYTES_PER_S = 1 << 30  # huge-page faults slower than this: the kernel is compacting memory for them
_huge_pages_slow = False  # measured once slow in this process: later buffers do not ask


def _madvise() -> Callable[[int, int, int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None
    fn = libc.madvise
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


_madvise_fn = _madvise()


def empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """``torch.empty`` on the CPU, asking for huge pages before the memory is first touched (unless they
    measured slow in this process; see the module docstring)."""
    global _huge_pages_slow
    t = torch.empty(shape, dtype=dtype)
    nbytes = t.numel() * t.element_size()
    if _madvise_fn is None or nbytes < 2 * _HUGE or _huge_pages_slow:
        return t
    start = -(-t.data_ptr() // _HUGE) * _HUGE  # the 2 MB-aligned interior of the buffer
    end = (t.data_ptr() + nbytes) // _HUGE * _HUGE
    _madvise_fn(start, end - start, _MADV_HUGEPAGE)  # advisory: a refusal leaves 4 KB pages
    if end - start >= 4 * PROBE_BYTES:
        began = time.perf_counter()
        ctypes.memset(start, 0, PROBE_BYTES)  # the contents of an empty tensor are anyone's
        if PROBE_BYTES / max(time.perf_counter() - began, 1e-9) < SLOW_BYTES_PER_S:
            _huge_pages_slow = True
            _madvise_fn(start + PROBE_BYTES, end - start - PROBE_BYTES, _MADV_NOHUGEPAGE)
    return t


def huge_pages_measured_slow() -> bool:
    """Whether this process found huge-page faults too slow and stopped asking for them."""
    return _huge_pages_slow


def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return empty(shape, dtype).zero_()
