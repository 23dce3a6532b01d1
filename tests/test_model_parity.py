"""pagedq's own model vs transformers on tiny random checkpoints of every supported variant.

The paged path is exercised the way the engine drives it: several sequences flattened into one
forward (full prefills, a chunked prefill, decodes, rows in shuffled order), KV caches laid out in
non-contiguous blocks, and a decode that crosses a block boundary. Each row's logits must match
transformers' forward over that sequence alone.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.attention_metadata import AttentionMetadata
from engine.layers import build_cos_sin_cache
from engine.loader import CheckpointMismatchError, load_model
from engine.model_config import ModelConfig, RopeScaling, UnsupportedModelError
from engine.models.llama import LlamaForCausalLM
from tests.tiny_models import TINY_ARCHS, make_hf_model, make_tiny_checkpoint

BLOCK_SIZE = 16
NUM_BLOCKS = 48
ATOL = 1e-4
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {arch: make_tiny_checkpoint(root / arch, arch) for arch in TINY_ARCHS}


@dataclass
class Seq:
    tokens: list[int]
    num_computed: int = 0  # tokens whose K/V are in the cache
    blocks: list[int] = field(default_factory=list)
    logits: dict[int, torch.Tensor] = field(default_factory=dict)  # position -> pagedq logits


class PagedHarness:
    """A minimal stand-in for the scheduler + block manager: hands out blocks in shuffled order
    and builds each step's flattened inputs and ``AttentionMetadata`` by hand."""

    def __init__(self, model: LlamaForCausalLM, seed: int = 0) -> None:
        cfg = model.config
        gen = torch.Generator().manual_seed(seed)
        self.model = model
        self.free = torch.randperm(NUM_BLOCKS, generator=gen).tolist()
        shape = (NUM_BLOCKS, BLOCK_SIZE, cfg.num_kv_heads, cfg.head_dim)
        # Finite noise rather than zeros: reading a slot that was never written changes the output.
        self.kv_caches = [
            (torch.randn(shape, generator=gen) * 5, torch.randn(shape, generator=gen) * 5)
            for _ in range(cfg.num_layers)
        ]

    def step(self, work: list[tuple[Seq, int]]) -> None:
        """Run ``n`` new tokens of each ``(seq, n)`` in one forward; record logits per position."""
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        for seq, n in work:
            start, end = seq.num_computed, seq.num_computed + n
            while len(seq.blocks) * BLOCK_SIZE < end:
                seq.blocks.append(self.free.pop())
            input_ids += seq.tokens[start:end]
            positions += range(start, end)
            slots += [seq.blocks[t // BLOCK_SIZE] * BLOCK_SIZE + t % BLOCK_SIZE for t in range(start, end)]
            query_lens.append(n)
            seq_lens.append(end)
        max_blocks = max(len(seq.blocks) for seq, _ in work)
        block_tables = torch.tensor(
            [seq.blocks + [0] * (max_blocks - len(seq.blocks)) for seq, _ in work], dtype=torch.int32
        )
        query_start_loc = torch.zeros(len(work) + 1, dtype=torch.int32)
        query_start_loc[1:] = torch.tensor(query_lens).cumsum(0)
        meta = AttentionMetadata(
            query_start_loc=query_start_loc,
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_tables=block_tables,
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            query_lens_cpu=query_lens,
            seq_lens_cpu=seq_lens,
        )
        with torch.inference_mode():
            self.model.ops.attention.prepare(meta)
            hidden = self.model(torch.tensor(input_ids), torch.tensor(positions), self.kv_caches, meta)
            assert hidden.shape == (len(input_ids), self.model.config.hidden_size)
            logits = self.model.compute_logits(hidden)
        assert logits.dtype == torch.float32
        row = 0
        for seq, n in work:
            for pos in range(seq.num_computed, seq.num_computed + n):
                seq.logits[pos] = logits[row]
                row += 1
            seq.num_computed += n


def _append_greedy(seq: Seq) -> None:
    seq.tokens.append(int(seq.logits[seq.num_computed - 1].argmax()))


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_flattened_paged_forward_matches_transformers(arch: str, checkpoints: dict[str, Path]) -> None:
    path = checkpoints[arch]
    model, config = load_model(path, torch.float32, CPU, "torch")
    hf = make_hf_model(path)
    gen = torch.Generator().manual_seed(1)

    def prompt(n: int) -> list[int]:
        return torch.randint(3, config.vocab_size, (n,), generator=gen).tolist()

    # C's second decode writes position 32: the first token of a freshly allocated block.
    a, b, c, d = Seq(prompt(37)), Seq(prompt(5)), Seq(prompt(31)), Seq(prompt(45))
    harness = PagedHarness(model)
    harness.step([(a, 37), (b, 5), (c, 31), (d, 20)])  # three full prefills + a first chunk
    for s in (a, b, c):
        _append_greedy(s)
    harness.step([(a, 1), (d, 25), (b, 1), (c, 1)])  # decodes mixed with the last chunk
    for s in (a, b, c, d):
        _append_greedy(s)
    harness.step([(d, 1), (c, 1), (b, 1), (a, 1)])  # decodes, rows in a different order
    for s in (a, c):
        _append_greedy(s)
    harness.step([(c, 1), (a, 1)])  # a subset of the sequences

    with torch.inference_mode():
        for name, seq in zip("abcd", (a, b, c, d), strict=True):
            computed = seq.tokens[: seq.num_computed]
            ref = hf(torch.tensor([computed])).logits[0].float()
            ours = torch.stack([seq.logits[p] for p in range(seq.num_computed)])
            diff = (ours - ref).abs().max().item()
            assert torch.allclose(ours, ref, atol=ATOL, rtol=ATOL), f"seq {name}: max |diff| {diff:.3g}"
            assert torch.equal(ours.argmax(-1), ref.argmax(-1)), f"seq {name}: greedy tokens differ"


def test_config_fields(checkpoints: dict[str, Path]) -> None:
    configs = {arch: ModelConfig.from_pretrained(checkpoints[arch]) for arch in TINY_ARCHS}
    gqa = configs["llama_gqa"]
    assert (gqa.architecture, gqa.num_layers, gqa.num_heads, gqa.num_kv_heads, gqa.head_dim) == (
        "LlamaForCausalLM",
        3,
        4,
        2,
        16,
    )
    assert not gqa.qkv_bias and not gqa.qk_norm and not gqa.tie_word_embeddings
    assert gqa.rope_scaling is None and gqa.max_model_len == 1024
    assert (gqa.bos_token_id, gqa.eos_token_ids, gqa.torch_dtype) == (1, [2], torch.float32)

    assert configs["llama_mqa_tied"].tie_word_embeddings and configs["llama_mqa_tied"].num_kv_heads == 1
    qwen2 = configs["qwen2"]
    assert qwen2.qkv_bias and not qwen2.o_bias and qwen2.rope_theta == 1e6 and qwen2.sliding_window is None
    qwen3 = configs["qwen3"]
    assert qwen3.qk_norm and qwen3.qkv_bias and qwen3.o_bias
    assert qwen3.head_dim * qwen3.num_heads != qwen3.hidden_size and qwen3.eos_token_ids == [2, 3]
    mistral = configs["mistral"]
    assert mistral.sliding_window == 256 and mistral.max_model_len == 256
    assert configs["llama3_scaled"].rope_scaling == RopeScaling(
        "llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=256
    )


@pytest.mark.parametrize("arch", ["llama_gqa", "llama_mqa_tied", "qwen3"])
def test_num_params_matmul_counts_every_linear(arch: str, checkpoints: dict[str, Path]) -> None:
    hf = make_hf_model(checkpoints[arch])
    linear_weights = sum(m.weight.numel() for m in hf.modules() if isinstance(m, torch.nn.Linear))
    assert ModelConfig.from_pretrained(checkpoints[arch]).num_params_matmul() == linear_weights


def _llama31_style_config(**changes: Any) -> dict[str, Any]:
    """A pre-transformers-5 config.json: top-level rope_theta, a ``rope_scaling`` dict, torch_dtype."""
    raw: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
        "bos_token_id": 128000,
        "eos_token_id": [128001, 128008, 128009],
        "torch_dtype": "bfloat16",
        "tie_word_embeddings": False,
    }
    raw.update(changes)
    return raw


def test_legacy_config_keys() -> None:
    cfg = ModelConfig.from_dict(_llama31_style_config(), {"eos_token_id": [128001, 128009, 128010]})
    assert cfg.rope_theta == 500000.0 and cfg.head_dim == 128 and cfg.torch_dtype == torch.bfloat16
    assert cfg.rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 8192)
    assert cfg.eos_token_ids == [128001, 128008, 128009, 128010]
    # Llama 3.1 8B: 8.03B parameters, of which 2 x 525M are embeddings/lm_head (one counted here).
    assert math.isclose(cfg.num_params_matmul(), 7.5e9, rel_tol=0.01)

    linear = ModelConfig.from_dict(_llama31_style_config(rope_scaling={"type": "linear", "factor": 2.0}))
    assert linear.rope_scaling == RopeScaling("linear", 2.0)
    default = ModelConfig.from_dict(_llama31_style_config(rope_scaling={"rope_type": "default"}))
    assert default.rope_scaling is None
    with pytest.raises(UnsupportedModelError, match="dynamic"):
        ModelConfig.from_dict(_llama31_style_config(rope_scaling={"type": "dynamic", "factor": 2.0}))


def test_qwen_sliding_window_only_when_a_layer_uses_it() -> None:
    base = _llama31_style_config(
        architectures=["Qwen2ForCausalLM"],
        rope_scaling=None,
        num_hidden_layers=4,
        sliding_window=4096,
        max_position_embeddings=32768,
    )
    assert ModelConfig.from_dict(base).max_model_len == 32768  # use_sliding_window absent
    unused = {**base, "use_sliding_window": True, "max_window_layers": 28}
    assert ModelConfig.from_dict(unused).sliding_window is None
    used = {**base, "use_sliding_window": True, "max_window_layers": 2}
    assert ModelConfig.from_dict(used).max_model_len == 4096


def test_unsupported_architecture(tmp_path: Path) -> None:
    raw = _llama31_style_config(architectures=["GPT2LMHeadModel"])
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(UnsupportedModelError) as info:
        load_model(tmp_path, torch.float32, CPU, "torch")
    message = str(info.value)
    assert "GPT2LMHeadModel" in message
    assert all(a in message for a in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"))
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize(
    "rope_parameters",
    [
        {"rope_type": "default", "rope_theta": 10000.0},
        {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
        {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 256,
        },
    ],
)
def test_cos_sin_cache_is_bit_exact(rope_parameters: dict[str, Any]) -> None:
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    max_pos, head_dim = 1024, 64
    hf_config = LlamaConfig(
        hidden_size=256,
        num_attention_heads=4,
        head_dim=head_dim,
        max_position_embeddings=max_pos,
        rope_parameters=dict(rope_parameters),
    )
    cfg = ModelConfig.from_dict({**hf_config.to_dict(), "architectures": ["LlamaForCausalLM"]})
    ours = build_cos_sin_cache(head_dim, max_pos, cfg.rope_theta, cfg.rope_scaling)
    positions = torch.arange(max_pos)[None]
    cos, sin = LlamaRotaryEmbedding(hf_config)(torch.zeros(1, dtype=torch.float32), positions)
    half = head_dim // 2
    assert ours.dtype == torch.float32 and ours.shape == (max_pos, head_dim)
    assert torch.equal(ours[:, :half], cos[0, :, :half]) and torch.equal(ours[:, half:], sin[0, :, :half])


def test_sharded_checkpoint_loads_like_single_file(tmp_path: Path, checkpoints: dict[str, Path]) -> None:
    sharded = make_tiny_checkpoint(tmp_path / "sharded", "qwen2", max_shard_size="100KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("*.safetensors"))) > 1
    model, _ = load_model(sharded, torch.float32, CPU, "torch")
    reference, _ = load_model(checkpoints["qwen2"], torch.float32, CPU, "torch")
    ours = dict(model.named_parameters())
    for name, param in reference.named_parameters():
        assert torch.equal(ours[name], param), name


def test_tied_embeddings_share_one_tensor(checkpoints: dict[str, Path]) -> None:
    model, _ = load_model(checkpoints["llama_mqa_tied"], torch.float32, CPU, "torch")
    assert model.lm_head_weight is model.embed_tokens.weight


def test_missing_and_unexpected_tensors_are_named(tmp_path: Path, checkpoints: dict[str, Path]) -> None:
    broken = tmp_path / "broken"
    broken.mkdir()
    for name in ("config.json", "generation_config.json"):
        (broken / name).write_text((checkpoints["llama_gqa"] / name).read_text())
    tensors = load_file(checkpoints["llama_gqa"] / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    tensors["model.layers.1.self_attn.extra.weight"] = torch.zeros(2)
    save_file(tensors, broken / "model.safetensors")
    with pytest.raises(CheckpointMismatchError) as info:
        load_model(broken, torch.float32, CPU, "torch")
    assert "model.layers.1.self_attn.k_proj.weight" in str(info.value)
    assert "model.layers.1.self_attn.extra.weight" in str(info.value)


def test_bfloat16_load(checkpoints: dict[str, Path]) -> None:
    model, config = load_model(checkpoints["qwen3"], torch.bfloat16, CPU, "torch")
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    harness = PagedHarness(model)
    harness.kv_caches = [(k.bfloat16(), v.bfloat16()) for k, v in harness.kv_caches]
    seq = Seq(list(range(3, 22)))
    harness.step([(seq, 19)])
    logits = torch.stack(list(seq.logits.values()))
    assert logits.dtype == torch.float32 and logits.shape == (19, config.vocab_size)
    assert torch.isfinite(logits).all()
