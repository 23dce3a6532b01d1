"""The CPU a benchmark ran on, named as ``lscpu`` names it, for the line beside every figure.

A model name alone does not say which kernels could run: KVM guests call a Zen 3, a Zen 4 and a Zen 5
all "AMD EPYC", and what separates them is the family and model numbers and the vector flags (AVX-512,
AVX512-bf16, AMX). Those come from ``/proc/cpuinfo`` and the cache sizes from sysfs, the sources ``lscpu``
reads, so the bench needs no ``lscpu`` binary. The flags are what the CPU claims; what the kernels found
runnable is the probe's word (``pagedq_kernels.cpu_isa``), reported beside this.
"""

from __future__ import annotations

import contextlib
import platform
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pagedq_kernels import cpu_isa

# The flags that decide which kernels and dtypes can run, in the order the README writes them.
VECTOR_FLAGS = (
    "avx",
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512dq",
    "avx512bw",
    "avx512vl",
    "avx512_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "avx_vnni",
    "amx_tile",
    "amx_bf16",
    "amx_int8",
)


@dataclass(frozen=True)
class HostCpu:
    """One CPU's identity: name, family/model numbers, the vector flags it lists, its cache sizes."""

    name: str
    family: int | None = None
    model: int | None = None
    vector_flags: tuple[str, ...] = ()
    caches: dict[str, str] = field(default_factory=dict)  # "L1d" -> "32 KiB", per core for L1/L2

    def describe(self) -> str:
        """``AMD EPYC (family 25 model 17; avx2 fma ... avx512_bf16, no AMX; L1d 32 KiB, L2 1 MiB, L3 32 MiB)``."""
        parts = []
        if self.family is not None and self.model is not None:
            parts.append(f"family {self.family} model {self.model}")
        if self.vector_flags:
            flags = " ".join(self.vector_flags)
            if "avx512f" in self.vector_flags and "avx512_bf16" not in self.vector_flags:
                flags += ", no AVX512-bf16"
            if "amx_tile" not in self.vector_flags and "avx512f" in self.vector_flags:
                flags += ", no AMX"
            if "avx512f" not in self.vector_flags:
                flags += ", no AVX-512"
            parts.append(flags)
        if self.caches:
            parts.append(", ".join(f"{level} {size}" for level, size in self.caches.items()))
        return f"{self.name} ({'; '.join(parts)})" if parts else self.name

    def as_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "family": self.family,
            "model": self.model,
            "vector_flags": list(self.vector_flags),
            "caches": dict(self.caches),
            "described": self.describe(),
        }


def _size(text: str) -> str:
    """sysfs's ``32K`` / ``1024K`` / ``32768K`` as ``32 KiB`` / ``1 MiB`` / ``32 MiB``."""
    text = text.strip()
    if text.endswith("K") and text[:-1].isdigit():
        kib = int(text[:-1])
        return f"{kib // 1024} MiB" if kib >= 1024 and kib % 1024 == 0 else f"{kib} KiB"
    return text


def _caches(cpu_dir: Path) -> dict[str, str]:
    """L1d, L2 and L3 of the first CPU, from sysfs (data and unified caches; instruction caches left out)."""
    found: dict[str, str] = {}
    for index in sorted(cpu_dir.glob("cache/index*")):
        with contextlib.suppress(OSError, ValueError):
            level = int((index / "level").read_text())
            kind = (index / "type").read_text().strip()
            if kind == "Instruction":
                continue
            found[f"L{level}{'d' if kind == 'Data' else ''}"] = _size((index / "size").read_text())
    return dict(sorted(found.items()))


def host_cpu(
    cpuinfo_path: Path = Path("/proc/cpuinfo"), sys_cpu: Path = Path("/sys/devices/system/cpu/cpu0")
) -> HostCpu:
    """This machine's CPU; on a system without ``/proc/cpuinfo``, the name Python knows and nothing more."""
    try:
        fields = cpu_isa.first_processor(cpuinfo_path.read_text(encoding="ascii", errors="replace"))
    except OSError:
        return HostCpu(name=platform.processor() or platform.machine())
    flags = set(fields.get("flags", "").split())

    def number(key: str) -> int | None:
        value = fields.get(key, "")
        return int(value) if value.isdigit() else None

    return HostCpu(
        name=fields.get("model name") or platform.processor() or platform.machine(),
        family=number("cpu family"),
        model=number("model"),
        vector_flags=tuple(flag for flag in VECTOR_FLAGS if flag in flags),
        caches=_caches(sys_cpu),
    )
