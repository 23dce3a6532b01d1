"""A tiny random Llama checkpoint with a real byte-level BPE tokenizer, for ``pagedq bench --quick``.

``--quick`` must finish in well under a minute on two cores and must not depend on the default model being
prepared, so it builds its own model: transformers' ``LlamaConfig`` + ``save_pretrained`` (the real on-disk
format every system loads), and a 512-token byte-level BPE trained in milliseconds on the bundled corpus (so
prompts are still real text, and detokenisation has multi-byte merges to deal with). The weights are random:
the outputs are gibberish, which does not matter when every system is forced to generate fixed lengths.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from ops.bench.workloads import CORPUS_PATH

VOCAB_SIZE = 512
EOS = "<|endoftext|>"


def train_byte_level_bpe(texts: list[str], vocab_size: int, special_tokens: list[str]) -> Tokenizer:
    """A byte-level BPE trained on ``texts`` (deterministic, milliseconds); ``special_tokens`` get ids 0, 1, ..."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def _train_tokenizer(corpus: Path) -> PreTrainedTokenizerFast:
    tok = train_byte_level_bpe(corpus.read_text(encoding="utf-8").split("\n\n"), VOCAB_SIZE, [EOS])
    special_tokens = dict.fromkeys(("bos_token", "eos_token", "pad_token", "unk_token"), EOS)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, clean_up_tokenization_spaces=False, model_max_length=4096, **special_tokens
    )


def make_quick_model(path: str | Path, seed: int = 0) -> Path:
    """Write the tiny checkpoint and tokenizer to ``path`` (created) and return it."""
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=2048,
        rms_norm_eps=1e-6,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(out)
    GenerationConfig(bos_token_id=0, eos_token_id=0, pad_token_id=0, do_sample=False).save_pretrained(out)
    _train_tokenizer(CORPUS_PATH).save_pretrained(str(out))
    return out
