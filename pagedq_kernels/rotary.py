"""Rotary position embedding, neox style (rotate halves): the torch reference.

``cos_sin_cache`` is ``[max_positions, rot_dim]`` with ``cos`` in the first half of the last
dimension and ``sin`` in the second; llama3 / linear scaling is folded into it when it is built
(see ``engine.layers.rotary``), so kernels never need to know about scaling.
"""

from __future__ import annotations

import torch


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def rotary_embedding_torch(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``q [N, H, D]`` and ``k [N, KVH, D]`` by their token ``positions [N]``; returns new tensors."""
    cs = cos_sin_cache.index_select(0, positions)
    half = cs.shape[-1] // 2
    cos = cs[:, None, :half].to(q.dtype)
    sin = cs[:, None, half:].to(q.dtype)
    return _rotate(q, cos, sin), _rotate(k, cos, sin)
