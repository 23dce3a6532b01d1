"""SiLU-and-mul (the gated MLP's activation): the Triton kernel.

Same contract as ``pagedq_kernels.activation.silu_and_mul_torch``. Fusing the two halves into one pass
reads ``[N, 2I]`` once and writes ``[N, I]`` once instead of materialising ``silu(gate)``. The
rounding follows the reference: ``silu(gate)`` is computed in fp32 and rounded to the input dtype
(as ``F.silu`` does), then multiplied by ``up`` and rounded again.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Columns per program: wide enough for coalesced 16-byte accesses, small enough for many programs.
BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(
    out_ptr,  # [R, I]
    x_ptr,  # [R, 2I] = [gate | up]
    stride_x,
    stride_o,
    inter,  # I
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + inter + cols, mask=mask, other=0.0).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    """``x`` is ``[..., 2 * I]`` = ``[gate | up]``; returns ``silu(gate) * up`` of shape ``[..., I]``."""
    if x.shape[-1] % 2:
        raise ValueError(f"last dim {x.shape[-1]} must be even ([gate | up])")
    inter = x.shape[-1] // 2
    out = torch.empty((*x.shape[:-1], inter), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    x2 = (x if x.stride(-1) == 1 else x.contiguous()).reshape(-1, 2 * inter)
    out2 = out.view(-1, inter)
    block = min(BLOCK, triton.next_power_of_2(inter))
    _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(inter, block))](
        out2,
        x2,
        x2.stride(0),
        out2.stride(0),
        inter,
        BLOCK=block,
        num_warps=4,
    )
    return out


__all__ = ["silu_and_mul_triton"]
