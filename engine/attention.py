"""Attention backends: write the new tokens' K/V into the paged cache, then attend through block tables.

A backend plans once per step (``prepare``: index tensors shared by every layer) and is then called
once per layer (``forward``). ``torch`` is the CPU path; ``triton`` runs the kernels in ``pagedq_kernels/``
(natively on CUDA, through the interpreter on CPU).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from engine.attention_metadata import AttentionMetadata
from pagedq_kernels import cpu_attention, kernel_call


class AttentionBackend(Protocol):
    name: str

    def prepare(self, meta: AttentionMetadata) -> None: ...

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor: ...


@dataclass
class _Prefill:
    rows: slice  # this sequence's query rows in the flattened batch
    blocks: torch.Tensor  # [num_blocks] its context's blocks, in order
    seq_len: int
    mask: torch.Tensor | None  # [q_len, seq_len] causal mask; None when the chunk is the whole context


@dataclass
class _PrefillBatch:
    """Every prefill chunk of the step, for one call of the C prefill kernel."""

    q_starts: torch.Tensor  # int64 [Sp] first query row of each chunk
    q_lens: torch.Tensor  # int32 [Sp]
    seq_lens: torch.Tensor  # int32 [Sp]
    tables: torch.Tensor  # int32 [Sp, max_blocks]


@dataclass
class _DecodeRows:
    """Sequences for one call of the C decode kernel."""

    rows: torch.Tensor  # int64 [Sd] first query row of each sequence
    q_lens: torch.Tensor | None  # int32 [Sd]; None: one query each
    seq_lens: torch.Tensor  # int32 [Sd]
    tables: torch.Tensor  # int32 [Sd, max_blocks]
    max_len: int


@dataclass
class _Split:
    """The step's sequences split between the C decode kernel and the prefill kernel (longer chunks)."""

    decode: _DecodeRows  # single-token queries: one call, where a shared prefix is attended once (cascade)
    verify: _DecodeRows | None  # 2 to decode_max_q queries each: a second call, the multi-query task
    prefill_batch: _PrefillBatch | None


# Query chunks of up to this many tokens (by cache dtype) go to the decode kernel where it takes several per
# sequence (cpu_attention.multi_query_supported: the avx512 build): speculative verification (1 + up to 8
# drafts). Short prompt tails did too, until a prefix-cache hit was seen to change a request's logprobs in the
# last bit (the tail on the decode kernel, the whole prompt on the prefill kernel): they stay on the prefill one.
# Measured in pagedq_kernels/csrc/cpu_attention.c (paged_decode_attention_f32's
# comment) against the prefill kernel: the crossover lies at 11-12 queries over a bf16 cache, past 16 over
# an fp32 one (whose prefill path copies twice the bytes per key).
MULTI_QUERY_MAX = {torch.bfloat16: 10, torch.float32: 16}


@dataclass
class _TorchPlan:
    # The step's batch (what _split reads; the plan lives in meta.backend_state, so it holds these, not meta)
    query_start_loc: torch.Tensor
    seq_lens_tensor: torch.Tensor
    block_tables: torch.Tensor
    q_lens: list[int]
    seq_lens: list[int]
    prompt_chunks: list[bool]  # AttentionMetadata.prompt_chunks_cpu (empty: not known)
    single: _Split  # decode kernel for single-token queries only
    prefills: list[_Prefill]
    multi: _Split | None = None  # decode kernel up to multi_max tokens; made on first use in a step
    multi_max: int = 0

    def multi_query(self, max_q: int) -> _Split:
        if self.multi is None or self.multi_max != max_q:
            batch = (self.query_start_loc, self.seq_lens_tensor, self.block_tables)
            self.multi, self.multi_max = _split(*batch, self.q_lens, self.seq_lens, max_q, self.prompt_chunks), max_q
        return self.multi


def _split(
    query_start_loc: torch.Tensor,
    seq_lens_tensor: torch.Tensor,
    block_tables: torch.Tensor,
    q_lens: list[int],
    seq_lens: list[int],
    decode_max_q: int,
    prompt_chunks: list[bool] | None = None,
) -> _Split:
    def rows(chosen: list[int], with_q_lens: bool) -> _DecodeRows:
        idx = torch.tensor(chosen, dtype=torch.long)
        return _DecodeRows(
            rows=query_start_loc.long()[idx].contiguous(),
            q_lens=torch.tensor([q_lens[i] for i in chosen], dtype=torch.int32) if with_q_lens else None,
            seq_lens=seq_lens_tensor[idx].to(torch.int32).contiguous(),
            tables=block_tables[idx].to(torch.int32).contiguous(),
            max_len=max((seq_lens[i] for i in chosen), default=0),
        )

    # A prompt's chunk, however short the prefix cache left it (one token included), goes to the prefill kernel as
    # the whole prompt would (the same floats); decode tokens and verification chunks to the decode kernel.
    prompt = prompt_chunks or [n > decode_max_q for n in q_lens]
    single = [i for i, n in enumerate(q_lens) if n == 1 and not prompt[i]]
    verify = [i for i, n in enumerate(q_lens) if 1 < n <= decode_max_q and not prompt[i]]
    pre = [i for i, n in enumerate(q_lens) if n > decode_max_q or prompt[i]]
    batch = None
    if pre and block_tables.device.type == "cpu":
        pre_idx = torch.tensor(pre, dtype=torch.long)
        batch = _PrefillBatch(
            q_starts=query_start_loc.long()[pre_idx].contiguous(),
            q_lens=torch.tensor([q_lens[i] for i in pre], dtype=torch.int32),
            seq_lens=seq_lens_tensor[pre_idx].to(torch.int32).contiguous(),
            tables=block_tables[pre_idx].to(torch.int32).contiguous(),
        )
    return _Split(
        decode=rows(single, False),
        verify=rows(verify, True) if verify else None,
        prefill_batch=batch,
    )


class TorchAttention:
    """CPU backend.

    Decode tokens (one query each, the bulk of a busy step) and prefill chunks each go through a C
    kernel that reads the cache in place (``pagedq_kernels/cpu_attention``), one call per layer for all of
    them; without a compiler, or for queries other than float32, torch paths gather the blocks instead
    (decode: one batched SDPA; prefill: one per chunk).
    The cache may hold a narrower dtype than the queries (bf16 under fp32 activations: half the bytes):
    the K/V are written rounded to nearest even, and read back widened to the queries' dtype. In the avx512
    build, chunks of up to :data:`MULTI_QUERY_MAX` queries of speculative verification go to the decode
    kernel too, which reads every K/V row once for all of a sequence's queries (a prompt's chunk never does:
    ``AttentionMetadata.prompt_chunks_cpu``).
    """

    name = "torch"

    def prepare(self, meta: AttentionMetadata) -> None:
        q_lens = meta.query_lens_cpu or (meta.query_start_loc[1:] - meta.query_start_loc[:-1]).tolist()
        seq_lens = meta.seq_lens_cpu or meta.seq_lens.tolist()
        starts = meta.query_start_loc.tolist()
        prefills = [
            _Prefill(
                slice(starts[i], starts[i] + q_lens[i]),
                meta.block_tables[i],
                seq_lens[i],
                _chunk_mask(q_lens[i], seq_lens[i], meta.block_tables.device),
            )
            for i, n in enumerate(q_lens)
            if n > 1 or (meta.prompt_chunks_cpu and meta.prompt_chunks_cpu[i])
        ]
        batch = (meta.query_start_loc, meta.seq_lens, meta.block_tables)
        single = _split(*batch, q_lens, seq_lens, 1, meta.prompt_chunks_cpu)
        meta.backend_state = _TorchPlan(*batch, q_lens, seq_lens, meta.prompt_chunks_cpu, single, prefills)

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
        out = q.new_empty(q.shape)
        calls = self.kernel_calls(q, k, v, [(k_cache, v_cache)], out, meta, scale)
        if calls is not None:
            kernel_call.run(calls[0])
            return out
        # Some part takes a torch path (no C kernels, other dtypes or layouts): each part on its own.
        cpu_attention.write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping)
        plan: _TorchPlan = meta.backend_state
        c_decode = _c_decode_ok(q, k_cache)
        split = self._split(plan, k_cache) if c_decode else plan.single
        decode = split.decode
        if decode.rows.numel():
            if c_decode:
                cpu_attention.paged_decode_attention(
                    q, k_cache, v_cache, out, decode.rows, decode.seq_lens, decode.tables, scale
                )
            else:
                out[decode.rows] = _decode_torch(q[decode.rows], k_cache, v_cache, decode, scale)
        if split.verify is not None:  # only in a multi-query split: c_decode, and the kernel takes them
            verify = split.verify
            cpu_attention.paged_decode_attention(
                q, k_cache, v_cache, out, verify.rows, verify.seq_lens, verify.tables, scale, q_lens=verify.q_lens
            )
        if split.prefill_batch is not None and _c_prefill_ok(q, k_cache):
            b = split.prefill_batch
            cpu_attention.paged_prefill_attention(
                q, k_cache, v_cache, out, b.q_starts, b.q_lens, b.seq_lens, b.tables, scale
            )
        elif split is plan.single:
            for p in plan.prefills:
                out[p.rows] = _prefill_torch(q[p.rows], k_cache, v_cache, p, scale)
        else:  # only the chunks the decode kernel did not take
            taken = set(split.verify.rows.tolist()) if split.verify is not None else set()
            for p in plan.prefills:
                if p.rows.start not in taken:
                    out[p.rows] = _prefill_torch(q[p.rows], k_cache, v_cache, p, scale)
        return out

    def kernel_calls(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
        out: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> list[list[kernel_call.KernelCall]] | None:
        """The C calls :meth:`forward` makes, for each ``(k_cache, v_cache)`` of ``caches`` (one per layer, all of
        one shape, dtype and layout), into ``out`` (``q``'s shape, contiguous): the KV write, then decode,
        verification and prefill attention as the step's plan splits its sequences; None where any part would
        take a torch path. What a whole-step plan (``engine/models/llama_cpu_plan.py``) strings together for
        every layer of a step: the checks run once, on the first layer's caches."""
        first_k, first_v = caches[0]
        supported = cpu_attention.write_kv_cache_supported(k, v, first_k, first_v, meta.slot_mapping)
        if not supported or not _c_decode_ok(q, first_k):
            return None
        plan: _TorchPlan = meta.backend_state
        split = self._split(plan, first_k)
        if split.prefill_batch is not None and not _c_prefill_ok(q, first_k):
            return None
        use_dp = cpu_attention.dp_attention_enabled(first_k.dtype)
        runs = [r for r in (split.decode, split.verify) if r is not None and r.rows.numel()]
        kinds = [cpu_attention.write_kv_cache_calls(k, v, caches, meta.slot_mapping)]
        for rows in runs:
            operands = (rows.rows, rows.seq_lens, rows.tables, scale)
            kinds.append(cpu_attention.decode_calls(q, caches, out, *operands, q_lens=rows.q_lens, use_dp=use_dp))
        if split.prefill_batch is not None:
            b = split.prefill_batch
            batch = (b.q_starts, b.q_lens, b.seq_lens, b.tables, scale)
            kinds.append(cpu_attention.prefill_calls(q, caches, out, *batch, use_dp=use_dp))
        return [list(layer) for layer in zip(*kinds, strict=True)]

    @staticmethod
    def _split(plan: _TorchPlan, k_cache: torch.Tensor) -> _Split:
        """The step's split for the C decode kernel: chunks of up to :data:`MULTI_QUERY_MAX` queries join the
        decode call where the kernel takes several per sequence and the step has any."""
        max_q = MULTI_QUERY_MAX.get(k_cache.dtype, 1)
        if plan.prefills and max_q > 1 and cpu_attention.multi_query_supported(k_cache.dtype):
            return plan.multi_query(max_q)
        return plan.single


def _c_decode_ok(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    return (
        q.dtype == torch.float32
        and q.stride(-1) == 1
        and k_cache.dtype in cpu_attention.KV_DTYPES
        and cpu_attention.available()
    )


def _c_prefill_ok(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    return (
        q.dtype == torch.float32
        and k_cache.dtype in cpu_attention.KV_DTYPES
        and q.stride(-1) == 1
        and k_cache.is_contiguous()
        and cpu_attention.available()
    )


def _chunk_mask(q_len: int, seq_len: int, device: torch.device) -> torch.Tensor | None:
    if q_len == seq_len:
        return None
    k_pos = torch.arange(seq_len, device=device)
    q_pos = torch.arange(seq_len - q_len, seq_len, device=device)
    return k_pos[None, :] <= q_pos[:, None]


def _context(cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """``[..., num_blocks]`` block ids -> ``[..., KVH, num_blocks * block_size, D]`` (one copy)."""
    gathered = cache[blocks]  # [..., nb, bs, KVH, D]
    shape = gathered.shape
    flat = gathered.reshape(*shape[:-4], shape[-4] * shape[-3], shape[-2], shape[-1])
    return flat.transpose(-3, -2)


def _decode_torch(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: _DecodeRows, scale: float
) -> torch.Tensor:
    block_size = k_cache.shape[1]
    num_blocks = -(-plan.max_len // block_size)
    tables = plan.tables[:, :num_blocks].long()
    k = _context(k_cache, tables).to(q.dtype)  # [Sd, KVH, L, D]
    v = _context(v_cache, tables).to(q.dtype)
    pos = torch.arange(k.shape[2], device=q.device)
    mask = (pos[None, :] < plan.seq_lens[:, None].long())[:, None, None, :]
    out = F.scaled_dot_product_attention(
        q[:, :, None, :], k, v, attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
    )
    return out[:, :, 0, :]


def _prefill_torch(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, p: _Prefill, scale: float
) -> torch.Tensor:
    num_blocks = -(-p.seq_len // k_cache.shape[1])
    blocks = p.blocks[:num_blocks].long()
    k = _context(k_cache, blocks)[:, : p.seq_len].to(q.dtype)  # [KVH, L, D]
    v = _context(v_cache, blocks)[:, : p.seq_len].to(q.dtype)
    # 4-D inputs: with 3-D ones torch's CPU SDPA takes the slow "math" path instead of flash (3-4x).
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        k[None],
        v[None],
        attn_mask=p.mask,
        is_causal=p.mask is None,
        scale=scale,
        enable_gqa=q.shape[1] != k.shape[0],
    )
    return out[0].transpose(0, 1)


def get_attention_backend(name: str) -> AttentionBackend:
    if name == "torch":
        return TorchAttention()
    if name == "triton":
        from engine.triton_attention import TritonAttention

        return TritonAttention()
    raise ValueError(f"unknown attention backend {name!r}; choose 'torch' or 'triton'")
