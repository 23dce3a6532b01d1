"""A tiny byte-level BPE tokenizer, built offline, for tests that need a real ``transformers`` tokenizer.

The machine has no hub access, so tests cannot download SmolLM2's tokenizer. This one has the same
shape where it matters: byte-level BPE (so emoji and CJK characters span several tokens, which is what
incremental detokenization must cope with), ``<|endoftext|>`` as id 0 doubling as eos/bos/pad, ChatML
special tokens and a ChatML chat template. The vocabulary stays within 512 so a toy model with a
512-row embedding can consume every id it produces.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from ops.bench.tiny import train_byte_level_bpe

EOS_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [EOS_TOKEN, IM_START, IM_END]  # ids 0, 1, 2 in this order
VOCAB_SIZE = 512

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Mostly English so the few hundred merges go to English words; CJK, emoji and accented text appear
# rarely enough that their characters stay split into several byte-level tokens.
_ENGLISH = [
    "The quick brown fox jumps over the lazy dog.",
    "A language model predicts the next token given the previous tokens.",
    "Continuous batching keeps the GPU busy by adding new requests as old ones finish.",
    "Paged attention stores the key and value cache in fixed size blocks.",
    "The scheduler decides which requests run in the next step of the engine.",
    "Streaming returns text to the client as soon as it is ready.",
    "Once upon a time there was a little robot who loved to read books.",
    "Hello, world! How are you today? I am fine, thank you.",
    "The weather is nice and the sun is shining over the hills.",
    "She sells sea shells by the sea shore, and the shells she sells are surely sea shells.",
    "Numbers like 1, 2, 3, 42 and 2024 show up in text all the time.",
    "def main():\n    print('hello')\n    return 0\n",
    "Temperature, top p and top k change how random the sampled text is.",
    "The cat sat on the mat while the dog slept in the garden.",
    "Please answer the question in one short sentence.",
]
_OTHER = [
    "你好，世界！今天天气很好。",
    "我喜欢读书和写代码。",
    "こんにちは、元気ですか？",
    "안녕하세요 세계",
    "Emoji time: 😀 🎉 🚀 👍 ❤️ 🐍",
    "Café, naïve, façade, jalapeño, Ångström, über, déjà vu.",
    "Grüße aus München! Ça va très bien, merci.",
    "Привет, мир! Как дела?",
]


def training_corpus() -> list[str]:
    """The built-in corpus: English repeated so its merges win, everything else once."""
    return _ENGLISH * 20 + _OTHER


def build_tokenizer_object() -> Tokenizer:
    """Train the raw ``tokenizers`` byte-level BPE model (deterministic, a few milliseconds)."""
    return train_byte_level_bpe(training_corpus(), VOCAB_SIZE, SPECIAL_TOKENS)


def make_tokenizer(path: str | Path) -> PreTrainedTokenizerFast:
    """Build the tiny tokenizer, ``save_pretrained`` it to ``path`` and return it reloaded from there.

    Reloading through ``AutoTokenizer`` proves the saved directory is self-contained, which is what a
    test model directory needs.
    """
    fast = PreTrainedTokenizerFast(
        tokenizer_object=build_tokenizer_object(),
        bos_token=EOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        unk_token=EOS_TOKEN,
        additional_special_tokens=[IM_START, IM_END],
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
        model_max_length=2048,
    )
    fast.save_pretrained(str(path))
    loaded = AutoTokenizer.from_pretrained(str(path))
    assert isinstance(loaded, PreTrainedTokenizerFast)
    return loaded
