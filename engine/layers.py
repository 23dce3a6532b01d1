"""Building blocks of pagedq's decoder: linear, embedding, RMSNorm and rotary modules.

They differ from their ``torch.nn`` namesakes in two ways that matter for an inference engine:

* parameters are allocated with ``torch.empty`` straight in the target dtype and device (no random
  init, no float32 detour), because the loader overwrites every one of them anyway;
* the math runs through an :class:`engine.kernel_dispatch.Ops` bundle, so a model runs on the torch reference
  ops or on Triton kernels without code changes.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernel_dispatch import Ops
from engine.model_config import RopeScaling
from pagedq_kernels import cpu_linear, int8_linear, w8a8_linear


def _empty_param(*shape: int, dtype: torch.dtype, device: torch.device | None) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


class Linear(nn.Module):
    """``y = x @ W.T (+ b)``; merged projections (qkv, gate_up) are just a larger ``out_features``.

    On CPU, :meth:`prepack` (called once after loading) moves the weight into a packed layout
    (``pagedq_kernels/cpu_linear``: C panels for fp32, the C AMX kernel for bf16, else oneDNN), 1.3-2x faster for
    decode-sized batches, and frees the dense copy so the model is not held twice in memory.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        dtype: torch.dtype,
        device: torch.device | None = None,
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = _empty_param(out_features, in_features, dtype=dtype, device=device)
        self.bias: nn.Parameter | None = _empty_param(out_features, dtype=dtype, device=device) if bias else None
        self.packed: cpu_linear.PackedWeight | None = None
        # Quantised (pagedq_kernels/int8_linear): the group-wise int8 weight, or its C-kernel panels once packed.
        # Either replaces the dense weight, which is then freed.
        self.int8: int8_linear.Int8Weight | None = None
        self.int8_packed: int8_linear.PackedInt8 | None = None
        # quantization="w8a8": the int8 weight packed for a W8A8 kernel (VNNI or oneDNN), inputs quantised per token.
        self.w8a8: w8a8_linear.PackedW8A8 | None = None

    def set_int8(self, weight: int8_linear.Int8Weight) -> None:
        """Hold ``weight`` (an int8 copy of this layer's weight) instead of the dense one."""
        if (weight.out_features, weight.in_features) != (self.out_features, self.in_features):
            raise ValueError(
                f"int8 weight {weight.out_features}x{weight.in_features} for a "
                f"{self.out_features}x{self.in_features} linear"
            )
        self.int8 = weight
        self.weight.data = self.weight.data.new_empty(0)

    def quantize_int8(self, int8_activations: bool = False) -> None:
        """Symmetric per-output-channel int8 from the loaded dense weight (``quantization="int8"``);
        ``int8_activations``: packed for W8A8 too (``quantization="w8a8"``), where :mod:`pagedq_kernels.w8a8_linear`
        can run (else the weight stays weight-only int8)."""
        self.set_int8(int8_linear.quantize_per_channel(self.weight))
        if int8_activations and self.int8 is not None and self.weight.device.type == "cpu":
            self.w8a8 = w8a8_linear.pack(self.int8)
            if self.w8a8 is not None:
                self.int8 = None

    @property
    def weight_bytes(self) -> int:
        """Bytes this layer's weight (and bias) occupy, in whichever form it is held."""
        total = sum(t.numel() * t.element_size() for t in (self.weight, self.bias) if t is not None)
        if self.packed is not None:
            total += self.packed.data.numel() * self.packed.data.element_size()
        for quantised in (self.int8, self.int8_packed, self.w8a8):
            total += quantised.nbytes if quantised is not None else 0
        return total

    def prepack(self, dtype: torch.dtype | None = None) -> bool:
        """Pack the loaded weight for the CPU kernel (stored in ``dtype``, default its own; an int8 weight
        stays int8, multiplied on AMX bf16 tiles where ``dtype`` is bf16 and the CPU has them); False (and
        nothing changed) where unsupported."""
        if self.int8 is not None:
            self.int8_packed = int8_linear.pack(self.int8, matmul_dtype=dtype)
            if self.int8_packed is None:
                return False
            self.int8 = None
            return True
        packed = cpu_linear.pack(self.weight, dtype=dtype)
        if packed is None:
            return False
        self.packed = packed
        self.weight.data = self.weight.data.new_empty(0)
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.w8a8 is not None:
            return w8a8_linear.linear(x, self.w8a8, self.bias)
        if self.packed is not None:
            return cpu_linear.linear(x, self.packed, self.bias)
        if self.int8_packed is not None:
            return int8_linear.linear(x, self.int8_packed, self.bias)
        if self.int8 is not None:
            return int8_linear.linear_any(x, self.int8, self.bias)
        return F.linear(x, self.weight, self.bias)

    def add_norm(
        self, x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(rms_norm(y), y)`` for ``y = self(x) + residual``, in one kernel call where the packed kind has
        that epilogue (``cpu_linear.linear_add_norm``); None otherwise (:meth:`RMSNorm.forward_after` then runs
        the two). Only a plain packed weight: quantised ones keep their own kernels."""
        if self.packed is None or self.w8a8 is not None:
            return None
        return cpu_linear.linear_add_norm(x, self.packed, self.bias, residual, norm_weight, eps)

    def extra_repr(self) -> str:
        packed = f", {self.packed.kind}" if self.packed is not None else ""
        if self.int8 is not None or self.int8_packed is not None:
            packed = ", int8"
        if self.w8a8 is not None:
            packed = ", w8a8"
        return f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}{packed}"


class VocabEmbedding(nn.Module):
    """Token embedding table; also serves as the lm_head weight when embeddings are tied."""

    def __init__(self, num_embeddings: int, dim: int, dtype: torch.dtype, device: torch.device | None = None) -> None:
        super().__init__()
        self.weight = _empty_param(num_embeddings, dim, dtype=dtype, device=device)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)


class RMSNorm(nn.Module):
    """RMSNorm over the last dimension, optionally fused with the residual add that precedes it.

    The fused form (:meth:`forward_residual`) saves one full read/write of the hidden states per
    norm, which is why decoder layers carry the residual separately instead of adding it eagerly.
    """

    def __init__(self, size: int, eps: float, ops: Ops, dtype: torch.dtype, device: torch.device | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.ops = ops
        self.weight = _empty_param(size, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.ops.rms_norm(x, self.weight, self.eps)
        return out

    def forward_residual(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(x + residual), x + residual)``: the next block's normed input and the new residual."""
        out, new_residual = self.ops.rms_norm(x, self.weight, self.eps, residual)
        assert new_residual is not None
        return out, new_residual

    def forward_after(
        self, linear: Linear, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`forward_residual` of ``linear(x)``: the projection, the residual add and this norm in one
        kernel call where ``linear``'s kernel has that epilogue (:meth:`Linear.add_norm`; the same floats),
        else the projection (a module call: hooks see it) and then the norm."""
        fused = linear.add_norm(x, residual, self.weight, self.eps)
        if fused is not None:
            return fused
        return self.forward_residual(linear(x), residual)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


def rope_inv_freq(head_dim: int, rope_theta: float, rope_scaling: RopeScaling | None) -> torch.Tensor:
    """Inverse frequencies ``[head_dim // 2]`` (float32), computed op for op like transformers.

    Mirrors ``LlamaRotaryEmbedding.compute_default_rope_parameters``,
    ``_compute_linear_scaling_rope_parameters`` and ``_compute_llama3_parameters`` so the cos/sin
    tables, and hence float32 logits, agree with the reference bit for bit.
    """
    dim = head_dim
    inv_freq = 1.0 / (rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float) / dim))
    if rope_scaling is None:
        return inv_freq
    if rope_scaling.rope_type == "linear":
        return inv_freq / rope_scaling.factor
    if rope_scaling.rope_type == "frequency_divisors":  # a GGUF's rope_freqs, as llama.cpp applies it
        if len(rope_scaling.divisors) != inv_freq.numel():
            raise ValueError(f"{len(rope_scaling.divisors)} rope divisors for {inv_freq.numel()} frequencies")
        return inv_freq / torch.tensor(rope_scaling.divisors, dtype=torch.float32)
    if rope_scaling.rope_type == "llama3":
        factor = rope_scaling.factor
        low_freq_factor = rope_scaling.low_freq_factor
        high_freq_factor = rope_scaling.high_freq_factor
        old_context_len = rope_scaling.original_max_position_embeddings
        low_freq_wavelen = old_context_len / low_freq_factor
        high_freq_wavelen = old_context_len / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths (beyond the pretraining context) are interpolated by ``factor``, short
        # ones are kept, and the band in between is blended smoothly.
        inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth_factor = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed_inv_freq = (1 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
        is_medium_freq = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        return torch.where(is_medium_freq, smoothed_inv_freq, inv_freq_llama)
    raise ValueError(f"unsupported rope scaling type {rope_scaling.rope_type!r}")


def build_cos_sin_cache(
    head_dim: int, max_positions: int, rope_theta: float, rope_scaling: RopeScaling | None
) -> torch.Tensor:
    """``[max_positions, head_dim]`` float32: ``cos`` in the first half of each row, ``sin`` in the second.

    Built once per model so kernels only gather rows by position; scaling is already folded into the
    frequencies, so kernels never need to know about it.
    """
    inv_freq = rope_inv_freq(head_dim, rope_theta, rope_scaling)
    positions = torch.arange(max_positions)
    freqs = positions.float()[:, None] * inv_freq[None, :]
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)


class RotaryEmbedding(nn.Module):
    """Neox-style rotary embedding applied to q and k by token position."""

    cos_sin_cache: torch.Tensor

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        rope_theta: float,
        rope_scaling: RopeScaling | None,
        ops: Ops,
        device: torch.device | None = None,
    ) -> None:
        super().__init__()
        self.ops = ops
        cache = build_cos_sin_cache(head_dim, max_positions, rope_theta, rope_scaling)
        # Kept in float32 whatever the model dtype: ops cast rows to q's dtype on use, as
        # transformers does, so bf16 models see the same rounded values.
        self.register_buffer("cos_sin_cache", cache.to(device), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.ops.rotary_embedding(positions, q, k, self.cos_sin_cache)
