"""Load a GGUF checkpoint (llama.cpp's format) as it ships: quantised weights stay quantised.

``LLM("model.gguf")``, or a folder holding one ``.gguf`` and no ``config.json``, is read through its checked
header (:func:`engine.checkpoint.read_gguf_header`) and a memory map of its tensors; nothing is converted on
disk. Each tensor of a ``llama``, ``qwen2`` or ``qwen3`` file (:data:`GGUF_ARCHITECTURES`) is mapped onto
pagedq's modules by its llama.cpp name:

- quantised decoder linears (``Q8_0``, ``Q4_0``, ``Q4_1``, ``Q5_0``, ``Q5_1``, the K-quants ``Q2_K`` to
  ``Q6_K`` and ``IQ4_NL`` / ``IQ4_XS``: every type of llama.cpp's Q2_K to Q8_0 files, ``Q4_K_M`` included) are
  repacked into :class:`pagedq_kernels.int8_linear.Int8Weight`, groups of 16 or 32 along K with an fp32 scale
  and, for formats with a minimum, an offset (:mod:`engine.gguf_quants`). Exact: ``dequantize()`` equals
  gguf's own. The C kernel then streams one byte per weight; a merged linear whose parts differ in group
  (``Q4_K_M``'s Q4_K q/k beside a Q6_K v) is held at the finer group, which is exact too;
- ``F32``, ``F16`` and ``BF16`` tensors, and quantised embeddings / lm_head / norms, are loaded as floats
  in the activation dtype (the embedding is a lookup and the lm_head stays in the activation dtype); a
  quantised lm_head (or the tied embedding) is kept as int8 as well, for decode-sized calls on the CPU
  (``LlamaForCausalLM.lm_head_int8``);
- llama.cpp's ``llama`` converter stores q and k rows permuted for its rotary layout: they are permuted back
  (for quantised weights, rows of values, scales and offsets move together, which is exact);
- rotary scaling comes from ``rope.scaling.type`` (linear) or, for Llama 3.1's, from the ``rope_freqs``
  tensor (:func:`read_config`).

Anything else (the lattice IQ1/IQ2/IQ3 types, ternary or fp4 types, another architecture, a truncated or
corrupt file, a file without the size metadata or the tensors of the model it describes:
:mod:`engine.gguf_layout`) is a :class:`GGUFError` naming the file and the problem (the tensor and its type,
the missing key). The tokenizer and chat template come from the metadata through transformers' GGUF tokenizer
support (:func:`load_tokenizer`).
"""

from __future__ import annotations

import collections
import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import torch

from engine.checkpoint import (
    GGUF_ARCHITECTURES,
    GGUFError,
    GGUFHeader,
    GGUFTensorInfo,
    check_gguf,
    gguf_file,
)
from engine.gguf_layout import check_gguf_model, hf_name, read_sizes
from engine.gguf_quants import FORMATS, to_int8_weight
from engine.kernel_dispatch import get_ops
from engine.layers import Linear
from engine.model_config import ModelConfig, RopeScaling
from engine.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from pagedq_kernels.int8_linear import Int8Weight

if TYPE_CHECKING:
    from engine.loader import Target


def _tensor_data(file: np.memmap, tensor: GGUFTensorInfo) -> np.ndarray:
    """``tensor``'s bytes, memory-mapped (read_gguf_header checked that they lie inside the file)."""
    return file[tensor.start : tensor.start + tensor.nbytes]


def _as_floats(raw: np.ndarray, tensor: GGUFTensorInfo) -> np.ndarray:
    """An F32/F16/BF16 tensor's bytes (or any type gguf dequantises) as fp32, in Hugging Face's shape."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    floats = np.asarray(dequantize(raw, GGMLQuantizationType[tensor.type_name]), dtype=np.float32)
    return floats.reshape(tuple(reversed(tensor.dims)))


def _float32_to_decimal(value: float) -> float:
    """GGUF keeps 1e-5 as float32 9.99999974e-06: the shortest decimal, as config.json would say."""
    return float(str(np.float32(value)))


def read_config(header: GGUFHeader, path: Path) -> ModelConfig:
    """The model's config from the GGUF metadata (``llama``: Llama 2/3, SmolLM2, Mistral; ``qwen2``; ``qwen3``).

    Rotary scaling: ``rope.scaling.type`` ``linear`` is position interpolation; Llama 3.1's scaling has no
    metadata key at all: llama.cpp's converter stores it as the ``rope_freqs`` tensor, one divisor per
    frequency, which is read here (a file loaded without it would run with the wrong rotary everywhere)."""
    arch = header.field("general.architecture")  # one of GGUF_ARCHITECTURES: read_gguf_header checked it
    tensors = {t.name: t for t in header.tensors}
    sizes = read_sizes(header, path)  # a missing size is one GGUFError naming the keys, not int(None)'s TypeError
    raw: dict[str, Any] = {
        "architectures": [GGUF_ARCHITECTURES[arch]],
        "model_type": arch,
        "hidden_size": sizes.hidden,
        "num_hidden_layers": sizes.layers,
        "intermediate_size": sizes.intermediate,
        "num_attention_heads": sizes.heads,
        "num_key_value_heads": sizes.kv_heads,
        "head_dim": sizes.head_dim,
        "vocab_size": sizes.vocab,
        "max_position_embeddings": int(header.field(f"{arch}.context_length", 2048)),
        "rms_norm_eps": _float32_to_decimal(header.field(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": _float32_to_decimal(header.field(f"{arch}.rope.freq_base", 10000.0)),
        "tie_word_embeddings": "output.weight" not in tensors,
        "bos_token_id": header.field("tokenizer.ggml.bos_token_id"),
        "eos_token_id": header.field("tokenizer.ggml.eos_token_id"),
    }
    if arch != "qwen2":  # Qwen2's q/k/v biases go with the architecture; Llama's and Qwen3's with a flag
        raw["attention_bias"] = "blk.0.attn_output.bias" in tensors
    scaling = header.field(f"{arch}.rope.scaling.type")
    factor = header.field(f"{arch}.rope.scaling.factor")
    if scaling == "linear" and isinstance(factor, int | float) and factor > 0:
        raw["rope_parameters"] = {"rope_type": "linear", "factor": float(factor)}
    elif scaling == "linear":
        raise GGUFError(f"{path}: linear rope scaling without a positive {arch}.rope.scaling.factor ({factor!r})")
    elif scaling not in (None, "none"):
        raise GGUFError(f"{path}: rope scaling {scaling!r} is not supported (supported: none, linear, rope_freqs)")
    # End of turn and end of message stop generation as EOS does (llama.cpp's end-of-generation set): an
    # instruct file whose eos is <|endoftext|> ends its chat turns with eot (<|eot_id|>, <|im_end|>).
    end_ids = [header.field(f"tokenizer.ggml.{kind}_token_id") for kind in ("eot", "eom")]
    config = ModelConfig.from_dict(raw, {"eos_token_id": [i for i in end_ids if i is not None]})
    freqs = tensors.get("rope_freqs.weight")
    if freqs is not None:
        values = _as_floats(_tensor_data(np.memmap(path, dtype=np.uint8, mode="r"), freqs), freqs)
        divisors = tuple(float(x) for x in values.reshape(-1))
        if config.rope_scaling is not None or len(divisors) != config.head_dim // 2:
            raise GGUFError(
                f"{path}: rope_freqs holds {len(divisors)} values for head_dim {config.head_dim}"
                + (f" beside rope scaling {scaling!r}" if config.rope_scaling is not None else "")
            )
        config = dataclasses.replace(config, rope_scaling=RopeScaling("frequency_divisors", divisors=divisors))
    return config


def read_gguf_config(path: Path) -> ModelConfig:
    """:func:`read_config` of the file at ``path`` (its header only), once the header holds the whole model
    (:func:`engine.gguf_layout.check_gguf_model`): the engine reads the config first, so a file missing
    tensors is refused here, before a model is built, as the worker's model check refuses it."""
    return read_config(check_gguf_model(path, require_tokenizer=False), path)


def _unpermute_rows(n_rows: int, n_head: int) -> torch.Tensor:
    """Row order that undoes llama.cpp's rotary permutation of q / k (transformers' reverse_permute)."""
    rows = torch.arange(n_rows)
    dim = n_rows // n_head // 2
    return rows.reshape(n_head, dim, 2).swapaxes(2, 1).reshape(n_rows)


def load_gguf_model(
    path: Path, dtype: torch.dtype, device: torch.device, ops_name: str
) -> tuple[LlamaForCausalLM, ModelConfig]:
    """The model with its weights from the GGUF at ``path`` (quantised linears int8) and its config; the
    model's ``source_quantization`` names its predominant linear type (``gguf:Q4_1``)."""
    header = check_gguf_model(path, require_tokenizer=False)  # every tensor the model needs, in its shape
    config = read_config(header, path)
    file = np.memmap(path, dtype=np.uint8, mode="r")
    permuted = config.architecture == GGUF_ARCHITECTURES["llama"]  # llama.cpp's rotary row order (q, k)
    model = LlamaForCausalLM(config, get_ops(ops_name), dtype=dtype, device=device)
    from engine.loader import weight_targets

    targets = weight_targets(model)
    items: dict[str, torch.Tensor | Int8Weight] = {}
    linear_types: collections.Counter[str] = collections.Counter()
    head_int8: Int8Weight | None = None
    unexpected: list[str] = []
    for tensor in header.tensors:
        name = hf_name(tensor.name)
        if name is None or (name == "lm_head.weight" and config.tie_word_embeddings):
            if not tensor.name.endswith("rope_freqs.weight"):
                unexpected.append(tensor.name)
            continue
        type_name = tensor.type_name
        shape = tuple(reversed(tensor.dims))  # ggml lists K first
        is_linear = name.startswith("model.layers.") and name.endswith("_proj.weight")
        try:
            if type_name in FORMATS:
                if len(shape) != 2 or shape[1] % FORMATS[type_name].elements:
                    raise GGUFError(f"{path}: tensor {tensor.name} ({type_name}) has shape {shape}")
                quantised = to_int8_weight(_tensor_data(file, tensor), type_name, shape[0], shape[1])
                items[name] = quantised if is_linear else quantised.dequantize()
                if name == "lm_head.weight" or (name == "model.embed_tokens.weight" and config.tie_word_embeddings):
                    head_int8 = quantised  # the lm_head's values as int8 too (LlamaForCausalLM.lm_head_int8)
            else:  # GGUF_FLOAT_TYPES: read_gguf_header refused every other type
                items[name] = torch.from_numpy(np.array(_as_floats(_tensor_data(file, tensor), tensor)))
        except GGUFError:
            raise
        except Exception as exc:  # a short data section shows up here, as a reshape or memmap error
            raise GGUFError(f"{path}: tensor {tensor.name} ({type_name}) is unreadable ({exc})") from None
        if is_linear:
            linear_types[type_name] += 1
        if permuted and name.endswith(("q_proj.weight", "k_proj.weight", "q_proj.bias", "k_proj.bias")):
            heads = config.num_heads if "q_proj" in name else config.num_kv_heads
            order = _unpermute_rows(shape[0], heads)
            item = items[name]
            items[name] = item.rows(order) if isinstance(item, Int8Weight) else item.index_select(0, order)
    missing = sorted(set(targets) - set(items))
    if missing or unexpected:
        problems = [f"missing tensors: {', '.join(missing[:20])}"] if missing else []
        problems += [f"unexpected tensors: {', '.join(unexpected[:20])}"] if unexpected else []
        # check_gguf_model refused such a file already; kept as the loader's own guard, as a GGUFError (a
        # ValueError the worker and the CLI report as an unusable model, in one line).
        raise GGUFError(f"{path}: GGUF does not match {config.architecture}: " + "; ".join(problems))
    with torch.no_grad():
        _fill(model, config, items, targets, device, path)
    if device.type == "cpu":
        model.lm_head_int8 = head_int8
    model.source_quantization = f"gguf:{linear_types.most_common(1)[0][0]}" if linear_types else "gguf"
    return model.eval(), config


def _fill(
    model: LlamaForCausalLM,
    config: ModelConfig,
    items: dict[str, torch.Tensor | Int8Weight],
    targets: dict[str, Target],
    device: torch.device,
    path: Path,
) -> None:
    """Copy every item into its slot. A merged linear (qkv, gate_up) whose parts are all int8 with one group
    layout is held int8; otherwise its parts are dequantised into the dense weight (exact either way)."""
    done: set[str] = set()
    for i, module in enumerate(model.layers):
        layer = cast(LlamaDecoderLayer, module)
        prefix = f"model.layers.{i}."
        merged: list[tuple[Linear, list[str]]] = [
            (layer.self_attn.qkv_proj, ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]),
            (layer.self_attn.o_proj, ["self_attn.o_proj"]),
            (layer.mlp.gate_up_proj, ["mlp.gate_proj", "mlp.up_proj"]),
            (layer.mlp.down_proj, ["mlp.down_proj"]),
        ]
        for linear, parts in merged:
            names = [f"{prefix}{p}.weight" for p in parts]
            quantised = [items[n] for n in names]
            if all(isinstance(q, Int8Weight) for q in quantised):
                try:
                    weight = Int8Weight.concat(cast(list[Int8Weight], quantised))
                except ValueError:
                    pass
                else:
                    linear.set_int8(weight.to(device))
                    done.update(names)
    for name, target in targets.items():
        if name in done:
            continue
        dest = target.dest  # the whole tensor: GGUF files load on one rank (engine/loader.py)
        item = items[name]
        value = item.dequantize() if isinstance(item, Int8Weight) else item
        if tuple(value.shape) != tuple(dest.shape):
            raise GGUFError(f"{path}: tensor for {name} has shape {tuple(value.shape)}, expected {tuple(dest.shape)}")
        dest.copy_(value)


_TOKENIZER_CLASS_FILES = ("tokenizer_config.json", "tekken.json", "config.json")
"""Files AutoTokenizer reads beside a GGUF to pick the class (a ``tokenizer_class``, Mistral's tekken)."""


def _auto_tokenizer(path: Path, model_type: str) -> Any:
    """``AutoTokenizer.from_pretrained(folder, gguf_file=...)``'s tokenizer, without its second read of the
    whole file. To pick the class, AutoTokenizer reads the model's config from the GGUF with the gguf
    package's reader for every architecture outside its short list of fast ones (llama, qwen2, qwen3
    included): 3.5 s of SmolLM2's 4.9 s tokenizer load. The class only depends on the model type, which the
    header already gave: ``tokenizer_type`` names it where transformers registers a tokenizer for the type
    (AutoTokenizer's own lookup), and a type it registers none for gets AutoTokenizer's fallback, the
    generic fast tokenizer (transformers 5: ``TokenizersBackend``). ``tests/test_gguf_tokenizer.py`` holds
    the result equal to AutoTokenizer's, class and all, for each architecture. Any other transformers
    layout, and a folder holding a file AutoTokenizer reads to pick the class, take AutoTokenizer's path."""
    from transformers import AutoTokenizer

    where: dict[str, Any] = {"gguf_file": path.name, "local_files_only": True}
    folder = str(path.parent)
    if any((path.parent / name).exists() for name in _TOKENIZER_CLASS_FILES):
        return AutoTokenizer.from_pretrained(folder, **where)  # a file beside it may name another class
    try:
        from transformers import TokenizersBackend  # type: ignore[attr-defined,unused-ignore]
        from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES
    except ImportError:  # transformers 4: AutoTokenizer reads the config (its llama class differs from the fallback)
        return AutoTokenizer.from_pretrained(folder, **where)
    if TOKENIZER_MAPPING_NAMES.get(model_type) is not None:
        return AutoTokenizer.from_pretrained(folder, tokenizer_type=model_type, **where)
    return TokenizersBackend.from_pretrained(folder, **where)


def load_tokenizer(path: Path) -> Any:
    """The tokenizer from the GGUF metadata (transformers' GGUF support), with the chat template, EOS and pad
    set from the metadata where transformers leaves them out."""
    header = check_gguf(path)  # the tokenizer's metadata is there: one line, not transformers' traceback
    try:
        tokenizer = _auto_tokenizer(path, str(header.field("general.architecture")))
    except Exception as exc:
        raise GGUFError(f"{path}: cannot build its tokenizer from the GGUF metadata ({exc})") from None
    eos = header.field("tokenizer.ggml.eos_token_id")
    if eos is not None and tokenizer.eos_token_id != eos:
        tokenizer.eos_token = tokenizer.convert_ids_to_tokens(int(eos))
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if not getattr(tokenizer, "chat_template", None):
        template = header.field("tokenizer.chat_template")
        if isinstance(template, str):
            tokenizer.chat_template = template
    return tokenizer


__all__ = ["GGUF_ARCHITECTURES", "GGUFError", "gguf_file", "load_gguf_model", "load_tokenizer", "read_config"]
