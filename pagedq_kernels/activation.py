"""SiLU-and-mul (the gated MLP's activation): the torch reference."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul_torch(x: torch.Tensor) -> torch.Tensor:
    """``x`` is ``[N, 2 * I]`` = ``[gate | up]``; returns ``silu(gate) * up`` of shape ``[N, I]``."""
    half = x.shape[-1] // 2
    return F.silu(x[..., :half]) * x[..., half:]
