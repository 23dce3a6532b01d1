"""Which SIMD instruction sets this process can run: probed by running them, then capped by the operator.

The machines pagedq lands on change from day to day, as users' servers do: an AVX2-only AMD one day, an
Intel with AVX-512, AVX512-bf16 and AMX the next. The C kernels are built once per instruction-set
*variant* (``generic``, ``avx2``, ``avx512``; :mod:`pagedq_kernels.c_build`) and the best variant this CPU runs
is loaded, instead of compiling for ``-march=native`` and hoping the build machine is the run machine.

Flags in ``/proc/cpuinfo`` are not proof: a KVM guest listed ``amx_tile`` and a llama.cpp built for AMX
died with SIGILL on ``tilezero``. So each feature is probed by executing its instructions in a child
process (``csrc/isa_probe.c``): a refused instruction kills only the child. AMX also needs the kernel's
permission for tile state (``arch_prctl(ARCH_REQ_XCOMP_PERM)``), which the probe asks for as a process
using AMX must.

``PAGEDQ_CPU_ISA`` caps the level (``generic`` < ``avx2`` < ``avx512`` < ``avx512_bf16`` < ``amx``), so
that every slower path can run, and be tested, on a machine that has a faster one. ``avx512_bf16`` is probed
with AVX512-VNNI beside it (the lm_head's int8 screen, :mod:`pagedq_kernels.argmax_screen`): every CPU with the
first has the second.
"""

from __future__ import annotations

import functools
import math
import os
import platform
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

ENV_CAP = "PAGEDQ_CPU_ISA"
LEVELS: tuple[str, ...] = ("generic", "avx2", "avx512", "avx512_bf16", "amx")
"""Ordered: each level is only claimed when every level before it runs too (a CPU with AMX and without
AVX512-bf16 does not exist; requiring the chain keeps the cap a single number)."""

Variant = Literal["generic", "avx2", "avx512", "native"]
VARIANTS: tuple[Variant, ...] = ("generic", "avx2", "avx512")
"""Kernel build variants on x86-64, slowest first; ``native`` is the one build on other architectures."""

PROBE_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class CpuIsa:
    """The instruction-set levels this process may use: those probed runnable, up to the cap."""

    probed: tuple[str, ...]  # runnable levels, in LEVELS order
    cap: str | None  # PAGEDQ_CPU_ISA, if set

    @property
    def levels(self) -> tuple[str, ...]:
        if self.cap is None:
            return self.probed
        return tuple(level for level in self.probed if LEVELS.index(level) <= LEVELS.index(self.cap))

    @property
    def best(self) -> str:
        """The highest level in use (``generic`` when nothing beyond baseline runs)."""
        return self.levels[-1] if self.levels else "generic"

    @property
    def kernel_variant(self) -> Variant:
        """Which build of the C kernels to load."""
        if not is_x86_64():
            return "native"
        if "avx512" in self.levels:
            return "avx512"
        return "avx2" if "avx2" in self.levels else "generic"

    @property
    def bf16_matmul(self) -> bool:
        """bf16 products with fp32 accumulation in hardware (AMX tiles or AVX512-bf16 dot products; AMX is only
        claimed above AVX512-bf16, :data:`LEVELS`), and so whether ``dtype=auto`` takes bf16. Where the dot products
        multiply slower than fp32 FMAs (:attr:`bf16_products_on_fma`), pagedq's bf16 kernels run the same sums on the
        FMAs, so bf16 weights and KV cache still halve the bytes a step streams at fp32's FLOP rate: on an Intel Xeon
        (family 6 model 207, AMX not exposed; rate 0.5) compass without drafts ran 199 tok/s in fp32 against 178 in
        bf16 on the dot products, and 207.7 in fp32 against 276.5 in bf16 once the products moved to the FMAs."""
        return "avx512_bf16" in self.levels

    @property
    def bf16_products_on_fma(self) -> bool:
        """Whether pagedq's bf16 kernels run their products on fp32 FMAs rather than on AVX512-bf16 dot products:
        where those multiply slower than FMAs (:func:`bf16_dot_rate` under :data:`BF16_RATE_FLOOR`) and AMX does not
        run. The matmul (``csrc/cpu_bf16_dp.c``) widens the weights in registers and gives the same floats either
        way; attention over a bf16 cache takes its fp32-arithmetic task (``cpu_attention.dp_attention_enabled``)."""
        if "amx" in self.levels or not self.bf16_matmul:
            return False
        rate = bf16_dot_rate()
        return rate is not None and rate < BF16_RATE_FLOOR

    @property
    def runnable_variants(self) -> tuple[Variant, ...]:
        """Every kernel variant this process can run (tests run each one)."""
        if not is_x86_64():
            return ("native",)
        return tuple(v for v in VARIANTS if v == "generic" or v in self.probed)

    def describe(self) -> dict[str, object]:
        """For startup logs, stats and benchmark reports."""
        described: dict[str, object] = {
            "kernel_variant": self.kernel_variant,
            "isa": self.best,
            "probed": list(self.probed),
            "cap": self.cap,
        }
        if "avx512_bf16" in self.probed:
            described["bf16_dot_rate"] = bf16_dot_rate()  # bf16 dot products' FLOP rate over fp32 FMAs'
        return described


@dataclass(frozen=True)
class CpuModel:
    """The core design as ``/proc/cpuinfo`` names it. Never what decides which instructions run (the probe does):
    only tuning choices measured to differ between core designs, such as which register tile a matmul prefers."""

    vendor: str  # cpuid's vendor string: GenuineIntel, AuthenticAMD
    family: int
    model: int


def first_processor(cpuinfo: str) -> dict[str, str]:
    """The ``key: value`` lines of the first processor's stanza of a ``/proc/cpuinfo`` text (the bench's CPU line,
    ``ops/bench/host_cpu.py``, reads it too)."""
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        if not line.strip():
            if fields:
                break
            continue
        key, sep, value = line.partition(":")
        if sep:
            fields.setdefault(key.strip(), value.strip())
    return fields


@functools.cache
def cpu_model() -> CpuModel | None:
    """This CPU's vendor, family and model from ``/proc/cpuinfo``'s first processor; None where it cannot be read."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as cpuinfo:
            fields = first_processor(cpuinfo.read())
        return CpuModel(fields["vendor_id"], int(fields["cpu family"]), int(fields["model"]))
    except (OSError, KeyError, ValueError):
        return None


@functools.cache
def is_x86_64() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")


_by_cap: dict[str | None, CpuIsa] = {}  # current() per raw PAGEDQ_CPU_ISA value


def current() -> CpuIsa:
    """What this process may use now: the probe (run once per process) under the cap read from the
    environment each call, so a test can switch the cap without restarting. Kernel wrappers ask on every
    call (through c_build.load): one dict lookup per distinct cap value, where parsing it each time cost
    ~14 us a call, 0.7 s of a 20 s bench run."""
    raw = os.environ.get(ENV_CAP)
    isa = _by_cap.get(raw)
    if isa is None:
        cap = raw.strip().lower() if raw else None
        if cap is not None and cap not in LEVELS:
            raise ValueError(f"{ENV_CAP}={cap!r} is not one of {', '.join(LEVELS)}")
        isa = _by_cap[raw] = CpuIsa(probed=probe(), cap=cap)
    return isa


@functools.cache
def probe() -> tuple[str, ...]:
    """The levels whose instructions ran in a child process, in order, stopping at the first that failed.
    Empty on other architectures, or when the probe cannot be built (no C compiler): baseline only."""
    if not is_x86_64():
        return ()
    from pagedq_kernels import c_build  # c_build imports this module: import here, not at the top

    exe = c_build.build_executable("isa_probe")
    if exe is None:
        return ()
    runnable: list[str] = []
    for level in LEVELS[1:]:
        result = _run_probe(exe, level)
        if result is None or result.returncode != 0:  # SIGILL shows as -4; 2: the kernel refused AMX tile state
            break
        runnable.append(level)
    _cap_onednn(tuple(runnable))
    return tuple(runnable)


def _run_probe(exe: Path, command: str) -> subprocess.CompletedProcess[str] | None:
    """The probe's child run on one command (a level to try, or ``bf16_rate``), or None where it could not start or
    outlived :data:`PROBE_TIMEOUT_S` (a hung child is killed)."""
    try:
        return subprocess.run(
            [str(exe), command], capture_output=True, text=True, errors="replace", timeout=PROBE_TIMEOUT_S
        )
    except (OSError, subprocess.TimeoutExpired):
        return None


BF16_RATE_FLOOR = 1.0
"""The least :func:`bf16_dot_rate` at which the bf16 kernels multiply on the dot products, not on fp32 FMAs
(:attr:`CpuIsa.bf16_products_on_fma`). An Intel Xeon without AMX (family 6 model 207) times 0.50; AMD Zen 4 and
Zen 5, whose bf16 matmul peak the bench measured at about twice their fp32 one (README runs 29-37), are expected
near 2 (one dot product per FMA slot, twice the products; not yet timed by this probe): far on either side of 1."""


@functools.cache
def bf16_dot_rate() -> float | None:
    """The FLOP rate of AVX512-bf16 dot products over that of fp32 FMAs on this core, timed once per process in the
    probe's child (``isa_probe bf16_rate``, a few milliseconds), or None where AVX512-bf16 did not run or the timing
    failed. Run on demand (``dtype=auto``, reports), not by :func:`probe`."""
    if "avx512_bf16" not in probe():
        return None
    from pagedq_kernels import c_build

    exe = c_build.build_executable("isa_probe")
    if exe is None:
        return None
    result = _run_probe(exe, "bf16_rate")
    try:
        rate = float(result.stdout.strip()) if result is not None and result.returncode == 0 else None
    except ValueError:
        return None
    return rate if rate is not None and rate > 0 else None


def fma_gflops(threads: int) -> float | None:
    """fp32 FMAs on registers alone, GFLOP/s summed over ``threads`` probe children run at once (one per thread,
    ``isa_probe fma_rate_<level>``, ~0.2 s), at the widest level the probe ran under the cap: the cores' own peak,
    which no cache or memory sharing moves. None without AVX2 or a compiler, or when a child failed. For the
    bench's report, beside the matmul peak over the model's shapes."""
    level = current().kernel_variant  # the widest of avx512 / avx2 that runs under the cap, as the kernels load
    if level not in ("avx512", "avx2") or threads < 1:
        return None
    from pagedq_kernels import c_build

    exe = c_build.build_executable("isa_probe")
    if exe is None:
        return None
    try:
        children = [
            subprocess.Popen([str(exe), f"fma_rate_{level}"], stdout=subprocess.PIPE, text=True) for _ in range(threads)
        ]
    except OSError:
        return None
    total = 0.0
    for child in children:
        try:
            out, _ = child.communicate(timeout=PROBE_TIMEOUT_S)
            total += float(out.strip()) if child.returncode == 0 else math.nan
        except (subprocess.TimeoutExpired, ValueError):
            child.kill()
            child.communicate()
            total = math.nan
    return round(total, 1) if math.isfinite(total) and total > 0 else None


# oneDNN's names for the levels: the most it may use when the probe stopped short of what the flags claim.
_ONEDNN_ISA = {"avx2": "AVX2", "avx512": "AVX512_CORE", "avx512_bf16": "AVX512_CORE_BF16"}


def _cap_onednn(runnable: tuple[str, ...]) -> None:
    """oneDNN (bf16 and int8 matmuls) picks its kernels from cpuid alone, so on a guest that lists AMX but
    faults on it, its AMX kernels would kill the process. Where the probe found a level fail that the flags
    claim, ``ONEDNN_MAX_CPU_ISA`` caps oneDNN at the last level that ran (an operator's own setting wins).
    oneDNN reads the variable when it first dispatches: the engine probes before it multiplies anything."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as cpuinfo:
            flags = next((line.split(":", 1)[1].split() for line in cpuinfo if line.startswith("flags")), [])
    except OSError:
        return
    claimed_amx = "amx_tile" in flags
    if runnable and claimed_amx and "amx" not in runnable and runnable[-1] in _ONEDNN_ISA:
        os.environ.setdefault("ONEDNN_MAX_CPU_ISA", _ONEDNN_ISA[runnable[-1]])
