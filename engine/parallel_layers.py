"""Tensor-parallel layers: each rank holds a slice of every big weight, and two collectives per layer
put the pieces back together (Megatron-LM's split, as vLLM uses it).

* :class:`ColumnParallelLinear` (qkv, gate_up): each rank holds a band of *output* rows, so its output is
  the slice of the activation for its own heads or its own band of the MLP: no communication at all.
* :class:`RowParallelLinear` (o_proj, down): each rank holds the matching band of *input* columns, so its
  output is a partial sum of the full result: one all-reduce makes it whole on every rank.
* :class:`VocabParallelEmbedding`: each rank holds a band of the vocabulary (padded up to a multiple of
  the rank count); a token outside a rank's band looks up zeros there, and an all-reduce sums the bands.
  The lm_head uses the same bands, and :func:`gather_logits` collects the bands of the logits on rank 0,
  where the sampler runs.

:class:`TensorParallel` says which rank this is of how many. With one rank (``SINGLE``) every class here
*is* its plain counterpart from :mod:`engine.layers`: the same shapes, the same ``forward``, no
collective, so a single-device engine runs exactly the code it ran before tensor parallelism existed.

:class:`AttentionShards` splits the attention heads. Query heads divide evenly; KV heads divide evenly
when there are at least as many as ranks, and otherwise each KV head is *replicated* on the
``size // num_kv_heads`` ranks whose query heads read it (vLLM's rule), so MQA runs on any rank count.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from engine.layers import Linear, VocabEmbedding
from engine.model_config import ModelConfig


@dataclass(frozen=True)
class TensorParallel:
    """This process's place in the tensor-parallel group: ``rank`` of ``size``."""

    rank: int = 0
    size: int = 1

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"tensor-parallel rank {self.rank} of {self.size} is not a valid place")

    def split(self, total: int, what: str) -> int:
        """``total`` divided evenly among the ranks, or a ValueError naming ``what`` does not divide."""
        if total % self.size:
            raise ValueError(f"{what} ({total}) is not divisible by tensor_parallel_size={self.size}")
        return total // self.size

    def band(self, total: int, what: str) -> tuple[int, int]:
        """This rank's ``[start, stop)`` of ``total`` items split evenly."""
        per_rank = self.split(total, what)
        return self.rank * per_rank, (self.rank + 1) * per_rank


SINGLE = TensorParallel()


def all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    """Sum ``tensor`` over the ranks, in place (the model's collectives run on the default group)."""
    dist.all_reduce(tensor)
    return tensor


@dataclass(frozen=True)
class AttentionShards:
    """Which attention heads a rank computes, and which slices of q/k/v weights that means."""

    num_heads: int  # query heads on this rank
    num_kv_heads: int  # KV heads on this rank (1 each when they are replicated)
    head_start: int  # first query head of this rank (global index)
    kv_head_start: int  # first KV head of this rank (global index)
    head_dim: int

    @classmethod
    def of(cls, config: ModelConfig, tp: TensorParallel) -> AttentionShards:
        heads = tp.split(config.num_heads, "num_attention_heads")
        total_kv = config.num_kv_heads
        if total_kv >= tp.size:
            kv_heads = tp.split(total_kv, "num_key_value_heads")
            kv_start = tp.rank * kv_heads
        else:
            if tp.size % total_kv:
                raise ValueError(
                    f"tensor_parallel_size={tp.size} must be a multiple of num_key_value_heads ({total_kv}) "
                    "when it exceeds it (each KV head is replicated on a whole number of ranks)"
                )
            kv_heads, kv_start = 1, tp.rank // (tp.size // total_kv)
        return cls(heads, kv_heads, tp.rank * heads, kv_start, config.head_dim)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def q_rows(self) -> tuple[int, int]:
        """Rows of the checkpoint's q_proj (and its bias) this rank holds; o_proj's columns likewise."""
        return self.head_start * self.head_dim, (self.head_start + self.num_heads) * self.head_dim

    def kv_rows(self) -> tuple[int, int]:
        """Rows of the checkpoint's k_proj and v_proj this rank holds."""
        return self.kv_head_start * self.head_dim, (self.kv_head_start + self.num_kv_heads) * self.head_dim


class ShardedLinear(Linear):
    """``Linear`` that knows its rank's place (``tp``); its shape is already this rank's share."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        dtype: torch.dtype,
        device: torch.device | None,
        tp: TensorParallel = SINGLE,
    ) -> None:
        super().__init__(in_features, out_features, bias, dtype, device)
        self.tp = tp


class ColumnParallelLinear(ShardedLinear):
    """``Linear`` holding this rank's band of output rows (``out_features`` is the rank's share)."""


class RowParallelLinear(ShardedLinear):
    """``Linear`` holding this rank's band of input columns; its partial outputs are summed over the
    ranks (one all-reduce), and the bias, held whole by every rank, is added once after the sum."""

    def add_norm(
        self, x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """:meth:`Linear.add_norm` on one rank only: over several, the partial sums meet in the all-reduce first."""
        return super().add_norm(x, residual, norm_weight, eps) if self.tp.size == 1 else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return super().forward(x)
        if self.packed is not None:
            from pagedq_kernels import cpu_linear

            partial = cpu_linear.linear(x, self.packed, None)
        else:
            partial = F.linear(x, self.weight)
        out = all_reduce(partial)
        return out if self.bias is None else out + self.bias


def padded_vocab(vocab_size: int, tp: TensorParallel) -> int:
    """The vocabulary rounded up to a multiple of the rank count, so every rank holds as many rows."""
    return -(-vocab_size // tp.size) * tp.size


class VocabParallelEmbedding(VocabEmbedding):
    """This rank's band of the (padded) embedding table; rows past the real vocabulary stay zero."""

    def __init__(
        self,
        vocab_size: int,
        dim: int,
        dtype: torch.dtype,
        device: torch.device | None,
        tp: TensorParallel = SINGLE,
    ) -> None:
        per_rank = padded_vocab(vocab_size, tp) // tp.size
        super().__init__(per_rank, dim, dtype, device)
        self.tp = tp
        self.vocab_size = vocab_size
        self.vocab_start = tp.rank * per_rank
        self.vocab_stop = self.vocab_start + per_rank

    def vocab_rows(self) -> tuple[int, int]:
        """Rows of the checkpoint's table this rank holds (the last rank's band may be cut short)."""
        return min(self.vocab_start, self.vocab_size), min(self.vocab_stop, self.vocab_size)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return super().forward(input_ids)
        outside = (input_ids < self.vocab_start) | (input_ids >= self.vocab_stop)
        local = (input_ids - self.vocab_start).masked_fill(outside, 0)
        embedded = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return all_reduce(embedded)


def gather_logits(local: torch.Tensor, tp: TensorParallel, vocab_size: int) -> torch.Tensor:
    """The full ``[M, vocab_size]`` logits on rank 0 from every rank's vocabulary band (padding cut off);
    an empty tensor on the other ranks, which have no sampler to feed."""
    if tp.size == 1:
        return local
    local = local.contiguous()
    if tp.rank == 0:
        bands = [torch.empty_like(local) for _ in range(tp.size)]
        dist.gather(local, bands, dst=0)
        return torch.cat(bands, dim=-1)[:, :vocab_size]
    dist.gather(local, None, dst=0)
    return local.new_empty(0)
