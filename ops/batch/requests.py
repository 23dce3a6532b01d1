"""Request mapping: one OpenAI Batch input line -> a validated pagedq job (protocol v1 fields).

An input line is ``{"custom_id", "method": "POST", "url", "body"}`` with ``url`` ``/v1/chat/completions``
(``messages``), ``/v1/completions`` (``prompt``) or ``/v1/responses`` (``input``, ``instructions``,
``max_output_tokens``: :func:`responses_to_chat_body`).

The mapping is strict: body fields pagedq cannot honour (``tools``, ``echo``...) make
the line an error rather than being silently ignored, so a batch never quietly gets answers to a different
question than it asked; ``store`` and ``service_tier`` are accepted and ignored (they change nothing about
the answer). So is ``model``: the queue's workers serve the model they serve, and the answer's ``body.model``
names it (:mod:`ops.batch.responses`). The tags, ``metadata``, ``user``, ``safety_identifier`` and
``prompt_cache_key``, are taken as the gateway takes them (:func:`ops.openai_request.openai_tags`: the job's
``metadata`` and affinity key), and are not part of the job id (:func:`job_id_for`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from pydantic import ValidationError

from ops.gateway.openai_api import ApiError
from ops.gateway.responses_api import responses_chat_body, responses_names
from ops.openai_request import (
    PASSTHROUGH_FIELDS,
    TAG_FIELDS,
    RequestFieldError,
    chat_messages,
    completion_prompt,
    max_tokens_fields,
    openai_tags,
    passthrough_fields,
)
from schemas.jobs import InvalidJob, JobRequest, describe_validation_error, loads_strict

T = TypeVar("T")
URLS = {"/v1/chat/completions": "chat", "/v1/completions": "completion", "/v1/responses": "responses"}
IGNORED_BODY_FIELDS = frozenset({"model", "store", "service_tier", "stream"})
CHAT_BODY_FIELDS = frozenset({"messages", "max_tokens", "max_completion_tokens", "logprobs", "top_logprobs"})
COMPLETION_BODY_FIELDS = frozenset({"prompt", "max_tokens", "logprobs", "echo", "suffix", "best_of"})

DEFAULT_MAX_TOKENS = 256


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
    kind: str  # "chat" | "completion" | "responses"
    model: str | None
    job: JobRequest
    echo: dict[str, Any] | None = None
    """``responses`` lines: what the ``response`` object repeats of the request (``instructions``,
    ``max_output_tokens``, ``temperature``...), as :func:`ops.gateway.responses_api.parse_responses_request`
    keeps it; the job has only the chat messages those became."""


def _field(parse: Callable[[Any, str], T], raw: Any, where: str) -> T:
    """Runs one of :mod:`ops.openai_request`'s readers, its error made this line's."""
    try:
        return parse(raw, where)
    except RequestFieldError as exc:
        raise LineError(exc.message) from None


def body_to_fields(kind: str, body: dict[str, Any], default_max_tokens: int) -> dict[str, Any]:
    """Job fields (protocol v1) for an OpenAI request body; raises :class:`LineError` on what cannot be
    honoured. JSON ``null`` means "not given", as in OpenAI's API."""
    body = {k: v for k, v in body.items() if v is not None}
    allowed = CHAT_BODY_FIELDS if kind == "chat" else COMPLETION_BODY_FIELDS
    unknown = set(body) - allowed - IGNORED_BODY_FIELDS - set(TAG_FIELDS) - set(PASSTHROUGH_FIELDS)
    if unknown:
        raise LineError(f"unsupported body field(s): {', '.join(sorted(unknown))}")
    if body.get("stream") is not False and "stream" in body:
        raise LineError("body.stream: streaming is not available in a batch")
    fields: dict[str, Any] = {}
    if kind == "chat":
        fields["messages"] = _field(chat_messages, body.get("messages"), "body.messages")
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
        fields.update(_field(completion_prompt, body["prompt"], "body.prompt"))
        max_tokens = body.get("max_tokens")
        if body.get("echo"):
            raise LineError("body.echo is not supported")
        if "suffix" in body:
            raise LineError("body.suffix is not supported")
        if "best_of" in body and body["best_of"] != body.get("n", 1):
            raise LineError("body.best_of is not supported (use n)")
        if "logprobs" in body:
            fields["logprobs"] = body["logprobs"]
    fields.update(max_tokens_fields(max_tokens, default_max_tokens))
    fields.update(passthrough_fields(body))
    fields.update(_field(openai_tags, body, "body."))
    return fields


def _responses_error(exc: LineError, instructions: bool) -> LineError:
    """``exc`` in the Responses line's names (the gateway's ``responses_names``: an error line names the field
    the line holds, not the chat field it became), its code kept."""
    return LineError(responses_names(exc.message, instructions), exc.code)


def responses_to_chat_body(body: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A ``/v1/responses`` body as (the chat body :func:`body_to_fields` reads, the response's echo): the
    gateway's own rewrite (:func:`ops.gateway.responses_api.responses_chat_body`: ``instructions`` a system
    message first, ``input`` the messages, ``max_output_tokens`` ``max_completion_tokens``), so a line is
    refused where the gateway would refuse the request, naming the same field. The chat body then goes
    through the batch's chat reader, not the gateway's: that one gives a request without a seed a random
    one, and a batch line's job id must be the same on every run."""
    try:
        return responses_chat_body(body)
    except ApiError as exc:
        # The gateway's messages start with the field's path ("input[0].role: ...") or name it after
        # (a field pagedq does not support): either way the line's error names it under ``body.``.
        param = exc.param or "input"
        named = exc.message if exc.message.startswith(param) else f"{param}: {exc.message}"
        raise LineError(f"body.{named}") from None


TAG_JOB_FIELDS = ("metadata", "affinity")
"""The job fields :func:`ops.openai_request.openai_tags` makes of a line's tags, which :func:`job_id_for`
leaves out."""


def job_id_for(run_key: str, custom_id: str, fields: dict[str, Any]) -> str:
    """A job id stable across reruns of the same batch: a run killed with jobs still in the queue leaves
    their results (kept ``result_ttl_s`` by workers) for the rerun to pick up instead of generating them
    again. ``run_key`` names the output file (plus a fresh nonce under ``--overwrite``).

    The id is of the question, not of its tags (:data:`TAG_JOB_FIELDS`: who asked, which shard it queues on),
    which change nothing about the answer: a line keeps the id it had when ``user`` and ``metadata`` were
    accepted and ignored, so a run resumed across that change finds its earlier jobs, and a rerun that only
    retags lines reads their answers back rather than generating them again."""
    question = {name: value for name, value in fields.items() if name not in TAG_JOB_FIELDS}
    blob = json.dumps([run_key, custom_id, question], sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return "batch-" + hashlib.sha256(blob.encode()).hexdigest()[:40]


def parse_line(
    raw: str, line_no: int, *, run_key: str, default_max_tokens: int, timeout_s: float | None = None
) -> BatchLine:
    """Validate one input line into a :class:`BatchLine`; every problem is a :class:`LineError`.
    ``timeout_s`` (``--timeout-s``) is a job field like the body's, so it is part of the job id: a rerun
    with another deadline runs the line again instead of reading back an answer (or a timeout) of the old."""
    try:
        data = loads_strict(raw)
    except (ValueError, RecursionError) as exc:
        raise LineError(f"not valid JSON: {exc}", "invalid_json") from None
    if not isinstance(data, dict):
        raise LineError(f"a line must be a JSON object, got {type(data).__name__}", "invalid_json")
    try:  # a lone surrogate escape ("\ud800") is valid JSON but no Unicode: no job id, no output line
        json.dumps(data, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise LineError("a string holds a lone UTF-16 surrogate escape (not valid Unicode)", "invalid_json") from None
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
        if kind != "responses":
            return _job_line(line_no, cid, kind, body, body, None, run_key, default_max_tokens, timeout_s)
        chat, echo = responses_to_chat_body(body)
        try:
            return _job_line(line_no, cid, kind, body, chat, echo, run_key, default_max_tokens, timeout_s)
        except LineError as exc:
            raise _responses_error(exc, echo["instructions"] is not None) from None
    except LineError as exc:
        exc.custom_id = cid
        raise


def _job_line(
    line_no: int,
    cid: str,
    kind: str,
    body: dict[str, Any],
    read: dict[str, Any],
    echo: dict[str, Any] | None,
    run_key: str,
    default_max_tokens: int,
    timeout_s: float | None,
) -> BatchLine:
    """The job for ``read``, the body as the chat or completions reader takes it (a ``responses`` line's, once
    rewritten): one path to the job and its id whatever the url, so a Responses line's job is the chat
    line's job for the same question (same fields, same id rule)."""
    fields = body_to_fields("chat" if kind == "responses" else kind, read, default_max_tokens)
    if timeout_s is not None:
        fields["timeout_s"] = timeout_s
    job_id = job_id_for(run_key, cid, fields)
    try:
        job = JobRequest.model_validate({**fields, "id": job_id, "stream": False})
    except ValidationError as exc:
        first = exc.errors()[0]
        if tuple(first.get("loc", ()))[:1] == ("affinity",):  # the job's name for the line's field
            raise LineError(f"body.prompt_cache_key: {first['msg']}") from None
        raise LineError(describe_validation_error(exc)) from None
    try:  # the engine's own invariants (min_tokens <= max_tokens...), as the worker checks them on reading the job
        job.sampling_params()
    except InvalidJob as exc:
        raise LineError(f"body.{exc}") from None
    model = body.get("model")
    return BatchLine(line_no, cid, kind, model if isinstance(model, str) else None, job, echo)
