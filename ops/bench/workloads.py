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

import json
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
    schema: str | None = None  # structured workload: the name of its JSON schema in STRUCTURED_SCHEMAS


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


# ------------------------------------------------------------------------------------- structured

# Extraction schemas of the kind bulk document processing asks for: nested objects, arrays of objects,
# enums, required fields, integer ranges, patterns. Every string and array is bounded, so that a grammar
# always completes within the workload's ``max_tokens`` whatever the model does (a random-weight model
# included): an unbounded string lets a weak model write until the cap and leave the JSON unclosed.
_LINE_ITEM: dict[str, Any] = {
    "type": "object",
    "properties": {
        "description": {"type": "string", "maxLength": 32},
        "quantity": {"type": "integer", "minimum": 1, "maximum": 100},
        "unit_price_cents": {"type": "integer", "minimum": 0, "maximum": 100000},
    },
    "required": ["description", "quantity", "unit_price_cents"],
    "additionalProperties": False,
}
STRUCTURED_SCHEMAS: dict[str, dict[str, Any]] = {
    "invoice": {
        "type": "object",
        "properties": {
            "vendor": {"type": "string", "maxLength": 40},
            "invoice_number": {"type": "string", "pattern": "^INV-[0-9]{4,6}$"},
            "date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"},
            "currency": {"enum": ["USD", "EUR", "GBP"]},
            "line_items": {"type": "array", "minItems": 1, "maxItems": 4, "items": _LINE_ITEM},
            "total_cents": {"type": "integer", "minimum": 0, "maximum": 10000000},
            "paid": {"type": "boolean"},
        },
        "required": ["vendor", "invoice_number", "date", "currency", "line_items", "total_cents", "paid"],
        "additionalProperties": False,
    },
    "ticket": {
        "type": "object",
        "properties": {
            "category": {"enum": ["billing", "shipping", "technical", "account", "other"]},
            "priority": {"enum": ["low", "medium", "high", "urgent"]},
            "sentiment": {"enum": ["negative", "neutral", "positive"]},
            "customer": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 40},
                    "account_id": {"type": "integer", "minimum": 1000, "maximum": 999999},
                    "plan": {"enum": ["free", "pro", "enterprise"]},
                },
                "required": ["name", "account_id", "plan"],
                "additionalProperties": False,
            },
            "summary": {"type": "string", "maxLength": 100},
            "tags": {"type": "array", "maxItems": 3, "items": {"type": "string", "maxLength": 16}},
            "refund_requested": {"type": "boolean"},
        },
        "required": ["category", "priority", "sentiment", "customer", "summary", "tags", "refund_requested"],
        "additionalProperties": False,
    },
    "contact": {
        "type": "object",
        "properties": {
            "name": {
                "type": "object",
                "properties": {
                    "first": {"type": "string", "maxLength": 24},
                    "last": {"type": "string", "maxLength": 24},
                },
                "required": ["first", "last"],
                "additionalProperties": False,
            },
            "email": {"type": "string", "pattern": "^[a-z0-9.]{1,24}@[a-z0-9-]{1,20}\\.(com|org|net|io)$"},
            "company": {"type": "string", "maxLength": 40},
            "title": {"type": "string", "maxLength": 40},
            "years_experience": {"type": "integer", "minimum": 0, "maximum": 50},
            "skills": {"type": "array", "minItems": 1, "maxItems": 4, "items": {"type": "string", "maxLength": 20}},
        },
        "required": ["name", "email", "company", "title", "years_experience", "skills"],
        "additionalProperties": False,
    },
    "meeting": {
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": 48},
            "date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"},
            "start": {"type": "string", "pattern": "^[0-2][0-9]:[0-5][0-9]$"},
            "duration_minutes": {"type": "integer", "minimum": 5, "maximum": 480},
            "attendees": {
                "type": "array",
                "minItems": 1,
                "maxItems": 4,
                "items": {
                    "type": "object",
                    "properties": {
                        "name": {"type": "string", "maxLength": 32},
                        "role": {"enum": ["organizer", "required", "optional"]},
                    },
                    "required": ["name", "role"],
                    "additionalProperties": False,
                },
            },
            "location": {
                "type": "object",
                "properties": {"room": {"type": "string", "maxLength": 24}, "remote": {"type": "boolean"}},
                "required": ["room", "remote"],
                "additionalProperties": False,
            },
        },
        "required": ["title", "date", "start", "duration_minutes", "attendees", "location"],
        "additionalProperties": False,
    },
}

_FIRST = ["Ada", "Bruno", "Chiara", "Dmitri", "Elena", "Farah", "Goran", "Hana", "Ivan", "Julia", "Kenji", "Lena"]
_LAST = ["Moreau", "Okafor", "Lindqvist", "Tanaka", "Brennan", "Costa", "Novak", "Haddad", "Schmidt", "Rossi"]
_COMPANY = ["Northwind Traders", "Blue Harbor Logistics", "Acme Tooling", "Fernwood Labs", "Quill & Co", "Orbital"]
_ITEMS = ["printer paper (500 sheets)", "toner cartridge", "desk lamp", "USB-C cable", "office chair", "whiteboard"]
_SKILLS = ["contract law", "Python", "negotiation", "SQL", "logistics", "public speaking", "accounting", "Spanish"]
_ISSUES = [
    "I was charged twice for the March subscription and want the duplicate refunded",
    "I cannot log in since the password reset email never arrives",
    "my package arrived damaged and I need a replacement shipped",
    "the export to CSV fails with an error on large reports",
]


def _person(rng: random.Random) -> tuple[str, str]:
    return rng.choice(_FIRST), rng.choice(_LAST)


def _date(rng: random.Random) -> str:
    return f"20{rng.randint(20, 29)}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"


def _invoice_text(rng: random.Random) -> str:
    lines = []
    total = 0
    for _ in range(rng.randint(1, 4)):
        qty, price = rng.randint(1, 20), rng.randint(199, 25000)
        total += qty * price
        lines.append(f"  {qty} x {rng.choice(_ITEMS)} at {price / 100:.2f} each")
    currency = rng.choice(["USD", "EUR", "GBP"])
    return (
        f"INVOICE INV-{rng.randint(1000, 999999)}\nFrom: {rng.choice(_COMPANY)}\nDate: {_date(rng)}\n"
        + "\n".join(lines)
        + f"\nTotal due: {total / 100:.2f} {currency}. "
        + rng.choice(["Paid in full by bank transfer, thank you.", "Payment due within 30 days."])
    )


def _ticket_text(rng: random.Random) -> str:
    first, last = _person(rng)
    plan = rng.choice(["free", "pro", "enterprise"])
    return (
        f"Support ticket from {first} {last} (account {rng.randint(1000, 999999)}, {plan} plan):\n"
        f"Hello, {rng.choice(_ISSUES)}. "
        + rng.choice(["This is the third time I write about it.", "No rush, whenever you can.", "Please help today."])
    )


def _contact_text(rng: random.Random) -> str:
    first, last = _person(rng)
    company = rng.choice(_COMPANY)
    domain = company.split()[0].lower().strip("&")
    skills = ", ".join(rng.sample(_SKILLS, rng.randint(1, 4)))
    return (
        f"Hi, I'm {first} {last}, {rng.choice(['head of procurement', 'senior engineer', 'legal counsel'])} at "
        f"{company}, with {rng.randint(1, 30)} years in the field. I work on {skills}. Reach me at "
        f"{first.lower()}.{last.lower()}@{domain}.com."
    )


def _meeting_text(rng: random.Random) -> str:
    people = [" ".join(_person(rng)) for _ in range(rng.randint(1, 4))]
    return (
        f"Calendar: '{rng.choice(['Quarterly budget review', 'Vendor onboarding', 'Contract renewal call'])}' on "
        f"{_date(rng)} at {rng.randint(8, 17):02d}:{rng.choice([0, 15, 30, 45]):02d} for "
        f"{rng.choice([15, 30, 45, 60, 90])} minutes, organised by {people[0]}"
        + (f", with {', '.join(people[1:])}" if people[1:] else "")
        + f". Room {rng.choice(['B-204', 'Atlas', 'Main hall'])}"
        + rng.choice([", video link for remote attendees.", ", in person only."])
    )


_DOCUMENTS = {"invoice": _invoice_text, "ticket": _ticket_text, "contact": _contact_text, "meeting": _meeting_text}


def structured_prompt(schema_name: str, document: str) -> str:
    """The instruction (schema first, so requests on one schema share a cacheable prefix), then the text."""
    schema = json.dumps(STRUCTURED_SCHEMAS[schema_name], separators=(",", ":"))
    return (
        f"Extract the {schema_name} below as one JSON object that matches this JSON schema:\n{schema}\n\n"
        f"{document}\n\nJSON:"
    )


def structured(n: int, seed: int, tokenizer: Any, vocab_size: int, max_tokens: int = 768) -> Workload:
    """``n`` extraction requests, round-robin over the schemas, each a generated document behind its
    schema's instruction; ``max_tokens`` is a cap, above what any schema's bounded output can take.

    The prompt goes through the tokenizer's chat template when it has one (the instruct model answers
    the user turn), else it is plain text. The unconstrained side of the benchmark generates exactly the
    lengths the constrained side produced (see ``ops.bench.structured``), so the two do the same work.
    """
    rng = random.Random(seed + 4)
    names = list(STRUCTURED_SCHEMAS)
    reqs = []
    for i in range(n):
        name = names[i % len(names)]
        text = structured_prompt(name, _DOCUMENTS[name](rng))
        if getattr(tokenizer, "chat_template", None):  # as Engine.chat_prompt_ids: text, then its ids
            messages = [{"role": "user", "content": text}]
            text = str(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))
        ids = tokenizer.encode(text, add_special_tokens=False)
        reqs.append(BenchRequest([t for t in ids if 0 <= t < vocab_size], max_tokens, schema=name))
    params = {"seed": seed, "max_tokens_cap": max_tokens, "schemas": names}
    return Workload("structured", reqs, params)
