"""Load a Hugging Face checkpoint's safetensors straight into pagedq's model.

transformers' modeling classes are deliberately not involved: building them would allocate and
randomly initialise a second copy of the weights. Instead every tensor in the checkpoint is mapped
by name onto its slot in pagedq's modules (``q_proj``/``k_proj``/``v_proj`` become row ranges of the
merged ``qkv_proj``, ``gate_proj``/``up_proj`` of ``gate_up_proj``), read once and cast on copy.
Every checkpoint tensor must land somewhere and every slot must be filled; anything else is an error
naming the offending tensors, because a half-loaded model produces plausible-looking garbage.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import cast

import torch
from safetensors import safe_open

from engine.checkpoint import gguf_file
from engine.kernel_dispatch import get_ops
from engine.model_config import ModelConfig
from engine.models.llama import LlamaDecoderLayer, LlamaForCausalLM


class CheckpointMismatchError(ValueError):
    """The checkpoint's tensors do not match the model: missing, unexpected or mis-shaped ones."""


def load_model(
    path: str | os.PathLike[str], dtype: torch.dtype, device: torch.device, ops_name: str
) -> tuple[LlamaForCausalLM, ModelConfig]:
    """Build the model for the checkpoint folder (or GGUF file: engine/gguf_checkpoint.py) ``path`` and fill it
    with its weights in ``dtype``."""
    gguf = gguf_file(path)
    if gguf is not None:
        from engine.gguf_checkpoint import load_gguf_model

        return load_gguf_model(gguf, dtype, device, ops_name)
    folder = Path(path)
    config = ModelConfig.from_pretrained(folder)
    model = LlamaForCausalLM(config, get_ops(ops_name), dtype=dtype, device=device)
    targets = weight_targets(model)
    loaded: set[str] = set()
    unexpected: list[str] = []
    with torch.no_grad():
        for file in checkpoint_files(folder):
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    dest = targets.get(name)
                    if dest is None:
                        if not _ignorable(name, config):
                            unexpected.append(name)
                        continue
                    tensor = f.get_tensor(name)
                    if tensor.shape != dest.shape:
                        raise CheckpointMismatchError(
                            f"{name}: checkpoint shape {tuple(tensor.shape)} != expected {tuple(dest.shape)}"
                        )
                    dest.copy_(tensor)  # casts to the model dtype and moves to its device
                    loaded.add(name)
    missing = sorted(set(targets) - loaded)
    if missing or unexpected:
        problems = []
        if missing:
            problems.append(f"missing tensors: {_name_list(missing)}")
        if unexpected:
            problems.append(f"unexpected tensors: {_name_list(sorted(unexpected))}")
        raise CheckpointMismatchError(
            f"checkpoint {folder} does not match {config.architecture}: " + "; ".join(problems)
        )
    return model.eval(), config


def checkpoint_files(folder: Path) -> list[Path]:
    """The safetensors files of a checkpoint: the index's shards, else ``model.safetensors``."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        return [folder / name for name in sorted(set(weight_map.values()))]
    single = folder / "model.safetensors"
    if single.is_file():
        return [single]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {folder}")
    return files


def weight_targets(model: LlamaForCausalLM) -> dict[str, torch.Tensor]:
    """HF tensor name -> the view of pagedq's parameter it is copied into.

    Views of merged parameters are row slices (``Linear`` weights are ``[out, in]``), so the q, k and
    v tensors land side by side in ``qkv_proj`` in exactly the order the model splits them.
    """
    config = model.config
    targets: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": model.embed_tokens.weight.detach(),
        "model.norm.weight": model.norm.weight.detach(),
    }
    if not config.tie_word_embeddings:
        targets["lm_head.weight"] = model.lm_head_weight.detach()
    q, kv, inter = config.q_size, config.kv_size, config.intermediate_size
    qkv_rows = {"q_proj": (0, q), "k_proj": (q, q + kv), "v_proj": (q + kv, q + 2 * kv)}
    for i, module in enumerate(model.layers):
        layer = cast(LlamaDecoderLayer, module)
        prefix = f"model.layers.{i}."
        attn, mlp = layer.self_attn, layer.mlp
        for proj, (start, stop) in qkv_rows.items():
            targets[f"{prefix}self_attn.{proj}.weight"] = attn.qkv_proj.weight.detach()[start:stop]
            if attn.qkv_proj.bias is not None:
                targets[f"{prefix}self_attn.{proj}.bias"] = attn.qkv_proj.bias.detach()[start:stop]
        targets[f"{prefix}self_attn.o_proj.weight"] = attn.o_proj.weight.detach()
        if attn.o_proj.bias is not None:
            targets[f"{prefix}self_attn.o_proj.bias"] = attn.o_proj.bias.detach()
        if attn.q_norm is not None and attn.k_norm is not None:
            targets[f"{prefix}self_attn.q_norm.weight"] = attn.q_norm.weight.detach()
            targets[f"{prefix}self_attn.k_norm.weight"] = attn.k_norm.weight.detach()
        targets[f"{prefix}mlp.gate_proj.weight"] = mlp.gate_up_proj.weight.detach()[:inter]
        targets[f"{prefix}mlp.up_proj.weight"] = mlp.gate_up_proj.weight.detach()[inter:]
        targets[f"{prefix}mlp.down_proj.weight"] = mlp.down_proj.weight.detach()
        targets[f"{prefix}input_layernorm.weight"] = layer.input_layernorm.weight.detach()
        targets[f"{prefix}post_attention_layernorm.weight"] = layer.post_attention_layernorm.weight.detach()

    # Guard against a parameter added to the model without a mapping here: it would stay
    # uninitialised (torch.empty) and no missing-tensor check could notice.
    mapped = sum(t.numel() for t in targets.values())
    total = sum(p.numel() for p in model.parameters())
    if mapped != total:
        raise AssertionError(f"weight_targets covers {mapped} of {total} model parameters")
    return targets


def _ignorable(name: str, config: ModelConfig) -> bool:
    """Checkpoint tensors that are legitimately unused: rope buffers some exporters saved, and a
    redundant lm_head copy in checkpoints with tied embeddings."""
    if name.endswith("rotary_emb.inv_freq"):
        return True
    return name == "lm_head.weight" and config.tie_word_embeddings


def _name_list(names: list[str], limit: int = 20) -> str:
    """Names for an error message, cut short when a wholly wrong checkpoint would list thousands."""
    shown = ", ".join(names[:limit])
    return shown if len(names) <= limit else f"{shown}, ... ({len(names) - limit} more)"
