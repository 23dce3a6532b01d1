"""Building pagedq's C kernels (``pagedq_kernels/csrc``) on first use with the system C compiler.

Plain C with OpenMP keeps a build under a second and free of torch's C++ headers. Each kernel is
built per instruction-set variant (:data:`VARIANT_FLAGS`: baseline x86-64, AVX2/FMA, AVX-512), never
for ``-march=native``, and the variant loaded is the best one this CPU was seen to run
(:mod:`pagedq_kernels.cpu_isa`), under the ``PAGEDQ_CPU_ISA`` cap: a kernel cache copied to, or shared with, an
older CPU stays correct, and every slower path stays testable on a faster machine. Shared objects are
cached per source hash (headers included), variant and flags; concurrent builders each install a
complete file atomically. Without a compiler, or with ``PAGEDQ_DISABLE_C_KERNELS`` set, :func:`load`
returns None and callers keep their torch path: nothing breaks, it is only slower.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

from pagedq_kernels import cpu_isa

CSRC = Path(__file__).parent / "csrc"
VARIANT_FLAGS: dict[cpu_isa.Variant, list[str]] = {
    "generic": ["-march=x86-64", "-mtune=generic"],
    "avx2": ["-march=x86-64-v3", "-mtune=generic"],  # AVX2, FMA, F16C, BMI2
    # AVX-512 F/BW/CD/DQ/VL. 512-bit vectors in auto-vectorised loops too (gcc defaults to 256 for x86-64-v4).
    "avx512": ["-march=x86-64-v4", "-mtune=generic", "-mprefer-vector-width=512"],
    "native": ["-mcpu=native" if platform.machine().lower() in ("aarch64", "arm64") else "-march=native"],
}
_lock = threading.Lock()
_loaded: dict[tuple[str, str], ctypes.CDLL | None] = {}
_errors: dict[tuple[str, str], str] = {}


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(os.environ.get("PAGEDQ_KERNEL_CACHE", Path(base) / "pagedq" / "kernels"))


def _compiler() -> str:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler (cc/gcc) found")
    return cc


def kernel_flags(variant_flags: list[str]) -> list[str]:
    """A kernel library's compiler flags around a variant's (:data:`VARIANT_FLAGS`)."""
    return ["-O3", *variant_flags, "-fopenmp", "-shared", "-fPIC"]


def compile_command(cc: str, name: str, flags: list[str], out: Path) -> list[str]:
    """The command that compiles ``csrc/<name>.c`` with ``flags`` into ``out`` (also the test that cross-compiles the
    kernels for ARM runs it)."""
    return [cc, *flags, f"-I{CSRC}", str(CSRC / f"{name}.c"), "-o", str(out), "-lm"]


def _compile(name: str, flags: list[str], suffix: str) -> Path:
    """``csrc/<name>.c`` compiled with ``flags`` into the cache (once per source, headers and flags)."""
    cc = _compiler()
    source = CSRC / f"{name}.c"
    digest = hashlib.sha256(source.read_bytes())
    for header in sorted(CSRC.glob("*.h")):
        digest.update(header.read_bytes())
    digest.update(" ".join([cc, platform.machine(), *flags]).encode())
    target = cache_dir() / f"{name}-{digest.hexdigest()[:16]}{suffix}"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            out = Path(tmp) / target.name
            subprocess.run(compile_command(cc, name, flags, out), check=True, capture_output=True)
            os.replace(out, target)
    return target


def build_executable(name: str) -> Path | None:
    """A small baseline program (the ISA probe), or None without a compiler."""
    try:
        return _compile(name, ["-O1"], ".exe")
    except (OSError, RuntimeError, subprocess.CalledProcessError):
        return None


def variant() -> cpu_isa.Variant:
    """The kernel variant :func:`load` returns now (the probe under the ``PAGEDQ_CPU_ISA`` cap)."""
    return cpu_isa.current().kernel_variant


def load(name: str, bind: Callable[[ctypes.CDLL], None]) -> ctypes.CDLL | None:
    """The compiled ``csrc/<name>.c`` for this CPU's best variant, or None if unavailable.

    Built once per process and variant (and cached on disk); ``bind`` declares its functions' ctypes
    signatures, once, before any caller sees the library. Cheap enough to call per kernel launch.
    """
    key = (name, variant())
    if key in _loaded:
        return _loaded[key]
    if os.environ.get("PAGEDQ_DISABLE_C_KERNELS"):
        return None
    with _lock:
        if key not in _loaded:
            try:
                lib = ctypes.CDLL(str(_compile(name, kernel_flags(VARIANT_FLAGS[key[1]]), ".so")))
                bind(lib)
                _loaded[key] = lib
            except (OSError, RuntimeError, AttributeError, subprocess.CalledProcessError) as exc:
                _errors[key] = str(getattr(exc, "stderr", b"") or exc)
                _loaded[key] = None
    return _loaded[key]


def amx_runnable() -> bool:
    """AMX probed runnable and allowed by the ``PAGEDQ_CPU_ISA`` cap, in the avx512 build (the only one whose
    sources hold AMX code; csrc/amx_tile.h)."""
    return "amx" in cpu_isa.current().levels and variant() == "avx512"


def load_amx(name: str, bind: Callable[[ctypes.CDLL], None], init: str) -> ctypes.CDLL | None:
    """:func:`load` for a kernel on AMX tiles, once its ``init`` export (the kernel's permission for this
    process's tile data: arch_prctl, csrc/amx_tile.h) returned 0; None without the build or the permission."""
    lib = load(name, bind)
    if lib is None:
        return None
    request = getattr(lib, init)
    request.argtypes, request.restype = [], ctypes.c_int
    return lib if request() == 0 else None


def error(name: str) -> str | None:
    """Why ``name`` could not be built for the current variant, if it could not."""
    return _errors.get((name, variant()))
