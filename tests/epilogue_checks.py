"""Checks of the matmul kernels' epilogues, shared by every kernel kind that has them: the argmax without the
product (``pagedq_kernels.cpu_linear.argmax_linear``) and the residual add with the RMSNorm after a projection
(``pagedq_kernels.cpu_linear.linear_add_norm``)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from pagedq_kernels import cpu_linear, cpu_ops

ArgmaxOf = Callable[[torch.Tensor, cpu_linear.PackedWeight], tuple[torch.Tensor, torch.Tensor] | None]


def check_argmax_epilogue(
    pack: Callable[[torch.Tensor], cpu_linear.PackedWeight | None],
    threads: int,
    argmax: ArgmaxOf = cpu_linear.argmax_linear,
) -> None:
    """``argmax`` (default ``argmax_linear``) is the argmax over :func:`~pagedq_kernels.cpu_linear.linear`'s own
    output (the same sums), tie-broken to the first column and NaN first as ``torch.max`` has them, across threads'
    column ranges. A partial last block (1000 columns) whose padding columns must never win."""
    g = torch.Generator().manual_seed(7)
    n, k = 1000, 64
    w = torch.randn(n, k, generator=g)
    w[500] = w[40]  # an exact tie between columns 40 and 500, in different threads' ranges at 2 threads
    w[777] = w[776]  # and one inside a block
    packed = pack(w)
    assert packed is not None
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        x = torch.randn(40, k, generator=g)
        x[1] = 0.0  # every logit 0: a tie over all columns, the first wins (not a zero padding column)
        x[2] = -x[2].abs()
        x[3] = float("nan")  # NaN everywhere: NaN at column 0
        for rows in (1, 13, 40):
            values, indices = argmax(x[:rows], packed) or (None, None)
            assert values is not None and indices is not None
            ref_values, ref_indices = cpu_linear.linear(x[:rows], packed, None).max(dim=1)
            assert torch.equal(indices, ref_indices)
            torch.testing.assert_close(values, ref_values, rtol=0, atol=0, equal_nan=True)
        w_nan = w.clone()
        w_nan[:, 0] = 1.0
        w_nan[900, 0] = float("nan")  # a NaN weight: column 900 is NaN in every row
        w_nan[300, 0] = 2.0
        nan_packed = pack(w_nan)
        assert nan_packed is not None
        ones = torch.zeros(2, k)
        ones[:, 0] = 1.0
        values, indices = argmax(ones, nan_packed) or (None, None)
        assert values is not None and indices is not None
        assert indices.tolist() == [900, 900] and bool(values.isnan().all())
        empty = argmax(torch.empty(0, k), packed)
        assert empty is not None and empty[0].shape == (0,)
    finally:
        torch.set_num_threads(before)


def check_add_norm_epilogue(pack: Callable[[torch.Tensor], cpu_linear.PackedWeight | None], threads: int) -> None:
    """``linear_add_norm`` computes exactly (bit for bit) what :func:`~pagedq_kernels.cpu_linear.linear` and then
    :func:`~pagedq_kernels.cpu_ops.rms_norm_cpu` with the residual compute, with and without a bias, for every tile
    height; the residual is not written; operands it does not take give None (the caller runs the two)."""
    g = torch.Generator().manual_seed(11)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for n, k in ((576, 64), (40, 96)):  # 40: a partial last block
            packed = pack(torch.randn(n, k, generator=g) * k**-0.5)
            assert packed is not None
            weight, bias = torch.randn(n, generator=g), torch.randn(n, generator=g)
            for rows in (1, 5, 13, 40):
                x, residual = torch.randn(rows, k, generator=g), torch.randn(rows, n, generator=g)
                kept = residual.clone()
                for b in (None, bias):
                    fused = cpu_linear.linear_add_norm(x, packed, b, residual, weight, 1e-5)
                    assert fused is not None
                    want = cpu_ops.rms_norm_cpu(cpu_linear.linear(x, packed, b), weight, 1e-5, residual)
                    assert torch.equal(fused[0], want[0]) and want[1] is not None and torch.equal(fused[1], want[1])
                assert torch.equal(residual, kept)
            x, residual = torch.randn(3, k, generator=g), torch.randn(3, n, generator=g)
            assert cpu_linear.linear_add_norm(x, packed, None, residual.double(), weight, 1e-5) is None
            assert cpu_linear.linear_add_norm(x, packed, None, residual[:, :-1], weight, 1e-5) is None
    finally:
        torch.set_num_threads(before)
