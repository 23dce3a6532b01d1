"""Large host buffers (the CPU KV cache, packed weights) backed by transparent huge pages.

A decode step streams the whole KV cache of the batch and every weight once; with 4 KB pages that
is one TLB miss and page walk per 4 KB, and the KV blocks of a sequence are scattered over the
cache, so the prefetchers cannot hide them. Measured on a 2-core EPYC VM with THP in ``madvise``
mode (the common default), decode attention over 30 cold layers streamed ~8 GB/s with 2 MB pages
against ~6.5 without. Linux only; elsewhere, or if the kernel refuses, the buffer is ordinary memory.

Huge pages can also cost far more than they save: where free memory is fragmented, the kernel compacts
memory on huge-page faults (THP ``defrag`` = ``madvise``). On a KVM guest on 2026-12-02 zeroing a 2 GiB
KV cache took 8.8-9.6 s with huge pages against 0.43 s without (~0.22 vs 5 GB/s), which every engine start
paid; the first few huge pages still came fast, the later ones slowly. So a large buffer is touched right
away in 64 MB chunks, each timed: the first chunk slower than 1 GB/s sends the rest of the buffer, and
every later one in this process, back to ordinary pages, if ordinary pages are the cure: the next chunk
is touched in them, timed too, and only when it runs ``COMPACTION_RATIO`` times faster. A slow first touch
can be the hypervisor's, which costs every page size alike: on a Zen 5 KVM guest on 2026-12-04 the 2 GiB
cache's first chunk measured slow at every engine start, yet loads took the same 8.4-12.6 s with the
fallback as with huge pages throughout, while the fallback left the cache in 4 KB pages and compass fp32
(one process, both engines, 6 interleaved pairs) ran 3.1 % slower (median wall 19.01 against 18.42 s, all
6 pairs). 64 MB touched there in a fresh process: huge pages 0.2-17 GB/s depending on what the host had
backed already, ordinary ones 2.5-2.7 GB/s every time.
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
CHUNK_BYTES = 64 << 20  # a large buffer is first touched in chunks this big, each one timed
SLOW_BYTES_PER_S = 1 << 30  # huge-page faults slower than this: the kernel may be compacting memory for them
COMPACTION_RATIO = 4.0  # ... and it is, when ordinary pages are touched this many times faster
_huge_pages_slow = False  # measured slow once in this process: later buffers do not ask


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


def _interior(t: torch.Tensor) -> tuple[int, int]:
    """The 2 MB-aligned interior ``[start, end)`` of ``t``'s memory (empty when it holds no huge page)."""
    nbytes = t.numel() * t.element_size()
    start = -(-t.data_ptr() // _HUGE) * _HUGE
    return start, max(start, (t.data_ptr() + nbytes) // _HUGE * _HUGE)


def _zero_timed(at: int, size: int) -> float:
    """Zero ``size`` bytes at ``at`` (their first touch); bytes per second."""
    began = time.perf_counter()
    ctypes.memset(at, 0, size)
    return size / max(time.perf_counter() - began, 1e-9)


def _advise_and_zero(start: int, end: int) -> None:
    """Ask for huge pages over ``[start, end)`` and zero it chunk by chunk, timing each chunk: the first one
    slower than ``SLOW_BYTES_PER_S`` has the next chunk touched in ordinary pages, and when those come
    ``COMPACTION_RATIO`` times faster the rest (and later buffers) take ordinary pages; else huge pages were
    not what was slow, and the rest keeps them unchecked."""
    global _huge_pages_slow
    assert _madvise_fn is not None
    _madvise_fn(start, end - start, _MADV_HUGEPAGE)  # advisory: a refusal leaves 4 KB pages
    at, checking = start, True
    while at < end:
        size = min(CHUNK_BYTES, end - at)
        rate = _zero_timed(at, size)
        at += size
        if checking and at < end and rate < SLOW_BYTES_PER_S:
            checking = False
            size = min(CHUNK_BYTES, end - at)
            _madvise_fn(at, size, _MADV_NOHUGEPAGE)
            ordinary = _zero_timed(at, size)
            at += size
            if ordinary >= COMPACTION_RATIO * rate:
                _huge_pages_slow = True
                _madvise_fn(at, end - at, _MADV_NOHUGEPAGE)
                ctypes.memset(at, 0, end - at)
                return


def empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """``torch.empty`` on the CPU, in huge pages where the kernel grants them quickly (see the module
    docstring); a large buffer comes back already touched (its interior zeroed)."""
    t = torch.empty(shape, dtype=dtype)
    start, end = _interior(t)
    if _madvise_fn is not None and end - start >= 2 * _HUGE and not _huge_pages_slow:
        _advise_and_zero(start, end)
    return t


def huge_pages_measured_slow() -> bool:
    """Whether this process found huge-page faults too slow and stopped asking for them."""
    return _huge_pages_slow


def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    t = torch.empty(shape, dtype=dtype)
    start, end = _interior(t)
    if _madvise_fn is None or end - start < 2 * _HUGE or _huge_pages_slow:
        return t.zero_()
    _advise_and_zero(start, end)
    head, tail = start - t.data_ptr(), t.data_ptr() + t.numel() * t.element_size() - end
    ctypes.memset(t.data_ptr(), 0, head)
    ctypes.memset(end, 0, tail)
    return t
