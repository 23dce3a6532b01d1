"""Writing the new tokens' K/V into the paged cache through the slot mapping: the torch reference."""

from __future__ import annotations

import torch


def write_kv_cache_torch(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store ``k, v [N, KVH, D]`` at ``slot_mapping [N]`` of caches ``[num_blocks, block_size, KVH, D]``.

    Into a narrower cache (fp32 K/V into a bf16 one) they are rounded to nearest, ties to even, as torch's
    conversions round. A negative slot marks a padding token and is skipped, as the C and Triton writers skip
    it: the engine's batches carry such rows, and index_copy_ would reject -1 (or, on some builds, wrap it
    into the last block)."""
    num_kv_heads, head_dim = k_cache.shape[-2:]
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        k, v, slot_mapping = k[keep], v[keep], slot_mapping[keep]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v.to(v_cache.dtype))
