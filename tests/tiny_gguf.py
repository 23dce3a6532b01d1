"""Tiny llama GGUF files written with gguf's own ``GGUFWriter``, from a tiny Hugging Face checkpoint.

Each weight goes in the type asked for (quantised by gguf's reference quantisers, or random blocks for the
types gguf cannot write: K-quants and IQ4), q and k rows permuted as
llama.cpp's converter does (``convert_hf_to_gguf.py``'s ``permute``), so the loader's un-permutation is
tested against the real convention. No tokenizer metadata: tests load the model, not an engine.
"""

from __future__ import annotations

import math
import zlib
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFWriter, RopeScalingType
from gguf.quants import quantize

from engine.model_config import ModelConfig

_LAYER = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
}


GGUF_ARCH = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}


def llama3_rope_divisors(config: ModelConfig) -> np.ndarray:
    """The ``rope_freqs`` tensor llama.cpp's converter writes for Llama 3.1 rope scaling (its
    ``LlamaModel.generate_extra_tensors``, transcribed): one divisor per rotary frequency."""
    scaling = config.rope_scaling
    assert scaling is not None and scaling.rope_type == "llama3"
    dim = config.head_dim
    freqs = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    divisors = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            divisors.append(1.0)
        elif wavelen > low_wavelen:
            divisors.append(scaling.factor)
        else:
            smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
                scaling.high_freq_factor - scaling.low_freq_factor
            )
            divisors.append(1 / ((1 - smooth) / scaling.factor + smooth))
    return np.array(divisors, dtype=np.float32)


def permute_like_llama_cpp(weights: np.ndarray, n_head: int) -> np.ndarray:
    return (
        weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def gguf_name(hf_name: str) -> str:
    if hf_name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf_name == "model.norm.weight":
        return "output_norm.weight"
    if hf_name == "lm_head.weight":
        return "output.weight"
    _, _, layer, rest = hf_name.split(".", 3)
    module, suffix = rest.rsplit(".", 1)
    return f"blk.{layer}.{_LAYER[module]}.{suffix}"


FP16_FIELDS = {
    "Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q2_K": (80, 82), "Q3_K": (108,),
    "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "IQ4_NL": (0,), "IQ4_XS": (0,),
}  # fmt: skip
"""Byte offsets of each block's fp16 fields (d, and dmin / m where the format has one), per ggml type."""

NO_QUANTIZER = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS")
"""Types gguf-py reads but cannot write: :func:`write_tiny_gguf` fills them with :func:`random_blocks`."""


LARGEST_FACTOR = {"Q2_K": 45, "Q3_K": 128, "Q4_K": 945, "Q5_K": 1953, "Q6_K": 4096, "IQ4_NL": 127, "IQ4_XS": 4064}
"""The largest ``|w / d|`` of a block (its code times its integer scale): random blocks of a model are written
with ``d`` up to 0.1 / this, so that weights stay within 0.1 as a trained model's do."""


def random_blocks(type_name: str, rows: int, cols: int, seed: int, d_max: float = 0.02) -> np.ndarray:
    """``[rows, bytes per row]`` of ``type_name`` blocks: random codes and small integer factors (every bit
    pattern is a valid block) with finite fp16 ``d`` / ``dmin`` of either sign, up to ``d_max``."""
    from gguf.constants import GGML_QUANT_SIZES

    elements, type_size = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (rows * cols // elements, type_size), dtype=np.uint8)
    for offset in FP16_FIELDS[type_name]:
        d = np.asarray(rng.uniform(-d_max, d_max, blocks.shape[0]), dtype=np.float16)
        blocks[:, offset : offset + 2] = d.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)


def write_tiny_gguf(
    path: Path,
    state: dict[str, torch.Tensor],
    config: ModelConfig,
    types: dict[str, str],
    raw_extra: dict[str, tuple[np.ndarray, GGMLQuantizationType]] | None = None,
    eot_token_id: int | None = None,
) -> None:
    """``state`` (HF names) written to ``path``; ``types[gguf name]`` picks each tensor's type (default F32).
    ``raw_extra``: tensors written as given bytes of a given type (e.g. a Q5_K block the loader must refuse)."""
    arch = GGUF_ARCH[config.architecture]
    writer = GGUFWriter(str(path), arch)
    writer.add_block_count(config.num_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_heads)
    writer.add_head_count_kv(config.num_kv_heads)
    writer.add_rope_dimension_count(config.head_dim)
    writer.add_key_length(config.head_dim)  # the converter writes it whenever config.json names head_dim
    writer.add_value_length(config.head_dim)
    scaling = config.rope_scaling
    if scaling is not None and scaling.rope_type == "linear":
        writer.add_rope_scaling_type(RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(scaling.factor)
    elif scaling is not None and scaling.rope_type == "llama3":  # no key: a tensor of divisors
        writer.add_tensor("rope_freqs.weight", llama3_rope_divisors(config))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_theta)
    writer.add_vocab_size(config.vocab_size)
    writer.add_uint32("tokenizer.ggml.bos_token_id", 1)
    writer.add_uint32("tokenizer.ggml.eos_token_id", 2)
    if eot_token_id is not None:
        writer.add_uint32("tokenizer.ggml.eot_token_id", eot_token_id)
    for hf_name, tensor in state.items():
        name = gguf_name(hf_name)
        data = tensor.float().numpy()
        if arch == "llama" and ".attn_q." in name:  # only llama.cpp's llama converter permutes
            data = permute_like_llama_cpp(data, config.num_heads)
        elif arch == "llama" and ".attn_k." in name:
            data = permute_like_llama_cpp(data, config.num_kv_heads)
        qtype = GGMLQuantizationType[types.get(name, "F32")]
        if qtype == GGMLQuantizationType.F32:
            writer.add_tensor(name, np.ascontiguousarray(data, dtype=np.float32))
        elif qtype.name in NO_QUANTIZER:
            d_max = 0.1 / LARGEST_FACTOR[qtype.name]
            blocks = random_blocks(qtype.name, data.shape[0], data.shape[1], zlib.crc32(name.encode()), d_max)
            writer.add_tensor(name, blocks, raw_dtype=qtype)
        else:
            writer.add_tensor(name, quantize(data, qtype), raw_dtype=qtype)
    write_with_raw_tensors(writer, raw_extra)


def write_with_raw_tensors(writer: GGUFWriter, raw: dict[str, tuple[np.ndarray, GGMLQuantizationType]] | None) -> None:
    """Add ``raw`` tensors as given (blocks of their type, no quantiser), then write the file and close it."""
    for name, (data, qtype) in (raw or {}).items():
        writer.add_tensor(name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
