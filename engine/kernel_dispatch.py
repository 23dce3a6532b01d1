"""The compute kernels a model runs with, chosen once by name.

Model code never imports kernels directly: it calls through an :class:`Ops` bundle, so the same
modules run on the torch reference ops (CPU, and the ground truth in tests) or on the Triton kernels
(GPU). Triton is imported only when ``"triton"`` is asked for, so CPU-only installs never need it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from engine.attention import AttentionBackend, get_attention_backend

OPS_NAMES: tuple[str, ...] = ("torch", "triton")


class RMSNormFn(Protocol):
    """``(norm(x + residual) * weight, x + residual)``; the second item is None without residual."""

    def __call__(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]: ...


class RotaryFn(Protocol):
    """Rotate ``q [N, H, D]`` and ``k [N, KVH, D]`` by ``positions [N]`` through the cos/sin cache."""

    def __call__(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


SiluAndMulFn = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Ops:
    """One consistent set of kernels: norms, rotary, gated activation and the attention backend."""

    name: str
    rms_norm: RMSNormFn
    rotary_embedding: RotaryFn
    silu_and_mul: SiluAndMulFn
    attention: AttentionBackend


def get_ops(name: str) -> Ops:
    """``"torch"``: the CPU ops (``pagedq_kernels/cpu_*.py``, falling back to the torch references in
    ``pagedq_kernels/*.py``); ``"triton"``: ``pagedq_kernels/*_triton.py``."""
    chosen: tuple[RMSNormFn, RotaryFn, SiluAndMulFn]
    if name == "torch":
        # The fused C versions of the references on float32 CPU tensors; each falls back to its
        # torch reference for anything else (other dtypes, CUDA, no C compiler).
        from pagedq_kernels.cpu_ops import rms_norm_cpu, rotary_embedding_cpu, silu_and_mul_cpu

        chosen = (rms_norm_cpu, rotary_embedding_cpu, silu_and_mul_cpu)
    elif name == "triton":
        # Lazy: importing these pulls in triton, which CPU-only installs do not have.
        from pagedq_kernels.activation_triton import silu_and_mul_triton
        from pagedq_kernels.rms_norm_triton import rms_norm_triton
        from pagedq_kernels.rotary_triton import rotary_embedding_triton

        chosen = (rms_norm_triton, rotary_embedding_triton, silu_and_mul_triton)
    else:
        raise ValueError(f"unknown ops {name!r}; choose one of {', '.join(OPS_NAMES)}")
    rms_norm, rotary_embedding, silu_and_mul = chosen
    return Ops(name, rms_norm, rotary_embedding, silu_and_mul, attention=get_attention_backend(name))
