"""Triton kernels against their torch references.

Without CUDA the kernels run through Triton's CPU interpreter, which must be switched on before
any ``@triton.jit`` function is defined, hence the environment tweak above the kernel imports.
(``tests.conftest_kernels`` explains why that alone is not enough under pytest.)
The interpreter runs every program in Python, so the shapes here are tiny (few sequences, short
contexts, few heads) yet still cover what breaks paged attention: contexts that are not
multiples of the block size, shuffled block tables, mixed prefill + decode in one batch, GQA
ratios 1 / 3 / 8, head_dim 80 (not a power of two), both block sizes, all three dtypes, and the
split-KV path (forced and chosen by the heuristic).
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tests.conftest_kernels import use_interpreter_without_cuda

use_interpreter_without_cuda()  # also repairs triton if conftest's imports loaded it first

import dataclasses  # noqa: E402
import math  # noqa: E402

import pytest  # noqa: E402

from engine.attention import TorchAttention  # noqa: E402
from engine.attention_metadata import AttentionMetadata  # noqa: E402
from engine.triton_attention import TritonAttention  # noqa: E402
from pagedq_kernels.activation import silu_and_mul_torch  # noqa: E402
from pagedq_kernels.activation_triton import silu_and_mul_triton  # noqa: E402
from pagedq_kernels.kv_cache import write_kv_cache_torch  # noqa: E402
from pagedq_kernels.kv_cache_triton import write_kv_cache_triton  # noqa: E402
from pagedq_kernels.paged_attention import paged_attention_torch  # noqa: E402
from pagedq_kernels.paged_attention_triton import choose_num_splits, paged_attention_triton  # noqa: E402
from pagedq_kernels.rms_norm import rms_norm_torch  # noqa: E402
from pagedq_kernels.rms_norm_triton import rms_norm_triton  # noqa: E402
from pagedq_kernels.rotary import rotary_embedding_torch  # noqa: E402
from pagedq_kernels.rotary_triton import rotary_embedding_triton  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

# (atol, rtol) per dtype. 16-bit attention rounds P to the input dtype before the P @ V matmul (as
# flash attention does on tensor cores) where the reference keeps fp32, so it gets a few ulps.
ATTN_TOL = {torch.float32: (2e-5, 2e-5), torch.float16: (4e-3, 4e-3), torch.bfloat16: (3e-2, 3e-2)}
# Elementwise kernels round exactly where the references do: one ulp of slack for reduction order.
# Triton's interpreter casts fp32 -> bf16 by truncation (compiled kernels round to nearest even),
# which costs up to one bf16 ulp per rounding step, so interpreted bf16 gets three.
BF16_ULP = 2.0**-7
ELEMENTWISE_TOL = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (1e-3, 1e-3),
    torch.bfloat16: (3 * BF16_ULP, 3 * BF16_ULP) if INTERPRETED else (BF16_ULP, BF16_ULP),
}


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(gen: torch.Generator, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """CPU-generated (so seeds reproduce across devices), then moved."""
    return torch.randn(*shape, generator=gen).to(device=DEVICE, dtype=dtype)


@dataclasses.dataclass
class PagedBatch:
    """A random flattened batch over a paged cache whose blocks are scattered at random."""

    q: torch.Tensor
    k_new: torch.Tensor
    v_new: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    meta: AttentionMetadata


def make_paged_batch(
    q_lens: list[int],
    seq_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    seed: int,
) -> PagedBatch:
    """Caches filled with random K/V for every context token; ``k_new/v_new`` are the step's tokens.

    Block tables are a random permutation of the pool (plus two spare blocks that nobody owns),
    rows padded with 0 like the engine's, so any indexing slip reads someone else's data.
    """
    gen = _gen(seed)
    blocks_per_seq = [math.ceil(s / block_size) for s in seq_lens]
    max_blocks = max(blocks_per_seq)
    num_blocks = sum(blocks_per_seq) + 2
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    block_tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    used = 0
    for i, nb in enumerate(blocks_per_seq):
        block_tables[i, :nb] = torch.tensor(perm[used : used + nb], dtype=torch.int32)
        used += nb
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache, v_cache = _randn(gen, *shape, dtype=dtype), _randn(gen, *shape, dtype=dtype)

    slots = []
    for i, (ql, sl) in enumerate(zip(q_lens, seq_lens, strict=True)):
        for t in range(sl - ql, sl):
            slots.append(int(block_tables[i, t // block_size]) * block_size + t % block_size)
    num_tokens = sum(q_lens)
    slot_mapping = torch.tensor(slots, dtype=torch.int64, device=DEVICE)
    k_new = k_cache.view(-1, num_kv_heads, head_dim)[slot_mapping].clone()
    v_new = v_cache.view(-1, num_kv_heads, head_dim)[slot_mapping].clone()
    starts = [0]
    for ql in q_lens:
        starts.append(starts[-1] + ql)
    meta = AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=DEVICE),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        block_tables=block_tables.to(DEVICE),
        slot_mapping=slot_mapping,
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        query_lens_cpu=list(q_lens),
        seq_lens_cpu=list(seq_lens),
    )
    q = _randn(gen, num_tokens, num_heads, head_dim, dtype=dtype)
    return PagedBatch(q, k_new, v_new, k_cache, v_cache, meta)


def random_lens(seed: int, num_seqs: int, block_size: int, max_q: int, max_ctx: int) -> tuple[list[int], list[int]]:
    """Mixed batch: alternating decodes (q_len 1) and prefill chunks; contexts off the block grid."""
    gen = _gen(seed)
    q_lens, seq_lens = [], []
    for i in range(num_seqs):
        q_len = 1 if i % 2 else int(torch.randint(2, max_q + 1, (1,), generator=gen))
        cached = int(torch.randint(0, max_ctx - q_len + 1, (1,), generator=gen))
        seq_len = q_len + cached
        if seq_len % block_size == 0:
            seq_len += 1 if seq_len < max_ctx else -1
            seq_len = max(seq_len, q_len)
        q_lens.append(q_len)
        seq_lens.append(seq_len)
    return q_lens, seq_lens


def run_attention(batch: PagedBatch, num_splits: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    m = batch.meta
    head_dim = batch.q.shape[-1]
    args = (
        batch.q,
        batch.k_cache,
        batch.v_cache,
        m.query_start_loc,
        m.seq_lens,
        m.block_tables,
        head_dim**-0.5,
        m.max_query_len,
        m.max_seq_len,
    )
    return paged_attention_triton(*args, num_splits=num_splits), paged_attention_torch(*args)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, tol: tuple[float, float]) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    torch.testing.assert_close(actual.float(), expected.float(), atol=tol[0], rtol=tol[1])


# --------------------------------------------------------------------------- paged attention

ATTN_CASES = [
    # id, heads, kv_heads, head_dim, block_size, dtype, num_seqs, max_q, max_ctx
    pytest.param(2, 2, 64, 16, torch.float32, 5, 20, 70, id="mha-d64-bs16-fp32"),
    pytest.param(6, 2, 80, 32, torch.bfloat16, 4, 12, 60, id="gqa3-d80-bs32-bf16"),
    pytest.param(8, 1, 128, 16, torch.float16, 4, 9, 50, id="gqa8-d128-bs16-fp16"),
    pytest.param(3, 1, 80, 16, torch.float32, 3, 24, 75, id="gqa3-d80-bs16-fp32"),
    pytest.param(8, 1, 64, 32, torch.bfloat16, 3, 10, 45, id="gqa8-d64-bs32-bf16"),
    pytest.param(4, 4, 128, 32, torch.float16, 3, 16, 50, id="mha-d128-bs32-fp16"),
]


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "block_size", "dtype", "num_seqs", "max_q", "max_ctx"),
    ATTN_CASES,
)
def test_paged_attention_mixed_batch(
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    num_seqs: int,
    max_q: int,
    max_ctx: int,
) -> None:
    seed = num_heads * 1000 + head_dim + block_size
    q_lens, seq_lens = random_lens(seed, num_seqs, block_size, max_q, max_ctx)
    batch = make_paged_batch(q_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, seed)
    out, ref = run_attention(batch, num_splits=1)
    assert_close(out, ref, ATTN_TOL[dtype])


def test_paged_attention_prefill_spanning_query_blocks() -> None:
    """Whole prompts longer than one query tile (several programs per sequence), no cached prefix."""
    batch = make_paged_batch([70, 33], [70, 33], 2, 1, 64, 16, torch.float32, seed=7)
    out, ref = run_attention(batch)
    assert_close(out, ref, ATTN_TOL[torch.float32])


def test_paged_attention_empty_query_sequence() -> None:
    """A sequence scheduled with no new tokens owns no rows and must not disturb its neighbours."""
    batch = make_paged_batch([3, 0, 1], [20, 17, 9], 4, 2, 64, 16, torch.float32, seed=11)
    out, ref = run_attention(batch)
    assert_close(out, ref, ATTN_TOL[torch.float32])


@pytest.mark.parametrize(
    ("num_splits", "dtype", "q_lens", "seq_lens"),
    [
        pytest.param(3, torch.float16, [1, 1, 1], [150, 37, 65], id="decode-3splits-fp16"),
        pytest.param(5, torch.bfloat16, [1, 1], [129, 8], id="decode-5splits-bf16-empty-splits"),
        pytest.param(2, torch.float32, [9, 1], [40, 70], id="mixed-2splits-fp32"),
    ],
)
def test_paged_attention_split_kv_forced(
    num_splits: int, dtype: torch.dtype, q_lens: list[int], seq_lens: list[int]
) -> None:
    batch = make_paged_batch(q_lens, seq_lens, 6, 2, 80, 16, dtype, seed=num_splits)
    out, ref = run_attention(batch, num_splits=num_splits)
    assert_close(out, ref, ATTN_TOL[dtype])


def test_choose_num_splits_heuristic() -> None:
    # Prefill or mixed steps never split.
    assert choose_num_splits(1, 1, max_query_len=4, max_seq_len=32768, num_sms=132) == 1
    # A busy GPU (programs >= SMs) does not split.
    assert choose_num_splits(64, 8, max_query_len=1, max_seq_len=32768, num_sms=132) == 1
    # Short contexts do not split: a split needs MIN_KEYS_PER_SPLIT keys.
    assert choose_num_splits(1, 8, max_query_len=1, max_seq_len=300, num_sms=132) == 1
    # Few sequences, long contexts: fill the SMs, bounded by context length and MAX_SPLITS.
    assert choose_num_splits(1, 8, max_query_len=1, max_seq_len=32768, num_sms=132) == 17
    assert choose_num_splits(2, 1, max_query_len=1, max_seq_len=1024, num_sms=132) == 4
    assert choose_num_splits(1, 1, max_query_len=1, max_seq_len=1 << 20, num_sms=132) == 64


def test_paged_attention_split_kv_chosen_by_heuristic() -> None:
    """Default path on a long-context decode step: the heuristic must pick split-KV and stay exact."""
    q_lens, seq_lens = [1, 1], [530, 301]
    batch = make_paged_batch(q_lens, seq_lens, 3, 1, 64, 32, torch.float32, seed=5)
    from pagedq_kernels.paged_attention_triton import _num_sms

    assert choose_num_splits(2, 1, 1, max(seq_lens), _num_sms(DEVICE)) > 1
    out, ref = run_attention(batch, num_splits=None)
    assert_close(out, ref, ATTN_TOL[torch.float32])


def test_triton_backend_matches_torch_backend() -> None:
    """Full backend step (cache write + attention) on strided q/k/v views of one fused qkv tensor."""
    num_heads, num_kv_heads, head_dim, block_size = 6, 2, 64, 16
    q_lens, seq_lens = [7, 1, 1, 12], [7, 30, 17, 40]
    ref_batch = make_paged_batch(q_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size, torch.float16, seed=3)
    gen = _gen(99)
    n = sum(q_lens)
    width = (num_heads + 2 * num_kv_heads) * head_dim
    qkv = _randn(gen, n, width, dtype=torch.float16)
    q = qkv[:, : num_heads * head_dim].view(n, num_heads, head_dim)
    k = qkv[:, num_heads * head_dim : (num_heads + num_kv_heads) * head_dim].view(n, num_kv_heads, head_dim)
    v = qkv[:, (num_heads + num_kv_heads) * head_dim :].view(n, num_kv_heads, head_dim)

    results = []
    for backend in (TritonAttention(), TorchAttention()):
        k_cache, v_cache = ref_batch.k_cache.clone(), ref_batch.v_cache.clone()
        backend.prepare(ref_batch.meta)
        out = backend.forward(q, k, v, k_cache, v_cache, ref_batch.meta, head_dim**-0.5)
        results.append((out, k_cache, v_cache))
    (out, kc, vc), (ref, kc_ref, vc_ref) = results
    assert TritonAttention.name == "triton"
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)
    assert_close(out, ref, ATTN_TOL[torch.float16])


# --------------------------------------------------------------------------- KV cache write


@pytest.mark.parametrize(
    ("cache_dtype", "src_dtype", "num_kv_heads", "head_dim", "block_size"),
    [
        pytest.param(torch.bfloat16, torch.bfloat16, 2, 80, 16, id="bf16-d80"),
        pytest.param(torch.float16, torch.float32, 3, 64, 32, id="fp32-into-fp16"),
        pytest.param(torch.float32, torch.float32, 1, 128, 16, id="fp32-d128"),
    ],
)
def test_write_kv_cache_skips_padding(
    cache_dtype: torch.dtype, src_dtype: torch.dtype, num_kv_heads: int, head_dim: int, block_size: int
) -> None:
    gen = _gen(head_dim)
    num_blocks, n = 6, 13
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache, v_cache = _randn(gen, *shape, dtype=cache_dtype), _randn(gen, *shape, dtype=cache_dtype)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:n]
    slots[[2, 7]] = -1  # padding tokens
    slots = slots.to(DEVICE)
    k = _randn(gen, n, num_kv_heads, head_dim, dtype=src_dtype)
    v = _randn(gen, n, num_kv_heads, head_dim, dtype=src_dtype)

    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    keep = slots >= 0
    write_kv_cache_torch(k[keep], v[keep], k_ref, v_ref, slots[keep])
    write_kv_cache_triton(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


# --------------------------------------------------------------------------- RMSNorm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm(dtype: torch.dtype, with_residual: bool) -> None:
    gen = _gen(1)
    x = _randn(gen, 2, 5, 200, dtype=dtype)  # leading dims and a non-power-of-two hidden size
    weight = (1.0 + 0.1 * _randn(gen, 200)).to(dtype)
    residual = _randn(gen, 2, 5, 200, dtype=dtype) if with_residual else None
    out, new_res = rms_norm_triton(x, weight, 1e-6, residual)
    ref, ref_res = rms_norm_torch(x, weight, 1e-6, residual)
    assert_close(out, ref, ELEMENTWISE_TOL[dtype])
    if with_residual:
        assert new_res is not None and ref_res is not None
        # One rounding of the sum: bit-exact, except for the interpreter's truncating bf16 cast.
        exact = not (INTERPRETED and dtype == torch.bfloat16)
        assert_close(new_res, ref_res, (0.0, 0.0) if exact else (BF16_ULP, BF16_ULP))
    else:
        assert new_res is None


def test_rms_norm_fp32_weight_promotes_like_reference() -> None:
    gen = _gen(2)
    x = _randn(gen, 4, 96, dtype=torch.bfloat16)
    weight = 1.0 + 0.1 * _randn(gen, 96)
    out, _ = rms_norm_triton(x, weight, 1e-5)
    ref, _ = rms_norm_torch(x, weight, 1e-5)
    assert out.dtype == torch.float32
    assert_close(out, ref, ELEMENTWISE_TOL[torch.bfloat16])  # normalised values pass through bf16


# --------------------------------------------------------------------------- rotary


def _cos_sin_cache(max_pos: int, rot_dim: int, base: float = 10000.0) -> torch.Tensor:
    inv_freq = 1.0 / base ** (torch.arange(0, rot_dim, 2, dtype=torch.float32) / rot_dim)
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv_freq)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(DEVICE)


@pytest.mark.parametrize(
    ("dtype", "num_heads", "num_kv_heads", "head_dim"),
    [
        pytest.param(torch.float32, 4, 4, 64, id="fp32-mha-d64"),
        pytest.param(torch.bfloat16, 6, 2, 80, id="bf16-gqa3-d80"),
        pytest.param(torch.float16, 8, 1, 128, id="fp16-gqa8-d128"),
    ],
)
def test_rotary_embedding(dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
    gen = _gen(head_dim)
    n = 11
    cache = _cos_sin_cache(256, head_dim)
    positions = torch.randint(0, 256, (n,), generator=gen).to(DEVICE)
    qkv = _randn(gen, n, (num_heads + num_kv_heads) * head_dim, dtype=dtype)
    q = qkv[:, : num_heads * head_dim].view(n, num_heads, head_dim)  # strided views, like the model's
    k = qkv[:, num_heads * head_dim :].view(n, num_kv_heads, head_dim)
    q_before, k_before = q.clone(), k.clone()
    q_out, k_out = rotary_embedding_triton(positions, q, k, cache)
    q_ref, k_ref = rotary_embedding_torch(positions, q, k, cache)
    assert_close(q_out, q_ref, ELEMENTWISE_TOL[dtype])
    assert_close(k_out, k_ref, ELEMENTWISE_TOL[dtype])
    assert torch.equal(q, q_before) and torch.equal(k, k_before)  # inputs untouched


# --------------------------------------------------------------------------- SiLU and mul


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_silu_and_mul(dtype: torch.dtype) -> None:
    gen = _gen(3)
    x = 3.0 * _randn(gen, 2, 3, 2 * 1500, dtype=dtype)  # leading dims, 1500 spans two column blocks
    assert_close(silu_and_mul_triton(x), silu_and_mul_torch(x), ELEMENTWISE_TOL[dtype])
