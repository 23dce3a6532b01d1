"""Causal attention of a mixed (prefill + decode) flattened batch over the paged KV cache.

This file holds the torch reference: plain, per sequence, easy to trust. The engine's CPU
backend (``engine.attention``) and the Triton kernel compute the same thing faster and are
tested against it. Layouts: see ``engine.attention_metadata``.
"""

from __future__ import annotations

import torch


def gather_context(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The first ``seq_len`` cached tokens of one sequence as ``[seq_len, KVH, D]`` (a copy)."""
    block_size = cache.shape[1]
    num_blocks = (seq_len + block_size - 1) // block_size
    blocks = cache.index_select(0, block_table[:num_blocks].long())
    return blocks.reshape(-1, *cache.shape[2:])[:seq_len]


def paged_attention_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    max_query_len: int,
    max_seq_len: int,
) -> torch.Tensor:
    """``q [N, H, D]`` -> ``[N, H, D]``; the new tokens' K/V must already be in the cache."""
    del max_query_len, max_seq_len  # part of the shared signature; kernels size their grids with them
    num_heads = q.shape[1]
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for i, seq_len in enumerate(lens):
        qs, qe = starts[i], starts[i + 1]
        q_len = qe - qs
        if q_len == 0:
            continue
        k = gather_context(k_cache, block_tables[i], seq_len).float()
        v = gather_context(v_cache, block_tables[i], seq_len).float()
        k = k.repeat_interleave(group, dim=1)  # [L, H, D]
        v = v.repeat_interleave(group, dim=1)
        qi = q[qs:qe].float()  # [q_len, H, D]
        scores = torch.einsum("qhd,khd->hqk", qi, k) * scale
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)[:, None]
        k_pos = torch.arange(seq_len, device=q.device)[None, :]
        scores = scores.masked_fill(k_pos > q_pos, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[qs:qe] = torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)
    return out
