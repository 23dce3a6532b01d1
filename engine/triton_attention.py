"""The ``triton`` attention backend: the kernels in ``pagedq_kernels/`` behind ``engine.attention``'s interface.

Per layer: write the step's new K/V into the paged cache, then attend the whole mixed batch in
one launch (plus a reduce when split-KV is chosen). Everything the kernels plan from is already a
host int on the metadata (``max_query_len``, ``max_seq_len``), so ``forward`` never syncs with the
device and nothing needs precomputing per step. Runs natively on CUDA and through Triton's
interpreter on CPU (set ``TRITON_INTERPRET=1`` before importing triton; slow, for tests).
"""

from __future__ import annotations

import torch

from engine.attention_metadata import AttentionMetadata
from pagedq_kernels.kv_cache_triton import write_kv_cache_triton
from pagedq_kernels.paged_attention_triton import paged_attention_triton


class TritonAttention:
    """Triton backend: ``write_kv_cache_triton`` then ``paged_attention_triton``."""

    name = "triton"

    def prepare(self, meta: AttentionMetadata) -> None:
        """Nothing to plan: the kernels find each program's sequence on the device."""
        del meta

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """``q [N, H, D]``, ``k, v [N, KVH, D]`` -> ``[N, H, D]``; caches are updated in place."""
        write_kv_cache_triton(k, v, k_cache, v_cache, meta.slot_mapping)
        return paged_attention_triton(
            q,
            k_cache,
            v_cache,
            meta.query_start_loc,
            meta.seq_lens,
            meta.block_tables,
            scale,
            meta.max_query_len,
            meta.max_seq_len,
        )
