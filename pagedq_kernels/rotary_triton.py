"""Rotary position embedding, neox style (rotate halves): the Triton kernel.

Same contract as ``pagedq_kernels.rotary.rotary_embedding_torch``: ``cos_sin_cache [max_positions, rot_dim]``
holds cos in the first half and sin in the second (scaling already folded in), and the rotation
covers the whole head (``rot_dim == head_dim``). One program per token rotates all its query
and key heads, so the token's cos/sin row is read once for both. Like the reference, cos/sin are
rounded to the query dtype first; the products are then taken in fp32 and rounded once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_heads(
    src,  # this token's first head
    dst,
    stride_src_h,
    stride_dst_h,
    cos,  # [1, HALF_P2] fp32
    sin,
    NUM_HEADS: tl.constexpr,
    HEADS_P2: tl.constexpr,
    HALF: tl.constexpr,
    HALF_P2: tl.constexpr,
):
    h = tl.arange(0, HEADS_P2)[:, None]
    d = tl.arange(0, HALF_P2)[None, :]
    mask = (h < NUM_HEADS) & (d < HALF)
    x1 = tl.load(src + h * stride_src_h + d, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + h * stride_src_h + HALF + d, mask=mask, other=0.0).to(tl.float32)
    out_ty = dst.dtype.element_ty
    tl.store(dst + h * stride_dst_h + d, (x1 * cos - x2 * sin).to(out_ty), mask=mask)
    tl.store(dst + h * stride_dst_h + HALF + d, (x2 * cos + x1 * sin).to(out_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    q_out_ptr,
    k_out_ptr,
    q_ptr,  # [N, H, D]
    k_ptr,  # [N, KVH, D]
    positions_ptr,  # [N]
    cos_sin_ptr,  # [max_positions, D]
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_qot,
    stride_qoh,
    stride_kot,
    stride_koh,
    stride_cs,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEADS_P2: tl.constexpr,
    KV_HEADS_P2: tl.constexpr,
    HALF: tl.constexpr,
    HALF_P2: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    d = tl.arange(0, HALF_P2)[None, :]
    d_mask = d < HALF
    row = cos_sin_ptr + pos * stride_cs
    # Round cos/sin to the activation dtype first, as the reference does.
    act_ty = q_ptr.dtype.element_ty
    cos = tl.load(row + d, mask=d_mask, other=0.0).to(act_ty).to(tl.float32)
    sin = tl.load(row + HALF + d, mask=d_mask, other=0.0).to(act_ty).to(tl.float32)
    _rotate_heads(
        q_ptr + token * stride_qt,
        q_out_ptr + token * stride_qot,
        stride_qh,
        stride_qoh,
        cos,
        sin,
        NUM_HEADS,
        HEADS_P2,
        HALF,
        HALF_P2,
    )
    _rotate_heads(
        k_ptr + token * stride_kt,
        k_out_ptr + token * stride_kot,
        stride_kh,
        stride_koh,
        cos,
        sin,
        NUM_KV_HEADS,
        KV_HEADS_P2,
        HALF,
        HALF_P2,
    )


def rotary_embedding_triton(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``q [N, H, D]`` and ``k [N, KVH, D]`` by their token ``positions [N]``; returns new tensors."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    if k.shape != (num_tokens, num_kv_heads, head_dim) or positions.shape != (num_tokens,):
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, positions {tuple(positions.shape)} disagree")
    if cos_sin_cache.shape[-1] != head_dim or head_dim % 2:
        raise ValueError(f"cos_sin_cache rot_dim {cos_sin_cache.shape[-1]} must equal the (even) head_dim {head_dim}")
    q_out = torch.empty((num_tokens, num_heads, head_dim), dtype=q.dtype, device=q.device)
    k_out = torch.empty((num_tokens, num_kv_heads, head_dim), dtype=k.dtype, device=k.device)
    if num_tokens == 0:
        return q_out, k_out
    q = q if q.stride(-1) == 1 else q.contiguous()
    k = k if k.stride(-1) == 1 else k.contiguous()
    cos_sin_cache = cos_sin_cache if cos_sin_cache.stride(-1) == 1 else cos_sin_cache.contiguous()
    half = head_dim // 2
    _rotary_kernel[(num_tokens,)](
        q_out,
        k_out,
        q,
        k,
        positions.contiguous(),
        cos_sin_cache,
        *q.stride()[:2],
        *k.stride()[:2],
        *q_out.stride()[:2],
        *k_out.stride()[:2],
        cos_sin_cache.stride(0),
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads,
        HEADS_P2=triton.next_power_of_2(num_heads),
        KV_HEADS_P2=triton.next_power_of_2(num_kv_heads),
        HALF=half,
        HALF_P2=triton.next_power_of_2(half),
        num_warps=4,
    )
    return q_out, k_out


__all__ = ["rotary_embedding_triton"]
