"""The model's shape and quirks, read from a Hugging Face checkpoint's ``config.json``.

pagedq runs one decoder family (Llama and its close relatives) with its own modules, so instead of
transformers' config classes it parses the JSON into a flat, explicit :class:`ModelConfig`: every
architectural difference the model code cares about (q/k/v bias, per-head q/k norm, tied embeddings,
rope scaling) becomes a plain field, and anything pagedq cannot run faithfully is rejected up front
with a clear error instead of silently producing wrong tokens.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

SUPPORTED_ARCHITECTURES: tuple[str, ...] = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
}


class UnsupportedModelError(ValueError):
    """The checkpoint is not one pagedq can run (architecture, rope type, activation, ...)."""


@dataclass(frozen=True)
class RopeScaling:
    """Rotary scaling folded into the cos/sin cache when it is built (see ``engine.layers``).

    ``rope_type`` is ``"linear"`` (position interpolation: every frequency divided by ``factor``),
    ``"llama3"`` (Llama 3.1's wavelength-dependent interpolation, which also needs the low/high
    frequency factors and the pretraining context length) or ``"frequency_divisors"`` (each inverse
    frequency divided by its own entry of ``divisors``: how a GGUF file stores Llama 3.1's scaling, the
    ``rope_freqs`` tensor llama.cpp's converter computes from the same four parameters).
    """

    rope_type: str
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    divisors: tuple[float, ...] = ()


@dataclass
class ModelConfig:
    """Everything the model code, loader and engine need to know about a checkpoint.

    ``max_model_len`` is the longest context pagedq will serve: ``max_position_embeddings``, capped
    at ``sliding_window`` when the checkpoint uses windowed attention, because pagedq only implements
    full causal attention and the two agree exactly while the context fits in the window.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    sliding_window: int | None
    bos_token_id: int | None
    eos_token_ids: list[int]
    torch_dtype: torch.dtype
    o_bias: bool = False
    max_model_len: int = field(default=0)

    def __post_init__(self) -> None:
        if self.max_model_len <= 0:
            self.max_model_len = self.max_position_embeddings
            if self.sliding_window is not None:
                self.max_model_len = min(self.max_model_len, self.sliding_window)
        if self.num_heads % self.num_kv_heads != 0:
            raise UnsupportedModelError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )

    @property
    def eos_token_id(self) -> int | None:
        """The primary end-of-sequence id (the first of ``eos_token_ids``), for APIs that want one."""
        return self.eos_token_ids[0] if self.eos_token_ids else None

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def num_params_matmul(self) -> int:
        """Weights touched by matmuls for one token (every decoder linear layer + lm_head).

        The FLOP accounting multiplies this by 2 per token; embeddings (a gather), norms and biases
        are left out because they cost no matmul FLOPs.
        """
        h = self.hidden_size
        per_layer = h * (self.q_size + 2 * self.kv_size) + self.num_params_past_attention()  # qkv_proj and the rest
        return self.num_layers * per_layer + h * self.vocab_size

    def num_params_past_attention(self) -> int:
        """One layer's matmul weights after its attention (o_proj, gate_up_proj, down_proj): what a row that gets
        no logits skips in the last layer (``LlamaForCausalLM.forward``'s ``output_rows``)."""
        h = self.hidden_size
        return self.q_size * h + h * 2 * self.intermediate_size + self.intermediate_size * h

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike[str]) -> ModelConfig:
        """Parse ``path/config.json`` (plus ``generation_config.json``'s extra EOS ids, if present), or a GGUF
        file's metadata (engine/gguf_checkpoint.py) where ``path`` names one."""
        from engine.checkpoint import gguf_file

        gguf = gguf_file(path)
        if gguf is not None:
            from engine.gguf_checkpoint import read_gguf_config  # imports this module: here, not at the top

            return read_gguf_config(gguf)
        folder = Path(path)
        config_file = folder / "config.json"
        if not config_file.is_file():
            raise FileNotFoundError(f"no config.json in {folder}")
        raw = json.loads(config_file.read_text())
        generation: dict[str, Any] = {}
        generation_file = folder / "generation_config.json"
        if generation_file.is_file():
            generation = json.loads(generation_file.read_text())
        return cls.from_dict(raw, generation)

    @classmethod
    def from_dict(cls, raw: dict[str, Any], generation: dict[str, Any] | None = None) -> ModelConfig:
        """Build from an already-parsed ``config.json`` dict (and optional ``generation_config``)."""
        architectures = raw.get("architectures") or []
        arch = architectures[0] if architectures else f"<none; model_type={raw.get('model_type')!r}>"
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"unsupported architecture {arch!r}; pagedq supports: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        hidden_act = raw.get("hidden_act", "silu")
        if hidden_act != "silu":
            raise UnsupportedModelError(f"{arch}: hidden_act {hidden_act!r} is not supported (only 'silu')")
        if raw.get("mlp_bias", False):
            raise UnsupportedModelError(f"{arch}: mlp_bias=true is not supported")

        hidden_size = int(raw["hidden_size"])
        num_heads = int(raw["num_attention_heads"])
        num_kv_heads = int(raw.get("num_key_value_heads") or num_heads)
        head_dim = int(raw.get("head_dim") or hidden_size // num_heads)
        max_positions = int(raw.get("max_position_embeddings", 2048))
        rope_theta, rope_scaling = _parse_rope(raw, arch, max_positions)

        attention_bias = bool(raw.get("attention_bias", False))
        if arch == "Qwen2ForCausalLM":
            # Qwen2 always has q/k/v biases (and never an o_proj bias); there is no config flag.
            qkv_bias, o_bias = True, False
        elif arch == "MistralForCausalLM":
            qkv_bias, o_bias = False, False
        else:
            # Llama and Qwen3: ``attention_bias`` puts a bias on all four projections.
            qkv_bias, o_bias = attention_bias, attention_bias

        return cls(
            architecture=arch,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden_size,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=max_positions,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            qk_norm=arch == "Qwen3ForCausalLM",
            sliding_window=_effective_sliding_window(raw, arch),
            bos_token_id=_optional_int(raw.get("bos_token_id")),
            eos_token_ids=_eos_ids(raw.get("eos_token_id"), (generation or {}).get("eos_token_id")),
            torch_dtype=_parse_dtype(raw.get("dtype", raw.get("torch_dtype"))),
        )


def _parse_rope(raw: dict[str, Any], arch: str, max_positions: int) -> tuple[float, RopeScaling | None]:
    """Read rope settings from either format transformers has written over the years.

    transformers 5 stores everything in ``rope_parameters`` (``rope_theta`` included); older
    checkpoints have a top-level ``rope_theta`` and an optional ``rope_scaling`` dict whose type key
    is ``rope_type`` or, older still, ``type``.
    """
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    partial = float(params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)))
    if partial != 1.0:
        raise UnsupportedModelError(f"{arch}: partial_rotary_factor={partial} is not supported")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type in (None, "default"):
        return theta, None
    if rope_type == "linear":
        return theta, RopeScaling("linear", factor=float(params["factor"]))
    if rope_type == "llama3":
        original = params.get("original_max_position_embeddings") or raw.get(
            "original_max_position_embeddings", max_positions
        )
        return theta, RopeScaling(
            "llama3",
            factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position_embeddings=int(original),
        )
    raise UnsupportedModelError(
        f"{arch}: rope scaling type {rope_type!r} is not supported (supported: default, linear, llama3)"
    )


def _effective_sliding_window(raw: dict[str, Any], arch: str) -> int | None:
    """The attention window if any layer actually uses one, mirroring transformers' config logic.

    Mistral windows every layer whenever ``sliding_window`` is set. Qwen2/Qwen3 only window when
    ``use_sliding_window`` is true, and then only the layers marked ``sliding_attention`` (or, without
    ``layer_types``, layers from ``max_window_layers`` on).
    """
    window = raw.get("sliding_window")
    if window is None:
        return None
    if arch == "MistralForCausalLM":
        return int(window)
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        if not raw.get("use_sliding_window", False):
            return None
        layer_types = raw.get("layer_types")
        num_layers = int(raw["num_hidden_layers"])
        if layer_types is not None:
            windowed = "sliding_attention" in layer_types
        else:
            windowed = int(raw.get("max_window_layers", 28)) < num_layers
        return int(window) if windowed else None
    return None


def _optional_int(value: Any) -> int | None:
    return None if value is None else int(value)


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, list | tuple):
        return [int(v) for v in value]
    return [int(value)]


def _eos_ids(config_eos: Any, generation_eos: Any) -> list[int]:
    """config.json's EOS id(s) first, then any extra ones generation_config.json adds.

    Instruct checkpoints (Llama 3, Qwen) often list their end-of-turn tokens only in
    generation_config.json; stopping on config.json's id alone would run past the end of the turn.
    """
    ids = _as_id_list(config_eos)
    for extra in _as_id_list(generation_eos):
        if extra not in ids:
            ids.append(extra)
    return ids


def _parse_dtype(value: Any) -> torch.dtype:
    """The checkpoint's stored dtype; float32 when unspecified (transformers' default too)."""
    if value is None:
        return torch.float32
    name = str(value).removeprefix("torch.")
    if name not in _DTYPES:
        raise UnsupportedModelError(f"unsupported checkpoint dtype {value!r}")
    return _DTYPES[name]
