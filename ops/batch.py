"""``pagedq batch INPUT.jsonl OUTPUT.jsonl``: bulk offline processing of an OpenAI Batch file.

Input lines are OpenAI Batch requests::

    {"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions",
     "body": {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 32}}

(``url`` may also be ``/v1/completions`` with a ``prompt``). Each becomes one pagedq job; each answer is one
output line ``{id, custom_id, response: {status_code, request_id, body}, error}`` whose body is shaped like
an OpenAI ``chat.completion`` / ``text_completion`` object with ``usage``. Lines that fail validation or
generation go to the errors file (default ``OUTPUT.errors.jsonl``) with the reason; the run goes on.

Two ways to run the jobs, same output:

* through the queue (default): jobs go to ``<ns>:jobs:<queue>`` and however many workers serve that queue
  share them; this process only submits and collects results;
* ``--local``: an engine in this process (on an :class:`~worker.engine_thread.EngineThread`), no Redis.

Design choices, and why:

* **Resumable by content, not by position.** Rerunning with the same OUTPUT skips every custom_id already
  in OUTPUT or in the errors file, so a run killed at any point and rerun ends with each custom_id exactly
  once (a torn last line from a kill is cut off first). Every output line is written with one ``write`` and
  flushed, so what is in the file is complete. In queue mode the job id is a hash of (OUTPUT, custom_id,
  request), so jobs a killed run left in the queue are not lost work: their results (kept
  ``result_ttl_s`` by workers) are picked up by the rerun instead of being generated again. ``--overwrite``
  starts from scratch (and with fresh job ids).
* **Duplicate custom_ids are refused up front** (exit 2, nothing written): resumption keys on them, and
  an OpenAI Batch with duplicates is invalid anyway.
* **Bounded.** The input is streamed twice (a first pass counts lines and checks custom_ids, keeping only
  the ids); at most ``--max-in-flight`` jobs are outstanding; results are written as they arrive (so the
  output is in completion order, as with OpenAI). Memory is O(number of custom_ids), not O(file size).
* **Progress** is a bar (done / total, tokens/s, ETA) when stderr is a terminal and a log line every
  ``--log-interval-s`` otherwise (CI logs, nohup), ending with a summary.
* Strict request mapping: body fields pagedq cannot honour (``tools``, ``response_format``, ``echo``...)
  make the line an error rather than being silently ignored; ``user``, ``store``, ``metadata`` and
  ``service_tier`` are accepted and ignored. Token strings in ``logprobs`` need a tokenizer: ``--local``
  has the engine's; queue mode uses ``--tokenizer`` (or the ``PAGEDQ_MODEL`` folder) and otherwise writes
  tokens as ``"token_id:<id>"`` (vLLM's ``return_tokens_as_token_ids`` convention).

Exit codes: 0 every line has an output or error line, 1 Redis failed or stayed unreachable for 5 minutes
(rerun to resume),
2 bad arguments or input (duplicates, unreadable file), 130 interrupted (rerun to resume).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import queue
import signal
import sys
import time
import uuid
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import IO, Any, Protocol

import redis
from pydantic import ValidationError

from schemas.jobs import (
    ErrorEvent,
    FinalEvent,
    JobRequest,
    TokenEvent,
    describe_validation_error,
    parse_event,
)
from schemas.keys import EVENT_FIELD, JOB_FIELD, Keys
from worker.settings import Settings, SettingsError

TerminalEvent = FinalEvent | ErrorEvent

URLS = {"/v1/chat/completions": "chat", "/v1/completions": "completion"}
SAMPLING_BODY_FIELDS = (
    "temperature", "top_p", "n", "stop", "seed", "presence_penalty", "frequency_penalty",
    "top_k", "min_p", "repetition_penalty", "min_tokens", "stop_token_ids", "ignore_eos",
)  # fmt: skip
"""Body fields passed to the job as they are (OpenAI's, plus vLLM's extensions)."""
IGNORED_BODY_FIELDS = frozenset({"model", "user", "store", "metadata", "service_tier", "stream"})
CHAT_BODY_FIELDS = frozenset({"messages", "max_tokens", "max_completion_tokens", "logprobs", "top_logprobs"})
COMPLETION_BODY_FIELDS = frozenset({"prompt", "max_tokens", "logprobs", "echo", "suffix", "best_of"})
IGNORED_MESSAGE_FIELDS = frozenset({"name"})

DEFAULT_MAX_TOKENS = 256
REDIS_GIVE_UP_S = 300.0


class LineError(Exception):
    """A line that cannot become a job; ``code`` and ``message`` go to the errors file."""

    def __init__(self, message: str, code: str = "invalid_request", custom_id: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.custom_id = custom_id


@dataclass(frozen=True)
class BatchLine:
    """A valid input line: where it was, what it asked for, and the job that answers it."""

    line_no: int
    custom_id: str
    kind: str  # "chat" | "completion"
    model: str | None
    job: JobRequest


# ------------------------------------------------------------------------------------ request mapping


def _text_content(content: Any, where: str) -> str:
    """A message's content: a string, or OpenAI content parts of type ``text`` (joined by newlines)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise LineError(f"{where}.content: only text parts are supported, got {kind!r}")
            texts.append(part["text"])
        return "\n".join(texts)
    raise LineError(f"{where}.content must be a string or a list of text parts")


def _messages(raw: Any) -> list[dict[str, str]]:
    if not isinstance(raw, list) or not raw:
        raise LineError("body.messages must be a non-empty list")
    out = []
    for i, m in enumerate(raw):
        where = f"body.messages[{i}]"
        if not isinstance(m, dict):
            raise LineError(f"{where} must be an object")
        extra = set(m) - {"role", "content"} - IGNORED_MESSAGE_FIELDS
        if extra:
            raise LineError(f"{where}: unsupported field(s) {', '.join(sorted(extra))}")
        if not isinstance(m.get("role"), str):
            raise LineError(f"{where}.role must be a string")
        out.append({"role": m["role"], "content": _text_content(m.get("content"), where)})
    return out


def _prompt(raw: Any) -> dict[str, Any]:
    """A completions prompt: a string or token ids, or a one-element list of either (one prompt per line)."""
    if isinstance(raw, list) and len(raw) == 1 and isinstance(raw[0], (str, list)):
        raw = raw[0]
    if isinstance(raw, str):
        return {"prompt": raw}
    if isinstance(raw, list) and raw and all(isinstance(t, int) and not isinstance(t, bool) for t in raw):
        return {"prompt_token_ids": raw}
    if isinstance(raw, list) and len(raw) > 1 and all(isinstance(p, (str, list)) for p in raw):
        raise LineError("body.prompt: one prompt per line (split multi-prompt requests into several lines)")
    raise LineError("body.prompt must be a string or a list of token ids")


def body_to_fields(kind: str, body: dict[str, Any], default_max_tokens: int) -> dict[str, Any]:
    """Job fields (protocol v1) for an OpenAI request body; raises :class:`LineError` on what cannot be
    honoured. JSON ``null`` means "not given", as in OpenAI's API."""
    body = {k: v for k, v in body.items() if v is not None}
    allowed = CHAT_BODY_FIELDS if kind == "chat" else COMPLETION_BODY_FIELDS
    unknown = set(body) - allowed - IGNORED_BODY_FIELDS - set(SAMPLING_BODY_FIELDS)
    if unknown:
        raise LineError(f"unsupported body field(s): {', '.join(sorted(unknown))}")
    if body.get("stream") is not False and "stream" in body:
        raise LineError("body.stream: streaming is not available in a batch")
    fields: dict[str, Any] = {}
    if kind == "chat":
        fields["messages"] = _messages(body.get("messages"))
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        logprobs, top = body.get("logprobs", False), body.get("top_logprobs")
        if not isinstance(logprobs, bool):
            raise LineError("body.logprobs must be a boolean for chat completions")
        if top is not None and not logprobs:
            raise LineError("body.top_logprobs requires body.logprobs to be true")
        if logprobs:
            fields["logprobs"] = 0 if top is None else top
    else:
        if "prompt" not in body:
            raise LineError("body.prompt is required for /v1/completions")
        fields.update(_prompt(body["prompt"]))
        max_tokens = body.get("max_tokens")
        if body.get("echo"):
            raise LineError("body.echo is not supported")
        if "suffix" in body:
            raise LineError("body.suffix is not supported")
        if "best_of" in body and body["best_of"] != body.get("n", 1):
            raise LineError("body.best_of is not supported (use n)")
        if "logprobs" in body:
            fields["logprobs"] = body["logprobs"]
    fields["max_tokens"] = default_max_tokens if max_tokens is None else max_tokens
    for name in SAMPLING_BODY_FIELDS:
        if name in body:
            fields[name] = body[name]
    return fields


def job_id_for(run_key: str, custom_id: str, fields: dict[str, Any]) -> str:
    """A job id stable across reruns of the same batch (see module doc: resumption reuses results)."""
    blob = json.dumps([run_key, custom_id, fields], sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return "batch-" + hashlib.sha256(blob.encode()).hexdigest()[:40]


def _loads(raw: str) -> Any:
    from schemas.jobs import loads_strict

    return loads_strict(raw)


def parse_line(raw: str, line_no: int, *, run_key: str, default_max_tokens: int) -> BatchLine:
    """Validate one input line into a :class:`BatchLine`; every problem is a :class:`LineError`."""
    try:
        data = _loads(raw)
    except (ValueError, RecursionError) as exc:
        raise LineError(f"not valid JSON: {exc}", "invalid_json") from None
    if not isinstance(data, dict):
        raise LineError(f"a line must be a JSON object, got {type(data).__name__}", "invalid_json")
    cid = data.get("custom_id")
    if not isinstance(cid, str) or not cid:
        raise LineError("custom_id must be a non-empty string")
    try:
        extra = set(data) - {"custom_id", "method", "url", "body"}
        if extra:
            raise LineError(f"unknown field(s) {', '.join(sorted(extra))}")
        if data.get("method", "POST") != "POST":
            raise LineError(f"method must be POST, got {data.get('method')!r}")
        kind = URLS.get(data.get("url"))  # type: ignore[arg-type]
        if kind is None:
            raise LineError(f"url must be one of {', '.join(URLS)}, got {data.get('url')!r}")
        body = data.get("body")
        if not isinstance(body, dict):
            raise LineError("body must be an object")
        fields = body_to_fields(kind, body, default_max_tokens)
        job_id = job_id_for(run_key, cid, fields)
        try:
            job = JobRequest.model_validate({**fields, "id": job_id, "stream": False})
        except ValidationError as exc:
            raise LineError(describe_validation_error(exc)) from None
        model = body.get("model")
        return BatchLine(line_no, cid, kind, model if isinstance(model, str) else None, job)
    except LineError as exc:
        exc.custom_id = cid
        raise


# ------------------------------------------------------------------------------------ response mapping


TokenText = Callable[[int], str]


def token_id_text(token_id: int) -> str:
    return f"token_id:{token_id}"


def _usage(event: FinalEvent) -> dict[str, Any]:
    u = event.usage
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
    }


def _chat_logprobs(choice: Any, text: TokenText) -> dict[str, Any]:
    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        s = text(token_id)
        return {"token": s, "logprob": logprob, "bytes": list(s.encode("utf-8", "replace"))}

    content = [
        {**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t.token_id, t.logprob) for t in lp.top]}
        for lp in choice.logprobs
    ]
    return {"content": content, "refusal": None}


def _completion_logprobs(choice: Any, text: TokenText) -> dict[str, Any]:
    tokens, offsets, offset = [], [], 0
    for lp in choice.logprobs:
        s = text(lp.token_id)
        tokens.append(s)
        offsets.append(offset)
        offset += len(s)
    return {
        "tokens": tokens,
        "token_logprobs": [lp.logprob for lp in choice.logprobs],
        "top_logprobs": [{text(t.token_id): t.logprob for t in lp.top} for lp in choice.logprobs],
        "text_offset": offsets,
    }


def response_body(line: BatchLine, event: FinalEvent, served_model: str, text: TokenText) -> dict[str, Any]:
    """The OpenAI ``chat.completion`` / ``text_completion`` object for a job's final event."""
    created = int(time.time())
    model = line.model or served_model
    if line.kind == "chat":
        chat_choices = [
            {
                "index": c.index,
                "message": {"role": "assistant", "content": c.text},
                "logprobs": _chat_logprobs(c, text) if c.logprobs is not None else None,
                "finish_reason": c.finish_reason,
            }
            for c in event.choices
        ]
        return {"id": f"chatcmpl-{event.id}", "object": "chat.completion", "created": created, "model": model,
                "choices": chat_choices, "usage": _usage(event), "system_fingerprint": None}
    text_choices = [
        {
            "index": c.index,
            "text": c.text,
            "logprobs": _completion_logprobs(c, text) if c.logprobs is not None else None,
            "finish_reason": c.finish_reason,
        }
        for c in event.choices
    ]
    return {"id": f"cmpl-{event.id}", "object": "text_completion", "created": created, "model": model,
            "choices": text_choices, "usage": _usage(event), "system_fingerprint": None}


def _record_id() -> str:
    return f"batch_req_{uuid.uuid4().hex}"


def output_record(line: BatchLine, event: FinalEvent, served_model: str, text: TokenText) -> dict[str, Any]:
    body = response_body(line, event, served_model, text)
    return {"id": _record_id(), "custom_id": line.custom_id,
            "response": {"status_code": 200, "request_id": event.id, "body": body}, "error": None}


def error_record(
    custom_id: str | None, line_no: int, code: str, message: str, request_id: str | None = None
) -> dict[str, Any]:
    error: dict[str, Any] = {"code": code, "message": message, "line": line_no}
    if request_id is not None:
        error["request_id"] = request_id
    return {"id": _record_id(), "custom_id": custom_id, "response": None, "error": error}


def outcome_record(
    line: BatchLine, event: TerminalEvent, served_model: str, text: TokenText
) -> tuple[bool, dict[str, Any]]:
    """(ok, record): a final event becomes an output line; an error event, or a generation stopped by
    cancellation or its deadline (OpenAI has no such finish_reason), an errors-file line."""
    if isinstance(event, ErrorEvent):
        return False, error_record(line.custom_id, line.line_no, event.code, event.message, event.id)
    cut = [c for c in event.choices if c.finish_reason in ("cancelled", "deadline")]
    if cut:
        reason = cut[0].finish_reason
        msg = f"generation stopped early ({reason}) after {event.usage.completion_tokens} tokens"
        code = "deadline_exceeded" if reason == "deadline" else "cancelled"
        return False, error_record(line.custom_id, line.line_no, code, msg, event.id)
    return True, output_record(line, event, served_model, text)


# ------------------------------------------------------------------------------------------ files


def errors_path_for(output: Path) -> Path:
    name = output.name
    stem = name[: -len(".jsonl")] if name.endswith(".jsonl") else name
    return output.with_name(stem + ".errors.jsonl")


def _iter_lines(path: Path) -> Iterator[tuple[int, str | None]]:
    """(1-based line number, text) of each non-blank line; text None when it is not valid UTF-8."""
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                yield line_no, raw.decode("utf-8").strip()
            except UnicodeDecodeError:
                yield line_no, None


@dataclass
class Scan:
    total: int
    ids: set[str]
    duplicates: dict[str, list[int]]


def scan_input(path: Path) -> Scan:
    """First pass: count lines and find duplicate custom_ids (only ids are kept in memory)."""
    first: dict[str, int] = {}
    duplicates: dict[str, list[int]] = {}
    total = 0
    for line_no, text in _iter_lines(path):
        total += 1
        if text is None:
            continue
        try:
            data = json.loads(text)
        except (ValueError, RecursionError):
            continue
        cid = data.get("custom_id") if isinstance(data, dict) else None
        if not isinstance(cid, str) or not cid:
            continue
        if cid in first:
            duplicates.setdefault(cid, [first[cid]]).append(line_no)
        else:
            first[cid] = line_no
    return Scan(total, set(first), duplicates)


def read_done(path: Path) -> tuple[set[str], set[int]]:
    """custom_ids (and, for lines that had none, line numbers) already recorded in ``path``.

    A last line without its newline is what a kill during a write leaves: it is cut off, so the rerun
    writes that answer again, whole.
    """
    ids: set[str] = set()
    lines: set[int] = set()
    if not path.exists():
        return ids, lines
    good_end = 0
    with open(path, "rb") as f:
        for raw in f:
            if not raw.endswith(b"\n"):
                break
            good_end += len(raw)
            try:
                rec = json.loads(raw)
            except ValueError:
                continue
            if not isinstance(rec, dict):
                continue
            cid = rec.get("custom_id")
            if isinstance(cid, str):
                ids.add(cid)
            elif isinstance(rec.get("error"), dict) and isinstance(rec["error"].get("line"), int):
                lines.add(rec["error"]["line"])
    if good_end < path.stat().st_size:
        with open(path, "rb+") as f:
            f.truncate(good_end)
    return ids, lines


class Writer:
    """Appends whole lines, flushed one by one, to OUTPUT and (created on first use) the errors file."""

    def __init__(self, output: Path, errors: Path) -> None:
        self.output_path, self.errors_path = output, errors
        self.out: IO[str] = open(output, "a", encoding="utf-8", newline="\n")  # noqa: SIM115
        self.err: IO[str] | None = None
        self.ok = 0
        self.failed = 0

    def write(self, ok: bool, record: dict[str, Any]) -> None:
        line = json.dumps(record, ensure_ascii=False) + "\n"
        if ok:
            f = self.out
            self.ok += 1
        else:
            if self.err is None:
                self.err = open(self.errors_path, "a", encoding="utf-8", newline="\n")  # noqa: SIM115
            f = self.err
            self.failed += 1
        f.write(line)
        f.flush()

    def close(self) -> None:
        for f in (self.out, self.err):
            if f is not None:
                with contextlib.suppress(OSError):
                    f.flush()
                    os.fsync(f.fileno())
                f.close()


# ------------------------------------------------------------------------------------------ progress


class Progress:
    """A tqdm bar on a terminal, periodic log lines otherwise; counts requests and completion tokens."""

    def __init__(self, total: int, initial: int, mode: str, interval_s: float, stream: IO[str] | None = None) -> None:
        self.stream = stream or sys.stderr
        if mode == "auto":
            mode = "bar" if self.stream.isatty() else "log"
        self.mode = mode
        self.total, self.initial = total, initial
        self.done = initial
        self.errors = 0
        self.tokens = 0
        self.interval_s = interval_s
        self.started = time.monotonic()
        self._next_log = self.started + interval_s
        self._next_postfix = 0.0
        self.bar: Any = None
        if mode == "bar":
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=initial, unit="req", desc="batch", file=self.stream,
                            dynamic_ncols=True, smoothing=0.1)

    def tok_s(self) -> float:
        elapsed = time.monotonic() - self.started
        return self.tokens / elapsed if elapsed > 0 else 0.0

    def eta_s(self) -> float | None:
        elapsed = time.monotonic() - self.started
        made = self.done - self.initial
        if made <= 0 or elapsed <= 0:
            return None
        return (self.total - self.done) * elapsed / made

    def update(self, ok: bool, tokens: int = 0) -> None:
        self.done += 1
        self.errors += not ok
        self.tokens += tokens
        if self.bar is not None:
            self.bar.update(1)
            now = time.monotonic()
            if now >= self._next_postfix:
                self._next_postfix = now + 0.5
                self.bar.set_postfix(tok_s=f"{self.tok_s():.1f}", errors=self.errors, refresh=False)
        self.tick()

    def note(self, message: str) -> None:
        if self.bar is not None:
            self.bar.write(message, file=self.stream)
        elif self.mode != "none":
            self.stream.write(f"{_now()} batch: {message}\n")
            self.stream.flush()

    def tick(self) -> None:
        if self.mode != "log":
            return
        now = time.monotonic()
        if now >= self._next_log:
            self._next_log = now + self.interval_s
            self._log_line()

    def _log_line(self, prefix: str = "") -> None:
        pct = 100.0 * self.done / self.total if self.total else 100.0
        eta = self.eta_s()
        eta_txt = "-" if eta is None else _duration(eta)
        self.stream.write(
            f"{_now()} batch: {prefix}{self.done}/{self.total} done ({pct:.1f}%), {self.errors} errors, "
            f"{self.tok_s():.1f} tok/s, ETA {eta_txt}\n"
        )
        self.stream.flush()

    def close(self, summary: str) -> None:
        if self.bar is not None:
            self.bar.set_postfix(tok_s=f"{self.tok_s():.1f}", errors=self.errors, refresh=True)
            self.bar.close()
        if self.mode == "log":
            self._log_line("finished: ")
        if self.mode != "none":
            self.stream.write(summary + "\n")
            self.stream.flush()


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S")


def _duration(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


# ------------------------------------------------------------------------------------------ backends


class Backend(Protocol):
    """Where jobs run: the queue (workers) or an engine in this process."""

    served_model: str

    def submit(self, jobs: list[JobRequest]) -> None: ...
    def wait(self, ids: Collection[str], timeout_s: float) -> list[TerminalEvent]: ...
    def token_text(self) -> TokenText: ...
    def close(self) -> None: ...


def load_token_text(source: str) -> TokenText:
    """Token id -> its text, from a model folder's ``tokenizer.json`` with the light ``tokenizers`` library
    when there is one (importing transformers costs seconds), else through ``AutoTokenizer``."""
    path = Path(source) / "tokenizer.json"
    if path.is_file():
        from tokenizers import Tokenizer

        fast = Tokenizer.from_file(str(path))
        return lambda t: str(fast.decode([t], skip_special_tokens=False))
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(source)
    return lambda t: str(tok.decode([t]))


class QueueBackend:
    """Jobs through ``<ns>:jobs:<queue>``; results from ``<ns>:result:<id>`` (MGET), woken by a blocking
    XREAD on the jobs' reply streams (jobs are sent with ``stream: false``, so these hold only the
    terminal event)."""

    def __init__(self, url: str, settings: Settings, tokenizer: str | None) -> None:
        self.r = redis.Redis.from_url(url, decode_responses=True, socket_connect_timeout=5, socket_timeout=30)
        self.keys = Keys(settings.namespace, settings.queue)
        self.served_model = settings.model or "pagedq"
        self._tokenizer_source = tokenizer or settings.model
        self._text: TokenText | None = None

    def live_workers(self) -> int:
        return sum(1 for _ in self.r.scan_iter(match=self.keys.heartbeat_pattern, count=1000))

    def submit(self, jobs: list[JobRequest]) -> None:
        if not jobs:
            return
        pipe = self.r.pipeline(transaction=True)  # all or nothing: a retry after an error adds no duplicates
        for job in jobs:
            pipe.xadd(self.keys.jobs, {JOB_FIELD: job.to_json()})
        pipe.execute()

    def _results(self, ids: list[str]) -> list[TerminalEvent]:
        out: list[TerminalEvent] = []
        for start in range(0, len(ids), 500):
            chunk = ids[start : start + 500]
            for raw in self.r.mget([self.keys.result(i) for i in chunk]):
                if raw is not None:
                    event = parse_event(raw)
                    if not isinstance(event, TokenEvent):
                        out.append(event)
        return out

    def wait(self, ids: Collection[str], timeout_s: float) -> list[TerminalEvent]:
        wanted = list(ids)
        found = self._results(wanted)
        if found or not wanted:
            return found
        streams: dict[Any, Any] = {self.keys.reply(i): "0" for i in wanted[:1000]}
        reply: Any = self.r.xread(streams, count=1, block=max(1, int(timeout_s * 1000)))
        events: list[TerminalEvent] = []
        for _stream, entries in reply or []:
            for _entry_id, fields in entries:
                raw = (fields or {}).get(EVENT_FIELD)
                event = parse_event(raw) if raw is not None else None
                if event is not None and not isinstance(event, TokenEvent):
                    events.append(event)
        return events or self._results(wanted)

    def token_text(self) -> TokenText:
        if self._text is None:
            self._text = token_id_text
            if self._tokenizer_source:
                try:
                    self._text = load_token_text(self._tokenizer_source)
                except Exception as exc:  # logprobs still usable as token ids
                    print(f"pagedq batch: cannot load tokenizer {self._tokenizer_source!r} ({exc}); "
                          "logprob tokens are written as token_id:<id>", file=sys.stderr)
        return self._text

    def close(self) -> None:
        self.r.close()


class LocalBackend:
    """An engine in this process, stepped by an :class:`~worker.engine_thread.EngineThread`."""

    def __init__(self, settings: Settings) -> None:
        from worker.engine_thread import EngineThread
        from worker.run import build_engine

        engine: Any = build_engine(settings)
        self.engine = engine
        self.thread = EngineThread(engine, worker_name="local", max_num_seqs=settings.max_num_seqs).start()
        self.done: queue.SimpleQueue[TerminalEvent] = queue.SimpleQueue()
        self.served_model = settings.model or Path(str(getattr(engine, "model_path", "pagedq"))).name

    def submit(self, jobs: list[JobRequest]) -> None:
        for job in jobs:
            handle = self.thread.submit(job)
            handle.future.add_done_callback(lambda f: self.done.put(f.result()))

    def wait(self, ids: Collection[str], timeout_s: float) -> list[TerminalEvent]:
        try:
            events = [self.done.get(timeout=timeout_s)]
        except queue.Empty:
            return []
        while True:
            try:
                events.append(self.done.get_nowait())
            except queue.Empty:
                return events

    def token_text(self) -> TokenText:
        tok = self.engine.tokenizer
        return lambda t: str(tok.decode([t]))

    def close(self) -> None:
        self.thread.stop()


# ---------------------------------------------------------------------------------------------- run


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from ops.queue_commands import add_connection_arguments

    parser.description = (
        "Run an OpenAI Batch JSONL file (chat and completions requests) through the queue's workers, "
        "or with --local through an engine in this process. Rerun the same command to resume."
    )
    parser.add_argument("input", type=Path, help="OpenAI Batch input (JSONL)")
    parser.add_argument("output", type=Path, help="output JSONL (appended to; existing custom_ids are skipped)")
    parser.add_argument("--errors", type=Path, default=None, help="errors file (default: OUTPUT.errors.jsonl)")
    parser.add_argument("--local", action="store_true", help="run an engine in this process instead of the queue")
    parser.add_argument("--max-in-flight", type=int, default=None,
                        help="jobs outstanding at once (default: 256 in queue mode, 2 x max-num-seqs local)")
    parser.add_argument("--default-max-tokens", type=int, default=DEFAULT_MAX_TOKENS,
                        help=f"max_tokens of requests that give none (default {DEFAULT_MAX_TOKENS})")
    parser.add_argument("--timeout-s", type=float, default=None, help="per-request deadline (job timeout_s)")
    parser.add_argument("--overwrite", action="store_true", help="discard OUTPUT and errors file and start over")
    parser.add_argument("--retry-errors", action="store_true",
                        help="run again the lines recorded in the errors file (which is started afresh)")
    parser.add_argument("--progress", choices=("auto", "bar", "log", "none"), default="auto",
                        help="auto: a bar on a terminal, log lines otherwise")
    parser.add_argument("--log-interval-s", type=float, default=10.0, help="seconds between progress log lines")
    parser.add_argument("--tokenizer", default=None,
                        help="queue mode: tokenizer folder for logprob token strings (default: $PAGEDQ_MODEL)")
    add_connection_arguments(parser)
    g = parser.add_argument_group("engine (--local)")
    g.add_argument("--model", default=None, help="checkpoint folder (default: $PAGEDQ_MODEL or SmolLM2)")
    g.add_argument("--max-num-seqs", type=int, default=None)
    g.add_argument("--max-num-batched-tokens", type=int, default=None)
    g.add_argument("--kv-cache-bytes", type=int, default=None)
    g.add_argument("--dtype", default=None)
    g.add_argument("--device", default=None)


def _fail(message: str, code: int) -> int:
    print(f"pagedq batch: {message}", file=sys.stderr)
    return code


def run(args: argparse.Namespace) -> int:
    """``pagedq batch``: see the module docstring. Returns the exit code."""
    from ops.queue_commands import resolve_redis_url, settings_from_args

    inp: Path = args.input
    out: Path = args.output
    errors: Path = args.errors or errors_path_for(out)
    if not inp.is_file():
        return _fail(f"cannot read {inp}", 2)
    if len({inp.resolve(), out.resolve(), errors.resolve()}) < 3:
        return _fail("INPUT, OUTPUT and the errors file must be three different files", 2)
    if args.max_in_flight is not None and args.max_in_flight < 1:
        return _fail("--max-in-flight must be at least 1", 2)
    try:
        settings = settings_from_args(
            args, model=args.model, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
            kv_cache_bytes=args.kv_cache_bytes, dtype=args.dtype, device=args.device,
        )
        url = None if args.local else resolve_redis_url(settings)
    except SettingsError as exc:
        return _fail(str(exc), 2)

    scan = scan_input(inp)
    if scan.duplicates:
        shown = "; ".join(f"{cid!r} (lines {', '.join(map(str, lines))})"
                          for cid, lines in list(scan.duplicates.items())[:5])
        more = len(scan.duplicates) - 5
        return _fail(f"{inp} has {len(scan.duplicates)} duplicate custom_id(s): {shown}"
                     + (f" and {more} more" if more > 0 else "") + "; nothing was processed", 2)

    if args.overwrite:
        for path in (out, errors):
            path.unlink(missing_ok=True)
    done_ids, _ = read_done(out)
    err_ids, err_lines = read_done(errors)
    if args.retry_errors:
        errors.unlink(missing_ok=True)
        err_ids, err_lines = set(), set()
    stray = len((done_ids | err_ids) - scan.ids)
    done_ids |= err_ids
    run_key = str(out.resolve()) + (f"#{uuid.uuid4().hex}" if args.overwrite else "")

    def pending_lines() -> Iterator[tuple[int, str | None]]:
        for line_no, text in _iter_lines(inp):
            if line_no in err_lines:
                continue
            if text is not None and done_ids:
                with contextlib.suppress(ValueError, RecursionError, AttributeError):
                    if json.loads(text).get("custom_id") in done_ids:
                        continue
            yield line_no, text

    skipped = len(done_ids & scan.ids) + len(err_lines)
    max_in_flight = args.max_in_flight or (2 * settings.max_num_seqs if args.local else 256)
    if skipped >= scan.total:  # nothing left: do not load a model or touch Redis
        what = f"all {scan.total} lines of {inp} are already in {out} / {errors}" if scan.total else f"{inp} is empty"
        print(f"pagedq batch: {what}", file=sys.stderr)
        return 0
    try:
        backend: Backend = LocalBackend(settings) if args.local else QueueBackend(str(url), settings, args.tokenizer)
    except Exception as exc:
        return _fail(f"cannot start: {exc}", 1)
    progress = Progress(scan.total, min(skipped, scan.total), args.progress, args.log_interval_s)
    if skipped:
        progress.note(f"resuming: {skipped} of {scan.total} lines already in {out.name} / {errors.name}")
    if stray:
        progress.note(f"warning: {stray} custom_id(s) in the output files are not in {inp.name} (another input?)")
    writer = Writer(out, errors)
    interrupted = _install_sigterm()
    code = 0
    try:
        if isinstance(backend, QueueBackend) and backend.live_workers() == 0:
            progress.note(f"warning: no live worker on queue {settings.queue!r}; jobs wait until one starts")
        code = _process(pending_lines(), backend, writer, progress, args, run_key, max_in_flight)
    except KeyboardInterrupt:
        code = 130
    except redis.RedisError as exc:  # not a lost connection (retried in _process): e.g. auth, wrong type
        progress.note(f"Redis error: {exc}")
        code = 1
    finally:
        interrupted()
        backend.close()
        writer.close()
    summary = (f"pagedq batch: {writer.ok} written to {out}, {writer.failed} to {errors}"
               f" this run; {progress.done}/{scan.total} lines done")
    if code == 130:
        summary += "; interrupted: rerun the same command to resume"
    elif code == 1:
        summary += "; Redis failed: rerun the same command to resume"
    progress.close(summary)
    return code


def _install_sigterm() -> Callable[[], None]:
    """SIGTERM stops the run like Ctrl-C (files closed cleanly); returns the restore function."""
    if not _is_main_thread():
        return lambda: None

    def on_term(_signum: int, _frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, on_term)

    def restore() -> None:
        signal.signal(signal.SIGTERM, previous)

    return restore


def _is_main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def _process(
    lines: Iterator[tuple[int, str | None]],
    backend: Backend,
    writer: Writer,
    progress: Progress,
    args: argparse.Namespace,
    run_key: str,
    max_in_flight: int,
) -> int:
    """The loop: keep up to ``max_in_flight`` jobs outstanding, write each answer as it arrives."""
    in_flight: dict[str, BatchLine] = {}
    unsent: list[BatchLine] = []
    exhausted = False
    redis_down_since: float | None = None
    backoff = 0.2
    while True:
        while not exhausted and len(in_flight) + len(unsent) < max_in_flight:
            item = next(lines, None)
            if item is None:
                exhausted = True
                break
            line_no, text = item
            if text is None:
                writer.write(False, error_record(None, line_no, "invalid_json", "line is not valid UTF-8"))
                progress.update(False)
                continue
            try:
                line = parse_line(text, line_no, run_key=run_key, default_max_tokens=args.default_max_tokens)
                if args.timeout_s is not None:
                    line = BatchLine(line.line_no, line.custom_id, line.kind, line.model,
                                     line.job.model_copy(update={"timeout_s": args.timeout_s}))
            except LineError as exc:
                writer.write(False, error_record(exc.custom_id, line_no, exc.code, exc.message))
                progress.update(False)
                continue
            unsent.append(line)
        if exhausted and not in_flight and not unsent:
            return 0
        try:
            if unsent:
                backend.submit([line.job for line in unsent])
                in_flight.update((line.job.id, line) for line in unsent)
                unsent = []
            events = backend.wait(in_flight.keys(), timeout_s=1.0)
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            now = time.monotonic()
            if redis_down_since is None:
                redis_down_since = now
                progress.note(f"Redis unreachable ({exc}); retrying")
            if now - redis_down_since > REDIS_GIVE_UP_S:
                return 1
            time.sleep(backoff)
            backoff = min(backoff * 2, 5.0)
            continue
        if redis_down_since is not None:
            progress.note("Redis reachable again")
            redis_down_since, backoff = None, 0.2
        text_of = None
        for event in events:
            answered = in_flight.pop(event.id, None)
            if answered is None:
                continue  # answered already (a result seen twice)
            if text_of is None:
                text_of = backend.token_text() if _wants_logprobs(events) else token_id_text
            ok, record = outcome_record(answered, event, backend.served_model, text_of)
            writer.write(ok, record)
            progress.update(ok, event.usage.completion_tokens if isinstance(event, FinalEvent) else 0)
        progress.tick()


def _wants_logprobs(events: list[TerminalEvent]) -> bool:
    return any(isinstance(e, FinalEvent) and any(c.logprobs is not None for c in e.choices) for e in events)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pagedq batch")
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
