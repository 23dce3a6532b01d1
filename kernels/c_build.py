"""Building pagedq's C kernels (``kernels/csrc``) on first use with the system C compiler.

Plain C with OpenMP keeps a build under a second and free of torch's C++ headers. Each shared
object is cached per source hash (headers included) and machine, since ``-march=native`` ties it
to this CPU; concurrent builders each install a complete file atomically. Without a compiler, or
with ``PAGEDQ_DISABLE_C_KERNELS`` set, :func:`load` returns None and callers keep their torch path:
nothing breaks, it is only slower.
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

CSRC = Path(__file__).parent / "csrc"
_lock = threading.Lock()
_loaded: dict[str, ctypes.CDLL | None] = {}
_errors: dict[str, str] = {}


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(os.environ.get("PAGEDQ_KERNEL_CACHE", Path(base) / "pagedq" / "kernels"))


def _build(name: str) -> ctypes.CDLL:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler (cc/gcc) found")
    source = CSRC / f"{name}.c"
    digest = hashlib.sha256(source.read_bytes())
    for header in sorted(CSRC.glob("*.h")):
        digest.update(header.read_bytes())
    digest.update(platform.node().encode() + platform.machine().encode())
    target = cache_dir() / f"{name}-{digest.hexdigest()[:16]}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            out = Path(tmp) / target.name
            flags = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", f"-I{CSRC}"]
            cmd = [cc, *flags, str(source), "-o", str(out), "-lm"]
            subprocess.run(cmd, check=True, capture_output=True)
            os.replace(out, target)
    return ctypes.CDLL(str(target))


def load(name: str, bind: Callable[[ctypes.CDLL], None]) -> ctypes.CDLL | None:
    """The compiled ``csrc/<name>.c``, or None if unavailable.

    Built once per process (and cached on disk); ``bind`` declares its functions' ctypes signatures,
    once, before any caller sees the library. Cheap enough to call per kernel launch.
    """
    if name in _loaded:
        return _loaded[name]
    if os.environ.get("PAGEDQ_DISABLE_C_KERNELS"):
        return None
    with _lock:
        if name not in _loaded:
            try:
                lib = _build(name)
                bind(lib)
                _loaded[name] = lib
            except (OSError, RuntimeError, AttributeError, subprocess.CalledProcessError) as exc:
                _errors[name] = str(getattr(exc, "stderr", b"") or exc)
                _loaded[name] = None
    return _loaded[name]


def error(name: str) -> str | None:
    """Why ``name`` could not be built, if it could not."""
    return _errors.get(name)
