"""Writing the new tokens' K/V into the paged cache through the slot mapping: the Triton kernel.

Same contract as ``pagedq_kernels.kv_cache.write_kv_cache_torch``, including its padding rule: a negative
slot marks a padding token (e.g. a CUDA-graph batch padded to a captured size) and is skipped, so
padded batches never scribble over a real cache block.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _write_kv_cache_kernel(
    k_ptr,  # [N, KVH, D]
    v_ptr,  # [N, KVH, D]
    k_cache_ptr,  # [num_blocks, block_size, KVH, D]
    v_cache_ptr,  # [num_blocks, block_size, KVH, D]
    slot_mapping_ptr,  # [N]
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_vcb,
    stride_vcs,
    stride_vch,
    BLOCK_SIZE: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    KV_HEADS_P2: tl.constexpr,
    HEAD_DIM_P2: tl.constexpr,
):
    """One program per token: copy all its KV heads (one [KVH, D] tile each for K and V)."""
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return  # padding token
    block = slot // BLOCK_SIZE
    in_block = slot % BLOCK_SIZE
    h = tl.arange(0, KV_HEADS_P2)[:, None]
    d = tl.arange(0, HEAD_DIM_P2)[None, :]
    mask = (h < NUM_KV_HEADS) & (d < HEAD_DIM)

    k = tl.load(k_ptr + token * stride_kt + h * stride_kh + d, mask=mask)
    v = tl.load(v_ptr + token * stride_vt + h * stride_vh + d, mask=mask)
    k_dst = k_cache_ptr + block * stride_kcb + in_block * stride_kcs + h * stride_kch + d
    v_dst = v_cache_ptr + block * stride_vcb + in_block * stride_vcs + h * stride_vch + d
    tl.store(k_dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv_cache_triton(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store ``k, v [N, KVH, D]`` at ``slot_mapping [N]`` of caches ``[num_blocks, block_size, KVH, D]``.

    In place on the caches (cast to their dtype); tokens with a negative slot are skipped.
    """
    num_tokens = int(slot_mapping.shape[0])
    if num_tokens == 0:
        return
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    if k.shape != (num_tokens, num_kv_heads, head_dim) or v.shape != k.shape:
        raise ValueError(
            f"k {tuple(k.shape)} / v {tuple(v.shape)} do not match {num_tokens} slots and cache {tuple(k_cache.shape)}"
        )
    if v_cache.shape != k_cache.shape or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("k_cache and v_cache must have one shape and a contiguous head_dim")
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    _write_kv_cache_kernel[(num_tokens,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping.contiguous(),
        *k.stride()[:2],
        *v.stride()[:2],
        *k_cache.stride()[:3],
        *v_cache.stride()[:3],
        BLOCK_SIZE=block_size,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        KV_HEADS_P2=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM_P2=triton.next_power_of_2(head_dim),
        num_warps=4,
    )


__all__ = ["write_kv_cache_triton"]
