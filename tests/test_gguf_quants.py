"""ggml's block formats unpacked into the int8 layout (engine/gguf_quants.py): bit for bit gguf's own
dequantisation, on random blocks of every format (every bit pattern of codes and factors is a valid block)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from engine.gguf_quants import FORMATS, to_int8_weight
from pagedq_kernels.int8_linear import Int8Weight
from tests.tiny_gguf import FP16_FIELDS, random_blocks


@pytest.mark.parametrize("type_name", sorted(FORMATS))
def test_unpacked_blocks_equal_gguf_dequantize_bit_for_bit(type_name: str) -> None:
    rows, cols = 6, 512  # two K-quant super-blocks per row, 16 blocks of 32
    raw = random_blocks(type_name, rows, cols, seed=0)
    weight = to_int8_weight(raw, type_name, rows, cols)
    want = dequantize(raw, GGMLQuantizationType[type_name]).reshape(rows, cols)
    got = weight.dequantize().numpy()
    assert got.view(np.uint32).tolist() == want.astype(np.float32).view(np.uint32).tolist()  # -0.0 included
    assert weight.group_size == FORMATS[type_name].group
    assert int(weight.values.abs().max()) <= 127


def test_every_format_has_its_fp16_fields_known_to_the_tests() -> None:
    assert set(FP16_FIELDS) == set(FORMATS)


def test_a_tensor_that_is_not_whole_blocks_is_refused() -> None:
    raw = random_blocks("Q4_K", 2, 256, seed=1)
    with pytest.raises(ValueError, match="do not hold 2 x 512"):
        to_int8_weight(raw, "Q4_K", 2, 512)


def test_merging_groups_of_16_and_32_is_exact() -> None:
    """A Q4_K_M qkv: q and k Q4_K (groups of 32, offsets), v Q6_K (groups of 16, none): held at 16, v's
    offsets zero, every row the value it had."""
    q = to_int8_weight(random_blocks("Q4_K", 4, 256, seed=2), "Q4_K", 4, 256)
    v = to_int8_weight(random_blocks("Q6_K", 2, 256, seed=3), "Q6_K", 2, 256)
    merged = Int8Weight.concat([q, v])
    assert merged.group_size == 16 and merged.offsets is not None
    assert torch.equal(merged.dequantize(), torch.cat([q.dequantize(), v.dequantize()]))
    with pytest.raises(ValueError, match="in_features"):
        Int8Weight.concat([q, to_int8_weight(random_blocks("Q6_K", 2, 512, seed=4), "Q6_K", 2, 512)])
