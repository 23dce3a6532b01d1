"""Structured output: JSON-schema, regex, choice and EBNF constraints through xgrammar.

A constrained request's constraint is checked at admission (``Engine.add_request``: a schema, regex or
grammar that does not parse is refused there) and compiled off the step path, on a compile thread, as
vLLM and SGLang do: compiling walks the whole vocabulary for every rule, and a large enum takes seconds
(20,000 values: 2.8 s on SmolLM2's vocabulary), which on the engine's thread stalled every other
request's tokens that long. The request waits, out of the scheduler, until its grammar is ready
(``GrammarCache.prepare`` gives a future, ``harvest`` collects it on the engine's thread). Compiled
grammars are kept in a bounded LRU keyed by the constraint's canonical text, so a schema sent by many
jobs is compiled once (and a compile in flight is shared). Each sample of the request gets its own
``GrammarMatcher`` (``n > 1`` samples diverge), advanced only by tokens the engine accepts: a preempted
sequence is recomputed from its kept tokens without resampling them, so its matcher needs no rollback.
Greedy constrained sequences speculate like the others, on drafts the grammar accepts (prompt lookup cut to the grammar,
or its forced tokens: ``GrammarCache.draft``); each draft position's logits row is masked with the
grammar's state after the drafts before it, and the matcher is rolled back, so it too only ever
advances by accepted tokens.

Each step, the bitmasks of all constrained rows are filled into one tensor and applied to the logits in
one ``apply_token_bitmask_inplace`` call before sampling; a step without constrained rows skips all of
it. xgrammar is imported here only, and only when an engine is built, so the wire schemas and producers
never load it.
"""

from __future__ import annotations

import json
import queue
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch
import xgrammar as xgr
from transformers import PreTrainedTokenizerBase

from schemas.jobs import unheld_schema_keyword
from schemas.sampling import SamplingParams

DEFAULT_CACHE_SIZE = 128
SYNC_PARSE_CHARS = 64 << 10
"""Constraints up to this many characters are parsed at admission, so a bad one is refused there (a
``ValueError`` from ``add_request``). Parsing is linear but not free (0.66 s for a 790 kB regex
alternation, 0.48 s for a 490 kB nested ``anyOf`` schema; under 60 ms at this size), so a longer
constraint is parsed on the compile thread too, and one that does not parse fails its request with
the parser's message (``RequestDelta.error``), never stalling the step loop."""

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
        if (why := unheld_schema_keyword(schema)) is not None:
            raise ValueError(f"json_schema: {why}")
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
        self.stop_token_ids = frozenset(stop_token_ids)
        self._bitmask: torch.Tensor | None = None  # kept between steps: see apply_bitmasks
        self.maxsize = maxsize
        self.grammars: OrderedDict[tuple[str, str], Any] = OrderedDict()
        # Compiles in flight, by constraint; the one compile thread and its queue of work.
        self._inflight: dict[tuple[str, str], Future[tuple[Any, float]]] = {}
        self._queue: queue.SimpleQueue[tuple[Future[tuple[Any, float]], Callable[[], tuple[Any, float]]]] = (
            queue.SimpleQueue()
        )
        self._thread: threading.Thread | None = None
        self.num_compiled = 0
        self.compile_s = 0.0
        self.reset_timers()

    def reset_timers(self) -> None:
        """Zero the step-path counters (``pagedq bench`` reads them around a timed run)."""
        self.fill_s = 0.0  # matchers writing their rows of the bitmask
        self.apply_s = 0.0  # masking the logits (and moving the bitmask to their device)
        self.accept_s = 0.0  # matchers advancing by accepted tokens
        self.draft_s = 0.0  # checking drafts against the grammar, finding forced tokens
        self.masked_rows = 0
        self.mask_calls = 0

    def timers(self) -> dict[str, float | int]:
        """Where the constrained steps' own time went, in seconds (``reset_timers`` starts them again)."""
        return {
            "fill_s": round(self.fill_s, 4),
            "apply_s": round(self.apply_s, 4),
            "accept_s": round(self.accept_s, 4),
            "draft_s": round(self.draft_s, 4),
            "masked_rows": self.masked_rows,
            "mask_calls": self.mask_calls,
        }

    def prepare(self, params: SamplingParams) -> Any:
        """``params``' compiled grammar when it is cached (None when it has no constraint), else a
        ``Future`` of it, compiling on the compile thread. Raises ValueError, with xgrammar's message,
        for a constraint that does not parse (one up to ``SYNC_PARSE_CHARS``; a longer one's future
        fails with that ValueError instead). Called on the engine's thread only, as ``harvest``."""
        key = constraint_of(params)
        if key is None:
            return None
        compiled = self.grammars.get(key)
        if compiled is not None:
            self.grammars.move_to_end(key)
            return compiled
        future = self._inflight.get(key)
        if future is not None:  # the same constraint is compiling for another request: share it
            return future
        kind, text = key
        field = "choice" if params.choice is not None else kind
        parsed = self._parse(kind, text, field) if len(text) <= SYNC_PARSE_CHARS else None
        future = self._submit(lambda: self._build(kind, text, field, parsed))
        self._inflight[key] = future
        return future

    def compile(self, params: SamplingParams) -> Any:
        """``params``' compiled grammar, waiting for it (for callers outside the step loop: tests, tools)."""
        prepared = self.prepare(params)
        if isinstance(prepared, Future):
            prepared.result()
            self.harvest()
            return self.grammars[constraint_of(params)]  # type: ignore[index]
        return prepared

    def harvest(self) -> None:
        """Move finished compiles into the LRU (on the engine's thread: the compile thread never touches
        the cache). A failed one is dropped: its requests fail with its error, and nothing is cached."""
        for key, future in list(self._inflight.items()):
            if not future.done():
                continue
            del self._inflight[key]
            if future.exception() is not None:
                continue
            compiled, seconds = future.result()
            self.compile_s += seconds
            self.num_compiled += 1
            self.grammars[key] = compiled
            if len(self.grammars) > self.maxsize:
                self.grammars.popitem(last=False)

    @staticmethod
    def _parse(kind: str, text: str, field: str) -> Any:
        """The constraint's xgrammar ``Grammar``, before any work over the vocabulary."""
        try:
            if kind == "json_schema":
                return json_schema_grammar(text)
            if kind == "regex":
                return xgr.Grammar.from_regex(text)
            return xgr.Grammar.from_ebnf(text)
        except Exception as exc:  # xgrammar raises RuntimeError (and a few subclasses) for bad input
            raise ValueError(f"{field}: {library_message(exc)}") from exc

    def _build(self, kind: str, text: str, field: str, parsed: Any) -> tuple[Any, float]:
        """On the compile thread: parse (when admission did not) and compile; (compiled, seconds)."""
        started = time.perf_counter()
        grammar = self._parse(kind, text, field) if parsed is None else parsed
        try:
            compiled = self.compiler.compile_grammar(grammar)
        except Exception as exc:
            raise ValueError(f"{field}: {library_message(exc)}") from exc
        return compiled, time.perf_counter() - started

    def _submit(self, work: Callable[[], tuple[Any, float]]) -> Future[tuple[Any, float]]:
        """Run ``work`` on the compile thread (started on first use). A daemon thread, not an executor's:
        a compile cannot be interrupted, and one still running must not hold up the process's exit."""
        future: Future[tuple[Any, float]] = Future()
        if self._thread is None:
            self._thread = threading.Thread(target=self._compile_loop, name="pagedq-grammar-compile", daemon=True)
            self._thread.start()
        self._queue.put((future, work))
        return future

    def _compile_loop(self) -> None:
        while True:
            future, work = self._queue.get()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(work())
            except BaseException as exc:  # the request fails with it; the thread goes on
                future.set_exception(exc)

    @staticmethod
    def matcher(compiled: Any) -> Any:
        """A fresh matcher (one per sample) at the grammar's start."""
        return xgr.GrammarMatcher(compiled)

    def apply_bitmasks(self, logits: torch.Tensor, constrained: list[tuple[int, Any, list[int]]]) -> None:
        """Mask ``logits`` [R, V] in place for each ``(first row, matcher, drafts)``: row ``first + j``
        keeps only the tokens the grammar allows after ``drafts[:j]`` (one row when there are no
        drafts). Other rows are not touched.

        Why this shape: a speculating matcher walks its drafts (valid: they were cut to what the
        grammar accepts when proposed, ``draft``), filling a row per position, and rolls back; then one
        batched apply. Filling is cheap next to applying (32 matchers on SmolLM2's vocabulary: 0.14 ms
        one by one, 0.18 ms through xgrammar's threaded ``BatchGrammarMatcher`` on 2 busy cores; the
        apply 7.6 ms), so the rows are filled one by one. The bitmask buffer is kept between steps
        (grown when a step has more rows): only the rows filled this step are read."""
        started = time.perf_counter()
        bitmask = self._bitmask_rows(logits.shape[0])
        rows: list[int] = []
        for row, matcher, drafts in constrained:
            for j, token in enumerate(drafts):
                matcher.fill_next_token_bitmask(bitmask, row + j)
                matcher.accept_token(token)
            matcher.fill_next_token_bitmask(bitmask, row + len(drafts))
            if drafts:
                matcher.rollback(len(drafts))
            rows.extend(range(row, row + len(drafts) + 1))
        filled = time.perf_counter()
        xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), indices=rows)
        self.apply_s += time.perf_counter() - filled
        self.fill_s += filled - started
        self.masked_rows += len(rows)
        self.mask_calls += 1

    def _bitmask_rows(self, rows: int) -> torch.Tensor:
        """The first ``rows`` rows of the kept bitmask buffer (reallocated, doubled, when too small)."""
        if self._bitmask is None or self._bitmask.shape[0] < rows:
            size = max(rows, 2 * (0 if self._bitmask is None else self._bitmask.shape[0]))
            self._bitmask = xgr.allocate_token_bitmask(size, self.info.vocab_size)
        return self._bitmask[:rows]

    def draft(self, matcher: Any, proposed: list[int], k: int) -> list[int]:
        """Draft tokens for a constrained sequence: the longest prefix of ``proposed`` (prompt lookup)
        that its grammar accepts, or the grammar's forced continuation (jump-forward tokens: a key,
        the punctuation around it) when that is longer; at most ``k``. The matcher is left as it was.

        Why: a draft the grammar rejects would cost a forward position and be refused by the mask
        anyway; forced tokens (a JSON key, the punctuation around it) are what the masked model emits
        next whenever it tokenizes them the same way, so they are the best draft there is. The drafts
        never hold a stop token: a grammar that ends is not rolled back."""
        started = time.perf_counter()
        stop = self.stop_token_ids
        valid = 0
        for token in proposed[:k]:
            if token in stop or not matcher.accept_token(token):
                break
            valid += 1
        if valid:
            matcher.rollback(valid)
        forced = [t for t in matcher.find_jump_forward_tokens()[:k] if t not in stop]
        self.draft_s += time.perf_counter() - started
        return forced if len(forced) > valid else proposed[:valid]

    def accept(self, matcher: Any, token: int) -> bool:
        """Advance ``matcher`` by an accepted token; False if its grammar does not allow it."""
        started = time.perf_counter()
        ok = bool(matcher.accept_token(token))
        self.accept_s += time.perf_counter() - started
        return ok
