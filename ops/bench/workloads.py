"""Benchmark workloads: lists of requests (prompt token ids + exact output length), generated from a seed.

Every system is handed the very same token ids and is asked for exactly ``max_tokens`` greedy tokens with
EOS ignored, so the only thing that differs between systems is how fast they do identical work. Prompts are
windows of real English text (the bundled ``corpus.txt``, tokenised with the model's own tokenizer) so that
detokenisation and prefix hashing see realistic ids; if the tokenizer yields too few tokens (a tiny test
vocabulary) the windows wrap around the corpus, and with no tokenizer at all random ids are used.

Lengths are drawn from a clipped log-normal: most requests are short, a few are long, which is the shape that
punishes static batching (padding to the longest prompt, waiting for the longest output) and that continuous
batching exists to handle.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

CORPUS_PATH = Path(__file__).with_name("corpus.txt")


class TokenizerLike(Protocol):
    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...


@dataclass(frozen=True)
class BenchRequest:
    """One request: exact prompt ids and the exact number of tokens to generate (EOS ignored)."""

    prompt_ids: list[int]
    max_tokens: int
    arrival_s: float = 0.0  # offset from the start of the run (online workload); 0 for offline ones


@dataclass
class Workload:
    """A named list of requests plus the knobs that define it, recorded in the report."""

    name: str
    requests: list[BenchRequest]
    params: dict[str, Any] = field(default_factory=dict)

    @property
    def prompt_tokens(self) -> int:
        return sum(len(r.prompt_ids) for r in self.requests)

    @property
    def output_tokens(self) -> int:
        return sum(r.max_tokens for r in self.requests)

    def summary(self) -> dict[str, Any]:
        """Counts and length statistics, so a reader can tell what the tok/s figures were measured on."""
        plens = [len(r.prompt_ids) for r in self.requests]
        olens = [r.max_tokens for r in self.requests]
        return {
            "name": self.name,
            "requests": len(self.requests),
            "prompt_tokens": sum(plens),
            "output_tokens": sum(olens),
            "prompt_len": _stats(plens),
            "output_len": _stats(olens),
            **self.params,
        }


def _stats(values: list[int]) -> dict[str, float]:
    if not values:
        return {"min": 0, "mean": 0.0, "max": 0}
    return {"min": min(values), "mean": round(sum(values) / len(values), 1), "max": max(values)}


def long_tailed(rng: random.Random, lo: int, hi: int, median: float, sigma: float = 0.9) -> int:
    """A log-normal draw clipped to ``[lo, hi]``: many short values, a long tail up to ``hi``."""
    return int(min(hi, max(lo, round(rng.lognormvariate(math.log(median), sigma)))))


class TextSource:
    """Windows of tokenised corpus text (or random ids), deterministic for a given rng."""

    def __init__(self, tokenizer: TokenizerLike | None, vocab_size: int, corpus: Path = CORPUS_PATH) -> None:
        self.vocab_size = vocab_size
        self.tokens: list[int] = []
        if tokenizer is not None:
            text = corpus.read_text(encoding="utf-8")
            ids = tokenizer.encode(text, add_special_tokens=False)
            self.tokens = [t for t in ids if 0 <= t < vocab_size]
        self.real_text = len(self.tokens) >= 64

    def window(self, rng: random.Random, length: int) -> list[int]:
        """``length`` consecutive corpus tokens from a random offset, wrapping around; random ids if no text."""
        if not self.real_text:
            # Skip the low ids: small vocabularies put special tokens there.
            low = min(4, self.vocab_size - 1)
            return [rng.randrange(low, self.vocab_size) for _ in range(length)]
        n = len(self.tokens)
        start = rng.randrange(n)
        out: list[int] = []
        while len(out) < length:
            take = min(length - len(out), n - start)
            out.extend(self.tokens[start : start + take])
            start = 0
        return out


@dataclass(frozen=True)
class MixedSpec:
    """Length ranges of the ``mixed`` workload (the issue's: prompts 16-512, outputs 16-256)."""

    prompt_lo: int = 16
    prompt_hi: int = 512
    prompt_median: float = 96.0
    output_lo: int = 16
    output_hi: int = 256
    output_median: float = 48.0


QUICK_MIXED = MixedSpec(8, 64, 24.0, 4, 24, 8.0)


def mixed(n: int, seed: int, source: TextSource, spec: MixedSpec = MixedSpec()) -> Workload:
    """``n`` requests with long-tailed prompt and output lengths."""
    rng = random.Random(seed)
    reqs = []
    for _ in range(n):
        plen = long_tailed(rng, spec.prompt_lo, spec.prompt_hi, spec.prompt_median)
        olen = long_tailed(rng, spec.output_lo, spec.output_hi, spec.output_median)
        reqs.append(BenchRequest(source.window(rng, plen), olen))
    return Workload("mixed", reqs, {"seed": seed, "real_text": source.real_text, "spec": vars(spec)})


def contended(n: int, seed: int, source: TextSource, spec: MixedSpec = MixedSpec()) -> Workload:
    """``mixed``'s requests under another name: run idle and beside a busy process (``bench/contention.py``)."""
    work = mixed(n, seed, source, spec)
    return Workload("contended", work.requests, work.params)


def prefix(
    n: int,
    seed: int,
    source: TextSource,
    prefix_len: int = 512,
    unique_lo: int = 64,
    unique_hi: int = 256,
    output_len: int = 64,
) -> Workload:
    """``n`` documents behind one shared ``prefix_len``-token instruction: the prefix-cache case."""
    rng = random.Random(seed + 1)
    shared = source.window(rng, prefix_len)
    reqs = [BenchRequest(shared + source.window(rng, rng.randint(unique_lo, unique_hi)), output_len) for _ in range(n)]
    params = {
        "seed": seed,
        "real_text": source.real_text,
        "prefix_len": prefix_len,
        "unique_len": [unique_lo, unique_hi],
        "output_len": output_len,
    }
    return Workload("prefix", reqs, params)


def online(n: int, seed: int, source: TextSource, rate: float, spec: MixedSpec = MixedSpec()) -> Workload:
    """``mixed``-shaped requests arriving as a Poisson process of ``rate`` requests per second."""
    base = mixed(n, seed + 2, source, spec)
    rng = random.Random(seed + 3)
    t = 0.0
    reqs = []
    for r in base.requests:
        reqs.append(BenchRequest(r.prompt_ids, r.max_tokens, arrival_s=t))
        t += rng.expovariate(rate)
    return Workload("online", reqs, {**base.params, "rate": rate})


@dataclass(frozen=True)
class CompassSpec:
    """The ``compass`` workload of issue 18: the vLLM comparison's fixed point (64 requests, random-token
    prompts of 32-512 tokens, 32-256 output tokens, uniform lengths)."""

    requests: int = 64
    prompt_lo: int = 32
    prompt_hi: int = 512
    output_lo: int = 32
    output_hi: int = 256


QUICK_COMPASS = CompassSpec(8, 16, 64, 32, 40)  # outputs >= 32: greedy agreement compares the first 32 tokens

# Random prompt ids start here: tokenizers keep special and control tokens at the lowest ids (SmolLM2:
# 0-16), and a prompt of them could end a sequence or switch a chat template on in one system only.
RANDOM_ID_LOW = 256


def compass(seed: int, vocab_size: int, spec: CompassSpec = CompassSpec()) -> Workload:
    """``spec.requests`` prompts of uniformly random token ids and uniformly drawn lengths, from ``seed``.

    Random ids rather than text, as in the issue's comparison with vLLM: no tokenizer, corpus or prefix
    cache is involved, so every system does the same prefill and decode work from the same ids. Greedy
    decoding of such prompts still falls into repetition, which prompt-lookup (n-gram) drafts then hit.
    """
    rng = random.Random(seed)
    low = RANDOM_ID_LOW if vocab_size > 4 * RANDOM_ID_LOW else min(4, vocab_size - 1)
    reqs = []
    for _ in range(spec.requests):
        plen = rng.randint(spec.prompt_lo, spec.prompt_hi)
        olen = rng.randint(spec.output_lo, spec.output_hi)
        reqs.append(BenchRequest([rng.randrange(low, vocab_size) for _ in range(plen)], olen))
    return Workload("compass", reqs, {"seed": seed, "real_text": False, "spec": vars(spec)})
