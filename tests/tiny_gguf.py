"""Tiny llama GGUF files written with gguf's own ``GGUFWriter``, from a tiny Hugging Face checkpoint.

Each weight goes in the type asked for (quantised by gguf's reference quantisers), q and k rows permuted as
llama.cpp's converter does (``convert_hf_to_gguf.py``'s ``permute``), so the loader's un-permutation is
tested against the real convention. No tokenizer metadata: tests load the model, not an engine.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFWriter
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
}


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


def write_tiny_gguf(
    path: Path,
    state: dict[str, torch.Tensor],
    config: ModelConfig,
    types: dict[str, str],
    raw_extra: dict[str, tuple[np.ndarray, GGMLQuantizationType]] | None = None,
) -> None:
    """``state`` (HF names) written to ``path``; ``types[gguf name]`` picks each tensor's type (default F32).
    ``raw_extra``: tensors written as given bytes of a given type (e.g. a Q5_K block the loader must refuse)."""
    writer = GGUFWriter(str(path), "llama")
    writer.add_block_count(config.num_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_heads)
    writer.add_head_count_kv(config.num_kv_heads)
    writer.add_rope_dimension_count(config.head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_theta)
    writer.add_vocab_size(config.vocab_size)
    writer.add_uint32("tokenizer.ggml.bos_token_id", 1)
    writer.add_uint32("tokenizer.ggml.eos_token_id", 2)
    for hf_name, tensor in state.items():
        name = gguf_name(hf_name)
        data = tensor.float().numpy()
        if ".attn_q." in name:
            data = permute_like_llama_cpp(data, config.num_heads)
        elif ".attn_k." in name:
            data = permute_like_llama_cpp(data, config.num_kv_heads)
        qtype = GGMLQuantizationType[types.get(name, "F32")]
        if qtype == GGMLQuantizationType.F32:
            writer.add_tensor(name, np.ascontiguousarray(data, dtype=np.float32))
        else:
            writer.add_tensor(name, quantize(data, qtype), raw_dtype=qtype)
    for name, (raw, qtype) in (raw_extra or {}).items():
        writer.add_tensor(name, raw, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
