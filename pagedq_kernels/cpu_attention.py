"""The CPU paged-attention kernels (``csrc/cpu_attention.c``: decode and prefill), called through ctypes.

Built on first use by :mod:`pagedq_kernels.c_build`. Where no compiler is available the engine falls back
to the torch path (``available()`` says which), so nothing breaks, it is only slower.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch

from pagedq_kernels import c_build, cpu_isa, kernel_call
from pagedq_kernels.kv_cache import write_kv_cache_torch

_NAME = "cpu_attention"


def _bind(lib: ctypes.CDLL) -> None:
    i64, ptr, f32, c_int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int
    # Both kernels start with (q, q_tok, q_head, k_cache, v_cache, out) and take the same shapes and scale
    # (num_seqs, max_blocks, num_heads, num_kv_heads, head_dim, block_size, scale) after their own arguments.
    query_and_cache: list[Any] = [ptr, i64, i64, ptr, ptr, ptr]  # what _query_and_cache passes
    shapes_and_scale: list[Any] = [i64, i64, i64, i64, i64, i64, f32]
    # Then kv_bf16 (the caches hold bfloat16, else float32).
    # + rows, seq_lens, block_tables, q_lens; kv_bf16, use_dp (dp_attention_enabled), cascade, num_threads
    decode = lib.paged_decode_attention_f32
    decode.argtypes = [*query_and_cache, ptr, ptr, ptr, ptr, *shapes_and_scale, c_int, c_int, c_int, c_int]
    decode.restype = c_int
    lib.paged_decode_multi_query_supported.argtypes = [c_int]
    lib.paged_decode_multi_query_supported.restype = c_int
    # + q_starts, q_lens, seq_lens, block_tables; kv_bf16, use_dp (dp_attention_enabled), num_threads
    prefill = lib.paged_prefill_attention_f32
    prefill.argtypes = [*query_and_cache, ptr, ptr, ptr, ptr, *shapes_and_scale, c_int, c_int, c_int]
    prefill.restype = None
    lib.prefill_flash_tiles.argtypes = [i64]
    lib.prefill_flash_tiles.restype = ctypes.c_int
    lib.write_kv_cache_f32.argtypes = [ptr, i64, ptr, i64, ptr, ptr, ptr, i64, i64, c_int]
    lib.write_kv_cache_f32.restype = None
    lib.decode_cascade_blocks.argtypes = [ptr, ptr, i64, i64, i64, i64, i64, i64]
    lib.decode_cascade_blocks.restype = i64


Caches = Sequence[tuple[torch.Tensor, torch.Tensor]]
"""``(k_cache, v_cache)`` per layer, all of one shape, dtype and layout."""


def _over_caches(
    function: Callable[..., int | None], head: tuple[object, ...], tail: tuple[object, ...], caches: Caches, what: str
) -> list[kernel_call.KernelCall]:
    """One call of ``function`` per layer: ``head``, the layer's two cache addresses, ``tail``. Every kernel here
    takes the caches in one place of its argument list, so a step's calls for all layers differ only there and
    their arguments are worked out once."""
    return [kernel_call.KernelCall(function, (*head, k.data_ptr(), v.data_ptr(), *tail), what) for k, v in caches]


def _query(q: torch.Tensor) -> tuple[int, int, int]:
    """The arguments both attention kernels start with: q's pointer, token and head strides."""
    return q.data_ptr(), q.stride(0), q.stride(1)


def _shapes_and_scale(
    num_seqs: int, block_tables: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor, scale: float
) -> tuple[int, int, int, int, int, int, float]:
    """The arguments both kernels take after their own: num_seqs, max_blocks, num_heads, num_kv_heads,
    head_dim, block_size (caches ``[num_blocks, block_size, KVH, D]``), scale."""
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    return num_seqs, block_tables.shape[1], q.shape[1], num_kv_heads, head_dim, block_size, scale


KV_DTYPES = (torch.float32, torch.bfloat16)
"""What the caches may hold: bf16 rows are widened to fp32 (exactly) as the kernels read them, except in the
kernels' bf16 dot-product paths (:func:`dp_attention_enabled`), which multiply them as bf16."""


def _kv_bf16(k_cache: torch.Tensor, v_cache: torch.Tensor) -> int:
    if k_cache.dtype != v_cache.dtype or k_cache.dtype not in KV_DTYPES:
        raise TypeError(f"KV caches must both be float32 or bfloat16, got {k_cache.dtype} and {v_cache.dtype}")
    return int(k_cache.dtype == torch.bfloat16)


DISABLE_DP_ENV = "PAGEDQ_DISABLE_DP_ATTENTION"
"""Set (to anything non-empty) to keep the bf16 cache's attention on fp32 arithmetic where VDPBF16PS runs."""


def dp_attention_enabled(kv_dtype: torch.dtype) -> bool:
    """Whether the C attention (decode and prefill) over a ``kv_dtype`` cache runs its products on AVX512-bf16
    dot products (VDPBF16PS): a bf16 cache, AVX512-bf16 probed runnable and allowed by the ``PAGEDQ_CPU_ISA``
    cap, the avx512 kernel build, and not switched off by ``PAGEDQ_DISABLE_DP_ATTENTION`` (then K/V are
    widened to fp32 and multiplied in fp32, as over an fp32 cache). It rounds q (scaled) and the softmax numerators to
    bf16 (as bf16 flash attention does; max, sums and normalisation stay fp32): results differ from the fp32
    arithmetic path by that rounding, ~1e-3 relative. Not where the dot products multiply slower than fp32 FMAs
    (``CpuIsa.bf16_products_on_fma``): on an Intel Xeon (family 6 model 207, rate 0.5) compass in bf16 without
    drafts ran 237.6 tok/s with them and 276.5 on the fp32-arithmetic task. Asked on every call, so the cap and the
    switch may move."""
    isa = cpu_isa.current()
    return (
        kv_dtype == torch.bfloat16
        and not os.environ.get(DISABLE_DP_ENV)
        and isa.bf16_matmul
        and not isa.bf16_products_on_fma
        and c_build.variant() == "avx512"
    )


def write_kv_cache(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """:func:`pagedq_kernels.kv_cache.write_kv_cache_torch` in one C call: ``k, v [N, KVH, D]`` float32 (each token's
    KVH x D values contiguous, tokens at any stride: views of the qkv output) into float32 or bf16 caches,
    rounded as torch rounds; anything else goes to the torch reference."""
    if not write_kv_cache_supported(k, v, k_cache, v_cache, slot_mapping):
        write_kv_cache_torch(k, v, k_cache, v_cache, slot_mapping)
        return
    kernel_call.run((write_kv_cache_call(k, v, k_cache, v_cache, slot_mapping),))


def write_kv_cache_supported(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> bool:
    """Whether :func:`write_kv_cache` makes its C call on these tensors (else it takes the torch reference)."""
    num_kv_heads, head_dim = k_cache.shape[-2:]
    return (
        c_build.load(_NAME, _bind) is not None
        and k.dtype == v.dtype == torch.float32
        and k.device.type == v.device.type == k_cache.device.type == "cpu"
        and k_cache.dtype == v_cache.dtype
        and k_cache.dtype in KV_DTYPES
        and k_cache.is_contiguous()
        and v_cache.is_contiguous()
        and slot_mapping.dtype == torch.int64
        and slot_mapping.is_contiguous()
        and all(
            t.dim() == 3 and t.shape[1:] == (num_kv_heads, head_dim) and t.stride(2) == 1 and t.stride(1) == head_dim
            for t in (k, v)
        )
        and k.shape[0] == v.shape[0] == slot_mapping.shape[0]
    )


def write_kv_cache_call(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> kernel_call.KernelCall:
    """The C call of :func:`write_kv_cache` on tensors :func:`write_kv_cache_supported` accepted."""
    return write_kv_cache_calls(k, v, [(k_cache, v_cache)], slot_mapping)[0]


def write_kv_cache_calls(
    k: torch.Tensor, v: torch.Tensor, caches: Caches, slot_mapping: torch.Tensor
) -> list[kernel_call.KernelCall]:
    """:func:`write_kv_cache_call` into each layer's caches (a plan asks :func:`write_kv_cache_supported` once, for
    the first layer's)."""
    lib = c_build.load(_NAME, _bind)
    assert lib is not None, "ask write_kv_cache_supported() first"
    k_cache, v_cache = caches[0]
    num_kv_heads, head_dim = k_cache.shape[-2:]
    head = (k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0))
    tail = (slot_mapping.data_ptr(), k.shape[0], num_kv_heads * head_dim, _kv_bf16(k_cache, v_cache))
    return _over_caches(lib.write_kv_cache_f32, head, tail, caches, "KV cache write")


def available() -> bool:
    """Build (once) and report whether the kernel can be used in this process."""
    return c_build.load(_NAME, _bind) is not None


def decode_call(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    rows: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    cascade: bool = True,
    q_lens: torch.Tensor | None = None,
    use_dp: bool | None = None,
) -> kernel_call.KernelCall:
    """The call that writes into ``out[rows]`` the attention of the single-token queries ``q[rows]`` over their
    contexts.

    With ``q_lens`` (int32, contiguous; only where :func:`multi_query_supported`), sequence ``i`` has
    ``q_lens[i]`` queries, rows ``rows[i]...``, at its last ``q_lens[i]`` positions (causal among them): a
    short prefill chunk or the verification rows of speculative drafts, read like a decode step (each K/V
    row once, in place) instead of through the prefill kernel's tiles.

    ``q [N, H, D]`` float32 with a unit last stride; ``rows`` int64, ``seq_lens``/``block_tables``
    int32, all contiguous CPU tensors; caches contiguous ``[num_blocks, block_size, KVH, D]``, float32
    or bfloat16 (:data:`KV_DTYPES`; the arithmetic is fp32 either way, except that where
    :func:`dp_attention_enabled` a bf16 cache's products run on VDPBF16PS, q and the softmax numerators
    rounded to bf16).
    With ``cascade``, blocks that start every sequence's table (a shared prompt prefix) are attended
    once for all sequences and merged into each (same result; the prefix is read once, not per
    sequence). The kernel finds them itself, so the engine needs no plan for it.

    The kernel refuses (a RuntimeError from :func:`pagedq_kernels.kernel_call.run`) ``q_lens`` where not
    :func:`multi_query_supported`. ``use_dp``: :func:`dp_attention_enabled` as the caller already asked it for
    this step (default: asked here).
    """
    operands = (rows, seq_lens, block_tables, scale)
    return decode_calls(q, [(k_cache, v_cache)], out, *operands, cascade=cascade, q_lens=q_lens, use_dp=use_dp)[0]


def decode_calls(
    q: torch.Tensor,
    caches: Caches,
    out: torch.Tensor,
    rows: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    cascade: bool = True,
    q_lens: torch.Tensor | None = None,
    use_dp: bool | None = None,
) -> list[kernel_call.KernelCall]:
    """:func:`decode_call` over each layer's caches."""
    lib = c_build.load(_NAME, _bind)
    assert lib is not None, "call available() first"
    k_cache, v_cache = caches[0]
    if use_dp is None:
        use_dp = dp_attention_enabled(k_cache.dtype)
    tail = (
        out.data_ptr(),
        rows.data_ptr(),
        seq_lens.data_ptr(),
        block_tables.data_ptr(),
        q_lens.data_ptr() if q_lens is not None else None,
        *_shapes_and_scale(rows.shape[0], block_tables, q, k_cache, scale),
        _kv_bf16(k_cache, v_cache),
        int(use_dp),
        int(cascade),
        torch.get_num_threads(),
    )
    what = "paged decode attention (q_lens need multi_query_supported())"
    return _over_caches(lib.paged_decode_attention_f32, _query(q), tail, caches, what)


paged_decode_attention = kernel_call.immediate(decode_call, "paged_decode_attention")
""":func:`decode_call`, made at once."""


def multi_query_supported(kv_dtype: torch.dtype) -> bool:
    """Whether :func:`paged_decode_attention` takes ``q_lens`` for a cache of ``kv_dtype`` here (the avx512
    build, whose decode task reads either cache dtype in place)."""
    lib = c_build.load(_NAME, _bind)
    return lib is not None and bool(lib.paged_decode_multi_query_supported(int(kv_dtype == torch.bfloat16)))


def cascade_blocks(seq_lens: torch.Tensor, block_tables: torch.Tensor, k_cache: torch.Tensor, num_heads: int) -> int:
    """How many leading blocks :func:`paged_decode_attention` attends once for all these sequences.

    0 when they share none, are fewer than the kernel's minimum, or the cascade path does not run
    here (no AVX2, ``head_dim % 16 != 0``). Same inputs as the kernel's.
    """
    lib = c_build.load(_NAME, _bind)
    if lib is None:
        return 0
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    return int(
        lib.decode_cascade_blocks(
            seq_lens.data_ptr(),
            block_tables.data_ptr(),
            seq_lens.shape[0],
            block_tables.shape[1],
            block_size,
            num_heads,
            num_kv_heads,
            head_dim,
        )
    )


def flash_tiles(head_dim: int) -> bool:
    """Whether prefill runs on flash tiles for this head size (AVX2 and up, head_dim % 16 == 0), and so whether
    decode steps can attend a shared prefix once (:func:`cascade_blocks`); elsewhere prefill takes one query row
    at a time, as decode does, and each sequence reads its whole context."""
    lib = c_build.load(_NAME, _bind)
    return lib is not None and bool(lib.prefill_flash_tiles(head_dim))


def prefill_call(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    q_starts: torch.Tensor,
    q_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    use_dp: bool | None = None,
) -> kernel_call.KernelCall:
    """The call of the causal attention of each sequence's new queries over its whole context, read from the cache.

    Sequence ``i``'s ``q_lens[i]`` queries are rows ``q_starts[i]...`` of ``q [N, H, D]``, at the last
    ``q_lens[i]`` of its ``seq_lens[i]`` positions (their K/V already written to the cache); results go
    to the same rows of ``out [N, H, D]`` (contiguous). ``q_starts`` int64, the rest int32, contiguous.
    Over a bf16 cache where :func:`dp_attention_enabled`, q and the softmax numerators are rounded to bf16 for
    the products (bf16 flash attention's numerics); otherwise the arithmetic is fp32.
    ``use_dp`` as for :func:`decode_call`. Any head size (:func:`flash_tiles` says which path); ask
    :func:`available` first.
    """
    operands = (q_starts, q_lens, seq_lens, block_tables, scale)
    return prefill_calls(q, [(k_cache, v_cache)], out, *operands, use_dp=use_dp)[0]


def prefill_calls(
    q: torch.Tensor,
    caches: Caches,
    out: torch.Tensor,
    q_starts: torch.Tensor,
    q_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    use_dp: bool | None = None,
) -> list[kernel_call.KernelCall]:
    """:func:`prefill_call` over each layer's caches."""
    lib = c_build.load(_NAME, _bind)
    assert lib is not None, "call available() first"
    k_cache, v_cache = caches[0]
    if use_dp is None:
        use_dp = dp_attention_enabled(k_cache.dtype)
    tail = (
        out.data_ptr(),
        q_starts.data_ptr(),
        q_lens.data_ptr(),
        seq_lens.data_ptr(),
        block_tables.data_ptr(),
        *_shapes_and_scale(q_starts.shape[0], block_tables, q, k_cache, scale),
        _kv_bf16(k_cache, v_cache),
        int(use_dp),
        torch.get_num_threads(),
    )
    return _over_caches(lib.paged_prefill_attention_f32, _query(q), tail, caches, "paged prefill attention")


paged_prefill_attention = kernel_call.immediate(prefill_call, "paged_prefill_attention")
""":func:`prefill_call`, made at once."""
