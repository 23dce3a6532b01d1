"""The CPU attention backend (C decode and prefill kernels, their torch fallbacks) against the torch reference."""

from __future__ import annotations

import random

import pytest
import torch

from engine.attention import TorchAttention
from engine.attention_metadata import AttentionMetadata
from pagedq_kernels import cpu_attention, cpu_isa
from pagedq_kernels.kv_cache import write_kv_cache_torch
from pagedq_kernels.paged_attention import paged_attention_torch

# Every test here runs once per C-kernel variant the machine can run (tests/conftest.py, isa_variant).
pytestmark = pytest.mark.usefixtures("isa_variant")


def random_batch(
    rng: random.Random, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, decode_only: bool
) -> tuple[AttentionMetadata, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    num_seqs = rng.randint(1, 6)
    seq_lens = [rng.randint(1, 90) for _ in range(num_seqs)]
    q_lens = [1 if decode_only else rng.choice([1, rng.randint(1, n)]) for n in seq_lens]
    return make_batch(seq_lens, q_lens, num_heads, num_kv_heads, head_dim, block_size)


def reference_args(
    meta: AttentionMetadata, scale: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float, int, int]:
    """``paged_attention_torch``'s arguments after q and the caches, from a step's metadata."""
    return (meta.query_start_loc, meta.seq_lens, meta.block_tables, scale, meta.max_query_len, meta.max_seq_len)


def make_batch(
    seq_lens: list[int],
    q_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    shared_blocks: int = 0,
) -> tuple[AttentionMetadata, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A step's batch over random caches; every table starts with the same ``shared_blocks`` blocks
    (a cached prefix; a sequence shorter than it holds only the blocks it reaches)."""
    num_blocks = sum(-(-n // block_size) for n in seq_lens) + 8
    free = torch.randperm(num_blocks).tolist()
    shared = [free.pop() for _ in range(shared_blocks)]
    tables = [
        shared[: -(-n // block_size)] + [free.pop() for _ in range(-(-n // block_size) - shared_blocks)]
        for n in seq_lens
    ]
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
# head_dim 20 takes the decode kernel's portable path (not a multiple of 8; the avx512 build's masked-tail
# task), and prefill a row at a time through the decode kernel (not a multiple of 16); the AVX2 decode task takes
# a kv head's query rows 3 at a time and 16 value columns at a time: groups of 8 (3 + 3 + 2) and 2, and head_dim
# 24 (16 + 8), run its shorter passes; a sequence's last, partly filled block runs its one-position tail. Block
# size 4 makes the prefill kernel's 64-key chunks span many blocks.
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim"), [(4, 4, 16), (9, 3, 64), (8, 1, 32), (6, 2, 20), (4, 2, 24)]
)
@pytest.mark.parametrize("block_size", [4, 16, 32])
def test_matches_reference(
    use_c: bool, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    if use_c and not cpu_attention.available():
        pytest.skip("no C compiler: the torch fallback is what runs here")
    if not use_c:
        monkeypatch.setattr(cpu_attention, "available", lambda: False)
    rng = random.Random(num_heads * 100 + head_dim + block_size)
    torch.manual_seed(rng.randrange(1000))
    for trial in range(8):
        meta, q, k, v, k_cache, v_cache = random_batch(
            rng, num_heads, num_kv_heads, head_dim, block_size, decode_only=trial % 2 == 0
        )
        backend = TorchAttention()
        backend.prepare(meta)
        out = backend.forward(q, k, v, k_cache, v_cache, meta, head_dim**-0.5)
        ref = paged_attention_torch(q, k_cache, v_cache, *reference_args(meta, head_dim**-0.5))
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)


# head_dim 20: the avx512 build's masked-tail task (other builds: the portable loops). The avx512 build's
# bf16 task takes query heads 4 at a time and columns 64 at a time: groups of 5 (4 + 1) and 8 (4 + 4),
# head_dim 100 (64 + 36: a short, masked second chunk).
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim"), [(9, 3, 64), (8, 1, 32), (6, 2, 16), (6, 2, 20), (10, 2, 100)]
)
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
def test_decode_task_shapes_agree(
    num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, kv_dtype: torch.dtype
) -> None:
    # The decode kernel runs one task per sequence (copying each block's rows in memory order) when
    # there are at least as many sequences as threads, else one per (sequence, kv head): both must
    # give the reference's result, and the same bits as each other (same arithmetic, in the same order).
    # A bf16 cache is widened whole rows at a time in the first, one kv head's columns in the second.
    if not cpu_attention.available():
        pytest.skip("no C compiler: the torch fallback is what runs here")
    rng = random.Random(head_dim + block_size)
    torch.manual_seed(rng.randrange(1000))
    seq_lens = [rng.randint(1, 120) for _ in range(5)] + [block_size * 3, 1]
    meta, q, _, _, k_cache, v_cache = make_batch(
        seq_lens, [1] * len(seq_lens), num_heads, num_kv_heads, head_dim, block_size
    )
    k_cache, v_cache = k_cache.to(kv_dtype), v_cache.to(kv_dtype)
    rows = torch.arange(len(seq_lens))
    tables = meta.block_tables.contiguous()
    scale = head_dim**-0.5
    threads = torch.get_num_threads()
    outs = []
    try:
        for n in (1, len(seq_lens) + 1):  # per sequence; per (sequence, kv head)
            torch.set_num_threads(n)
            out = torch.zeros_like(q)
            cpu_attention.paged_decode_attention(q, k_cache, v_cache, out, rows, meta.seq_lens, tables, scale)
            outs.append(out)
    finally:
        torch.set_num_threads(threads)
    args = reference_args(meta, scale)
    ref = paged_attention_torch(q, k_cache.float(), v_cache.float(), *args)
    torch.testing.assert_close(outs[0], ref, atol=2e-5, rtol=1e-4)
    assert torch.equal(outs[0], outs[1])


def test_prefill_kernel_long_chunks() -> None:
    if not cpu_attention.available():
        pytest.skip("no C compiler: torch's prefill runs")
    # Many 16-query tiles and 64-key chunks: a whole 300-token prompt, a 70-token chunk after 230
    # cached tokens, a chunk starting mid-block, next to decode tokens in the same step.
    torch.manual_seed(0)
    meta, q, k, v, k_cache, v_cache = make_batch([300, 300, 45, 77, 9], [300, 70, 13, 1, 1], 9, 3, 64, 16)
    backend = TorchAttention()
    backend.prepare(meta)
    out = backend.forward(q, k, v, k_cache, v_cache, meta, 0.125)
    args = reference_args(meta, 0.125)
    ref = paged_attention_torch(q, k_cache, v_cache, *args)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(9, 3, 64), (6, 2, 20), (4, 2, 24)])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
def test_prefill_rows_do_not_depend_on_their_chunk(
    num_heads: int, num_kv_heads: int, head_dim: int, kv_dtype: torch.dtype
) -> None:
    # A 70-token prompt prefilled whole, and its tail as chunks of 1-16 rows after the rest is cached (what a
    # prefix-cache hit leaves): each row's floats are the same bit for bit, on the flash tiles (head_dim % 16
    # == 0 from AVX2 up) and where a row is decoded alone (the generic build; other head sizes), where they are
    # also what the decode kernel gives for that row.
    if not cpu_attention.available():
        pytest.skip("no C compiler: torch's prefill runs")
    torch.manual_seed(head_dim)
    total, block_size = 70, 16
    meta, q, _, _, k_cache, v_cache = make_batch([total], [total], num_heads, num_kv_heads, head_dim, block_size)
    k_cache, v_cache = k_cache.to(kv_dtype), v_cache.to(kv_dtype)
    q, tables, scale = q.contiguous(), meta.block_tables.contiguous(), head_dim**-0.5

    def prefill(start: int) -> torch.Tensor:
        rows = q[start:].contiguous()
        out = torch.empty_like(rows)
        q_starts, q_lens = torch.zeros(1, dtype=torch.int64), torch.tensor([total - start], dtype=torch.int32)
        lens = meta.seq_lens
        cpu_attention.paged_prefill_attention(rows, k_cache, v_cache, out, q_starts, q_lens, lens, tables, scale)
        return out

    whole = prefill(0)
    for tail in (1, 2, 5, 9, 16):
        assert torch.equal(prefill(total - tail), whole[total - tail :]), tail
    if not cpu_attention.flash_tiles(head_dim):
        for pos in (0, 33, total - 1):
            out = torch.zeros_like(q)
            lens = torch.tensor([pos + 1], dtype=torch.int32)
            cpu_attention.paged_decode_attention(q, k_cache, v_cache, out, torch.tensor([pos]), lens, tables, scale)
            assert torch.equal(out[pos], whole[pos]), pos
    args = reference_args(meta, scale)
    ref = paged_attention_torch(q, k_cache.float(), v_cache.float(), *args)
    torch.testing.assert_close(whole, ref, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(9, 3, 64), (8, 1, 32), (4, 4, 16), (6, 2, 20)])
@pytest.mark.parametrize("block_size", [4, 16, 32])
def test_decode_cascade_over_shared_prefix(num_heads: int, num_kv_heads: int, head_dim: int, block_size: int) -> None:
    # Decode sequences whose tables start with the same blocks (a cached prompt prefix): the kernel
    # attends those once for all of them (in tiles of 16 sequences) and merges each one's own part.
    if not cpu_attention.available():
        pytest.skip("no C compiler: the torch fallback is what runs here")
    rng = random.Random(head_dim * 7 + block_size)
    torch.manual_seed(rng.randrange(1000))
    cascade_runs = cpu_attention.flash_tiles(head_dim)
    shared = 96 // block_size
    cases = [
        # 37 sequences (tiles of 16, 16, 5), one of them with a single position of its own
        ([shared * block_size + 1] + [shared * block_size + rng.randint(1, 150) for _ in range(36)], shared),
        # one shorter sequence ends inside the prefix: only the blocks before its last position are shared
        (
            [shared * block_size - 5] + [shared * block_size + rng.randint(1, 40) for _ in range(5)],
            (shared * block_size - 6) // block_size,
        ),
        # three sequences: below the minimum, read one by one
        ([shared * block_size + 7] * 3, 0),
    ]
    for seq_lens, expected in cases:
        meta, q, _, _, k_cache, v_cache = make_batch(
            seq_lens, [1] * len(seq_lens), num_heads, num_kv_heads, head_dim, block_size, shared_blocks=shared
        )
        rows = torch.arange(len(seq_lens))
        tables = meta.block_tables.contiguous()
        assert cpu_attention.cascade_blocks(meta.seq_lens, tables, k_cache, num_heads) == (
            expected if cascade_runs else 0
        )
        scale = head_dim**-0.5
        outs = []
        for cascade in (True, False):
            out = torch.zeros_like(q)
            cpu_attention.paged_decode_attention(
                q, k_cache, v_cache, out, rows, meta.seq_lens, tables, scale, cascade=cascade
            )
            outs.append(out)
        args = reference_args(meta, scale)
        ref = paged_attention_torch(q, k_cache, v_cache, *args)
        torch.testing.assert_close(outs[0], ref, atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(outs[1], ref, atol=2e-5, rtol=1e-4)


def test_backend_cascade_next_to_prefills() -> None:
    # The engine's path: six decodes behind a shared 64-token prefix plus prefill chunks in one step.
    if not cpu_attention.available():
        pytest.skip("no C compiler: the torch fallback is what runs here")
    torch.manual_seed(3)
    seq_lens = [64 + n for n in (5, 30, 17, 1, 60, 44)] + [64 + 40, 64 + 25]
    q_lens = [1] * 6 + [40, 25]
    meta, q, k, v, k_cache, v_cache = make_batch(seq_lens, q_lens, 9, 3, 64, 16, shared_blocks=4)
    backend = TorchAttention()
    backend.prepare(meta)
    out = backend.forward(q, k, v, k_cache, v_cache, meta, 0.125)
    args = reference_args(meta, 0.125)
    torch.testing.assert_close(out, paged_attention_torch(q, k_cache, v_cache, *args), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("use_c", [True, False])
# head_dim 20: masked or portable tails; 64 with 16-token blocks: the engine's shape, prefill's flash tiles.
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(9, 3, 64), (8, 1, 32), (6, 2, 20)])
@pytest.mark.parametrize("block_size", [4, 16])
def test_bf16_cache(
    use_c: bool, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A bf16 cache under fp32 queries (CPU dtype="bfloat16"): the new K/V are written rounded to nearest
    # even, the kernels widen the cache exactly and compute in fp32, so they match the fp32 reference run
    # on the widened cache to fp32 tolerance, and the reference on the unrounded values to bf16's.
    if use_c and not cpu_attention.available():
        pytest.skip("no C compiler: the torch fallback is what runs here")
    if not use_c:
        monkeypatch.setattr(cpu_attention, "available", lambda: False)
    rng = random.Random(head_dim * 13 + block_size)
    torch.manual_seed(rng.randrange(1000))
    shared = 48 // block_size
    verify_lens = [rng.randint(20, 90) for _ in range(7)] + [40]
    cases = [  # decodes and prefill chunks mixed; then six decodes behind a shared prefix (the cascade)
        ([rng.randint(1, 90) for _ in range(4)] + [70, 33], [1, 1, 1, 1, 70, 12], 0),
        ([shared * block_size + rng.randint(1, 60) for _ in range(6)], [1] * 6, shared),
        # speculative verification (1 + drafts query tokens each; the avx512 build's decode kernel takes
        # them, tokens x heads rows 4 at a time), chunks of 10 (the most it takes over a bf16 cache) and 11
        ([*verify_lens, 16, 17], [1, 2, 3, 4, 5, 7, 9, 1, 10, 11], 0),
        # decodes behind a shared prefix (one call, the cascade) beside verification rows (a second call)
        ([shared * block_size + rng.randint(20, 60) for _ in range(6)], [1, 1, 1, 1, 3, 5], shared),
    ]
    for seq_lens, q_lens, shared_blocks in cases:
        meta, q, k, v, k32, v32 = make_batch(
            seq_lens, q_lens, num_heads, num_kv_heads, head_dim, block_size, shared_blocks=shared_blocks
        )
        k_cache, v_cache = k32.bfloat16(), v32.bfloat16()
        backend = TorchAttention()
        backend.prepare(meta)
        out = backend.forward(q, k, v, k_cache, v_cache, meta, head_dim**-0.5)
        assert out.dtype == torch.float32
        written = k_cache.view(-1, num_kv_heads, head_dim)[meta.slot_mapping]
        assert torch.equal(written, k.bfloat16())  # torch's rounding: to nearest, ties to even
        assert torch.equal(v_cache.view(-1, num_kv_heads, head_dim)[meta.slot_mapping], v.bfloat16())
        args = (meta.query_start_loc, meta.seq_lens, meta.block_tables, head_dim**-0.5)
        lens = (meta.max_query_len, meta.max_seq_len)
        ref = paged_attention_torch(q, k_cache.float(), v_cache.float(), *args, *lens)
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
        # Against the fp32 cache with the new K/V unrounded: bf16's 8-bit mantissa on every K/V value.
        k32.view(-1, num_kv_heads, head_dim)[meta.slot_mapping] = k
        v32.view(-1, num_kv_heads, head_dim)[meta.slot_mapping] = v
        torch.testing.assert_close(out, paged_attention_torch(q, k32, v32, *args, *lens), atol=3e-2, rtol=2e-2)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
def test_multi_query_only_where_supported(kv_dtype: torch.dtype) -> None:
    # Several queries per sequence in the decode kernel: the avx512 build; elsewhere the call is refused
    # (nothing written), never computed as if each sequence had one query.
    if not cpu_attention.available():
        pytest.skip("no C compiler: the torch fallback is what runs here")
    meta, q, _, _, k32, v32 = make_batch([9, 5], [3, 1], 2, 1, 16, 4)
    k_cache, v_cache = k32.to(kv_dtype), v32.to(kv_dtype)
    out = torch.zeros_like(q)
    rows, q_lens = torch.tensor([0, 3]), torch.tensor([3, 1], dtype=torch.int32)
    args = (rows, meta.seq_lens, meta.block_tables, 0.25)
    if not cpu_attention.multi_query_supported(kv_dtype):
        with pytest.raises(RuntimeError, match="multi_query_supported"):
            cpu_attention.paged_decode_attention(q, k_cache, v_cache, out, *args, q_lens=q_lens)
        assert not out.any()
        return
    cpu_attention.paged_decode_attention(q, k_cache, v_cache, out, *args, q_lens=q_lens)
    ref = paged_attention_torch(q, k_cache.float(), v_cache.float(), meta.query_start_loc, *args[1:], 3, 9)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)


def test_cache_dtypes_must_match() -> None:
    if not cpu_attention.available():
        pytest.skip("no C compiler: the torch fallback is what runs here")
    meta, q, _, _, k_cache, v_cache = make_batch([5], [1], 2, 1, 16, 4)
    out = torch.empty_like(q)
    with pytest.raises(TypeError, match="float32 or bfloat16"):
        cpu_attention.paged_decode_attention(
            q, k_cache, v_cache.bfloat16(), out, torch.arange(1), meta.seq_lens, meta.block_tables, 0.25
        )


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
def test_write_kv_cache_rounds_as_torch(kv_dtype: torch.dtype) -> None:
    # The C writer stores what torch's index_copy_ of k.to(cache dtype) stores, bit for bit: ties to even,
    # NaN, infinities, signed zeros, subnormals; k and v read as strided views (the qkv output), padding
    # slots (-1) skipped.
    torch.manual_seed(0)
    num_kv_heads, head_dim, n = 2, 8, 6
    qkv = torch.randn(n, 5 * num_kv_heads * head_dim)
    special = torch.tensor(
        [1.0 + 2**-8, 1.0 + 3 * 2**-8, float("nan"), float("inf"), -float("inf"), -0.0, 1e-40, -3.4e38],
        dtype=torch.float32,
    )
    qkv[0, : special.numel()] = special
    k = qkv[:, : num_kv_heads * head_dim].view(n, num_kv_heads, head_dim)
    v = qkv[:, 3 * num_kv_heads * head_dim : 4 * num_kv_heads * head_dim].view(n, num_kv_heads, head_dim)
    slots = torch.tensor([5, 0, -1, 9, 3, 11])
    caches = [torch.zeros(3, 4, num_kv_heads, head_dim, dtype=kv_dtype) for _ in range(4)]
    cpu_attention.write_kv_cache(k, v, caches[0], caches[1], slots)
    keep = slots >= 0
    write_kv_cache_torch(k[keep], v[keep], caches[2], caches[3], slots[keep])
    for ours, torchs in ((caches[0], caches[2]), (caches[1], caches[3])):
        nan = ours.isnan()
        assert torch.equal(nan, torchs.isnan())  # NaN stays NaN (torch's own payloads differ by code path)
        bits = torch.int16 if kv_dtype == torch.bfloat16 else torch.int32
        assert torch.equal(ours.view(bits)[~nan], torchs.view(bits)[~nan])


@pytest.mark.parametrize("src_dtype", [torch.float32, torch.bfloat16], ids=["reference", "fallback"])
def test_torch_writer_skips_padding_slots(src_dtype: torch.dtype) -> None:
    # The torch writer is the fallback behind write_kv_cache (bf16 K/V, no compiler, odd strides): it keeps
    # the C writer's padding rule, so a -1 slot neither raises nor lands in any block. bf16 K/V send
    # cpu_attention.write_kv_cache to that fallback on every machine.
    torch.manual_seed(0)
    num_kv_heads, head_dim, n = 2, 8, 5
    k = torch.randn(n, num_kv_heads, head_dim).to(src_dtype)
    v = torch.randn(n, num_kv_heads, head_dim).to(src_dtype)
    slots = torch.tensor([-1, 7, 2, -1, 10])
    keep = slots >= 0
    expected = [torch.zeros(3, 4, num_kv_heads, head_dim) for _ in range(2)]
    expected[0].view(-1, num_kv_heads, head_dim)[slots[keep]] = k[keep].float()
    expected[1].view(-1, num_kv_heads, head_dim)[slots[keep]] = v[keep].float()
    for write in (write_kv_cache_torch, cpu_attention.write_kv_cache):
        caches = [torch.zeros(3, 4, num_kv_heads, head_dim) for _ in range(2)]
        write(k, v, caches[0], caches[1], slots)
        assert torch.equal(caches[0], expected[0]) and torch.equal(caches[1], expected[1])


# ---- The bf16 cache's decode and prefill on AVX512-bf16 dot products (VDPBF16PS; cpu_attention.dp_attention_enabled).
# The suite caps the instruction set at avx512 (tests/conftest.py), which keeps every test above on fp32
# arithmetic; these lift the cap to avx512_bf16 themselves. q (scaled) and the softmax numerators are rounded
# to bf16 there, so results are held to bf16 tolerances against float64 on the same bf16 K/V, and to a tight
# one against a float64 emulation of exactly that rounding.
DP_ATOL = DP_RTOL = 2e-2


@pytest.fixture
def dp_on(isa_variant: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if isa_variant != "avx512":
        pytest.skip(f"the dp attention paths are built only in the avx512 variant, not {isa_variant}")
    if "avx512_bf16" not in cpu_isa.current().probed:
        pytest.skip("this CPU does not run AVX512-bf16 (VDPBF16PS): the fp32-arithmetic paths run")
    if not cpu_attention.available():
        pytest.skip("no C compiler: the torch fallback is what runs here")
    monkeypatch.setenv(cpu_isa.ENV_CAP, "avx512_bf16")
    monkeypatch.delenv(cpu_attention.DISABLE_DP_ENV, raising=False)
    # where this CPU's dot products are slower than its FMAs the fp32-arithmetic task runs (test_dp_switch); the dp
    # task is tested here all the same, as it runs where they are not
    monkeypatch.setattr(cpu_isa.CpuIsa, "bf16_products_on_fma", property(lambda self: False))
    assert cpu_attention.dp_attention_enabled(torch.bfloat16)


def bf16_cache_batch(
    seq_lens: list[int],
    q_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    shared_blocks: int = 0,
) -> tuple[AttentionMetadata, torch.Tensor, torch.Tensor, torch.Tensor]:
    """make_batch's metadata, q and caches, the caches rounded to bf16."""
    meta, q, _, _, k32, v32 = make_batch(seq_lens, q_lens, num_heads, num_kv_heads, head_dim, block_size, shared_blocks)
    return meta, q, k32.bfloat16(), v32.bfloat16()


def decode(
    meta: AttentionMetadata,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    threads: int = 1,
    cascade: bool = True,
    multi_query: bool = False,
) -> torch.Tensor:
    """The decode kernel on every row of q (each sequence's last q_lens positions with ``multi_query``) with
    ``threads`` (1: a task per sequence; more threads than sequences: a task per (sequence, kv head))."""
    q_lens = torch.tensor(meta.query_lens_cpu, dtype=torch.int32)
    rows = meta.query_start_loc[:-1].long()
    out = torch.zeros_like(q)
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        cpu_attention.paged_decode_attention(
            q,
            k_cache,
            v_cache,
            out,
            rows,
            meta.seq_lens,
            meta.block_tables.contiguous(),
            q.shape[-1] ** -0.5,
            cascade=cascade,
            q_lens=q_lens if multi_query else None,
        )
    finally:
        torch.set_num_threads(saved)
    return out


def reference64(meta: AttentionMetadata, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
    """The attention in float64 on the same (bf16) K/V values."""
    args = (meta.query_start_loc, meta.seq_lens, meta.block_tables, q.shape[-1] ** -0.5)
    lens = (meta.max_query_len, meta.max_seq_len)
    return paged_attention_torch(q.double(), k_cache.double(), v_cache.double(), *args, *lens).float()


def dp_emulation(
    meta: AttentionMetadata, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor
) -> torch.Tensor:
    """What the dp task computes, in float64: q * scale rounded to bf16, scores, max and sum unrounded, the
    numerators exp(score - max) rounded to bf16 (from fp32) before they weight V; causal among a sequence's
    queries."""
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    group = q.shape[1] // num_kv_heads
    out = torch.zeros_like(q)
    starts = meta.query_start_loc.tolist()
    for i, (n, ql) in enumerate(zip(meta.seq_lens_cpu, meta.query_lens_cpu, strict=True)):
        table = meta.block_tables[i, : -(-n // block_size)].long()
        keys = k_cache[table].reshape(-1, num_kv_heads, head_dim)[:n].double().repeat_interleave(group, 1)
        values = v_cache[table].reshape(-1, num_kv_heads, head_dim)[:n].double().repeat_interleave(group, 1)
        for j in range(ql):
            qs = (q[starts[i] + j] * head_dim**-0.5).bfloat16().double()  # [H, D]
            visible = n - ql + j + 1
            scores = torch.einsum("hd,thd->ht", qs, keys[:visible])
            numer = torch.exp(scores - scores.max(1, keepdim=True).values)
            weights = numer.float().bfloat16().double()
            sums = numer.sum(1, keepdim=True)
            out[starts[i] + j] = (torch.einsum("ht,thd->hd", weights, values[:visible]) / sums).float()
    return out


# Groups 1, 3, 4 and 8; head_dim 64, 128 and two not a multiple of 32 (80: 64 + a masked 16; 20: one masked
# chunk); blocks of 16 and 4, contexts not multiples of either, odd ones (a block's lone last token).
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim"), [(4, 4, 64), (9, 3, 64), (8, 2, 128), (8, 1, 80), (6, 2, 20)]
)
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.usefixtures("dp_on")
def test_dp_decode_matches_reference(num_heads: int, num_kv_heads: int, head_dim: int, block_size: int) -> None:
    rng = random.Random(head_dim * 31 + block_size + num_heads)
    torch.manual_seed(rng.randrange(1000))
    many = [rng.randint(1, 150) for _ in range(9)] + [block_size * 3 + 1, block_size - 1, 1, 2 * block_size + 3]
    for seq_lens in ([rng.randint(200, 300) * 2 + 1], many):  # a single (long, odd) sequence; many
        meta, q, k_cache, v_cache = bf16_cache_batch(
            seq_lens, [1] * len(seq_lens), num_heads, num_kv_heads, head_dim, block_size
        )
        per_seq = decode(meta, q, k_cache, v_cache)
        per_head = decode(meta, q, k_cache, v_cache, threads=len(seq_lens) + 1)
        assert torch.equal(per_seq, per_head)  # the same arithmetic in the same order, task by task
        torch.testing.assert_close(per_seq, reference64(meta, q, k_cache, v_cache), atol=DP_ATOL, rtol=DP_RTOL)
        torch.testing.assert_close(per_seq, dp_emulation(meta, q, k_cache, v_cache), atol=2e-4, rtol=1e-3)


# Speculative verification and short chunks: 2..10 queries per sequence, causal among themselves.
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(9, 3, 64), (8, 1, 128), (8, 2, 80), (6, 2, 20)])
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.usefixtures("dp_on")
def test_dp_multi_query(num_heads: int, num_kv_heads: int, head_dim: int, block_size: int) -> None:
    rng = random.Random(head_dim * 17 + block_size)
    torch.manual_seed(rng.randrange(1000))
    q_lens = [2, 3, 4, 5, 7, 9, 10, 1, 6]
    seq_lens = [ql + rng.randint(0, 120) for ql in q_lens]
    meta, q, k_cache, v_cache = bf16_cache_batch(seq_lens, q_lens, num_heads, num_kv_heads, head_dim, block_size)
    assert cpu_attention.multi_query_supported(torch.bfloat16)
    out = decode(meta, q, k_cache, v_cache, multi_query=True)
    assert torch.equal(out, decode(meta, q, k_cache, v_cache, threads=len(seq_lens) + 1, multi_query=True))
    torch.testing.assert_close(out, reference64(meta, q, k_cache, v_cache), atol=DP_ATOL, rtol=DP_RTOL)
    torch.testing.assert_close(out, dp_emulation(meta, q, k_cache, v_cache), atol=2e-4, rtol=1e-3)


@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(9, 3, 64), (8, 1, 128), (8, 2, 80)])
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.usefixtures("dp_on")
def test_dp_cascade_over_shared_prefix(num_heads: int, num_kv_heads: int, head_dim: int, block_size: int) -> None:
    # 37 decodes behind a shared 96-token prefix: the prefix pass (fp32 flash tiles, where head_dim % 16 == 0)
    # merged into each dp task's own part, against the same kernel reading every block per sequence.
    rng = random.Random(head_dim * 5 + block_size)
    torch.manual_seed(rng.randrange(1000))
    shared = 96 // block_size
    seq_lens = [shared * block_size + 1] + [shared * block_size + rng.randint(1, 150) for _ in range(36)]
    meta, q, k_cache, v_cache = bf16_cache_batch(
        seq_lens, [1] * len(seq_lens), num_heads, num_kv_heads, head_dim, block_size, shared_blocks=shared
    )
    expected = shared if cpu_attention.flash_tiles(head_dim) else 0
    assert cpu_attention.cascade_blocks(meta.seq_lens, meta.block_tables.contiguous(), k_cache, num_heads) == expected
    ref = reference64(meta, q, k_cache, v_cache)
    for cascade in (True, False):
        out = decode(meta, q, k_cache, v_cache, cascade=cascade)
        torch.testing.assert_close(out, ref, atol=DP_ATOL, rtol=DP_RTOL)
    # Without the cascade the whole context goes through the dp task: exactly its rounding.
    torch.testing.assert_close(out, dp_emulation(meta, q, k_cache, v_cache), atol=2e-4, rtol=1e-3)


@pytest.mark.usefixtures("dp_on")
def test_dp_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    # PAGEDQ_DISABLE_DP_ATTENTION=1 puts a bf16 cache back on the fp32-arithmetic task (the bits the avx512
    # cap gives, and the fp32 reference within 2e-5); with it unset, the dp task runs (different bits, bf16's
    # tolerance). An fp32 cache never takes the dp task.
    torch.manual_seed(7)
    q_lens = [1, 1, 3, 1, 9, 1]
    meta, q, k_cache, v_cache = bf16_cache_batch([77, 5, 130, 16, 41, 200], q_lens, 9, 3, 64, 16)
    args = reference_args(meta, 0.125)
    ref32 = paged_attention_torch(q, k_cache.float(), v_cache.float(), *args)
    dp = decode(meta, q, k_cache, v_cache, multi_query=True)
    monkeypatch.setenv(cpu_attention.DISABLE_DP_ENV, "1")
    assert not cpu_attention.dp_attention_enabled(torch.bfloat16)
    off = decode(meta, q, k_cache, v_cache, multi_query=True)
    torch.testing.assert_close(off, ref32, atol=2e-5, rtol=1e-4)
    monkeypatch.delenv(cpu_attention.DISABLE_DP_ENV)
    monkeypatch.setenv(cpu_isa.ENV_CAP, "avx512")
    assert not cpu_attention.dp_attention_enabled(torch.bfloat16)
    assert torch.equal(decode(meta, q, k_cache, v_cache, multi_query=True), off)
    assert not torch.equal(dp, off)
    torch.testing.assert_close(dp, ref32, atol=DP_ATOL, rtol=DP_RTOL)
    monkeypatch.setenv(cpu_isa.ENV_CAP, "avx512_bf16")
    assert not cpu_attention.dp_attention_enabled(torch.float32)
    # where the dot products multiply slower than fp32 FMAs, the fp32-arithmetic task: off's bits
    monkeypatch.setattr(cpu_isa.CpuIsa, "bf16_products_on_fma", property(lambda self: True))
    assert not cpu_attention.dp_attention_enabled(torch.bfloat16)
    assert torch.equal(decode(meta, q, k_cache, v_cache, multi_query=True), off)


def _prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    q_lens: list[int],
    scale: float,
) -> torch.Tensor:
    """The prefill kernel over every sequence of ``meta`` (chunks of ``q_lens`` queries), into a fresh output."""
    out = torch.zeros_like(q)
    starts = meta.query_start_loc[:-1].to(torch.int64).contiguous()
    lens = torch.tensor(q_lens, dtype=torch.int32)
    tables = meta.block_tables.contiguous()
    cpu_attention.paged_prefill_attention(q, k_cache, v_cache, out, starts, lens, meta.seq_lens, tables, scale)
    return out


# Groups of 1, 3 and 4 query heads per kv head (R = 16, 48, 64 rows per tile: one, three and four 16-row
# vectors), head_dim 16-128; blocks of 16 and of 7 (chunks of 64 keys across blocks, not aligned to them).
# Sequences: a whole 300-token prompt (not a multiple of 16 or 64), a 70-token chunk after 180 cached, tiles
# of fewer than 16 queries (13, 5, 1), a prompt of 77.
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim"),
    [(9, 3, 64), (4, 4, 64), (8, 2, 128), (4, 1, 128), (6, 2, 32), (4, 4, 16)],
)
@pytest.mark.parametrize("block_size", [16, 7])
def test_prefill_dp_matches_reference(
    dp_on: None, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The bf16 cache's products on AVX512-bf16 dot products: q and the softmax numerators rounded to bf16, fp32
    # sums. Against float64 attention over the same (bf16) K/V: bf16's rounding of q and P, not fp32's, bounds it.
    torch.manual_seed(head_dim * 31 + block_size + num_heads)
    seq_lens, q_lens = [300, 250, 45, 77, 9, 131], [300, 70, 13, 77, 5, 1]
    meta, q, _, _, k32, v32 = make_batch(seq_lens, q_lens, num_heads, num_kv_heads, head_dim, block_size)
    k_cache, v_cache = k32.bfloat16(), v32.bfloat16()
    scale = head_dim**-0.5
    out = _prefill(q, k_cache, v_cache, meta, q_lens, scale)
    args = reference_args(meta, scale)
    ref = paged_attention_torch(q.double(), k_cache.double(), v_cache.double(), *args).float()
    torch.testing.assert_close(out, ref, atol=1e-2, rtol=1e-2)
    # the dot-product path ran: the fp32 path's result (switched off) is within fp32 rounding of the reference
    monkeypatch.setenv(cpu_attention.DISABLE_DP_ENV, "1")
    widened = _prefill(q, k_cache, v_cache, meta, q_lens, scale)
    torch.testing.assert_close(widened, ref, atol=2e-5, rtol=1e-4)
    assert (out - widened).abs().max() > 1e-5


def test_prefill_dp_switched_off(dp_on: None, monkeypatch: pytest.MonkeyPatch) -> None:
    # PAGEDQ_DISABLE_DP_ATTENTION=1: the bf16 cache is widened and multiplied in fp32, as over an fp32 cache of
    # the same values (fp32 tolerance), even where AVX512-bf16 runs.
    monkeypatch.setenv(cpu_attention.DISABLE_DP_ENV, "1")
    assert not cpu_attention.dp_attention_enabled(torch.bfloat16)
    torch.manual_seed(5)
    seq_lens, q_lens = [200, 90, 33], [200, 40, 33]
    meta, q, _, _, k32, v32 = make_batch(seq_lens, q_lens, 9, 3, 64, 16)
    k_cache, v_cache = k32.bfloat16(), v32.bfloat16()
    out = _prefill(q, k_cache, v_cache, meta, q_lens, 0.125)
    fp32 = _prefill(q, k_cache.float(), v_cache.float(), meta, q_lens, 0.125)
    torch.testing.assert_close(out, fp32, atol=2e-5, rtol=1e-4)
