"""The CPU attention backend (C decode and prefill kernels, their torch fallbacks) against the torch reference."""

from __future__ import annotations

import random

import pytest
import torch

from engine.attention import TorchAttention
from engine.attention_metadata import AttentionMetadata
from kernels import cpu_attention
from kernels.paged_attention import paged_attention_torch


def random_batch(
    rng: random.Random, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, decode_only: bool
) -> tuple[AttentionMetadata, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    num_seqs = rng.randint(1, 6)
    seq_lens = [rng.randint(1, 90) for _ in range(num_seqs)]
    q_lens = [1 if decode_only else rng.choice([1, rng.randint(1, n)]) for n in seq_lens]
    return make_batch(seq_lens, q_lens, num_heads, num_kv_heads, head_dim, block_size)


def make_batch(
    seq_lens: list[int], q_lens: list[int], num_heads: int, num_kv_heads: int, head_dim: int, block_size: int
) -> tuple[AttentionMetadata, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    num_blocks = sum(-(-n // block_size) for n in seq_lens) + 8
    free = torch.randperm(num_blocks).tolist()
    tables = [[free.pop() for _ in range(-(-n // block_size))] for n in seq_lens]
    width = max(map(len, tables))
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    slots = [
        tables[i][p // block_size] * block_size + p % block_size
        for i, (n, q) in enumerate(zip(seq_lens, q_lens, strict=True))
        for p in range(n - q, n)
    ]
    cu = torch.tensor([0, *torch.cumsum(torch.tensor(q_lens), 0).tolist()], dtype=torch.int32)
    meta = AttentionMetadata(
        cu,
        torch.tensor(seq_lens, dtype=torch.int32),
        block_tables,
        torch.tensor(slots),
        max(q_lens),
        max(seq_lens),
        q_lens,
        seq_lens,
    )
    n = len(slots)
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim)
    qkv = torch.randn(n, (num_heads + 2 * num_kv_heads) * head_dim)  # q as a strided view, like the model's
    q = qkv[:, : num_heads * head_dim].view(n, num_heads, head_dim)
    k = torch.randn(n, num_kv_heads, head_dim)
    v = torch.randn(n, num_kv_heads, head_dim)
    return meta, q, k, v, k_cache, v_cache


@pytest.mark.parametrize("use_c", [True, False])
# head_dim 20 takes the decode kernel's portable path (not a multiple of 8) and torch's prefill (not a
# multiple of 16); block size 4 leaves every block shorter than the AVX2 decode path's 8-row step, so
# only its tail loops run, and makes the prefill kernel's 16-key chunks span several blocks.
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(4, 4, 16), (9, 3, 64), (8, 1, 32), (6, 2, 20)])
@pytest.mark.parametrize("block_size", [4, 16, 32])
def test_matches_reference(
    use_c: bool, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    if use_c and not cpu_attention.available():
        pytest.skip("no C compiler: the torch fallback is what runs here")
    if not use_c:
        monkeypatch.setattr(cpu_attention, "available", lambda: False)
        monkeypatch.setattr(cpu_attention, "prefill_supported", lambda head_dim: False)
    rng = random.Random(num_heads * 100 + head_dim + block_size)
    torch.manual_seed(rng.randrange(1000))
    for trial in range(8):
        meta, q, k, v, k_cache, v_cache = random_batch(
            rng, num_heads, num_kv_heads, head_dim, block_size, decode_only=trial % 2 == 0
        )
        backend = TorchAttention()
        backend.prepare(meta)
        out = backend.forward(q, k, v, k_cache, v_cache, meta, head_dim**-0.5)
        ref = paged_attention_torch(
            q,
            k_cache,
            v_cache,
            meta.query_start_loc,
            meta.seq_lens,
            meta.block_tables,
            head_dim**-0.5,
            meta.max_query_len,
            meta.max_seq_len,
        )
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)


@pytest.mark.skipif(not cpu_attention.prefill_supported(64), reason="no C compiler or no AVX2: torch's prefill runs")
def test_prefill_kernel_long_chunks() -> None:
    # Many 16-query tiles and 16-key chunks: a whole 300-token prompt, a 70-token chunk after 230
    # cached tokens, a chunk starting mid-block, next to decode tokens in the same step.
    torch.manual_seed(0)
    meta, q, k, v, k_cache, v_cache = make_batch([300, 300, 45, 77, 9], [300, 70, 13, 1, 1], 9, 3, 64, 16)
    backend = TorchAttention()
    backend.prepare(meta)
    out = backend.forward(q, k, v, k_cache, v_cache, meta, 0.125)
    args = (meta.query_start_loc, meta.seq_lens, meta.block_tables, 0.125, meta.max_query_len, meta.max_seq_len)
    ref = paged_attention_torch(q, k_cache, v_cache, *args)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
