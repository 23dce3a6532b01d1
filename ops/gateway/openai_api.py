"""OpenAI's request and response shapes, mapped onto pagedq's jobs and events (pure: no I/O).

Requests are read as plain JSON objects, field by field, instead of through a permissive model: a field
pagedq does not support must be refused by name (400, ``param`` = the field), never dropped in silence, or a
client asking for tools or logit biases would get an answer that ignored what it asked for. Fields OpenAI's
SDKs may send with a neutral value (``logit_bias: {}``, ``store: false``...) pass when neutral.

Every response's ``id`` is the job id, so a request can be looked up in Redis (``<ns>:result:<id>``) and in
the workers' ``job.finished`` lines.
"""

from __future__ import annotations

import secrets
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

from pydantic import ValidationError

from ops.openai_request import (
    PASSTHROUGH_FIELDS,
    RequestFieldError,
    chat_messages,
    completion_prompt,
    passthrough_fields,
)
from schemas.jobs import Choice, ErrorEvent, FinalEvent, JobRequest, Logprob, Usage

Kind = Literal["chat", "completion"]
T = TypeVar("T")

COMMON_FIELDS = frozenset({"model", "max_tokens", "logprobs", "stream", "stream_options", "user", *PASSTHROUGH_FIELDS})
CHAT_FIELDS = COMMON_FIELDS | {"messages", "max_completion_tokens", "top_logprobs"}
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt"}

# Fields accepted only with these values (what the SDKs send, or the behaviour pagedq has anyway).
NEUTRAL: dict[str, tuple[Any, ...]] = {
    "logit_bias": (None, {}),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "function_call": (None, "none"),
    "parallel_tool_calls": (None, False, True),
    "store": (None, False),
    "metadata": (None, {}),
    "service_tier": (None, "auto", "default"),
    "modalities": (None, ["text"]),
    "audio": (None,),
    "prediction": (None,),
    "reasoning_effort": (None,),
    "web_search_options": (None,),
    "echo": (None, False),
    "suffix": (None, ""),
    "best_of": (None, 1),
}

RANDOM_SEED_BOUND = 2**63
"""A request without a seed gets a random one: a job redelivered after its worker died must produce the text
already streamed to the client again (per-request seeds make sampling reproducible whatever the batch), or
the gateway would have sent text it cannot take back."""


class ApiError(Exception):
    """An error in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}`` with an HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        job_id: str | None = None,
    ) -> None:
        super().__init__(message)
        self.job_id = job_id  # sent as the x-request-id header when a job was submitted
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, param=param, code=code)


@dataclass
class Request:
    """An OpenAI request turned into a job's fields, with what the response needs to know."""

    kind: Kind
    model: str
    fields: dict[str, Any]
    stream: bool
    include_usage: bool
    chat_logprobs: bool = False  # chat: logprobs asked (the response shape differs from completions')
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def job_id(self) -> str:
        return str(self.fields["id"])


def _check_fields(body: dict[str, Any], allowed: frozenset[str]) -> None:
    for name, value in body.items():
        if name in allowed:
            continue
        if name in NEUTRAL and value in NEUTRAL[name]:
            continue
        raise bad_request(
            f"pagedq does not support the field {name!r} (or this value of it)", name, "unsupported_field"
        )


def _field(parse: Callable[[Any, str], T], raw: Any, where: str) -> T:
    """Runs one of :mod:`ops.openai_request`'s readers, its error answered as a 400 naming the field."""
    try:
        return parse(raw, where)
    except RequestFieldError as exc:
        raise bad_request(exc.message, exc.param) from None


def parse_request(
    kind: Kind, body: Any, *, default_max_tokens: int, timeout_s: float, random_seed: int | None = None
) -> Request:
    """Check an OpenAI request body and build its job's fields; :class:`ApiError` (400) names what is wrong."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    _check_fields(body, CHAT_FIELDS if kind == "chat" else COMPLETION_FIELDS)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("model: a model name is required (GET /v1/models lists them)", "model")
    fields: dict[str, Any] = {"id": f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"}
    chat_logprobs = False
    if kind == "chat":
        fields["messages"] = _field(chat_messages, body.get("messages"), "messages")
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        logprobs, top = body.get("logprobs"), body.get("top_logprobs")
        if logprobs not in (None, True, False):
            raise bad_request("logprobs: must be a boolean", "logprobs")
        if top is not None and not logprobs:
            raise bad_request("top_logprobs: needs logprobs set to true", "top_logprobs")
        if logprobs:
            chat_logprobs = True
            fields["logprobs"] = 0 if top is None else top
    else:
        if "prompt" not in body:
            raise bad_request("prompt: required", "prompt")
        fields.update(_field(completion_prompt, body["prompt"], "prompt"))
        max_tokens = body.get("max_tokens")
        if body.get("logprobs") is not None:
            fields["logprobs"] = body["logprobs"]
    fields["max_tokens"] = default_max_tokens if max_tokens is None else max_tokens
    fields.update(passthrough_fields(body))
    if isinstance(fields.get("stop"), list):
        fields["stop"] = [s for s in fields["stop"] if s != ""] or None  # OpenAI ignores empty stop strings
        if fields["stop"] is None:
            del fields["stop"]
    if "seed" not in fields:
        fields["seed"] = secrets.randbelow(RANDOM_SEED_BOUND) if random_seed is None else random_seed
    user = body.get("user")
    if user is not None:
        if not isinstance(user, str):
            raise bad_request("user: must be a string", "user")
        fields["metadata"] = {"user": user[:256]}
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise bad_request("stream: must be a boolean", "stream")
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not stream:
            raise bad_request("stream_options: only allowed with stream set to true", "stream_options")
        if not isinstance(options, dict) or set(options) - {"include_usage", "continuous_usage_stats"}:
            raise bad_request("stream_options: pagedq supports include_usage only", "stream_options")
        include_usage = bool(options.get("include_usage"))
    fields["stream"] = stream  # a non-streaming request reads only the final event: no token events sent
    fields["timeout_s"] = timeout_s
    try:
        JobRequest.model_validate({**fields, "submitted_at": time.time()})
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = [str(p) for p in err.get("loc", ())]
        param = _openai_name(kind, loc[0]) if loc else None
        message = str(err.get("msg", "invalid")).removeprefix("Value error, ")
        raise bad_request(f"{'.'.join([param or 'request', *loc[1:]])}: {message}", param) from None
    return Request(kind, model, fields, stream, include_usage, chat_logprobs)


def _openai_name(kind: Kind, job_field: str) -> str:
    if job_field == "logprobs" and kind == "chat":
        return "top_logprobs"
    return job_field


# ------------------------------------------------------------------------------------------ errors


def error_for_event(event: ErrorEvent, kind: Kind) -> ApiError:
    """The HTTP error for a job that ended with an ``error`` event."""
    if event.code == "prompt_too_long":
        return ApiError(
            400, event.message, param="messages" if kind == "chat" else "prompt", code="context_length_exceeded"
        )
    if event.code == "invalid_request":
        return ApiError(400, event.message, code="invalid_value")
    if event.code in ("deadline_exceeded", "cancelled"):
        return ApiError(503, f"the job did not run: {event.message}", type="server_error", code=event.code)
    return ApiError(500, f"the job failed ({event.code}): {event.message}", type="server_error", code=event.code)


# ------------------------------------------------------------------------------------------ responses


def usage(u: Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
    }


def _token(token_id: int) -> str:
    """The gateway has no tokenizer (no model, no torch): a token is named by its id, as vLLM's
    ``return_tokens_as_token_ids`` does."""
    return f"token_id:{token_id}"


def logprobs_body(kind: Kind, logprobs: list[Logprob] | None, text_offset: int = 0) -> dict[str, Any] | None:
    if logprobs is None:
        return None
    if kind == "chat":
        return {
            "content": [
                {
                    "token": _token(lp.token_id),
                    "logprob": lp.logprob,
                    "bytes": None,
                    "top_logprobs": [
                        {"token": _token(t.token_id), "logprob": t.logprob, "bytes": None} for t in lp.top
                    ],
                }
                for lp in logprobs
            ]
        }
    return {
        "tokens": [_token(lp.token_id) for lp in logprobs],
        "token_logprobs": [lp.logprob for lp in logprobs],
        "top_logprobs": [{_token(t.token_id): t.logprob for t in lp.top} for lp in logprobs],
        "text_offset": [],
    }


def completion_body(req: Request, final: FinalEvent) -> dict[str, Any]:
    """The non-streaming response."""
    choices: list[dict[str, Any]] = []
    for c in sorted(final.choices, key=lambda c: c.index):
        if req.kind == "chat":
            choices.append(
                {
                    "index": c.index,
                    "message": {"role": "assistant", "content": c.text},
                    "logprobs": logprobs_body("chat", c.logprobs),
                    "finish_reason": c.finish_reason,
                }
            )
        else:
            choices.append(
                {
                    "index": c.index,
                    "text": c.text,
                    "logprobs": logprobs_body("completion", c.logprobs),
                    "finish_reason": c.finish_reason,
                }
            )
    return {
        "id": req.job_id,
        "object": "chat.completion" if req.kind == "chat" else "text_completion",
        "created": req.created,
        "model": req.model,
        "system_fingerprint": None,
        "choices": choices,
        "usage": usage(final.usage),
    }


def chunk(req: Request, choices: list[dict[str, Any]], usage_body: dict[str, Any] | None = None) -> dict[str, Any]:
    """One streamed chunk; with ``include_usage`` every chunk has ``usage`` (null but in the last one)."""
    body: dict[str, Any] = {
        "id": req.job_id,
        "object": "chat.completion.chunk" if req.kind == "chat" else "text_completion",
        "created": req.created,
        "model": req.model,
        "system_fingerprint": None,
        "choices": choices,
    }
    if req.include_usage:
        body["usage"] = usage_body
    return body


def delta_choice(req: Request, index: int, text: str, *, first: bool) -> dict[str, Any]:
    if req.kind == "chat":
        delta: dict[str, Any] = {"role": "assistant", "content": text} if first else {"content": text}
        return {"index": index, "delta": delta, "logprobs": None, "finish_reason": None}
    return {"index": index, "text": text, "logprobs": None, "finish_reason": None}


def finish_choice(req: Request, choice: Choice, text: str, *, first: bool) -> dict[str, Any]:
    """A choice's last chunk: its remaining text, its logprobs (known only at the end) and finish reason."""
    out = delta_choice(req, choice.index, text, first=first)
    if req.kind == "chat" and not text and not first:
        out["delta"] = {}
    out["logprobs"] = logprobs_body(req.kind, choice.logprobs)
    out["finish_reason"] = choice.finish_reason
    return out
