"""Linear layers on CPU through oneDNN with weights reordered once at load time.

``F.linear`` on an x86 CPU build of torch calls MKL's sgemm, which re-packs the weight matrix on
every call. A decode step multiplies a few dozen rows by each weight, so that re-packing (a full
read and write of the weight) costs as much as the arithmetic: measured on a 2-core AMD EPYC
(AVX2), SmolLM2's projections ran at 50-60 GFLOP/s for 16 rows and its 49152-row lm_head at 22-50,
against 90-125 and 55-105 GFLOP/s with the weight reordered once into oneDNN's blocked layout
(``torch.ops.mkldnn._reorder_linear_weight``) and multiplied by ``_linear_pointwise``. Prefill-sized
batches gain too (gate_up at 2048 rows: ~95 -> ~135 GFLOP/s).

The reordered weight is an opaque oneDNN tensor: it can only be multiplied, so the dense weight
stays the source of truth until :func:`pack` succeeds, and anything unsupported (no oneDNN, a
dtype this CPU's oneDNN cannot reorder, such as bf16 without AVX512-BF16) keeps ``F.linear``.
The reference is ``F.linear`` itself; results agree to float32 rounding (the summation order of
the blocked kernel differs).
"""

from __future__ import annotations

import os

import torch

# The batch-size hint for the reorder: oneDNN picks its blocking for this many rows. Decode batches
# of 16-128 rows dominate engine time; measured, the layout chosen for 64 rows served 1-2048 rows as
# well as one chosen for each size.
BATCH_HINT = 64


def available(dtype: torch.dtype) -> bool:
    """Whether weights of ``dtype`` can be reordered here (and the feature is not switched off)."""
    if os.environ.get("PAGEDQ_DISABLE_ONEDNN_LINEAR"):
        return False
    if dtype != torch.float32 or not torch.backends.mkldnn.is_available():
        return False
    return hasattr(torch.ops.mkldnn, "_reorder_linear_weight") and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def pack(weight: torch.Tensor) -> torch.Tensor | None:
    """``weight [out, in]`` reordered for :func:`linear`, or None where this CPU/dtype cannot have it."""
    if weight.device.type != "cpu" or not available(weight.dtype):
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), BATCH_HINT)
    except RuntimeError:  # e.g. an ISA oneDNN's reorder does not support for this dtype
        return None


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ W.T + bias`` with ``packed`` from :func:`pack`; ``x`` may have any leading dimensions."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
