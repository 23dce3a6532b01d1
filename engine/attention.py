"""Attention backends: write the new tokens' K/V into the paged cache, then attend through block tables.

A backend plans once per step (``prepare``: index tensors shared by every layer) and is then called
once per layer (``forward``). ``torch`` is the CPU path; ``triton`` runs the kernels in ``kernels/``
(natively on CUDA, through the interpreter on CPU).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from engine.attention_metadata import AttentionMetadata
from kernels.kv_cache import write_kv_cache_torch


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
class _PrefillPlan:
    rows: slice  # this sequence's query rows in the flattened batch
    slots: torch.Tensor  # [seq_len] cache slots of its whole context
    mask: torch.Tensor | None  # [q_len, seq_len] causal mask (None when q_len == seq_len: plain causal)


@dataclass
class _TorchPlan:
    decode_rows: torch.Tensor  # [Sd] query rows of single-token sequences
    decode_slots: torch.Tensor  # [Sd, Lmax] cache slots of their contexts (padding repeats a valid slot)
    decode_mask: torch.Tensor  # [Sd, 1, 1, Lmax] additive mask: 0 valid, -inf padding
    prefills: list[_PrefillPlan]
    all_decode: bool


class TorchAttention:
    """CPU backend: decodes batched into one padded attention, prefill chunks one SDPA call each.

    Index tensors are built once per step in ``prepare`` and reused by every layer, so a layer
    costs one slot gather per K and V plus the attention itself.
    """

    name = "torch"

    def prepare(self, meta: AttentionMetadata) -> None:
        # The plan itself needs the block size, which only the cache tensors know: the first
        # layer's forward builds it, the others reuse it.
        q_lens = meta.query_lens_cpu or (meta.query_start_loc[1:] - meta.query_start_loc[:-1]).tolist()
        seq_lens = meta.seq_lens_cpu or meta.seq_lens.tolist()
        starts = meta.query_start_loc.tolist()
        meta.backend_state = _PlanInputs(q_lens, seq_lens, starts)

    def _plan(self, meta: AttentionMetadata, block_size: int) -> _TorchPlan:
        inputs: _PlanInputs = meta.backend_state
        device = meta.block_tables.device
        dec = [i for i, n in enumerate(inputs.q_lens) if n == 1]
        pre = [i for i, n in enumerate(inputs.q_lens) if n > 1]
        tables = meta.block_tables.long()
        if dec:
            dec_t = torch.tensor(dec, device=device)
            lens = meta.seq_lens.long()[dec_t]
            lmax = max(inputs.seq_lens[i] for i in dec)
            pos = torch.arange(lmax, device=device)
            valid = pos[None, :] < lens[:, None]
            pos_c = torch.minimum(pos[None, :], lens[:, None] - 1)
            slots = tables[dec_t[:, None], pos_c // block_size] * block_size + pos_c % block_size
            mask = torch.zeros(valid.shape, dtype=torch.float32, device=device)
            mask.masked_fill_(~valid, float("-inf"))
            rows = meta.query_start_loc.long()[dec_t]
        else:
            rows = torch.empty(0, dtype=torch.long, device=device)
            slots = torch.empty(0, 0, dtype=torch.long, device=device)
            mask = torch.empty(0, 0, device=device)
        prefills = []
        for i in pre:
            seq_len, q_len, start = inputs.seq_lens[i], inputs.q_lens[i], inputs.starts[i]
            pos = torch.arange(seq_len, device=device)
            s = tables[i, pos // block_size] * block_size + pos % block_size
            m = None
            if q_len != seq_len:
                qpos = torch.arange(seq_len - q_len, seq_len, device=device)
                m = pos[None, :] <= qpos[:, None]
            prefills.append(_PrefillPlan(slice(start, start + q_len), s, m))
        return _TorchPlan(rows, slots, mask[:, None, None, :], prefills, not pre)

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
        write_kv_cache_torch(k, v, k_cache, v_cache, meta.slot_mapping)
        inputs: _PlanInputs = meta.backend_state
        if inputs.plan is None:
            inputs.plan = self._plan(meta, k_cache.shape[1])
        plan = inputs.plan
        num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
        flat_k = k_cache.view(-1, num_kv_heads, head_dim)
        flat_v = v_cache.view(-1, num_kv_heads, head_dim)
        num_heads = q.shape[1]
        group = num_heads // num_kv_heads
        out = q.new_empty(q.shape) if not plan.all_decode else None

        if plan.decode_rows.numel():
            sd, lmax = plan.decode_slots.shape
            kd = flat_k[plan.decode_slots].permute(0, 2, 1, 3)  # [Sd, KVH, L, D]
            vd = flat_v[plan.decode_slots].permute(0, 2, 1, 3)
            qd = q if plan.all_decode else q[plan.decode_rows]
            qd = qd.view(sd, num_kv_heads, group, head_dim)
            scores = torch.matmul(qd, kd.transpose(-1, -2)).mul_(scale)  # [Sd, KVH, G, L]
            scores.add_(plan.decode_mask)
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
            od = torch.matmul(probs, vd).reshape(sd, num_heads, head_dim)
            if plan.all_decode:
                return od
            assert out is not None
            out[plan.decode_rows] = od
        assert out is not None
        for p in plan.prefills:
            kp = flat_k[p.slots].transpose(0, 1)  # [KVH, L, D]
            vp = flat_v[p.slots].transpose(0, 1)
            qp = q[p.rows].transpose(0, 1)  # [H, q_len, D]
            o = F.scaled_dot_product_attention(
                qp, kp, vp, attn_mask=p.mask, is_causal=p.mask is None, scale=scale,
                enable_gqa=group > 1,
            )
            out[p.rows] = o.transpose(0, 1)
        return out


@dataclass
class _PlanInputs:
    q_lens: list[int]
    seq_lens: list[int]
    starts: list[int]
    plan: _TorchPlan | None = None


def get_attention_backend(name: str) -> AttentionBackend:
    if name == "torch":
        return TorchAttention()
    if name == "triton":
        from engine.triton_attention import TritonAttention

        return TritonAttention()
    raise ValueError(f"unknown attention backend {name!r}; choose 'torch' or 'triton'")
