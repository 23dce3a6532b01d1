"""The ``contended`` workload: pagedq with one competing CPU-bound process pinned to one of its cores.

Why: a worker rarely has its cores to itself (a container's CPU quota, a shared host, a neighbour's
batch job), and OpenMP teams that spin or barrier per operation collapse when one of their threads is
descheduled: a new user measured small jobs 40x slower on 2 cores with one other busy process, where a
fair share is about 2x. The bench runs the same requests idle and beside a busy loop pinned to the last
core of pagedq's affinity mask, and reports the ratio (target: >= 40 % of the idle run's tok/s).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator

from ops.bench.system import BenchContext, System, SystemResult
from ops.bench.workloads import Workload

BUSY_LOOP = "while True:\n    pass\n"


@contextlib.contextmanager
def competing_process() -> Iterator[int]:
    """A pure-Python busy loop pinned to the last CPU this process may use; yields that CPU."""
    cpus = sorted(os.sched_getaffinity(0))
    cpu = cpus[-1]
    proc = subprocess.Popen([sys.executable, "-c", BUSY_LOOP])
    try:
        os.sched_setaffinity(proc.pid, {cpu})
        yield cpu
    finally:
        proc.kill()
        proc.wait(timeout=10)


class ContendedSystem(System):
    """Another system's run, with :func:`competing_process` busy beside it."""

    def __init__(self, inner: System) -> None:
        self.inner = inner
        self.name = f"{inner.name}-contended"

    def unavailable(self, ctx: BenchContext) -> str | None:
        if not hasattr(os, "sched_setaffinity"):
            return "needs Linux CPU affinity"
        return self.inner.unavailable(ctx)

    def run(self, workload: Workload, ctx: BenchContext) -> SystemResult:
        with competing_process() as cpu:
            ctx.log(f"  {self.name}: a busy loop is pinned to CPU {cpu}")
            result = self.inner.run(workload, ctx)
        result.system = self.name
        return result

    def close(self) -> None:
        """Nothing of its own: the inner system is one of the bench's systems and is closed as such."""
