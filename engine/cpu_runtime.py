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
- **Cores another process takes.** Passive waiting makes a descheduled thread cheap, not free: a team of
  two on two cores beside one busy process still ran each region at the pace of the thread that shared
  its core, and every region's wake-up waited for that core's next slice. On a 2-vCPU Xeon (family 6
  model 167, bf16 on AMX) the contended bench ran at 0.24 of its idle rate, where one thread alone on
  the free core ran at 0.77. :class:`CoreShare` measures, about once a second, how many of our CPUs'
  worth of time other processes used (``/proc/stat`` busy and steal time, less this process's own CPU
  time) and fits the team to the cores they leave: ``torch.set_num_threads``, which the C kernels and
  oneDNN follow.
- **Freed memory handed back to the kernel.** A step allocates its activations fresh (a 2048-token prefill
  step's fp32 rows are 5-25 MB a tensor), and glibc returns large freed blocks to the kernel: blocks over
  its mmap threshold are unmapped, and a freed heap top over its trim threshold is released. The next
  step's tensors then fault in their pages one at a time, zeroed, inside the kernels' parallel regions.
  Measured on a 2-vCPU AMD EPYC Zen 5 (compass, no drafts): fp32 739k page faults and 3.0 s of system time
  in a 30 s run, bf16 63k; with :func:`keep_freed_memory` 115 and 57, fp32 304 -> 319-357 tok/s, its
  2048-row RMSNorm 1.56 -> 0.69 ms and its prefill matmuls 10-30 % faster.
"""

from __future__ import annotations

import ctypes
import functools
import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

WAIT_DEFAULTS = {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "30000"}
CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_STAT = Path("/proc/stat")


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


def busy_cpu_seconds(cpus: set[int], stat_text: str) -> float:
    """Seconds the given CPUs were not idle since boot, from ``/proc/stat``'s ``cpuN`` lines: user, nice,
    system, irq, softirq, and steal (time the hypervisor gave this vCPU to another guest is time this
    process could not have had either)."""
    ticks_per_s = os.sysconf("SC_CLK_TCK")
    ticks = 0
    for line in stat_text.splitlines():
        name, _, rest = line.partition(" ")
        if not name.startswith("cpu") or not name[3:].isdigit() or int(name[3:]) not in cpus:
            continue
        user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in rest.split()[:8])
        ticks += user + nice + system + irq + softirq + steal
    return ticks / ticks_per_s


class CoreShare:
    """Fits the engine's thread count to the cores other processes leave free, re-measured every
    ``interval_s`` and changed only after two readings agree (one burst of a neighbour, a compile or a
    cron job, does not halve the team).

    Others' load is ``busy(our CPUs) - our CPU time`` over the interval, in cores; a neighbour using at
    least half a core takes that core (a thread that gets half its core makes a barrier-bound team no
    faster than one thread fewer). Off where it cannot judge: one thread, no ``/proc/stat``, or a cgroup
    quota below the affinity mask (the quota is the limit there, and other tenants' use of the host's
    CPUs says nothing about it)."""

    def __init__(
        self,
        max_threads: int,
        *,
        interval_s: float = 1.0,
        read_busy: Callable[[], float] | None = None,
        read_own: Callable[[], float] = time.process_time,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_threads = max_threads
        self.threads = max_threads
        self.interval_s = interval_s
        self.others_cores = 0.0  # the last reading: other processes' load on our CPUs, in cores
        self._read_own, self._clock = read_own, clock
        try:
            cpus = os.sched_getaffinity(0)
        except (AttributeError, OSError):
            cpus = set(range(os.cpu_count() or 1))
        self._num_cpus = len(cpus)
        if read_busy is None:
            read_busy = lambda: busy_cpu_seconds(cpus, PROC_STAT.read_text())
        self._read_busy = read_busy
        self.enabled = max_threads > 1 and usable_cpus() == self._num_cpus
        self._pending: int | None = None
        self._last: tuple[float, float, float] | None = None
        if self.enabled:
            try:
                self._last = (clock(), read_busy(), read_own())
            except (OSError, ValueError):
                self.enabled = False

    def poll(self) -> int | None:
        """The thread count to switch to, when it should change now; else None. Cheap between readings."""
        if not self.enabled or self._last is None:
            return None
        now = self._clock()
        then, busy0, own0 = self._last
        if now - then < self.interval_s:
            return None
        try:
            busy, own = self._read_busy(), self._read_own()
        except (OSError, ValueError):
            self.enabled = False
            return None
        self._last = (now, busy, own)
        self.others_cores = max(0.0, ((busy - busy0) - (own - own0)) / (now - then))
        free = self._num_cpus - math.floor(self.others_cores + 0.5)
        target = max(1, min(self.max_threads, free))
        if target == self.threads:
            self._pending = None
            return None
        if self._pending != target:
            self._pending = target
            return None
        self.threads, self._pending = target, None
        return target


MALLOC_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "GLIBC_TUNABLES")
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
MMAP_THRESHOLD_BYTES = 256 << 20  # blocks up to this size come from the heap and are reused, not unmapped
TRIM_THRESHOLD_BYTES = 1 << 30  # free memory kept at the heap top before any is handed back


@functools.cache
def keep_freed_memory() -> bool:
    """Have glibc keep freed memory for reuse instead of handing it back to the kernel (see the module's
    notes: every step's large tensors page-faulted in again); True when set here.

    Blocks up to :data:`MMAP_THRESHOLD_BYTES` (a speculative step's logits: 576 rows x 49152 fp32, 113 MB)
    are taken from the heap, and up to :data:`TRIM_THRESHOLD_BYTES` of free heap top are kept: the process
    holds on to its peak step's memory, as tcmalloc or jemalloc (vLLM's CPU guide preloads one) would. Left
    alone where the operator tuned malloc (any of :data:`MALLOC_ENV`, or another allocator preloaded) and
    outside glibc. Once per process."""
    if any(os.environ.get(name) for name in MALLOC_ENV):
        return False
    if any(name in os.environ.get("LD_PRELOAD", "") for name in ("tcmalloc", "jemalloc", "mimalloc")):
        return False
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018  # glibc only: other libcs' mallopt take other parameters
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(
        mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
    )


def threads_per_rank(ranks: int) -> int:
    """Threads for each of ``ranks`` tensor-parallel ranks on this CPU: :func:`default_threads` shared out
    (at least one each), so N ranks together run as many threads as one engine would."""
    return max(1, default_threads() // max(1, ranks))


configure_openmp_waiting()  # at import: engine/__init__.py imports this module before anything loads torch
