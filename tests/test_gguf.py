"""GGUF checkpoints (engine/gguf_checkpoint.py): exact repacking, un-permuted q/k, float types, clear errors,
and a tiny model's logits against transformers on the same weights dequantised by gguf."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM
from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

from engine.attention_metadata import AttentionMetadata
from engine.checkpoint import check_gguf, gguf_file
from engine.gguf_checkpoint import GGUFError, load_gguf_model
from engine.layers import Linear
from engine.model_config import ModelConfig
from engine.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from tests.tiny_gguf import write_tiny_gguf

CPU = torch.device("cpu")
# Layer 0 all Q4_1 (the default model's type), layer 1 a mix: Q8_0 / Q4_0 / F16 / BF16, and q and k of
# different kinds, so a merged qkv falls back to dense floats.
TYPES = {
    **{f"blk.0.{n}.weight": "Q4_1" for n in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up")},
    "blk.0.ffn_down.weight": "Q8_0",
    "blk.1.attn_q.weight": "Q4_0",
    "blk.1.attn_k.weight": "Q8_0",
    "blk.1.attn_v.weight": "F16",
    "blk.1.attn_output.weight": "Q4_0",
    "blk.1.ffn_gate.weight": "Q8_0",
    "blk.1.ffn_up.weight": "Q8_0",
    "blk.1.ffn_down.weight": "BF16",
    "token_embd.weight": "Q8_0",
}


@pytest.fixture(scope="module")
def tiny_gguf(tiny_model: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    folder = tiny_model("llama_mqa_tied")  # tied lm_head, one KV head
    state = load_file(str(folder / "model.safetensors"))
    state = {k: v for k, v in state.items() if k != "lm_head.weight"}
    config = ModelConfig.from_pretrained(folder)
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_tiny_gguf(path, state, config, TYPES)
    return path, folder


def _gguf_reference(path: Path, config: ModelConfig) -> dict[str, torch.Tensor]:
    """Every tensor dequantised by gguf itself, q/k un-permuted by transformers: the reference weights."""
    processor = LlamaTensorProcessor(
        {"num_attention_heads": config.num_heads, "num_key_value_heads": config.num_kv_heads}
    )
    out = {}
    for t in GGUFReader(path).tensors:
        weights = dequantize(t.data, t.tensor_type).reshape([int(s) for s in reversed(t.shape)])
        out[t.name] = torch.from_numpy(np.array(processor.process(weights, t.name).weights))
    return out


def _dense(linear: Linear) -> torch.Tensor:
    return linear.int8.dequantize() if linear.int8 is not None else linear.weight.detach()


def test_weights_equal_gguf_dequantize_exactly(tiny_gguf: tuple[Path, Path]) -> None:
    path, _ = tiny_gguf
    model, config = load_gguf_model(path, torch.float32, CPU, "torch")
    assert model.source_quantization == "gguf:Q4_1"
    ref = _gguf_reference(path, config)
    layer0, layer1 = cast(LlamaDecoderLayer, model.layers[0]), cast(LlamaDecoderLayer, model.layers[1])
    assert layer0.self_attn.qkv_proj.int8 is not None and layer0.self_attn.qkv_proj.int8.offsets is not None
    assert layer0.mlp.down_proj.int8 is not None and layer0.mlp.down_proj.int8.offsets is None  # Q8_0
    assert layer1.self_attn.qkv_proj.int8 is None  # Q4_0 + Q8_0 + F16: dequantised into the dense weight
    assert layer1.mlp.down_proj.int8 is None  # BF16: a float
    for i, layer in enumerate((layer0, layer1)):
        qkv = torch.cat([ref[f"blk.{i}.attn_{p}.weight"] for p in "qkv"])
        assert torch.equal(_dense(layer.self_attn.qkv_proj), qkv)  # bit for bit, q/k rows un-permuted
        assert torch.equal(_dense(layer.self_attn.o_proj), ref[f"blk.{i}.attn_output.weight"])
        gate_up = torch.cat([ref[f"blk.{i}.ffn_gate.weight"], ref[f"blk.{i}.ffn_up.weight"]])
        assert torch.equal(_dense(layer.mlp.gate_up_proj), gate_up)
        assert torch.equal(_dense(layer.mlp.down_proj), ref[f"blk.{i}.ffn_down.weight"])
    assert torch.equal(model.embed_tokens.weight.detach(), ref["token_embd.weight"])


def _logits(model: LlamaForCausalLM, config: ModelConfig, ids: list[int]) -> torch.Tensor:
    """One prefill of ``ids`` through pagedq's model over a private KV cache."""
    n, bs = len(ids), 16
    blocks = -(-n // bs)
    cache = torch.zeros(config.num_layers, 2, blocks, bs, config.num_kv_heads, config.head_dim)
    positions = torch.arange(n)
    table = torch.arange(blocks, dtype=torch.int32)[None]
    meta = AttentionMetadata(
        query_start_loc=torch.tensor([0, n], dtype=torch.int32),
        seq_lens=torch.tensor([n], dtype=torch.int32),
        block_tables=table,
        slot_mapping=positions.clone(),
        max_query_len=n,
        max_seq_len=n,
        query_lens_cpu=[n],
        seq_lens_cpu=[n],
    )
    model.ops.attention.prepare(meta)
    with torch.inference_mode():
        caches = [(cache[i, 0], cache[i, 1]) for i in range(config.num_layers)]
        hidden = model(torch.tensor(ids), positions, caches, meta)
        return model.compute_logits(hidden)


def test_tiny_gguf_logits_match_transformers_on_dequantised_weights(tiny_gguf: tuple[Path, Path]) -> None:
    """The C int8 kernel on the repacked blocks vs transformers' fp32 forward on gguf's dequantisation."""
    _assert_logits_match_transformers(*tiny_gguf)


def _assert_logits_match_transformers(path: Path, folder: Path) -> None:
    model, config = load_gguf_model(path, torch.float32, CPU, "torch")
    model.prepack_cpu_weights()
    ref = _gguf_reference(path, config)
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    names = {
        "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    }  # fmt: skip
    state = {"model.embed_tokens.weight": ref["token_embd.weight"], "model.norm.weight": ref["output_norm.weight"]}
    for name, tensor in ref.items():
        if name.startswith("blk."):
            _, layer, kind, _ = name.split(".")
            state[f"model.layers.{layer}.{names[kind]}.weight"] = tensor
    hf.load_state_dict(state, strict=False)
    hf.tie_weights()
    ids = torch.randint(3, config.vocab_size, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(_logits(model, config, ids), want, atol=2e-4, rtol=1e-4)


# A Q4_K_M-like file (llama.cpp's most downloaded kind): Q4_K linears, Q6_K v and down in layer 0, and in
# layer 1 the other K-quants and IQ4 types, a Q6_K embedding. K-quants need rows of whole 256-element
# super-blocks, so this tiny model is 256 wide (4 heads of 64) with a 512-wide MLP.
K_TYPES = {
    **{f"blk.0.{n}.weight": "Q4_K" for n in ("attn_q", "attn_k", "attn_output", "ffn_gate", "ffn_up")},
    "blk.0.attn_v.weight": "Q6_K",
    "blk.0.ffn_down.weight": "Q6_K",
    "blk.1.attn_q.weight": "Q5_K",
    "blk.1.attn_k.weight": "Q5_K",
    "blk.1.attn_v.weight": "Q5_1",
    "blk.1.attn_output.weight": "Q2_K",
    "blk.1.ffn_gate.weight": "Q3_K",
    "blk.1.ffn_up.weight": "IQ4_XS",
    "blk.1.ffn_down.weight": "IQ4_NL",
    "token_embd.weight": "Q6_K",
}


@pytest.fixture(scope="module")
def k_quant_gguf(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    from tests.tiny_models import make_tiny_checkpoint

    folder = make_tiny_checkpoint(
        tmp_path_factory.mktemp("k-quant-hf"), "llama_mqa_tied", hidden_size=256, intermediate_size=512, head_dim=64
    )
    state = {k: v for k, v in load_file(str(folder / "model.safetensors")).items() if k != "lm_head.weight"}
    path = tmp_path_factory.mktemp("k-quant") / "tiny-Q4_K_M.gguf"
    write_tiny_gguf(path, state, ModelConfig.from_pretrained(folder), K_TYPES)
    return path, folder


def test_k_quants_load_as_int8_equal_to_gguf_dequantize(k_quant_gguf: tuple[Path, Path]) -> None:
    """K-quant and IQ4 linears stay int8 (one byte per weight), merged across groups of 16 and 32, and every
    weight equals gguf's dequantisation bit for bit; the logits then match transformers on those weights."""
    path, folder = k_quant_gguf
    model, config = load_gguf_model(path, torch.float32, CPU, "torch")
    assert model.source_quantization == "gguf:Q4_K"
    ref = _gguf_reference(path, config)
    layer0, layer1 = cast(LlamaDecoderLayer, model.layers[0]), cast(LlamaDecoderLayer, model.layers[1])
    qkv0 = layer0.self_attn.qkv_proj.int8
    assert qkv0 is not None and qkv0.group_size == 16 and qkv0.offsets is not None  # Q4_K q/k beside Q6_K v
    for layer in (layer0, layer1):
        for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            assert linear.int8 is not None
    for i, layer in enumerate((layer0, layer1)):
        qkv = torch.cat([ref[f"blk.{i}.attn_{p}.weight"] for p in "qkv"])
        assert torch.equal(_dense(layer.self_attn.qkv_proj), qkv)
        assert torch.equal(_dense(layer.self_attn.o_proj), ref[f"blk.{i}.attn_output.weight"])
        gate_up = torch.cat([ref[f"blk.{i}.ffn_gate.weight"], ref[f"blk.{i}.ffn_up.weight"]])
        assert torch.equal(_dense(layer.mlp.gate_up_proj), gate_up)
        assert torch.equal(_dense(layer.mlp.down_proj), ref[f"blk.{i}.ffn_down.weight"])
    assert torch.equal(model.embed_tokens.weight.detach(), ref["token_embd.weight"])
    _assert_logits_match_transformers(path, folder)


@pytest.mark.parametrize(
    ("arch", "overrides"),
    [
        ("llama3_scaled", {}),  # Llama 3.1 rope scaling: no metadata key, a rope_freqs tensor
        ("llama_gqa", {"rope_parameters": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}}),
        ("qwen2", {}),  # q/k/v biases, rows not permuted
        ("qwen3", {}),  # per-head q/k norms, head_dim (16 x 8 heads) apart from hidden (64): key_length
    ],
)
def test_gguf_architectures_and_rope_scaling_match_transformers(
    arch: str, overrides: dict[str, Any], tmp_path: Path
) -> None:
    """A GGUF written as llama.cpp's converter writes each kind (F32 tensors: the weights are the checkpoint's)
    gives transformers' logits on the checkpoint. A Llama 3.1 file loaded without its rope_freqs tensor ran
    the plain rotary: logits off by far more than the tolerance at every position past the first."""
    from tests.tiny_models import make_tiny_checkpoint

    folder = make_tiny_checkpoint(tmp_path / "hf", arch, **overrides)
    config = ModelConfig.from_pretrained(folder)
    state = load_file(str(folder / "model.safetensors"))
    path = tmp_path / f"{arch}.gguf"
    write_tiny_gguf(path, state, config, {}, eot_token_id=5)
    model, loaded = load_gguf_model(path, torch.float32, CPU, "torch")
    assert loaded.eos_token_ids == [2, 5]  # end of turn stops generation as EOS does
    assert loaded.architecture == config.architecture and loaded.head_dim == config.head_dim
    assert (loaded.qkv_bias, loaded.qk_norm) == (config.qkv_bias, config.qk_norm)
    want_scaling = {"llama3_scaled": "frequency_divisors", "llama_gqa": "linear"}.get(arch)
    assert (loaded.rope_scaling.rope_type if loaded.rope_scaling else None) == want_scaling
    model.prepack_cpu_weights()
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    ids = torch.randint(3, config.vocab_size, (300,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(_logits(model, loaded, ids), want, atol=2e-4, rtol=1e-4)


@pytest.mark.usefixtures("isa_variant")
def test_quantised_lm_head_serves_decode_sized_calls_as_int8(tiny_gguf: tuple[Path, Path]) -> None:
    """The tied Q8_0 embedding is also held as int8 for the lm_head: calls of up to ``lm_head_int8_rows`` rows (a
    lone sequence's decode step: the fused path's rows, at most LM_HEAD_INT8_ROWS) read it there, a quarter of the
    bytes, and give the dense panels' floats; larger calls keep the dense panels and their greedy argmax without
    logits."""
    from engine.models.llama import LM_HEAD_INT8_ROWS
    from pagedq_kernels import cpu_linear, int8_linear

    model, config = load_gguf_model(tiny_gguf[0], torch.float32, CPU, "torch")
    model.prepack_cpu_weights()
    fused = model.lm_head_int8_rows
    assert fused == min(int8_linear.fused_rows(), LM_HEAD_INT8_ROWS)
    assert model.lm_head_int8 is None  # packed, or dropped where nothing would use it
    if not fused:
        assert model.lm_head_int8_packed is None
        pytest.skip("this kernel build has no fused int8 path (the generic one): the dense lm_head serves all")
    assert model.lm_head_packed is not None and model.lm_head_int8_packed is not None
    hidden = torch.randn(fused + 1, config.hidden_size, generator=torch.Generator().manual_seed(2))
    dense = cpu_linear.linear(hidden, model.lm_head_packed, None)
    for rows in range(1, fused + 1):
        assert model.compute_greedy(hidden[:rows]) is None  # its logits come from the int8 head
        assert torch.equal(model.compute_logits(hidden[:rows]), dense[:rows])
    _, indices = cast(tuple[torch.Tensor, torch.Tensor], model.compute_greedy(hidden))
    assert torch.equal(indices, dense.argmax(dim=1))


def test_quantised_lm_head_of_a_bf16_model_on_dot_products_gives_the_dense_heads_floats(
    tiny_gguf: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under a bf16 model where the AVX512-bf16 kernels run (no AMX), the tied Q8_0 embedding's int8 copy serves
    the lm_head's calls of up to LM_HEAD_INT8_DP_ROWS rows on gemm_int8_dp: the dequantised weight rounded to bf16,
    what the dense bf16 head holds, so the logits are the dense head's, bit for bit; larger calls keep the dense
    head and its argmax epilogue."""
    from engine.models.llama import LM_HEAD_INT8_DP_ROWS
    from pagedq_kernels import cpu_isa, cpu_linear

    monkeypatch.delenv(cpu_isa.ENV_CAP, raising=False)  # the suite caps the ISA below bf16 (tests/conftest.py)
    monkeypatch.setenv(cpu_isa.ENV_CAP, "avx512_bf16")  # the dot products, AMX off where it runs
    if cpu_linear.dp_library() is None:
        pytest.skip(f"AVX512-bf16 not runnable here (probed: {list(cpu_isa.current().probed)})")
    model, config = load_gguf_model(tiny_gguf[0], torch.bfloat16, CPU, "torch")
    model.prepack_cpu_weights()
    assert model.lm_head_packed is not None and model.lm_head_packed.kind == "dpbf16"
    assert model.lm_head_int8_packed is not None and model.lm_head_int8_packed.dp_kernels is not None
    assert model.lm_head_int8_rows == LM_HEAD_INT8_DP_ROWS and model.lm_head_int8 is None
    hidden = torch.randn(LM_HEAD_INT8_DP_ROWS + 1, config.hidden_size, generator=torch.Generator().manual_seed(3))
    dense = cpu_linear.linear(hidden, model.lm_head_packed, None)
    for rows in (1, 2, LM_HEAD_INT8_DP_ROWS):
        assert model.compute_greedy(hidden[:rows]) is None  # its logits come from the int8 head
        assert torch.equal(model.compute_logits(hidden[:rows]), dense[:rows])
    _, indices = cast(tuple[torch.Tensor, torch.Tensor], model.compute_greedy(hidden))
    assert torch.equal(indices, dense.argmax(dim=1))


def test_folder_with_one_gguf_resolves_to_it(tiny_gguf: tuple[Path, Path], tmp_path: Path) -> None:
    path, _ = tiny_gguf
    (tmp_path / "model.gguf").symlink_to(path)
    assert gguf_file(tmp_path) == tmp_path / "model.gguf"
    assert gguf_file(path) == path
    (tmp_path / "config.json").write_text("{}")  # a Hugging Face folder wins over a stray .gguf
    assert gguf_file(tmp_path) is None


def test_truncated_gguf_is_one_clear_error(tiny_gguf: tuple[Path, Path], tmp_path: Path) -> None:
    path, _ = tiny_gguf
    data = path.read_bytes()
    for cut in (len(data) // 2, 100):  # in the tensor data; in the metadata
        short = tmp_path / f"short-{cut}.gguf"
        short.write_bytes(data[:cut])
        with pytest.raises(GGUFError, match=r"short-\d+\.gguf"):
            load_gguf_model(short, torch.float32, CPU, "torch")


def test_unsupported_quant_type_names_tensor_and_type(tiny_model: Callable[[str], Path], tmp_path: Path) -> None:
    folder = tiny_model("llama_mqa_tied")
    state = {k: v for k, v in load_file(str(folder / "model.safetensors")).items() if k != "lm_head.weight"}
    config = ModelConfig.from_pretrained(folder)
    del state["model.layers.1.mlp.down_proj.weight"]
    # A lattice type (256 elements in 66 bytes per block): 32 blocks, as many elements as down_proj's 64 x 128.
    raw = np.zeros((32, 66), dtype=np.uint8)
    path = tmp_path / "iq2.gguf"
    write_tiny_gguf(path, state, config, {}, {"blk.1.ffn_down.weight": (raw, GGMLQuantizationType.IQ2_XXS)})
    with pytest.raises(GGUFError, match=r"tensor blk\.1\.ffn_down\.weight has type IQ2_XXS"):
        load_gguf_model(path, torch.float32, CPU, "torch")


def test_default_model_is_the_packaged_gguf_until_prepared(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from engine.default_model import EXPECTED_CONFIG, DefaultModelUnavailable, find_default_gguf, resolve_model_path
    from engine.gguf_checkpoint import read_config

    try:
        gguf = find_default_gguf()
    except DefaultModelUnavailable as exc:
        pytest.skip(f"default model package not installed: {exc}")
    monkeypatch.setenv("PAGEDQ_MODEL_DIR", str(tmp_path))  # nothing prepared here
    assert resolve_model_path(None) == gguf
    config = read_config(check_gguf(gguf, require_tokenizer=False), gguf)  # the header only
    assert (config.num_layers, config.hidden_size, config.num_kv_heads) == (30, 576, 3)
    assert config.rms_norm_eps == EXPECTED_CONFIG["rms_norm_eps"] and config.tie_word_embeddings
    assert config.rope_theta == EXPECTED_CONFIG["rope_theta"] and config.vocab_size == 49152


def test_model_config_reads_a_gguf(tiny_gguf: tuple[Path, Path]) -> None:
    path, folder = tiny_gguf
    from_gguf, from_folder = ModelConfig.from_pretrained(path), ModelConfig.from_pretrained(folder)
    assert (from_gguf.num_layers, from_gguf.num_kv_heads, from_gguf.head_dim) == (
        from_folder.num_layers,
        from_folder.num_kv_heads,
        from_folder.head_dim,
    )
    assert from_gguf.tie_word_embeddings and from_gguf.rms_norm_eps == from_folder.rms_norm_eps
