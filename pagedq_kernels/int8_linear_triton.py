"""The group-wise int8 weight-only matmul for CUDA: the Triton kernel.

Same contract as :func:`pagedq_kernels.int8_linear.linear_reference`: ``y = x @ (scale * q + offset).T + bias``
with the weight dequantised tile by tile in registers (``scale * q`` rounded, then ``+ offset``, as the
reference) and products accumulated in fp32 by ``tl.dot`` at full fp32 precision (no TF32, which would
add its own error on top of the quantisation's). Each program computes a ``BLOCK_M x BLOCK_N`` tile of y
and streams its ``BLOCK_N`` int8 weight rows once: at decode sizes one row block, so the int8 bytes are all
that is read of the weight. Tested on small shapes under ``TRITON_INTERPRET=1`` (tests/test_int8_triton.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedq_kernels.int8_linear import Int8Weight


@triton.jit
def _int8_linear_kernel(
    x_ptr,  # [M, K], row stride stride_x
    q_ptr,  # int8 [N, K]
    scale_ptr,  # float32 [N, K // group]
    offset_ptr,  # float32 [N, K // group] (HAS_OFFSET only)
    bias_ptr,  # [N] (HAS_BIAS only)
    y_ptr,  # [M, N] float32
    M,
    N,
    K,
    stride_x,
    group,
    num_groups,
    HAS_OFFSET: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = rm < M
    n_mask = rn < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        k_mask = rk < K
        x = tl.load(
            x_ptr + rm[:, None].to(tl.int64) * stride_x + rk[None, :],
            mask=m_mask[:, None] & k_mask[None, :],
            other=0.0,
        ).to(tl.float32)
        w_mask = k_mask[:, None] & n_mask[None, :]
        q = tl.load(q_ptr + rn[None, :].to(tl.int64) * K + rk[:, None], mask=w_mask, other=0).to(tl.float32)
        g = rn[None, :].to(tl.int64) * num_groups + rk[:, None] // group
        w = q * tl.load(scale_ptr + g, mask=w_mask, other=0.0)
        if HAS_OFFSET:
            w = w + tl.load(offset_ptr + g, mask=w_mask, other=0.0)
        acc += tl.dot(x, w, input_precision="ieee")
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rm[:, None] * N + rn[None, :], acc, mask=m_mask[:, None] & n_mask[None, :])


def int8_linear(x: torch.Tensor, weight: Int8Weight, bias: torch.Tensor | None) -> torch.Tensor:
    """``x [..., K] @ dequantize(weight).T + bias``, returned in ``x``'s dtype."""
    n, k = weight.out_features, weight.in_features
    if x.shape[-1] != k:
        raise ValueError(f"int8 linear: input has {x.shape[-1]} features, the weight expects {k}")
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    y = torch.empty((m, n), dtype=torch.float32, device=x.device)
    if m:
        # tl.dot needs every block dimension >= 16; 16 rows covers a decode batch in one row block.
        block_m = 16 if m <= 16 else 64
        block_n, block_k = 64, 32
        grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
        _int8_linear_kernel[grid](
            x2,
            weight.values,
            weight.scales,
            weight.offsets if weight.offsets is not None else weight.scales,
            bias if bias is not None else weight.scales,
            y,
            m,
            n,
            k,
            x2.stride(0),
            weight.group_size,
            k // weight.group_size,
            HAS_OFFSET=weight.offsets is not None,
            HAS_BIAS=bias is not None,
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            BLOCK_K=block_k,
        )
    return y.view(*x.shape[:-1], n).to(x.dtype)
