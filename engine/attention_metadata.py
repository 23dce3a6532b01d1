"""What one forward pass needs to know about the flattened batch to read and write the paged KV cache.

The batch is the concatenation of every scheduled sequence's new tokens (prefill chunks and single
decode tokens alike): no padding. Sequence ``i`` owns query rows
``query_start_loc[i]:query_start_loc[i+1]``; those rows sit at the *end* of its context of
``seq_lens[i]`` tokens, so row ``r`` of sequence ``i`` may attend to context positions
``<= seq_lens[i] - query_len_i + r`` (causal).

KV cache layout (shared by every backend, torch and Triton): per layer two tensors
``k_cache`` and ``v_cache`` of shape ``[num_blocks, block_size, num_kv_heads, head_dim]``.
Token ``t`` of a sequence lives in slot ``block_tables[i, t // block_size] * block_size + t % block_size``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class AttentionMetadata:
    query_start_loc: torch.Tensor  # int32 [S + 1], cumulative query lengths
    seq_lens: torch.Tensor  # int32 [S], context length after this step (cached + new tokens)
    block_tables: torch.Tensor  # int32 [S, max_blocks_per_seq], rows padded with 0
    slot_mapping: torch.Tensor  # int64 [N], cache slot of each new token
    max_query_len: int
    max_seq_len: int
    # Host-side copies, so CPU backends can plan without device syncs.
    query_lens_cpu: list[int] = field(default_factory=list)
    seq_lens_cpu: list[int] = field(default_factory=list)
    # Per sequence: whether its queries hold prompt tokens (a prefill chunk, however short the prefix cache left
    # it). A CPU backend sends those to its prefill kernel, never to the decode kernel that takes single tokens
    # and a token with its drafts, so a prompt's floats are the same with and without a cache hit. Empty: not
    # known (chunks go by length alone).
    prompt_chunks_cpu: list[bool] = field(default_factory=list)
    # Per-step scratch a backend computes once in ``prepare`` and reuses in every layer.
    backend_state: Any = None

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])
