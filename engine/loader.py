"""Load a Hugging Face checkpoint's safetensors straight into pagedq's model.

transformers' modeling classes are deliberately not involved: building them would allocate and
randomly initialise a second copy of the weights. Instead every tensor in the checkpoint is mapped
by name onto its slot in pagedq's modules (``q_proj``/``k_proj``/``v_proj`` become row ranges of the
merged ``qkv_proj``, ``gate_proj``/``up_proj`` of ``gate_up_proj``), read once and cast on copy.
Every checkpoint tensor must land somewhere and every slot must be filled; anything else is an error
naming the offending tensors, because a half-loaded model produces plausible-looking garbage.

Under tensor parallelism (:mod:`engine.parallel_layers`) each rank reads only its band of each sharded
tensor, through safetensors' ``get_slice``: a rank never holds, or even reads into memory, the whole
model. The checkpoint tensor's full shape is still checked against the model's before slicing.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
from safetensors import safe_open

from engine.checkpoint import gguf_file
from engine.kernel_dispatch import get_ops
from engine.model_config import ModelConfig
from engine.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from engine.parallel_layers import SINGLE, TensorParallel


class CheckpointMismatchError(ValueError):
    """The checkpoint's tensors do not match the model: missing, unexpected or mis-shaped ones."""


@dataclass(frozen=True)
class Target:
    """Where one checkpoint tensor goes: ``dest`` (a view of a model parameter) receives rows (``dim`` 0)
    or columns (``dim`` 1) ``[start, stop)`` of the checkpoint tensor, whose full shape is ``shape``.
    ``dim`` None: the whole tensor. A band shorter than ``dest`` (the last vocabulary band) leaves the
    rest of ``dest`` zero."""

    dest: torch.Tensor
    shape: tuple[int, ...]
    dim: int | None = None
    start: int = 0
    stop: int = 0


def load_model(
    path: str | os.PathLike[str],
    dtype: torch.dtype,
    device: torch.device,
    ops_name: str,
    tp: TensorParallel = SINGLE,
) -> tuple[LlamaForCausalLM, ModelConfig]:
    """Build the model (this rank's shard of it, under tensor parallelism) for the checkpoint folder (or
    GGUF file: engine/gguf_checkpoint.py) ``path`` and fill it with its weights in ``dtype``."""
    gguf = gguf_file(path)
    if gguf is not None:
        if tp.size > 1:
            raise ValueError("tensor parallelism does not load GGUF files yet: convert with prepare-model")
        from engine.gguf_checkpoint import load_gguf_model

        return load_gguf_model(gguf, dtype, device, ops_name)
    folder = Path(path)
    config = ModelConfig.from_pretrained(folder)
    model = LlamaForCausalLM(config, get_ops(ops_name), dtype=dtype, device=device, tp=tp)
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
                    _copy_into(dest, f, name)
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


def _copy_into(target: Target, f: Any, name: str) -> None:
    """Read ``name`` (only ``target``'s band of it when sharded) and copy it into ``target.dest``, which
    casts to the model dtype and moves to its device."""
    if target.dim is None:
        tensor = f.get_tensor(name)
        if tuple(tensor.shape) != target.shape:
            raise CheckpointMismatchError(f"{name}: checkpoint shape {tuple(tensor.shape)} != expected {target.shape}")
        target.dest.copy_(tensor)
        return
    piece = f.get_slice(name)
    shape = tuple(piece.get_shape())
    if shape != target.shape:
        raise CheckpointMismatchError(f"{name}: checkpoint shape {shape} != expected {target.shape}")
    band = piece[target.start : target.stop] if target.dim == 0 else piece[:, target.start : target.stop]
    length = target.stop - target.start
    target.dest.narrow(target.dim, 0, length).copy_(band)
    if length < target.dest.shape[target.dim]:  # vocabulary padding: rows no token id reaches
        target.dest.narrow(target.dim, length, target.dest.shape[target.dim] - length).zero_()


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


def weight_targets(model: LlamaForCausalLM) -> dict[str, Target]:
    """HF tensor name -> the :class:`Target` (view of pagedq's parameter, and band of the tensor) it is
    copied into.

    Views of merged parameters are row slices (``Linear`` weights are ``[out, in]``), so the q, k and
    v tensors land side by side in ``qkv_proj`` in exactly the order the model splits them. With one
    rank every band is the whole tensor and is read whole, as before tensor parallelism.
    """
    config = model.config
    sharded = model.tp.size > 1
    hidden, inter_total = config.hidden_size, config.intermediate_size

    def whole(dest: torch.Tensor) -> Target:
        return Target(dest.detach(), tuple(dest.shape))

    def band(dest: torch.Tensor, shape: tuple[int, ...], dim: int, rows: tuple[int, int]) -> Target:
        if not sharded:
            return whole(dest)
        return Target(dest.detach(), shape, dim, *rows)

    embed = model.embed_tokens
    vocab_shape = (config.vocab_size, hidden)
    targets: dict[str, Target] = {
        "model.embed_tokens.weight": band(embed.weight, vocab_shape, 0, embed.vocab_rows()),
        "model.norm.weight": whole(model.norm.weight),
    }
    if not config.tie_word_embeddings:
        targets["lm_head.weight"] = band(model.lm_head_weight, vocab_shape, 0, embed.vocab_rows())
    for i, module in enumerate(model.layers):
        layer = cast(LlamaDecoderLayer, module)
        prefix = f"model.layers.{i}."
        attn, mlp = layer.self_attn, layer.mlp
        shards = attn.shards
        q, kv, inter = shards.q_size, shards.kv_size, mlp.intermediate_size
        q_rows, kv_rows = shards.q_rows(), shards.kv_rows()
        qkv = {
            "q_proj": ((0, q), q_rows, config.q_size),
            "k_proj": ((q, q + kv), kv_rows, config.kv_size),
            "v_proj": ((q + kv, q + 2 * kv), kv_rows, config.kv_size),
        }
        for proj, ((start, stop), rows, total) in qkv.items():
            weight = attn.qkv_proj.weight[start:stop]
            targets[f"{prefix}self_attn.{proj}.weight"] = band(weight, (total, hidden), 0, rows)
            if attn.qkv_proj.bias is not None:
                bias = attn.qkv_proj.bias[start:stop]
                targets[f"{prefix}self_attn.{proj}.bias"] = band(bias, (total,), 0, rows)
        targets[f"{prefix}self_attn.o_proj.weight"] = band(attn.o_proj.weight, (hidden, config.q_size), 1, q_rows)
        if attn.o_proj.bias is not None:
            targets[f"{prefix}self_attn.o_proj.bias"] = whole(attn.o_proj.bias)
        if attn.q_norm is not None and attn.k_norm is not None:
            targets[f"{prefix}self_attn.q_norm.weight"] = whole(attn.q_norm.weight)
            targets[f"{prefix}self_attn.k_norm.weight"] = whole(attn.k_norm.weight)
        inter_rows = model.tp.band(inter_total, "intermediate_size")
        gate_up = mlp.gate_up_proj.weight
        targets[f"{prefix}mlp.gate_proj.weight"] = band(gate_up[:inter], (inter_total, hidden), 0, inter_rows)
        targets[f"{prefix}mlp.up_proj.weight"] = band(gate_up[inter:], (inter_total, hidden), 0, inter_rows)
        targets[f"{prefix}mlp.down_proj.weight"] = band(mlp.down_proj.weight, (hidden, inter_total), 1, inter_rows)
        targets[f"{prefix}input_layernorm.weight"] = whole(layer.input_layernorm.weight)
        targets[f"{prefix}post_attention_layernorm.weight"] = whole(layer.post_attention_layernorm.weight)

    # Guard against a parameter added to the model without a mapping here: it would stay
    # uninitialised (torch.empty) and no missing-tensor check could notice.
    mapped = sum(t.dest.numel() for t in targets.values())
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
