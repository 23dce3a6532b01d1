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


def byte_level_alphabet() -> list[str]:
    """GPT-2's byte-to-character table: the 256 base tokens of every byte-level BPE vocabulary."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars, extra = dict(zip(printable, printable, strict=True)), 0
    for byte in range(256):
        if byte not in chars:
            chars[byte] = 256 + extra
            extra += 1
    return [chr(chars[byte]) for byte in range(256)]


BPE_MERGES = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "a t", "Ġ c"]
BPE_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
SMALL_SIZES = {"embedding_length": 32, "block_count": 1, "feed_forward_length": 64, "attention.head_count": 2}
"""The metadata sizes of :func:`write_small_gguf`'s model, by key after ``{arch}.``."""


def small_gguf_tensors(arch: str, vocab: int) -> dict[str, tuple[int, ...]]:
    """Every tensor of :func:`write_small_gguf`'s one-layer model, by llama.cpp name, with its Hugging Face
    shape: Qwen2's q/k/v biases and Qwen3's q/k norms included."""
    hidden, ffn, head_dim = SMALL_SIZES["embedding_length"], SMALL_SIZES["feed_forward_length"], 16
    shapes: dict[str, tuple[int, ...]] = {"token_embd.weight": (vocab, hidden), "output_norm.weight": (hidden,)}
    for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
        shapes[f"blk.0.{name}.weight"] = (hidden, hidden)
    shapes |= {"blk.0.ffn_gate.weight": (ffn, hidden), "blk.0.ffn_up.weight": (ffn, hidden)}
    shapes |= {"blk.0.ffn_down.weight": (hidden, ffn), "blk.0.attn_norm.weight": (hidden,)}
    shapes["blk.0.ffn_norm.weight"] = (hidden,)
    if arch == "qwen2":
        shapes |= {f"blk.0.{name}.bias": (hidden,) for name in ("attn_q", "attn_k", "attn_v")}
    if arch == "qwen3":
        shapes |= {"blk.0.attn_q_norm.weight": (head_dim,), "blk.0.attn_k_norm.weight": (head_dim,)}
    return shapes


def write_small_gguf(
    path: Path,
    arch: str = "llama",
    *,
    tokenizer: bool = True,
    omit: tuple[str, ...] = (),
    metadata: dict[str, str | int] | None = None,
    shapes: dict[str, tuple[int, ...]] | None = None,
    raw: dict[str, tuple[np.ndarray, GGMLQuantizationType]] | None = None,
) -> Path:
    """A complete small model the engine loads (one layer, hidden 32, two heads, random F32 weights), with a
    byte-level BPE tokenizer and a chat template (as llama.cpp writes SmolLM2's) unless ``tokenizer`` is
    False. To make a bad file: ``omit`` leaves out metadata keys (after ``{arch}.``) or tensors by name,
    ``metadata`` adds or replaces keys (full names), ``shapes`` writes tensors (new or in place of the
    model's) in other shapes, ``raw`` writes tensors (likewise) as given blocks of a given type."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tokens = [*byte_level_alphabet(), *(m.replace(" ", "") for m in BPE_MERGES), *BPE_SPECIAL]
    writer = GGUFWriter(str(path), arch)
    keys: dict[str, str | int] = {f"{arch}.{key}": value for key, value in SMALL_SIZES.items() if key not in omit}
    for key, value in (keys | (metadata or {})).items():
        if isinstance(value, str):
            writer.add_string(key, value)
        else:
            writer.add_uint32(key, value)
    if tokenizer:
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("default")
        writer.add_token_list(tokens)
        writer.add_token_merges(BPE_MERGES)
        writer.add_token_types([1] * (len(tokens) - len(BPE_SPECIAL)) + [3] * len(BPE_SPECIAL))
        writer.add_bos_token_id(tokens.index("<|endoftext|>"))
        writer.add_eos_token_id(tokens.index("<|im_end|>"))
        writer.add_chat_template(
            "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        )
    elif "vocab_size" not in omit:
        writer.add_vocab_size(len(tokens))
    rng = np.random.default_rng(0)
    tensors = small_gguf_tensors(arch, len(tokens)) | (shapes or {})
    for name, shape in tensors.items():
        if name not in omit and name not in (raw or {}):
            data = np.ones(shape) if len(shape) == 1 else rng.normal(0, 0.02, shape)
            writer.add_tensor(name, np.asarray(data, dtype=np.float32))
    write_with_raw_tensors(writer, raw)
    return path
