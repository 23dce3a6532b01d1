"""Tiny random-weight Hugging Face checkpoints, one per architecture variant pagedq supports.

Built with transformers' own model classes and ``save_pretrained``, so they exercise the real
on-disk format (config.json keys, tensor names, sharding) that the loader must understand, and
transformers' forward on the same folder is the reference the parity tests compare against.

Weights use a large ``initializer_range`` so logits are spread out and greedy argmax gaps are not
razor thin; norm weights and biases (which transformers initialises to exactly 1 and 0) are
perturbed too, so a norm or bias loaded into the wrong slot cannot go unnoticed.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoModelForCausalLM,
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from engine.layers import Linear

_COMMON: dict[str, Any] = {
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 1024,
    "initializer_range": 0.08,
    "rms_norm_eps": 1e-6,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "tie_word_embeddings": False,
}

# arch -> (config class, model class, overrides of _COMMON)
_ARCHS: dict[str, tuple[type[PretrainedConfig], type[PreTrainedModel], dict[str, Any]]] = {
    "llama_gqa": (LlamaConfig, LlamaForCausalLM, {"num_hidden_layers": 3}),
    "llama_mqa_tied": (
        LlamaConfig,
        LlamaForCausalLM,
        {"num_key_value_heads": 1, "tie_word_embeddings": True},
    ),
    # Qwen2: q/k/v biases are implicit in the architecture.
    "qwen2": (
        Qwen2Config,
        Qwen2ForCausalLM,
        {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}},
    ),
    # Qwen3: 8 heads x head_dim 16 = 128 != hidden 64, so head_dim must come from the config; the
    # attention biases (off in released Qwen3) are switched on to cover the o_proj bias path.
    "qwen3": (
        Qwen3Config,
        Qwen3ForCausalLM,
        {"num_attention_heads": 8, "attention_bias": True, "eos_token_id": [2, 3]},
    ),
    # Mistral: the sliding window caps pagedq's max_model_len.
    "mistral": (MistralConfig, MistralForCausalLM, {"sliding_window": 256}),
    # Tensor parallelism over 2 or 3 ranks: 6 heads and 6 KV heads split evenly both ways, and a vocabulary
    # of 511 that neither divides (the vocab-parallel embedding and lm_head are padded).
    "llama_tp_odd_vocab": (
        LlamaConfig,
        LlamaForCausalLM,
        {
            "hidden_size": 96,
            "num_attention_heads": 6,
            "num_key_value_heads": 6,
            "intermediate_size": 96,
            "vocab_size": 511,
        },
    ),
    # Llama 3.1-style rope scaling; original context 256 puts frequencies in all three bands.
    "llama3_scaled": (
        LlamaConfig,
        LlamaForCausalLM,
        {
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 256,
            },
        },
    ),
}

TINY_ARCHS: tuple[str, ...] = tuple(_ARCHS)


def make_tiny_checkpoint(
    path: str | os.PathLike[str],
    arch: str,
    seed: int = 0,
    *,
    max_shard_size: int | str | None = None,
    **config_overrides: Any,
) -> Path:
    """Write a tiny random ``arch`` checkpoint (safetensors + configs) to ``path`` and return it.

    ``max_shard_size`` (e.g. ``"100KB"``) forces a sharded checkpoint with an index file.
    """
    if arch not in _ARCHS:
        raise ValueError(f"unknown tiny arch {arch!r}; choose one of {', '.join(TINY_ARCHS)}")
    config_cls, model_cls, overrides = _ARCHS[arch]
    config = config_cls(**{**_COMMON, **overrides, **config_overrides})
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.mul_(1.0 + 0.2 * torch.randn_like(param))
            elif name.endswith(".bias"):
                param.normal_(0.0, 0.1)
    out = Path(path)
    save_kwargs: dict[str, Any] = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(out, **save_kwargs)
    GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, do_sample=False
    ).save_pretrained(out)
    return out


def make_hf_model(path: str | os.PathLike[str]) -> PreTrainedModel:
    """transformers' reference model for a checkpoint folder: float32, eager attention, eval mode."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    return model.eval()


def hf_greedy_tokens(model: Any, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """transformers' greedy continuation of each prompt, exactly ``new_tokens`` long (EOS cannot end it
    early), one prompt at a time on the model's device: the reference the engine's tokens are held to."""
    outs = []
    with torch.inference_mode():
        for prompt in prompts:
            x = torch.tensor([prompt], device=model.device)
            y = model.generate(
                x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=0,
            )
            outs.append(y[0, len(prompt) :].tolist())
    return outs


def random_linear(in_features: int, out_features: int, bias: bool) -> Linear:
    """One of pagedq's fp32 ``Linear`` layers with standard-normal weights (and bias), drawn from torch's
    global generator (seed it first): what the kernel tests pack and multiply."""
    layer = Linear(in_features, out_features, bias, torch.float32)
    with torch.no_grad():
        layer.weight.normal_()
        if layer.bias is not None:
            layer.bias.normal_()
    return layer
