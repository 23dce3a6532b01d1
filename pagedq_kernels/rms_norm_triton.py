"""RMSNorm with an optional fused residual add: the Triton kernel.

Same contract as ``pagedq_kernels.rms_norm.rms_norm_torch`` and the same rounding steps (residual sum
rounded to the activation dtype, normalisation in fp32, cast back to the activation dtype *before*
the weight multiply, like transformers' ``LlamaRMSNorm``), so results agree with the reference to
the last bit up to the order of the fp32 sum of squares. Fusing the add saves one full
read + write of the hidden state per layer; both outputs are fresh tensors (no aliasing surprises).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    out_ptr,  # [R, hidden]
    residual_out_ptr,  # [R, hidden] x + residual (HAS_RESIDUAL only)
    x_ptr,  # [R, hidden]
    residual_ptr,  # [R, hidden] (HAS_RESIDUAL only)
    weight_ptr,  # [hidden]
    stride_x,
    stride_r,
    stride_o,
    stride_ro,
    hidden,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,  # next power of two >= hidden: one row is one tile
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < hidden
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + offs, mask=mask, other=0.0)
        # Round the sum to the residual stream's dtype, as ``x + residual`` does in torch.
        x = (x.to(tl.float32) + r.to(tl.float32)).to(residual_out_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * stride_ro + offs, x, mask=mask)
    h = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(h * h, axis=0) / hidden + eps)
    normed = (h * inv_rms).to(x.dtype).to(tl.float32)
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (normed * w).to(out_ptr.dtype.element_ty), mask=mask)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``[..., hidden]`` as a 2-D ``[rows, hidden]`` view with a contiguous last dim."""
    t = t if t.stride(-1) == 1 else t.contiguous()
    return t.reshape(-1, t.shape[-1])


def rms_norm_triton(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Return ``(norm(x + residual) * weight, x + residual)``; the second item is None without residual.

    ``x`` is ``[..., hidden]``. The output dtype follows torch promotion of ``weight`` and the
    activation dtype, exactly like the reference's ``weight * h.to(dtype)``.
    """
    hidden = x.shape[-1]
    if weight.shape != (hidden,):
        raise ValueError(f"weight {tuple(weight.shape)} does not match hidden size {hidden}")
    act_dtype = x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, act_dtype), device=x.device)
    new_residual = None if residual is None else torch.empty(x.shape, dtype=act_dtype, device=x.device)
    if x.numel() == 0:
        return out, new_residual

    x2 = _rows(x)
    out2 = out.view(-1, hidden)
    if residual is not None:
        if residual.shape != x.shape:
            raise ValueError(f"residual {tuple(residual.shape)} does not match x {tuple(x.shape)}")
        assert new_residual is not None
        r2, ro2 = _rows(residual), new_residual.view(-1, hidden)
    else:  # never read; any tensors keep the signature uniform
        r2, ro2 = x2, out2
    block = triton.next_power_of_2(hidden)
    num_warps = 4 if block <= 2048 else 8 if block <= 8192 else 16
    _rms_norm_kernel[(x2.shape[0],)](
        out2,
        ro2,
        x2,
        r2,
        weight.contiguous(),
        x2.stride(0),
        r2.stride(0),
        out2.stride(0),
        ro2.stride(0),
        hidden,
        float(eps),
        HAS_RESIDUAL=residual is not None,
        BLOCK=block,
        num_warps=num_warps,
    )
    return out, new_residual


__all__ = ["rms_norm_triton"]
