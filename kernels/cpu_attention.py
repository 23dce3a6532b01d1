"""The CPU decode-attention kernel (``csrc/cpu_paged_attention.c``), built on first use with the
system C compiler and called through ctypes.

Plain C with OpenMP keeps the build under a second and free of torch's C++ headers; the shared
object is cached per source hash and machine. Where no compiler is available the engine falls
back to the torch path (``available()`` says which), so nothing breaks, it is only slower.
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
from pathlib import Path

import torch

_SOURCE = Path(__file__).parent / "csrc" / "cpu_paged_attention.c"
_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_failed: str | None = None


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(os.environ.get("PAGEDQ_KERNEL_CACHE", Path(base) / "pagedq" / "kernels"))


def _build() -> ctypes.CDLL:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler (cc/gcc) found")
    src = _SOURCE.read_bytes()
    key = hashlib.sha256(src + platform.node().encode() + platform.machine().encode()).hexdigest()[:16]
    target = _cache_dir() / f"cpu_paged_attention-{key}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            out = Path(tmp) / target.name
            cmd = [cc, "-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", str(_SOURCE), "-o", str(out), "-lm"]
            subprocess.run(cmd, check=True, capture_output=True)
            os.replace(out, target)  # atomic: concurrent builders each install a complete file
    lib = ctypes.CDLL(str(target))
    fn = lib.paged_decode_attention_f32
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn.argtypes = [ptr, i64, i64, ptr, ptr, ptr, ptr, ptr, ptr,
                   i64, i64, i64, i64, i64, i64, ctypes.c_float, ctypes.c_int]
    fn.restype = None
    return lib


def available() -> bool:
    """Build (once) and report whether the kernel can be used in this process."""
    global _lib, _failed
    if _lib is not None:
        return True
    if _failed is not None or os.environ.get("PAGEDQ_DISABLE_C_KERNELS"):
        return False
    with _lock:
        if _lib is None and _failed is None:
            try:
                _lib = _build()
            except (OSError, RuntimeError, subprocess.CalledProcessError) as exc:
                _failed = str(exc)
    return _lib is not None


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    rows: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
) -> None:
    """Write into ``out[rows]`` the attention of the single-token queries ``q[rows]`` over their contexts.

    ``q [N, H, D]`` float32 with a unit last stride; ``rows`` int64, ``seq_lens``/``block_tables``
    int32, all contiguous CPU tensors; caches contiguous ``[num_blocks, block_size, KVH, D]``.
    """
    assert _lib is not None, "call available() first"
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    del num_blocks
    _lib.paged_decode_attention_f32(
        q.data_ptr(), q.stride(0), q.stride(1),
        k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(),
        rows.data_ptr(), seq_lens.data_ptr(), block_tables.data_ptr(),
        rows.shape[0], block_tables.shape[1], q.shape[1], num_kv_heads, head_dim, block_size,
        scale, torch.get_num_threads(),
    )
