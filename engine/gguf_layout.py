"""What a GGUF must hold for pagedq to build its model, checked from the header alone (no torch).

:func:`engine.checkpoint.check_gguf` proves a file whole and of supported types; that is not enough to load
it. :func:`engine.gguf_checkpoint.read_config` needs the size metadata (``{arch}.embedding_length``,
``.block_count``, ``.feed_forward_length``, ``.attention.head_count``), and the loader needs every tensor of
the model those sizes describe, in its shape. A file without them passed the worker's model check and then
failed minutes later inside the engine: ``int(None)`` (a ``TypeError`` traceback) for a missing key, a
mismatch error for a missing tensor, and the worker exited 1 (restarted forever by a supervisor) instead of
``worker.model_unavailable`` (78). :func:`check_gguf_model` finds both before torch loads, as one
:class:`GGUFError` naming the file and what is missing, as llama.cpp does (``key not found in model``,
``missing tensor``). It lives apart from engine/gguf_checkpoint.py because that module imports torch and
this check runs before the worker's slow imports (engine/default_model.py ``resolve_model_path``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from engine.checkpoint import GGUFError, GGUFHeader, check_gguf

LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q_norm": "self_attn.q_norm",  # Qwen3
    "attn_k_norm": "self_attn.k_norm",
}
"""llama.cpp tensor name (after ``blk.N.``) -> Hugging Face name (after ``model.layers.N.``)."""

GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
"""llama.cpp names of the tensors outside the layers -> Hugging Face names."""

_SHOWN = 8
"""Missing tensors named in one error; the rest are counted (a file holding only the embedding misses hundreds)."""


def hf_name(gguf_name: str) -> str | None:
    """The Hugging Face name of a llama.cpp tensor name, or None for a name the loader does not know."""
    if gguf_name in GLOBAL_NAMES:
        return GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in LAYER_NAMES:
        return f"model.layers.{parts[1]}.{LAYER_NAMES[parts[2]]}.{parts[3]}"
    return None


@dataclass(frozen=True)
class GGUFSizes:
    """The model's sizes as the GGUF metadata gives them (what read_config builds the config from)."""

    hidden: int
    layers: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int


def _int_field(header: GGUFHeader, path: Path, key: str, default: int | None = None) -> int | None:
    """The metadata integer ``key`` (``default`` if absent), or a GGUFError for a value that is no positive
    integer: a string or float there gave ``int()``'s own error, naming neither the file nor the key."""
    value = header.field(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise GGUFError(f"{path}: GGUF metadata {key} is {value!r}, not a positive integer")
    return value


def read_sizes(header: GGUFHeader, path: Path) -> GGUFSizes:
    """The sizes from the metadata, or one GGUFError naming the file and every required key it lacks."""
    arch = header.field("general.architecture")  # one of GGUF_ARCHITECTURES: read_gguf_header checked it
    required = {name: f"{arch}.{name}" for name in ("embedding_length", "block_count", "feed_forward_length")} | {
        "head_count": f"{arch}.attention.head_count"
    }
    found = {name: value for name, key in required.items() if (value := _int_field(header, path, key)) is not None}
    kv_heads = _int_field(header, path, f"{arch}.attention.head_count_kv")  # read (an array refused) before any default
    head_dim = _int_field(
        header, path, f"{arch}.attention.key_length", _int_field(header, path, f"{arch}.rope.dimension_count")
    )
    n_tokens = header.array_length("tokenizer.ggml.tokens")
    vocab = _int_field(header, path, f"{arch}.vocab_size", n_tokens or None)
    missing = [key for name, key in required.items() if name not in found]
    if vocab is None:
        missing.append(f"{arch}.vocab_size (or a tokenizer.ggml.tokens list)")
    if missing or vocab is None:
        raise GGUFError(f"{path}: GGUF metadata is missing {', '.join(missing)}, which pagedq needs to build the model")
    hidden, heads = found["embedding_length"], found["head_count"]
    return GGUFSizes(
        hidden=hidden,
        layers=found["block_count"],
        intermediate=found["feed_forward_length"],
        heads=heads,
        kv_heads=kv_heads or heads,
        head_dim=head_dim or hidden // heads,
        vocab=vocab,
    )


def attention_biases(header: GGUFHeader) -> tuple[bool, bool]:
    """Whether the model has q/k/v biases and an o_proj bias: Qwen2 always has q/k/v biases and no o bias;
    a Llama or Qwen3 file has all four where llama.cpp wrote ``blk.0.attn_output.bias`` (``attention_bias``)."""
    if header.field("general.architecture") == "qwen2":
        return True, False
    has = any(t.name == "blk.0.attn_output.bias" for t in header.tensors)
    return has, has


def expected_tensors(header: GGUFHeader, sizes: GGUFSizes) -> dict[str, tuple[int, ...]]:
    """Every tensor the loader fills, by llama.cpp name, with its Hugging Face shape (the header's dims
    reversed). ``output.weight`` is not among them: without it the lm_head is tied to the embedding."""
    arch = header.field("general.architecture")
    qkv_bias, o_bias = attention_biases(header)
    q, kv = sizes.heads * sizes.head_dim, sizes.kv_heads * sizes.head_dim
    h, inter = sizes.hidden, sizes.intermediate
    shapes: dict[str, tuple[int, ...]] = {"token_embd.weight": (sizes.vocab, h), "output_norm.weight": (h,)}
    for i in range(sizes.layers):
        layer = {
            "attn_q.weight": (q, h),
            "attn_k.weight": (kv, h),
            "attn_v.weight": (kv, h),
            "attn_output.weight": (h, q),
            "ffn_gate.weight": (inter, h),
            "ffn_up.weight": (inter, h),
            "ffn_down.weight": (h, inter),
            "attn_norm.weight": (h,),
            "ffn_norm.weight": (h,),
        }
        if qkv_bias:
            layer |= {"attn_q.bias": (q,), "attn_k.bias": (kv,), "attn_v.bias": (kv,)}
        if o_bias:
            layer["attn_output.bias"] = (h,)
        if arch == "qwen3":
            layer |= {"attn_q_norm.weight": (sizes.head_dim,), "attn_k_norm.weight": (sizes.head_dim,)}
        shapes |= {f"blk.{i}.{name}": shape for name, shape in layer.items()}
    return shapes


def check_layout(header: GGUFHeader, path: Path) -> GGUFSizes:
    """The sizes, once every tensor the model needs is in the header with its shape and no tensor is one the
    loader cannot place; else one GGUFError naming ``path`` and the missing, unknown or misshapen tensors."""
    sizes = read_sizes(header, path)
    arch = header.field("general.architecture")
    expected = expected_tensors(header, sizes)
    if any(t.name == "output.weight" for t in header.tensors):
        expected["output.weight"] = (sizes.vocab, sizes.hidden)
    present = {t.name: tuple(reversed(t.dims)) for t in header.tensors}
    missing = [name for name in expected if name not in present]
    unknown = [name for name in present if hf_name(name) is None and not name.endswith("rope_freqs.weight")]
    model = f"the {arch} model its metadata describes (block_count {sizes.layers}, embedding_length {sizes.hidden})"
    if missing or unknown:
        problems = []
        if missing:
            more = f" and {len(missing) - _SHOWN} more" if len(missing) > _SHOWN else ""
            problems.append(f"missing tensors {', '.join(missing[:_SHOWN])}{more}")
        if unknown:
            more = f" and {len(unknown) - _SHOWN} more" if len(unknown) > _SHOWN else ""
            problems.append(f"tensors pagedq cannot place: {', '.join(unknown[:_SHOWN])}{more}")
        raise GGUFError(f"{path}: GGUF does not hold {model}: {'; '.join(problems)}")
    for name, shape in expected.items():
        if present[name] != shape:
            raise GGUFError(f"{path}: GGUF tensor {name} has shape {present[name]}, but {model} needs {shape}")
    return sizes


def check_gguf_model(path: Path, require_tokenizer: bool = True) -> GGUFHeader:
    """:func:`engine.checkpoint.check_gguf`, then :func:`check_layout`: the header of a GGUF pagedq can build
    a model from, or one GGUFError (a ``ValueError``: the worker's ``worker.model_unavailable``, exit 78)."""
    header = check_gguf(path, require_tokenizer=require_tokenizer)
    check_layout(header, path)
    return header


__all__ = ["GGUFSizes", "check_gguf_model", "check_layout", "expected_tensors", "hf_name", "read_sizes"]
