"""ggml's quantised block formats, unpacked into pagedq's one int8 layout without losing a bit.

Every format a llama.cpp ``quantize`` run writes for a dense model's linears is, per group of 16 or 32
elements along K, ``w = scale * q + offset`` with an integer code ``|q| <= 127``: the K-quants only compute
the group's scale and offset from a super-block's fp16 ``d``/``dmin`` and the group's small integer factors,
and the IQ4 formats look their codes up in a 16-entry table of int8 values. So each becomes an
:class:`~pagedq_kernels.int8_linear.Int8Weight` (codes, fp32 scales, fp32 offsets or none, group size) with
the scale and offset computed in fp32 exactly as gguf's ``dequantize()`` computes them (``d * sc`` and
``dmin * m``, then ``scale * q - dmin_m``, which is ``scale * q + offset`` with ``offset = -dmin_m``): the
weight the kernel sees equals gguf's dequantisation bit for bit (``tests/test_gguf_quants.py``, on random
blocks of every format). Formats whose codes are points of a lattice codebook (IQ1/IQ2/IQ3, TQ) or fp4
(MXFP4, NVFP4) are not this shape and are refused by the loader.

The unpacking follows gguf-py's ``quants.py`` (the reference for the bit layouts) up to, and not including,
its final multiplication. Each function takes the blocks as ``uint8 [n_blocks, type_size]`` and returns
``codes int8 [n_blocks, elements]``, ``scales fp32 [n_blocks, groups]`` and ``offsets`` of the scales' shape
or None.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from pagedq_kernels.int8_linear import Int8Weight

QK_K = 256  # elements per K-quant super-block
IQ4_VALUES = np.array((-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113), dtype=np.int8)
"""IQ4_NL / IQ4_XS's code book (ggml's ``kvalues_iq4nl``): a non-uniform 4-bit grid, every value an int8."""

Unpacked = tuple[np.ndarray, np.ndarray, np.ndarray | None]


@dataclass(frozen=True)
class BlockFormat:
    """One ggml type: its block (``elements`` in ``type_size`` bytes), its group along K, its unpacker."""

    elements: int
    type_size: int
    group: int
    unpack: Callable[[np.ndarray], Unpacked]


def _fp16(raw: np.ndarray) -> np.ndarray:
    """Little-endian fp16 bytes ``[n, 2]`` -> fp32 ``[n, 1]`` (exact)."""
    return np.ascontiguousarray(raw).view(np.float16).astype(np.float32)


def _nibbles(packed: np.ndarray) -> np.ndarray:
    """``[n, 16]`` bytes -> ``[n, 32]`` codes: element i is byte i's low nibble, element 16 + i its high one."""
    return np.concatenate((packed & 0x0F, packed >> 4), axis=-1)


def _fifth_bits(qh: np.ndarray) -> np.ndarray:
    """Q5_0 / Q5_1's ``qh``: 4 bytes, bit j (little-endian uint32) the fifth bit of element j."""
    bits = np.ascontiguousarray(qh).view(np.uint32) >> np.arange(32, dtype=np.uint32)
    return (bits & 1).astype(np.uint8)


def _q8_0(b: np.ndarray) -> Unpacked:
    return np.ascontiguousarray(b[:, 2:]).view(np.int8), _fp16(b[:, 0:2]), None


def _q4_0(b: np.ndarray) -> Unpacked:
    return _nibbles(b[:, 2:]).astype(np.int8) - np.int8(8), _fp16(b[:, 0:2]), None


def _q4_1(b: np.ndarray) -> Unpacked:
    return _nibbles(b[:, 4:]).astype(np.int8), _fp16(b[:, 0:2]), _fp16(b[:, 2:4])


def _q5_0(b: np.ndarray) -> Unpacked:
    q = _nibbles(b[:, 6:]) | (_fifth_bits(b[:, 2:6]) << 4)
    return q.astype(np.int8) - np.int8(16), _fp16(b[:, 0:2]), None


def _q5_1(b: np.ndarray) -> Unpacked:
    q = _nibbles(b[:, 8:]) | (_fifth_bits(b[:, 4:8]) << 4)
    return q.astype(np.int8), _fp16(b[:, 0:2]), _fp16(b[:, 2:4])


def _k_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K's 12 bytes of eight 6-bit scales and eight 6-bit minimums (gguf's ``get_scale_min``)."""
    n = scales.shape[0]
    d, m, m_d = np.split(scales.reshape(n, 3, 4), 3, axis=-2)
    sc = np.concatenate([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], axis=-1).reshape(n, 8)
    mn = np.concatenate([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], axis=-1).reshape(n, 8)
    return sc, mn


def _q2_k(b: np.ndarray) -> Unpacked:
    n = b.shape[0]
    sc, qs = b[:, :16], b[:, 16:80]
    d, dmin = _fp16(b[:, 80:82]), _fp16(b[:, 82:84])
    q = (qs.reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 3
    scales = d * (sc & 0xF).astype(np.float32)
    offsets = -(dmin * (sc >> 4).astype(np.float32))
    return q.reshape(n, QK_K).astype(np.int8), scales, offsets


def _q3_k(b: np.ndarray) -> Unpacked:
    n = b.shape[0]
    hmask, qs, packed, d = b[:, :32], b[:, 32:96], b[:, 96:108], _fp16(b[:, 108:110])
    low = (packed[:, :8].reshape(n, 1, 8) >> np.array([0, 4], dtype=np.uint8).reshape(1, 2, 1)).reshape(n, 16)
    high = (packed[:, 8:].reshape(n, 1, 4) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 4, 1)).reshape(n, 16)
    sc = ((low & 0x0F) | ((high & 0x03) << 4)).astype(np.int8) - np.int8(32)
    ql = (qs.reshape(n, -1, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)).reshape(n, QK_K) & 3
    qh = (hmask.reshape(n, -1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)).reshape(n, QK_K) & 1
    q = ql.astype(np.int8) - ((qh ^ 1) << 2).astype(np.int8)  # a clear high bit subtracts 4
    return q, d * sc.astype(np.float32), None


def _q4_k(b: np.ndarray) -> Unpacked:
    n = b.shape[0]
    d, dmin = _fp16(b[:, 0:2]), _fp16(b[:, 2:4])
    sc, mn = _k_scale_min(b[:, 4:16])
    q = (b[:, 16:].reshape(n, -1, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 0x0F
    return q.reshape(n, QK_K).astype(np.int8), d * sc.astype(np.float32), -(dmin * mn.astype(np.float32))


def _q5_k(b: np.ndarray) -> Unpacked:
    n = b.shape[0]
    d, dmin = _fp16(b[:, 0:2]), _fp16(b[:, 2:4])
    sc, mn = _k_scale_min(b[:, 4:16])
    qh, qs = b[:, 16:48], b[:, 48:]
    ql = (qs.reshape(n, -1, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)).reshape(n, QK_K) & 0x0F
    high = (qh.reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)).reshape(n, QK_K) & 1
    q = (ql | (high << 4)).astype(np.int8)
    return q, d * sc.astype(np.float32), -(dmin * mn.astype(np.float32))


def _q6_k(b: np.ndarray) -> Unpacked:
    n = b.shape[0]
    ql, qh = b[:, :128], b[:, 128:192]
    sc, d = np.ascontiguousarray(b[:, 192:208]).view(np.int8), _fp16(b[:, 208:210])
    low = (ql.reshape(n, -1, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)).reshape(n, -1, 32) & 0x0F
    high = (qh.reshape(n, -1, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)).reshape(n, -1, 32)
    q = (low | ((high & 3) << 4)).astype(np.int8) - np.int8(32)
    return q.reshape(n, QK_K), d * sc.astype(np.float32), None


def _iq4_nl(b: np.ndarray) -> Unpacked:
    return IQ4_VALUES[_nibbles(b[:, 2:])], _fp16(b[:, 0:2]), None


def _iq4_xs(b: np.ndarray) -> Unpacked:
    n = b.shape[0]
    d = _fp16(b[:, 0:2])
    high = np.ascontiguousarray(b[:, 2:4]).view(np.uint16).reshape(n, 1) >> (2 * np.arange(8, dtype=np.uint16))
    low = (b[:, 4:8].reshape(n, -1, 1) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2)).reshape(n, 8) & 0x0F
    sc = (low | ((high.astype(np.uint8) & 3) << 4)).astype(np.int8) - np.int8(32)
    idx = (b[:, 8:].reshape(n, -1, 1, 16) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 0x0F
    return IQ4_VALUES[idx.reshape(n, QK_K)], d * sc.astype(np.float32), None


FORMATS: dict[str, BlockFormat] = {
    "Q8_0": BlockFormat(32, 34, 32, _q8_0),
    "Q4_0": BlockFormat(32, 18, 32, _q4_0),
    "Q4_1": BlockFormat(32, 20, 32, _q4_1),
    "Q5_0": BlockFormat(32, 22, 32, _q5_0),
    "Q5_1": BlockFormat(32, 24, 32, _q5_1),
    "Q2_K": BlockFormat(QK_K, 84, 16, _q2_k),
    "Q3_K": BlockFormat(QK_K, 110, 16, _q3_k),
    "Q4_K": BlockFormat(QK_K, 144, 32, _q4_k),
    "Q5_K": BlockFormat(QK_K, 176, 32, _q5_k),
    "Q6_K": BlockFormat(QK_K, 210, 16, _q6_k),
    "IQ4_NL": BlockFormat(32, 18, 32, _iq4_nl),
    "IQ4_XS": BlockFormat(QK_K, 136, 32, _iq4_xs),
}
"""The ggml types pagedq loads as int8, by gguf's type name."""


def to_int8_weight(raw: np.ndarray, type_name: str, rows: int, cols: int) -> Int8Weight:
    """A ``[rows, cols]`` tensor's blocks of ``type_name`` (``cols`` a multiple of its block) as an exact
    :class:`Int8Weight`."""
    fmt = FORMATS[type_name]
    blocks = np.ascontiguousarray(raw).reshape(-1, fmt.type_size)
    if blocks.shape[0] * fmt.elements != rows * cols:
        raise ValueError(f"{blocks.shape[0]} blocks of {type_name} do not hold {rows} x {cols} elements")
    codes, scales, offsets = fmt.unpack(blocks)
    groups = (rows, cols // fmt.group)
    return Int8Weight(
        torch.from_numpy(np.ascontiguousarray(codes, dtype=np.int8).reshape(rows, cols)),
        torch.from_numpy(np.ascontiguousarray(scales, dtype=np.float32).reshape(groups)),
        None if offsets is None else torch.from_numpy(np.ascontiguousarray(offsets, dtype=np.float32).reshape(groups)),
        fmt.group,
    )
