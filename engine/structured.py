"""Structured output: JSON-schema, regex, choice and EBNF constraints through xgrammar.

A constrained request's grammar is compiled once, at admission (``Engine.add_request``), and kept in a
bounded LRU keyed by the constraint's canonical text, so the step loop never compiles and a schema sent
by many jobs is compiled once. Each sample of the request gets its own ``GrammarMatcher`` (``n > 1``
samples diverge), advanced only by tokens the engine accepts: a preempted sequence is recomputed from
its kept tokens without resampling them, so its matcher needs no rollback; speculative drafts are not
proposed for constrained sequences (see ``Engine._propose_drafts``), so no matcher sees a rejected draft.

Each step, the bitmasks of all constrained rows are filled into one tensor and applied to the logits in
one ``apply_token_bitmask_inplace`` call before sampling; a step without constrained rows skips all of
it. xgrammar is imported here only, and only when an engine is built, so the wire schemas and producers
never load it.
"""

from __future__ import annotations

import json
import re
import time
from collections import OrderedDict
from typing import Any

import torch
import xgrammar as xgr
from transformers import PreTrainedTokenizerBase

from schemas.sampling import SamplingParams

DEFAULT_CACHE_SIZE = 128

# xgrammar's C++ errors start with a timestamp, a source location and sometimes the failed check; the
# producer gets the reason only.
_LOCATION = re.compile(r"^\s*\[[0-9:.]+\]\s*\S+:\d+:\s*")
_CHECK = re.compile(r"^Check failed: \(.*?\) is false:\s*")


def library_message(exc: BaseException) -> str:
    """The first meaningful line of an xgrammar error, without its C++ source location."""
    text = str(exc).strip()
    text = _CHECK.sub("", _LOCATION.sub("", text)).strip()
    first = text.splitlines()[0] if text else type(exc).__name__
    return first[:300]


def constraint_of(params: SamplingParams) -> tuple[str, str] | None:
    """(kind, canonical text) of the request's constraint, or None: the grammar cache's key. A schema
    given as a dict and the same schema as a string share one entry. Keys are not sorted: the order of
    ``properties`` is the order the JSON object's keys are generated in (as OpenAI's structured output)."""
    if params.json_schema is not None:
        schema = params.json_schema
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as exc:
                raise ValueError(f"json_schema is not valid JSON: {exc}") from exc
        return "json_schema", json.dumps(schema, separators=(",", ":"))
    if params.regex is not None:
        return "regex", params.regex
    if params.choice is not None:
        # A choice is a grammar of string literals; JSON string escapes are EBNF's literal escapes.
        return "grammar", "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in params.choice)
    if params.grammar is not None:
        return "grammar", params.grammar
    return None


# xgrammar 0.2.9 writes the characters of a length-bounded string (minLength / maxLength) as this class,
# which lets raw control characters (tab, NUL...) into the string: not JSON (RFC 8259 wants them
# escaped; Python's json.loads refuses them). Its unbounded strings use the right class, below.
_LOOSE_STRING_CHAR = r"[^\"\\\r\n]"
_JSON_STRING_CHAR = r"[^\0-\x1f\"\\]"


def json_schema_grammar(schema: str) -> Any:
    """xgrammar's grammar for a JSON schema, compact (no free whitespace: a model, a weak one above all,
    can emit spaces and newlines until ``max_tokens`` and never close the object), with bounded
    strings' characters limited to what JSON allows unescaped."""
    grammar = xgr.Grammar.from_json_schema(schema, any_whitespace=False)
    ebnf = str(grammar)
    if _LOOSE_STRING_CHAR in ebnf:
        grammar = xgr.Grammar.from_ebnf(ebnf.replace(_LOOSE_STRING_CHAR, _JSON_STRING_CHAR))
    return grammar


class GrammarCache:
    """Compiles constraints against one tokenizer and keeps the last ``maxsize`` compiled grammars.

    ``vocab_size`` is the model's logits width, which may exceed the tokenizer's size: the bitmask must
    cover (and mask) every logits column. ``stop_token_ids`` are the tokens that end a completed grammar
    (the engine's EOS ids).
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        vocab_size: int,
        stop_token_ids: list[int],
        maxsize: int = DEFAULT_CACHE_SIZE,
        max_threads: int = 2,
    ) -> None:
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
        # xgrammar's own cache is unbounded by default; this class's LRU is the one bound.
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=max_threads, cache_enabled=False)
        self.maxsize = maxsize
        self.grammars: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self.num_compiled = 0
        self.compile_s = 0.0
        self.reset_timers()

    def reset_timers(self) -> None:
        """Zero the step-path counters (``pagedq bench`` reads them around a timed run)."""
        self.fill_s = 0.0  # matchers writing their rows of the bitmask
        self.apply_s = 0.0  # masking the logits (and moving the bitmask to their device)
        self.accept_s = 0.0  # matchers advancing by accepted tokens
        self.masked_rows = 0
        self.mask_calls = 0

    def timers(self) -> dict[str, float | int]:
        """Where the constrained steps' own time went, in seconds (``reset_timers`` starts them again)."""
        return {
            "fill_s": round(self.fill_s, 4),
            "apply_s": round(self.apply_s, 4),
            "accept_s": round(self.accept_s, 4),
            "masked_rows": self.masked_rows,
            "mask_calls": self.mask_calls,
        }

    def compile(self, params: SamplingParams) -> Any:
        """The compiled grammar of ``params``' constraint (None when it has none). Raises ValueError with
        xgrammar's message for a schema, regex or grammar it cannot compile."""
        key = constraint_of(params)
        if key is None:
            return None
        compiled = self.grammars.get(key)
        if compiled is not None:
            self.grammars.move_to_end(key)
            return compiled
        started = time.perf_counter()
        kind, text = key
        try:
            if kind == "json_schema":
                compiled = self.compiler.compile_grammar(json_schema_grammar(text))
            elif kind == "regex":
                compiled = self.compiler.compile_regex(text)
            else:
                compiled = self.compiler.compile_grammar(text)
        except Exception as exc:  # xgrammar raises RuntimeError (and a few subclasses) for bad input
            field = "choice" if params.choice is not None else kind
            raise ValueError(f"{field}: {library_message(exc)}") from exc
        self.compile_s += time.perf_counter() - started
        self.num_compiled += 1
        self.grammars[key] = compiled
        if len(self.grammars) > self.maxsize:
            self.grammars.popitem(last=False)
        return compiled

    @staticmethod
    def matcher(compiled: Any) -> Any:
        """A fresh matcher (one per sample) at the grammar's start."""
        return xgr.GrammarMatcher(compiled)

    def apply_bitmasks(self, logits: torch.Tensor, matchers: list[tuple[int, Any]]) -> None:
        """Mask ``logits`` [R, V] in place: row ``i`` of each ``(i, matcher)`` keeps only the tokens its
        grammar allows next. One bitmask tensor, one batched apply; other rows are not touched."""
        started = time.perf_counter()
        bitmask = xgr.allocate_token_bitmask(logits.shape[0], self.info.vocab_size)
        for row, matcher in matchers:
            matcher.fill_next_token_bitmask(bitmask, row)
        rows = [row for row, _ in matchers]
        filled = time.perf_counter()
        xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), indices=rows)
        self.apply_s += time.perf_counter() - filled
        self.fill_s += filled - started
        self.masked_rows += len(matchers)
        self.mask_calls += 1

    def accept(self, matcher: Any, token: int) -> bool:
        """Advance ``matcher`` by an accepted token; False if its grammar does not allow it."""
        started = time.perf_counter()
        ok = bool(matcher.accept_token(token))
        self.accept_s += time.perf_counter() - started
        return ok
