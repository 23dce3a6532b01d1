"""The CPU paged-attention kernels (``csrc/cpu_attention.c``: decode and prefill), called through ctypes.

Built on first use by :mod:`kernels.c_build`. Where no compiler is available the engine falls back
to the torch path (``available()`` says which), so nothing breaks, it is only slower.
"""

from __future__ import annotations

import ctypes

import torch

from kernels import c_build

_NAME = "cpu_attention"


def _bind(lib: ctypes.CDLL) -> None:
    fn = lib.paged_decode_attention_f32
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn.argtypes = [ptr, i64, i64, ptr, ptr, ptr, ptr, ptr, ptr,
                   i64, i64, i64, i64, i64, i64, ctypes.c_float, ctypes.c_int]
    fn.restype = None
    fn = lib.paged_prefill_attention_f32
    fn.argtypes = [ptr, i64, i64, ptr, ptr, ptr, ptr, ptr, ptr, ptr,
                   i64, i64, i64, i64, i64, i64, ctypes.c_float, ctypes.c_int]
    fn.restype = None
    lib.paged_prefill_attention_supported.argtypes = [i64]
    lib.paged_prefill_attention_supported.restype = ctypes.c_int


def available() -> bool:
    """Build (once) and report whether the kernel can be used in this process."""
    return c_build.load(_NAME, _bind) is not None


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
    lib = c_build.load(_NAME, _bind)
    assert lib is not None, "call available() first"
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    del num_blocks
    lib.paged_decode_attention_f32(
        q.data_ptr(), q.stride(0), q.stride(1),
        k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(),
        rows.data_ptr(), seq_lens.data_ptr(), block_tables.data_ptr(),
        rows.shape[0], block_tables.shape[1], q.shape[1], num_kv_heads, head_dim, block_size,
        scale, torch.get_num_threads(),
    )


def prefill_supported(head_dim: int) -> bool:
    """Whether :func:`paged_prefill_attention` runs here for this head size (AVX2, head_dim % 16 == 0)."""
    lib = c_build.load(_NAME, _bind)
    return lib is not None and bool(lib.paged_prefill_attention_supported(head_dim))


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    q_starts: torch.Tensor,
    q_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
) -> None:
    """Causal attention of each sequence's new queries over its whole context, read from the cache.

    Sequence ``i``'s ``q_lens[i]`` queries are rows ``q_starts[i]...`` of ``q [N, H, D]``, at the last
    ``q_lens[i]`` of its ``seq_lens[i]`` positions (their K/V already written to the cache); results go
    to the same rows of ``out [N, H, D]`` (contiguous). ``q_starts`` int64, the rest int32, contiguous.
    """
    lib = c_build.load(_NAME, _bind)
    assert lib is not None and prefill_supported(q.shape[-1]), "call prefill_supported() first"
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    lib.paged_prefill_attention_f32(
        q.data_ptr(), q.stride(0), q.stride(1),
        k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(),
        q_starts.data_ptr(), q_lens.data_ptr(), seq_lens.data_ptr(), block_tables.data_ptr(),
        q_starts.shape[0], block_tables.shape[1], q.shape[1], num_kv_heads, head_dim, block_size,
        scale, torch.get_num_threads(),
    )
