"""A C kernel call with its arguments bound ahead of time, to be made later, perhaps many times over.

Why: a CPU decode step of a small model is ~200 C kernel calls of a few tens of microseconds each, and
each wrapper in front of one (shape checks, ``torch.empty`` for its output, ``data_ptr()``, the library
lookup) spent ~12 us of Python on top of ctypes' own ~3 us: measured on a 2-vCPU AMD EPYC Zen 4, about 6 ms
of a 17 ms single-sequence decode step. The wrappers in :mod:`pagedq_kernels.cpu_linear`,
:mod:`pagedq_kernels.cpu_ops` and :mod:`pagedq_kernels.cpu_attention` build their calls with the same
functions a whole-step plan (``engine/models/llama_cpu_plan.py``) uses, so an argument list is written once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import NamedTuple, ParamSpec

P = ParamSpec("P")


class KernelCall(NamedTuple):
    """``function(*args)``: a ctypes entry point and its converted arguments. Entry points that return a
    status return 0 on success (the others None): anything else means the kernel refused and wrote nothing."""

    function: Callable[..., int | None]
    args: tuple[object, ...]
    what: str  # the kernel's name, for the error a refusal raises


def run(calls: Iterable[KernelCall]) -> None:
    """Make each call in order; a refusal (a non-zero status) raises a RuntimeError naming the kernel."""
    for function, args, what in calls:
        status = function(*args)
        if status:
            raise RuntimeError(f"the {what} kernel refused the call (status {status})")


def immediate(builder: Callable[P, KernelCall], name: str) -> Callable[P, None]:
    """The function ``name`` that builds its call with ``builder`` and makes it at once: the plain wrapper of a
    kernel whose call a plan may also build ahead, from the one argument list."""

    def call_now(*args: P.args, **kwargs: P.kwargs) -> None:
        run((builder(*args, **kwargs),))

    call_now.__name__ = call_now.__qualname__ = name
    call_now.__doc__ = builder.__doc__
    return call_now
