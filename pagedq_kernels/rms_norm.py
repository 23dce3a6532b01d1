"""RMSNorm with an optional fused residual add: the torch reference (the Triton kernel sits beside it)."""

from __future__ import annotations

import torch


def rms_norm_torch(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Return ``(norm(x + residual) * weight, x + residual)``; the second item is None without residual.

    Computes in float32 and casts back before the weight multiply, exactly like transformers'
    ``LlamaRMSNorm``, so float32 and bf16 results match the reference bit for bit.
    """
    if residual is not None:
        x = x + residual
        residual = x
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype), residual
