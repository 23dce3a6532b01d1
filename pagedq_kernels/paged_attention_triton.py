"""Causal paged attention of a mixed (prefill + decode) flattened batch: the Triton kernels.

Computes exactly what ``pagedq_kernels.paged_attention.paged_attention_torch`` computes (layouts: see
``engine.attention_metadata``), in one launch for the whole batch:

* **Varlen queries, no padding.** Each sequence's query rows are cut into blocks of ``BLOCK_Q``
  rows. Sequence ``i``'s blocks are numbered from ``query_start_loc[i] // BLOCK_Q + i``; that
  numbering is strictly increasing and leaves every sequence enough blocks, so the grid
  ``num_tokens // BLOCK_Q + num_seqs`` is a host-side upper bound (no device sync, graph
  friendly) and a program finds its sequence with a binary search over ``query_start_loc``.
  Programs past the end of their sequence's queries return at once.
* **Grouped query heads share K/V loads.** A program owns one KV head and the ``GROUP`` query
  heads that read it: its query tile has ``BLOCK_M = BLOCK_Q * GROUP`` (padded) rows, row ``m``
  being query row ``m // GROUP`` and head ``m % GROUP`` of the group. Every K/V tile is loaded
  once and used by all heads of the group (MHA: GROUP 1, MQA: GROUP = num_heads).
* **K/V read in place.** Each key tile resolves its tokens' physical blocks through the block
  table row and loads straight from the cache; nothing is gathered into contiguous copies, and
  any block size works (the tile may span several cache blocks).
* **Online softmax in fp32** (log2 domain: ``exp2`` with the scale folded into ``log2(e)``),
  matmuls on the input dtype with fp32 accumulation. fp32 inputs use IEEE matmuls (not TF32) so
  the fp32 path is as accurate as the reference.
* **Split-KV (flash decoding).** A decode step with few sequences and long contexts would use
  only ``num_seqs * num_kv_heads`` programs and leave most of the GPU idle. The same kernel can
  then also split each context into ``num_splits`` chunks (third grid axis), writing unnormalised
  partial results plus their running max and sum; a small reduce kernel merges them.
  ``choose_num_splits`` decides.

``head_dim`` need not be a power of two (80): tiles use the next power of two and mask.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

# Keys per inner-loop iteration. 32 keeps the S = Q K^T tile and the K/V tiles small enough for
# registers at head_dim 128 with 4 warps on H100/H200, and short contexts need few masked lanes.
TILE_N = 32
# Query-tile rows (query rows x grouped heads). Decode-only batches have one query row per
# sequence, so a 16-row tile (the tl.dot minimum) wastes the least; prefill wants larger tiles
# to reuse each K/V tile across more queries.
BLOCK_M_DECODE = 16
BLOCK_M_PREFILL = 64
# Split-KV heuristic knobs: never give a split fewer keys than this (the reduce and the extra
# partial writes must stay cheap next to the attention work), and never more splits than this.
MIN_KEYS_PER_SPLIT = 256
MAX_SPLITS = 64
LOG2_E = 1.4426950408889634


@triton.jit
def _find_seq_idx(query_start_loc_ptr, q_block_idx, num_seqs, BLOCK_Q: tl.constexpr):
    """Index of the sequence that owns global query block ``q_block_idx``.

    Sequence ``i``'s first block is ``query_start_loc[i] // BLOCK_Q + i`` (strictly increasing in
    ``i``); return the last ``i`` whose first block is ``<= q_block_idx``.
    """
    lo: tl.int32 = 0
    hi: tl.int32 = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_block = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_block <= q_block_idx:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _paged_attention_kernel(
    out_ptr,  # [N, H, D] final output (unused when SPLIT_KV)
    part_acc_ptr,  # [N, H, num_splits, D] fp32 unnormalised partial outputs (SPLIT_KV only)
    part_max_ptr,  # [N, H, num_splits] fp32 running max, log2 domain (SPLIT_KV only)
    part_sum_ptr,  # [N, H, num_splits] fp32 softmax denominators (SPLIT_KV only)
    q_ptr,  # [N, H, D]
    k_cache_ptr,  # [num_blocks, block_size, KVH, D]
    v_cache_ptr,  # [num_blocks, block_size, KVH, D]
    block_tables_ptr,  # [S, max_blocks_per_seq]
    seq_lens_ptr,  # [S]
    query_start_loc_ptr,  # [S + 1]
    scale_log2,  # softmax scale * log2(e)
    num_seqs,
    split_size,  # keys per split (a multiple of TILE_N); unused without SPLIT_KV
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bt,
    stride_pt,
    stride_ph,
    stride_ps,
    stride_mt,
    stride_mh,
    BLOCK_SIZE: tl.constexpr,  # tokens per KV cache block
    GROUP: tl.constexpr,  # query heads per KV head
    BLOCK_Q: tl.constexpr,  # query rows per program
    BLOCK_M: tl.constexpr,  # tile rows, >= BLOCK_Q * GROUP, power of two >= 16
    TILE_N: tl.constexpr,  # keys per iteration
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P2: tl.constexpr,
    SPLIT_KV: tl.constexpr,
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 inputs, None (backend default) otherwise
    DOT_FP32: tl.constexpr,  # run the matmuls in fp32 (interpreter workaround, see _dot_in_fp32)
):
    q_block_idx = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq = _find_seq_idx(query_start_loc_ptr, q_block_idx, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    q_block = q_block_idx - (q_start // BLOCK_Q + seq)
    if q_block * BLOCK_Q >= q_len:
        return  # spare block of the upper-bound grid
    seq_len = tl.load(seq_lens_ptr + seq)
    context_start = seq_len - q_len  # context position of the sequence's first query row

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_P2)
    offs_n = tl.arange(0, TILE_N)
    q_row = q_block * BLOCK_Q + offs_m // GROUP  # query row within the sequence
    head = kv_head * GROUP + offs_m % GROUP
    row_mask = (offs_m < BLOCK_Q * GROUP) & (q_row < q_len)
    d_mask = offs_d < HEAD_DIM
    q_pos = context_start + q_row  # causal limit of each row: keys at positions <= q_pos
    token = (q_start + q_row).to(tl.int64)

    q_offs = token[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptr + q_offs, mask=row_mask[:, None] & d_mask[None, :], other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)

    # Keys visible to the block's last valid row bound the loop (causal); a split takes its chunk.
    last_row = tl.minimum(q_block * BLOCK_Q + BLOCK_Q, q_len) - 1
    kv_end = context_start + last_row + 1
    if SPLIT_KV:
        kv_lo = split * split_size
        kv_hi = tl.minimum(kv_lo + split_size, kv_end)
    else:
        kv_lo = 0
        kv_hi = kv_end

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_P2], dtype=tl.float32)
    block_table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    k_head = k_cache_ptr + kv_head * stride_kh
    v_head = v_cache_ptr + kv_head * stride_vh

    for start_n in range(kv_lo, kv_hi, TILE_N):
        k_pos = start_n + offs_n
        n_mask = k_pos < kv_hi
        # Resolve every key's page through the block table and read the cache in place.
        page = tl.load(block_table + k_pos // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        in_page = k_pos % BLOCK_SIZE
        k_offs = page[None, :] * stride_kb + in_page[None, :] * stride_ks + offs_d[:, None]
        k = tl.load(k_head + k_offs, mask=n_mask[None, :] & d_mask[:, None], other=0.0)  # [D, TILE_N]
        s = tl.dot(q, k.to(q.dtype), input_precision=DOT_PRECISION) * scale_log2
        visible = (k_pos[None, :] <= q_pos[:, None]) & n_mask[None, :]
        s = tl.where(visible, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # A row with nothing visible yet keeps m = -inf; shift by 0 there so exp2 gives 0, not NaN.
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_shift[:, None])
        alpha = tl.exp2(m_i - m_shift)
        l_i = l_i * alpha + tl.sum(p, axis=1)

        v_offs = page[:, None] * stride_vb + in_page[:, None] * stride_vs + offs_d[None, :]
        v = tl.load(v_head + v_offs, mask=n_mask[:, None] & d_mask[None, :], other=0.0)  # [TILE_N, D]
        v = v.to(q.dtype)
        acc = tl.dot(p.to(v.dtype), v, acc=acc * alpha[:, None], input_precision=DOT_PRECISION)
        m_i = m_new

    out_mask = row_mask[:, None] & d_mask[None, :]
    if SPLIT_KV:
        # Written even when the chunk is empty (m = -inf, l = 0): the reduce reads every split.
        p_offs = token[:, None] * stride_pt + head[:, None] * stride_ph + split * stride_ps + offs_d[None, :]
        tl.store(part_acc_ptr + p_offs, acc, mask=out_mask)
        ml_offs = token * stride_mt + head * stride_mh + split
        tl.store(part_max_ptr + ml_offs, m_i, mask=row_mask)
        tl.store(part_sum_ptr + ml_offs, l_i, mask=row_mask)
    else:
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        o = acc / l_safe[:, None]
        o_offs = token[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
        tl.store(out_ptr + o_offs, o.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _split_kv_reduce_kernel(
    out_ptr,  # [N, H, D]
    part_acc_ptr,  # [N, H, num_splits, D]
    part_max_ptr,  # [N, H, num_splits]
    part_sum_ptr,  # [N, H, num_splits]
    num_splits,
    stride_ot,
    stride_oh,
    stride_pt,
    stride_ph,
    stride_ps,
    stride_mt,
    stride_mh,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P2: tl.constexpr,
    SPLITS_P2: tl.constexpr,
):
    """Merge one (token, head)'s split partials: rescale each by exp2(m_s - max m) and normalise."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_P2)
    offs_d = tl.arange(0, HEAD_DIM_P2)
    s_mask = offs_s < num_splits
    d_mask = offs_d < HEAD_DIM

    ml_offs = token * stride_mt + head * stride_mh + offs_s
    m = tl.load(part_max_ptr + ml_offs, mask=s_mask, other=float("-inf"))
    l = tl.load(part_sum_ptr + ml_offs, mask=s_mask, other=0.0)  # noqa: E741
    m_max = tl.max(m, axis=0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.where(m == float("-inf"), 0.0, tl.exp2(m - m_max))  # empty splits weigh nothing
    denom = tl.sum(w * l, axis=0)
    denom = tl.where(denom == 0.0, 1.0, denom)

    a_offs = token * stride_pt + head * stride_ph + offs_s[:, None] * stride_ps + offs_d[None, :]
    a = tl.load(part_acc_ptr + a_offs, mask=s_mask[:, None] & d_mask[None, :], other=0.0)
    a = tl.where(w[:, None] > 0.0, a, 0.0)
    o = tl.sum(a * w[:, None], axis=0) / denom
    o_ptrs = out_ptr + token * stride_ot + head * stride_oh + offs_d
    tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=d_mask)


@functools.lru_cache(maxsize=8)
def _num_sms(device: torch.device) -> int:
    """Streaming multiprocessors to fill; the interpreter on CPU pretends to have a small GPU."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).multi_processor_count)
    return 8


def _dot_in_fp32(kernel: object, dtype: torch.dtype) -> bool:
    """Whether to upcast matmul operands to fp32.

    Triton's CPU interpreter stores bf16 as uint16 and hands those raw bits to ``np.matmul``, so a
    bf16 ``tl.dot`` returns garbage there (triton 3.x). Compiled kernels keep the native dtype.
    """
    return dtype == torch.bfloat16 and type(kernel).__name__ == "InterpretedFunction"


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_query_len: int, max_seq_len: int, num_sms: int) -> int:
    """How many chunks to split each context into (1 = the plain single-pass kernel).

    Split only decode-only steps (every sequence has one query row): prefill already has many
    query blocks to parallelise over. Split only when the plain grid (one program per
    (sequence, KV head)) cannot fill the GPU's SMs, and only as far as each split keeps at least
    ``MIN_KEYS_PER_SPLIT`` keys, so long contexts with few sequences gain and everything else
    stays on the single pass.
    """
    if max_query_len != 1 or num_seqs <= 0:
        return 1
    programs = num_seqs * num_kv_heads
    if programs >= num_sms:
        return 1
    splits = min(triton.cdiv(num_sms, programs), max_seq_len // MIN_KEYS_PER_SPLIT, MAX_SPLITS)
    return max(1, splits)


def _launch_shape(group: int, max_query_len: int) -> tuple[int, int]:
    """``(BLOCK_M, BLOCK_Q)``: tile rows and the query rows they hold (rows = query rows x group)."""
    block_m = BLOCK_M_DECODE if max_query_len <= 1 else BLOCK_M_PREFILL
    block_m = max(block_m, triton.next_power_of_2(group))
    return block_m, block_m // group


def paged_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    max_query_len: int,
    max_seq_len: int,
    *,
    num_splits: int | None = None,
) -> torch.Tensor:
    """``q [N, H, D]`` -> ``[N, H, D]``; same contract as ``paged_attention_torch``.

    The new tokens' K/V must already be in the cache. ``max_query_len`` / ``max_seq_len`` are
    host ints used to plan the launch (tile shape, split-KV) without reading device tensors.
    ``num_splits`` forces the split-KV factor (tests, tuning); ``None`` lets
    ``choose_num_splits`` decide. Rows past ``query_start_loc[-1]`` (padding) are unspecified.
    """
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, cache_head_dim = k_cache.shape
    if cache_head_dim != head_dim or v_cache.shape != k_cache.shape:
        raise ValueError(f"caches {tuple(k_cache.shape)} / {tuple(v_cache.shape)} do not fit q {tuple(q.shape)}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("KV cache head_dim must be contiguous")
    num_seqs = int(seq_lens.shape[0])
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if num_tokens == 0 or num_seqs == 0:
        return out
    if q.stride(-1) != 1:
        q = q.contiguous()
    query_start_loc = query_start_loc.contiguous()
    seq_lens = seq_lens.contiguous()
    if block_tables.stride(-1) != 1:
        block_tables = block_tables.contiguous()

    group = num_heads // num_kv_heads
    block_m, block_q = _launch_shape(group, max_query_len)
    head_dim_p2 = max(16, triton.next_power_of_2(head_dim))
    dot_fp32 = _dot_in_fp32(_paged_attention_kernel, q.dtype)
    # fp32 matmuls in full IEEE precision (the default would be TF32); 16-bit: backend default.
    dot_precision = "ieee" if q.dtype == torch.float32 or dot_fp32 else None
    if num_splits is None:
        num_splits = choose_num_splits(num_seqs, num_kv_heads, max_query_len, max_seq_len, _num_sms(q.device))
    num_splits = max(1, min(num_splits, triton.cdiv(max_seq_len, TILE_N)))
    split_size = triton.cdiv(triton.cdiv(max_seq_len, num_splits), TILE_N) * TILE_N
    num_splits = triton.cdiv(max_seq_len, split_size)  # whole tiles per split can leave some over
    split_kv = num_splits > 1

    if split_kv:
        part_acc = torch.empty((num_tokens, num_heads, num_splits, head_dim), dtype=torch.float32, device=q.device)
        part_max = torch.empty((num_tokens, num_heads, num_splits), dtype=torch.float32, device=q.device)
        part_sum = torch.empty_like(part_max)
    else:  # never touched; any tensor keeps the signature uniform
        part_acc = part_max = part_sum = out

    grid = (num_tokens // block_q + num_seqs, num_kv_heads, num_splits)
    _paged_attention_kernel[grid](
        out,
        part_acc,
        part_max,
        part_sum,
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        float(scale) * LOG2_E,
        num_seqs,
        split_size,
        *q.stride()[:2],
        *out.stride()[:2],
        *k_cache.stride()[:3],
        *v_cache.stride()[:3],
        block_tables.stride(0),
        *part_acc.stride()[:3],
        *part_max.stride()[:2],
        BLOCK_SIZE=block_size,
        GROUP=group,
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        TILE_N=TILE_N,
        HEAD_DIM=head_dim,
        HEAD_DIM_P2=head_dim_p2,
        SPLIT_KV=split_kv,
        DOT_PRECISION=dot_precision,
        DOT_FP32=dot_fp32,
        num_warps=4,
    )
    if split_kv:
        _split_kv_reduce_kernel[(num_tokens, num_heads)](
            out,
            part_acc,
            part_max,
            part_sum,
            num_splits,
            *out.stride()[:2],
            *part_acc.stride()[:3],
            *part_max.stride()[:2],
            HEAD_DIM=head_dim,
            HEAD_DIM_P2=head_dim_p2,
            SPLITS_P2=max(2, triton.next_power_of_2(num_splits)),
            num_warps=4,
        )
    return out


__all__ = ["choose_num_splits", "paged_attention_triton"]
