"""How many threads CPU inference uses, and how its idle threads wait, on a machine shared with others.

A container with a CPU quota, or a host where another process is busy, is the normal case for a worker,
and two defaults of the OpenMP runtime under torch and pagedq's C kernels turn it into a collapse:

- **Thread count.** OpenMP starts one thread per CPU in the affinity mask and ignores the cgroup quota:
  ``--cpus 2`` on a 64-core host gives 64 threads that the kernel's CFS bandwidth control freezes for
  the rest of each 100 ms period once the quota is spent. A decode step is ~300 parallel regions, each
  ending in a barrier that waits for the last thread, so one frozen thread stalls the whole step. Here
  the thread count is the affinity mask's size, capped at the quota rounded *down* (a thread over quota
  is frozen mid-region; one fewer thread is only a bit slower).
- **Waiting.** libgomp's idle threads spin for ~3 ms after each region before sleeping. A thread that
  shares its core with another busy process then never sleeps, so the scheduler gives it ordinary time
  slices of a few ms; every one of a step's regions waits for its next slice. Measured by a new user on
  2 cores with one other busy process: small jobs at 0.73-0.81 tok/s against ~30 on a quiet machine. A
  thread that sleeps instead is woken with the scheduler's wake-up preference and runs within
  microseconds. ``OMP_WAIT_POLICY=PASSIVE`` with a short spin first (``GOMP_SPINCOUNT=30000``, ~0.3 ms;
  the bench measured a futex wake-up before every region at 8-13 % of a quiet run's time) keeps both.
  libgomp reads these when it loads, with torch: :func:`configure_openmp_waiting` runs when ``engine``
  is imported, before torch, and an operator's own values win.
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

WAIT_DEFAULTS = {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "30000"}
CGROUP_ROOT = Path("/sys/fs/cgroup")


def configure_openmp_waiting() -> bool:
    """Set the wait policy (unless the environment has one) while it can still apply; False when torch,
    and with it libgomp, was loaded first (then the process keeps libgomp's defaults)."""
    if "torch" in sys.modules:
        return all(os.environ.get(k) == v for k, v in WAIT_DEFAULTS.items())
    for key, value in WAIT_DEFAULTS.items():
        os.environ.setdefault(key, value)
    return True


def cgroup_cpu_limit(root: Path = CGROUP_ROOT) -> float | None:
    """The CPU quota of this process's cgroup in cores (``--cpus``), or None when unlimited or unknown.
    cgroup v2 (``cpu.max``: ``"<quota> <period>"`` or ``"max <period>"``), then v1 (``cfs_quota_us``)."""
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota_us = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period_us = int((root / "cpu" / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return None if quota_us <= 0 or period_us <= 0 else quota_us / period_us


def usable_cpus(root: Path = CGROUP_ROOT) -> int:
    """CPUs this process may run on at once: the affinity mask, capped by the cgroup quota (rounded down,
    at least 1)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        cpus = os.cpu_count() or 1
    limit = cgroup_cpu_limit(root)
    if limit is not None:
        cpus = min(cpus, max(1, math.floor(limit)))
    return max(1, cpus)


def default_threads() -> int:
    """torch's intra-op threads for the engine: ``OMP_NUM_THREADS`` when the operator set it, else
    :func:`usable_cpus`."""
    explicit = os.environ.get("OMP_NUM_THREADS", "").strip()
    if explicit.isdigit() and int(explicit) > 0:
        return int(explicit)
    return usable_cpus()


def threads_per_rank(ranks: int) -> int:
    """Threads for each of ``ranks`` tensor-parallel ranks on this CPU: :func:`default_threads` shared out
    (at least one each), so N ranks together run as many threads as one engine would."""
    return max(1, default_threads() // max(1, ranks))


configure_openmp_waiting()  # at import: engine/__init__.py imports this module before anything loads torch
