"""OpenAI's request and response shapes, mapped onto pagedq's jobs and events (pure: no I/O).

Requests are read as plain JSON objects, field by field, instead of through a permissive model: a field
pagedq does not support must be refused by name (400, ``param`` = the field), never dropped in silence, or a
client asking for tools would get an answer that ignored what it asked for. Fields OpenAI's SDKs may send
with a neutral value (``tools: []``, ``store: false``...) pass when neutral.

Every response's ``id`` is the job id, so a request can be looked up in Redis (``<ns>:{<id>}:result``) and
in the workers' ``job.finished`` lines.

Responses speak OpenAI's vocabulary only: a job's own endings that OpenAI has no ``finish_reason`` for
(``deadline``, ``cancelled``) become the errors the gateway gives for the same situations
(:func:`final_error`), so a request near its timeout gets the same 504 whichever deadline, the worker's or
the gateway's, passes first.
"""

from __future__ import annotations

import bisect
import re
import secrets
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

from pydantic import ValidationError

from ops.openai_request import (
    PASSTHROUGH_FIELDS,
    SEED_RANGE,
    TAG_FIELDS,
    RequestFieldError,
    chat_messages,
    completion_prompt,
    max_tokens_fields,
    openai_tags,
    passthrough_fields,
)
from schemas.jobs import (
    MAX_STOP_STRINGS,
    Choice,
    ErrorEvent,
    FinalEvent,
    JobRequest,
    Logprob,
    TokenEvent,
    Usage,
    long_integer_problem,
)
from schemas.sampling import SamplingParams

Kind = Literal["chat", "completion"]
T = TypeVar("T")

COMMON_FIELDS = frozenset(
    {"model", "max_tokens", "logprobs", "stream", "stream_options", *TAG_FIELDS, *PASSTHROUGH_FIELDS}
)
CHAT_FIELDS = COMMON_FIELDS | {"messages", "max_completion_tokens", "top_logprobs"}
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt"}

# Fields accepted only with these values (what the SDKs send, or the behaviour pagedq has anyway).
NEUTRAL: dict[str, tuple[Any, ...]] = {
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "function_call": (None, "none"),
    "parallel_tool_calls": (None, False, True),
    "store": (None, False),
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


def timeout_error(timeout_s: float) -> ApiError:
    """The answer to a request that did not finish in time: the gateway's own deadline or the job's (the
    worker's ``deadline`` ending, or ``deadline_exceeded`` before it started), whichever passed first."""
    return ApiError(
        504,
        f"the request did not finish within {timeout_s:g} s (request_timeout_s)",
        type="server_error",
        code="timeout",
    )


# ------------------------------------------------------------------------------------------ the body


def json_problem(exc: ValueError) -> str:
    """Why ``json.loads`` refused a body, in words that never quote it. Python's guard against integers of
    over 4300 digits raises a ValueError that names an interpreter setting: say what is wrong instead."""
    if (problem := long_integer_problem(exc)) is not None:
        return problem
    if isinstance(exc, UnicodeDecodeError):
        return f"it is not UTF-8 (byte {exc.start})"
    msg, line, col = getattr(exc, "msg", None), getattr(exc, "lineno", None), getattr(exc, "colno", None)
    return f"{msg} (line {line}, column {col})" if msg else "it is not JSON"


def shown(text: str, limit: int = 80) -> str:
    """``text`` fit to quote in a message: cut to ``limit`` characters, and lone surrogates (which no UTF-8
    response can carry) written as their ``\\udXXX`` escapes."""
    cut = text if len(text) <= limit else text[:limit] + "..."
    return cut.encode("utf-8", "backslashreplace").decode("utf-8")


def _is_text(value: str) -> bool:
    if value.isascii():
        return True
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate: "\\ud800" is valid JSON, but no Unicode text
        return False
    return True


def _not_text(where: str, what: str = "a lone UTF-16 surrogate is not text (send text as valid UTF-8)") -> ApiError:
    return bad_request(f"{shown(where)}: {what}", shown(where))


def _child(path: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else key


def check_unicode(body: Any) -> None:
    """Refuse a body with a lone UTF-16 surrogate in any string, member names included (400, ``param`` the
    path to it). JSON's ``\\ud800`` escape decodes to one; it is not text: the job's JSON could not be
    written, nor a response quoting it. Iterative (the body may be as deep as ``json`` reads), and paths are
    made for containers only: a prompt of 100k token ids costs one pass over them, no strings."""
    if isinstance(body, str) and not _is_text(body):
        raise _not_text("body")
    stack: list[tuple[Any, str]] = [(body, "")]
    while stack:
        value, path = stack.pop()
        items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
        for key, item in items:
            if isinstance(key, str) and not _is_text(key):
                raise _not_text(_child(path, key), "a member name with a lone UTF-16 surrogate")
            if isinstance(item, str):
                if not _is_text(item):
                    raise _not_text(_child(path, key))
            elif isinstance(item, dict | list):
                stack.append((item, _child(path, key)))


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

    @property
    def logprobs(self) -> bool:
        """Logprobs asked, in either API's way."""
        return self.fields.get("logprobs") is not None


def _check_fields(body: dict[str, Any], allowed: frozenset[str]) -> None:
    for name, value in body.items():
        if name in allowed:
            continue
        if name in NEUTRAL and value in NEUTRAL[name]:
            continue
        raise bad_request(
            f"pagedq does not support the field {shown(name)!r} (or this value of it)", shown(name), "unsupported_field"
        )


def _field(parse: Callable[[Any, str], T], raw: Any, where: str) -> T:
    """Runs one of :mod:`ops.openai_request`'s readers, its error answered as a 400 naming the field."""
    try:
        return parse(raw, where)
    except RequestFieldError as exc:
        raise bad_request(exc.message, exc.param) from None


def _stop(raw: Any) -> list[str] | None:
    """``stop``: a string or a list of up to 16 strings. Empty strings are dropped (OpenAI ignores them; one
    would match at once and end every answer before its first token), a lone one as in a list."""
    if isinstance(raw, str):
        raw = [raw]
    if not isinstance(raw, list):
        raise bad_request(f"stop: must be a string or a list of at most {MAX_STOP_STRINGS} strings", "stop")
    for i, item in enumerate(raw):
        if not isinstance(item, str):
            raise bad_request(f"stop[{i}]: must be a string, got {_json_type(item)}", "stop")
    if len(raw) > MAX_STOP_STRINGS:
        raise bad_request(f"stop: at most {MAX_STOP_STRINGS} strings, got {len(raw)}", "stop")
    return [s for s in raw if s] or None


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    return "a list" if isinstance(value, list) else "an object"


def parse_request(
    kind: Kind, body: Any, *, default_max_tokens: int, timeout_s: float, random_seed: int | None = None
) -> Request:
    """Check an OpenAI request body and build its job's fields; :class:`ApiError` (400) names what is wrong."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    # JSON null means "not given", as in OpenAI's API, for every field: the SDK sends an explicit None as
    # null (max_completion_tokens=None must leave max_tokens in charge), and an unknown field set to null
    # asks for nothing that could be dropped.
    body = {name: value for name, value in body.items() if value is not None}
    _check_fields(body, CHAT_FIELDS if kind == "chat" else COMPLETION_FIELDS)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("model: a model name is required (GET /v1/models lists them)", "model")
    fields: dict[str, Any] = {"id": f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"}
    chat_logprobs = False
    names = {"max_tokens": "max_tokens"}  # job field -> the request's name for it, in messages and param
    if kind == "chat":
        fields["messages"] = _field(chat_messages, body.get("messages"), "messages")
        if "max_completion_tokens" in body:  # OpenAI's newer name wins over the deprecated max_tokens
            names["max_tokens"] = "max_completion_tokens"
        max_tokens = body.get(names["max_tokens"])
        logprobs, top = body.get("logprobs"), body.get("top_logprobs")
        if logprobs not in (None, True, False):
            raise bad_request("logprobs: must be a boolean", "logprobs")
        if top is not None and not logprobs:
            raise bad_request("top_logprobs: needs logprobs set to true", "top_logprobs")
        if logprobs:
            chat_logprobs = True
            fields["logprobs"] = 0 if top is None else top
            names["logprobs"] = "top_logprobs"
    else:
        if "prompt" not in body:
            raise bad_request("prompt: required", "prompt")
        fields.update(_field(completion_prompt, body["prompt"], "prompt"))
        max_tokens = body.get("max_tokens")
        if body.get("logprobs") is not None:
            fields["logprobs"] = body["logprobs"]
    fields.update(max_tokens_fields(max_tokens, default_max_tokens))
    seed = body.get("seed")
    if type(seed) is int and not -SEED_RANGE <= seed < SEED_RANGE:  # the job's own message would say ">= 0"
        raise bad_request(
            f"seed: must be a signed 64-bit integer (from -2**63 to 2**63 - 1), got {shown(str(seed), 40)}", "seed"
        )
    fields.update(passthrough_fields(body))
    if "stop" in fields:
        stop = _stop(fields.pop("stop"))
        if stop is not None:
            fields["stop"] = stop
    if "seed" not in fields:
        fields["seed"] = secrets.randbelow(RANDOM_SEED_BOUND) if random_seed is None else random_seed
    fields.update(_field(openai_tags, body, ""))
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise bad_request("stream: must be a boolean", "stream")
    include_usage = _stream_options(body.get("stream_options"), stream)
    # A non-streaming request reads only the final event: no token events sent, except with completions'
    # logprobs, whose text_offset needs the text of the steps that produced the tokens (completion_body).
    fields["stream"] = stream or (kind == "completion" and "logprobs" in fields)
    fields["timeout_s"] = timeout_s
    low, high = fields.get("min_tokens"), fields["max_tokens"]
    if type(low) is int and type(high) is int and low > high:  # the engine's rule, in the request's names
        if not fields.get("strict_max_tokens"):  # the gateway's default cap, not the client's: room for min_tokens
            fields["max_tokens"] = low
        else:
            raise bad_request(f"min_tokens: must be at most {names['max_tokens']} ({high}), got {low}", "min_tokens")
    constraints = [f for f in ("response_format", "guided_regex", "guided_choice") if f in fields]
    if fields.get("response_format") == {"type": "text"}:
        constraints.remove("response_format")
    if len(constraints) > 1:
        raise bad_request(f"{constraints[1]}: at most one of {', '.join(constraints)} may be set", constraints[1])
    try:
        job = JobRequest.model_validate({**fields, "submitted_at": time.time()})
        # The engine's own rules (min_tokens <= max_tokens...), checked by the worker when it reads the job:
        # checked here too, so that a 400 names the field instead of coming back from the worker without one.
        SamplingParams.model_validate(job.sampling_kwargs())
    except ValidationError as exc:
        raise _validation_error(exc, names) from None
    return Request(kind, model, fields, stream, include_usage, chat_logprobs)


def _stream_options(options: Any, stream: bool) -> bool:
    """``stream_options``: whether usage is sent in a last chunk. ``continuous_usage_stats`` (vLLM: usage in
    every chunk) is refused by name: a worker reports the prompt's token count only when the job ends.
    ``include_obfuscation`` (OpenAI's random padding of chunks against length side channels, on by default
    there) is taken when false, what pagedq does; true is refused by name: pagedq does not pad chunks."""
    if options is None:
        return False
    if not stream:
        raise bad_request("stream_options: only allowed with stream set to true", "stream_options")
    if not isinstance(options, dict):
        raise bad_request("stream_options: must be an object", "stream_options")
    unknown = set(options) - {"include_usage", "continuous_usage_stats", "include_obfuscation"}
    if unknown:
        raise bad_request(
            f"stream_options: pagedq supports include_usage (and include_obfuscation: false) only, not "
            f"{shown(sorted(unknown)[0])!r}",
            "stream_options",
        )
    for name, value in options.items():
        if value is not None and not isinstance(value, bool):
            raise bad_request(f"stream_options.{name}: must be a boolean", "stream_options")
    if options.get("continuous_usage_stats"):
        raise bad_request(
            "stream_options.continuous_usage_stats: pagedq does not support usage in every chunk (a worker knows "
            "the prompt's token count only when the job ends); include_usage sends it in a last chunk",
            "stream_options",
            "unsupported_field",
        )
    if options.get("include_obfuscation"):
        raise bad_request(
            "stream_options.include_obfuscation: pagedq does not pad streamed chunks against length side channels "
            "(keep the gateway on a trusted network, or behind TLS); send false or leave it out",
            "stream_options",
            "unsupported_field",
        )
    return bool(options.get("include_usage"))


# Job or SamplingParams field -> the request field it comes from, where the names differ.
_REQUEST_NAMES = {
    "json_schema": "response_format",
    "regex": "guided_regex",
    "choice": "guided_choice",
    "affinity": "prompt_cache_key",
}


def _validation_error(exc: ValidationError, names: dict[str, str]) -> ApiError:
    """A 400 for the first field pydantic refused, named as the request names it (``messages[0].content``)."""
    err = exc.errors()[0]
    loc = list(err.get("loc", ()))
    message = str(err.get("msg", "invalid")).removeprefix("Value error, ")
    if not loc:  # a rule over the whole job; its message starts with the field it judged ("metadata is ...")
        first = message.split(" ", 1)[0].rstrip(":")
        known = first in JobRequest.model_fields or first in _REQUEST_NAMES
        return bad_request(message, (names.get(first) or _REQUEST_NAMES.get(first, first)) if known else None)
    head = str(loc[0])
    param = names.get(head) or _REQUEST_NAMES.get(head, head)
    path = param + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc[1:])
    return bad_request(f"{path}: {message}", param)


# ------------------------------------------------------------------------------------------ errors


def _refused_field(message: str) -> str | None:
    """The request field a worker's refusal names, as the request names it: workers start such a message with
    the job or sampling field (``json_schema: Unsupported type "nope"``, for a schema only the grammar
    compiler can judge)."""
    name = message.split(":", 1)[0] if ":" in message else ""
    if name in _REQUEST_NAMES:
        return _REQUEST_NAMES[name]
    if name in JobRequest.model_fields and name not in ("id", "reply_to", "metadata", "submitted_at"):
        return name
    return None


# The two refusals of engine.errors.PromptTooLongError, as a worker words them: the prompt alone fills the
# context, or (strict_max_tokens) the prompt plus the client's max_tokens does not fit in it.
_PROMPT_FILLS_CONTEXT = re.compile(r"prompt is (\d+) tokens; the model's context is (\d+) tokens\b")
_PROMPT_AND_COMPLETION = re.compile(
    r"This model's maximum context length is (\d+) tokens\. However, you requested \d+ tokens "
    r"\((\d+) in the prompt, (\d+) in the completion\)"
)


def context_length_error(message: str, kind: Kind, max_tokens: int) -> ApiError:
    """OpenAI's 400 for a prompt too long for the model, from a worker's ``prompt_too_long`` message.

    Clients of OpenAI's API and of vLLM's OpenAI server match this exact wording (the official SDK shows it,
    retry and truncation helpers parse its numbers out of it), so the worker's own words, made for a log,
    are rewritten into it: "This model's maximum context length is N tokens. However, you requested M tokens
    (P in the messages, C in the completion). Please reduce the length of the messages or completion." It is
    the same sentence for both endpoints, as vLLM words it; ``param`` says which field is too long.

    N and P are the worker's (only it tokenizes, and it knows its model's context); C is the job's
    ``max_tokens``: the client's own when it set one, else the gateway's default for the endpoint, the
    tokens the job asked for either way. A message of another wording (a worker of another version) is
    passed on as it came, with the same ``code`` and ``param``: numbers are never made up.
    """
    param = "messages" if kind == "chat" else "prompt"
    if match := _PROMPT_AND_COMPLETION.search(message):
        context, prompt, completion = (int(g) for g in match.groups())
    elif match := _PROMPT_FILLS_CONTEXT.search(message):
        prompt, context = (int(g) for g in match.groups())
        completion = max_tokens
    else:
        return ApiError(400, message, param=param, code="context_length_exceeded")
    return ApiError(
        400,
        f"This model's maximum context length is {context} tokens. However, you requested "
        f"{prompt + completion} tokens ({prompt} in the messages, {completion} in the completion). "
        "Please reduce the length of the messages or completion.",
        param=param,
        code="context_length_exceeded",
    )


def error_for_event(event: ErrorEvent, spec: Request, timeout_s: float) -> ApiError:
    """The HTTP error for the job of ``spec`` that ended with an ``error`` event."""
    if event.code == "prompt_too_long":
        return context_length_error(event.message, spec.kind, int(spec.fields["max_tokens"]))
    if event.code == "invalid_request":
        return ApiError(400, event.message, param=_refused_field(event.message), code="invalid_value")
    if event.code == "deadline_exceeded":  # its deadline (request_timeout_s) passed before it started
        return timeout_error(timeout_s)
    if event.code == "cancelled":
        return ApiError(503, f"the job was cancelled: {event.message}", type="server_error", code="cancelled")
    return ApiError(500, f"the job failed ({event.code}): {event.message}", type="server_error", code=event.code)


def final_error(final: FinalEvent, timeout_s: float) -> ApiError | None:
    """The error a final event means, if any: OpenAI has no ``finish_reason`` for a job that reached its
    deadline or was cancelled, so a choice ended that way makes the request an error (its text is partial),
    the one the gateway gives for the same situation itself: 504 past the deadline, 503 when cancelled (by
    ``pagedq cancel``: a gateway cancels only jobs whose client has gone)."""
    reasons = {c.finish_reason for c in final.choices}
    if "deadline" in reasons:
        return timeout_error(timeout_s)
    if "cancelled" in reasons:
        return ApiError(503, "the job was cancelled while it ran", type="server_error", code="cancelled")
    return None


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


Piece = tuple[int, str, list[Logprob] | None, int]
"""A part of a choice as streamed: its index, text, its tokens' logprobs, the text's offset in the choice's."""


@dataclass
class Steps:
    """The token events of a job, by attempt: what each engine step added to a choice (its text and how many
    tokens), the only place the gateway learns which part of the text came with which tokens. These split
    the final event's logprobs up again: into ``text_offset``, and per streamed chunk for what was not
    streamed as it came (:class:`LiveLogprobs`: an older worker sends logprobs in the final event only)."""

    # (index, text, tokens, where each token's text starts or None from a worker that does not say:
    # TokenEvent.text_offsets)
    by_attempt: dict[int, list[tuple[int, str, int, list[int] | None]]] = field(default_factory=dict)

    def add(self, event: TokenEvent) -> None:
        step = (event.index, event.text, len(event.token_ids), token_offsets(event))
        self.by_attempt.setdefault(event.attempt, []).append(step)

    def text_offsets(self, final: FinalEvent) -> dict[int, list[int]]:
        """Per choice whose every token came in an event that placed it (TokenEvent.text_offsets), where each
        token's text starts in the choice's text (past its end for tokens of a stop string cut off: its end)."""
        found: dict[int, list[int]] = {}
        placed = {c.index for c in final.choices}
        for index, _text, _count, offsets in self.by_attempt.get(final.attempt, []):
            if offsets is None:
                placed.discard(index)
            else:
                found.setdefault(index, []).extend(offsets)
        return {
            c.index: [min(at, len(c.text)) for at in found.get(c.index, [])]
            for c in final.choices
            if c.index in placed and len(found.get(c.index, [])) == len(c.token_ids)
        }

    def split(self, final: FinalEvent) -> list[Piece]:
        """The final's choices cut at the steps of its attempt, in the order they came: (index, text, its
        tokens' logprobs, offset of the text in the choice's). A choice's text and tokens after its last
        step (held back for a stop string, or sent with the final only) make its last piece, even if
        empty; the steps of a choice that do not add up to its final (a reply stream trimmed under a slow
        reader) are not used past the first that does not fit."""
        choices = {c.index: c for c in final.choices}
        at = dict.fromkeys(choices, 0)  # characters of each choice covered so far
        used = dict.fromkeys(choices, 0)  # tokens
        broken: set[int] = set()
        out: list[Piece] = []
        for index, text, count, _offsets in self.by_attempt.get(final.attempt, []):
            choice = choices.get(index)
            if choice is None or index in broken:
                continue
            if not choice.text.startswith(text, at[index]) or used[index] + count > len(choice.token_ids):
                broken.add(index)
                continue
            lps = None if choice.logprobs is None else choice.logprobs[used[index] : used[index] + count]
            out.append((index, text, lps, at[index]))
            at[index] += len(text)
            used[index] += count
        for index, choice in sorted(choices.items()):
            lps = None if choice.logprobs is None else choice.logprobs[used[index] :]
            out.append((index, choice.text[at[index] :], lps, at[index]))
        return out


def logprobs_body(kind: Kind, logprobs: list[Logprob] | None, text_offset: list[int] | None = None) -> Any:
    """``logprobs`` of a choice or chunk. ``text_offset`` (completions): where each token's text starts in
    the choice's text, as its worker placed it (:meth:`Steps.text_offsets`); streamed, a chunk's start; from
    an older worker, where the text of the engine step that produced it starts (the gateway has no
    tokenizer)."""
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
        "text_offset": text_offset if text_offset is not None else [0] * len(logprobs),
    }


def token_offsets(event: TokenEvent) -> list[int] | None:
    """Where each of ``event``'s tokens' text starts in its choice's text, when its worker said so for every
    token (:attr:`TokenEvent.text_offsets`), else None."""
    offsets = event.text_offsets
    return offsets if offsets is not None and len(offsets) == len(event.token_ids) else None


def _offsets(steps: Steps, final: FinalEvent) -> dict[int, list[int]]:
    """Per choice, the ``text_offset`` of each of its tokens (see :func:`logprobs_body`): where its worker
    placed it, else at the start of the text of the step that produced it."""
    out: dict[int, list[int]] = {c.index: [] for c in final.choices}
    for index, _text, lps, at in steps.split(final):
        out[index] += [at] * len(lps or ())
    return out | steps.text_offsets(final)


def completion_body(req: Request, final: FinalEvent, steps: Steps | None = None) -> dict[str, Any]:
    """The non-streaming response; ``steps``, the job's token events, place completions' ``text_offset``."""
    offsets = _offsets(steps or Steps(), final) if req.kind == "completion" and req.logprobs else {}
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
                    "logprobs": logprobs_body("completion", c.logprobs, offsets.get(c.index)),
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


def delta_choice(req: Request, index: int, text: str, *, first: bool, logprobs: Any = None) -> dict[str, Any]:
    if req.kind == "chat":
        delta: dict[str, Any] = {"role": "assistant", "content": text} if first else {"content": text}
        return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": None}
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": None}


def finish_choice(req: Request, choice: Choice, text: str, *, first: bool, logprobs: Any = None) -> dict[str, Any]:
    """A choice's last chunk: its remaining text, the logprobs of the tokens that came with it, its finish."""
    out = delta_choice(req, choice.index, text, first=first, logprobs=logprobs)
    if req.kind == "chat" and not text and not first and logprobs is None:
        out["delta"] = {}
    out["finish_reason"] = choice.finish_reason
    return out


class Diverged(Exception):
    """A redelivered attempt's output differs from what was already streamed (sampling without a seed)."""


Output = TypeVar("Output", str, list[int])


def _continued(sent: Output, now: Output, checked: int) -> Output:
    """What ``now`` (the current attempt's text or token ids so far, its first ``checked`` already found to
    agree with ``sent``) adds to ``sent``: nothing while it still repeats a part of it, :class:`Diverged`
    when it differs."""
    overlap = min(len(sent), len(now))
    if checked < overlap and now[checked:overlap] != sent[checked:overlap]:
        raise Diverged
    return now[len(sent) :]


@dataclass
class LiveLogprobs:
    """One choice of a streamed request that asked for logprobs, followed as its token events come (workers
    send each event's logprobs with it, :attr:`schemas.jobs.TokenEvent.logprobs`): each event's text goes
    out at once with the logprobs of the tokens whose text has begun (:attr:`TokenEvent.text_offsets`: text
    held back for a stop string comes after its tokens; from a worker without them, the event's tokens).
    Across a redelivery as the plain stream (:class:`worker.client.StreamState`): the highest attempt is
    followed, stays silent while it repeats what was sent, continues past it, and :class:`Diverged` when it
    differs. An attempt with an event without logprobs (an older worker) is not streamed past it: the rest
    comes with the final event."""

    attempt: int = 0
    live: bool = True  # every event of this attempt so far came with its tokens' logprobs
    text: str = ""  # the current attempt's text, token ids and logprobs so far
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[Logprob] = field(default_factory=list)
    # where each token's text starts (TokenEvent.text_offsets); None once an event of the attempt did not say
    offsets: list[int] | None = field(default_factory=list)
    sent_text: str = ""  # what was streamed: the text, and the ids of the tokens whose logprobs were sent
    sent_ids: list[int] = field(default_factory=list)
    started: bool = False  # a chunk of this choice was sent

    def feed(self, event: TokenEvent) -> tuple[str, list[Logprob], int] | None:
        """What ``event`` adds to the stream, if anything: its text, its tokens' logprobs, and where that
        text starts in the choice's (completions' ``text_offset``)."""
        if event.attempt < self.attempt:
            return None  # a stale delivery that was taken over still talking
        if event.attempt > self.attempt:
            self.attempt, self.live, self.text, self.token_ids, self.logprobs = event.attempt, True, "", [], []
            self.offsets = []
        if not self.live:
            return None
        if event.logprobs is None or len(event.logprobs) != len(event.token_ids):
            self.live = False
            return None
        at, used = len(self.sent_text), len(self.sent_ids)
        checked_text, checked_ids = len(self.text), len(self.token_ids)
        self.text += event.text
        self.token_ids += event.token_ids
        self.logprobs += event.logprobs
        offsets = token_offsets(event)
        self.offsets = None if offsets is None or self.offsets is None else self.offsets + offsets
        # A token's logprob goes out with the chunk its text starts in: text held back for a stop string comes
        # in later events than its tokens (offsets never decrease, so the tokens whose text has begun lead).
        begun = len(self.token_ids) if self.offsets is None else bisect.bisect_left(self.offsets, len(self.text))
        new_text = _continued(self.sent_text, self.text, checked_text)
        new_ids = _continued(self.sent_ids, self.token_ids[:begun], min(checked_ids, begun))
        self.sent_text += new_text
        self.sent_ids += new_ids
        if not new_text and not new_ids:
            return None
        return new_text, self.logprobs[used : used + len(new_ids)], at

    def unsent(self, choice: Choice, pieces: list[Piece]) -> list[Piece]:
        """``pieces``, the final event's choice cut at its steps (:meth:`Steps.split`), less what was streamed
        (:class:`Diverged` when the final's output does not continue it)."""
        if not choice.text.startswith(self.sent_text) or choice.token_ids[: len(self.sent_ids)] != self.sent_ids:
            raise Diverged
        at, used = len(self.sent_text), len(self.sent_ids)
        if self.live and self.offsets is not None and choice.logprobs is not None:
            # Its worker placed every token: what was not streamed is the text's rest and the tokens whose text
            # starts there (or that have none), one piece; cut at the steps it would pair a stop string's
            # held-back text with later tokens. The pieces before it are left empty (their count is kept).
            empty: list[Piece] = [(index, "", [], at) for index, *_ in pieces[:-1]]
            return [*empty, (pieces[-1][0], choice.text[at:], choice.logprobs[used:], at)]
        out: list[Piece] = []
        tokens = 0  # tokens of the choice before the piece
        for index, text, lps, offset in pieces:
            kept = None if lps is None else lps[max(0, used - tokens) :]
            tokens += len(lps or ())
            out.append((index, text[max(0, at - offset) :], kept, max(offset, at)))
        return out


def logprob_choice(
    req: Request,
    index: int,
    text: str,
    lps: list[Logprob] | None,
    at: int,
    *,
    first: bool,
    finish: Choice | None = None,
) -> dict[str, Any]:
    """A streamed choice with its tokens' logprobs, ``at`` its text's offset in the choice's; with ``finish``,
    the choice's last."""
    body = logprobs_body(req.kind, lps, [at] * len(lps or ())) if lps else None
    if finish is not None:
        return finish_choice(req, finish, text, first=first, logprobs=body)
    return delta_choice(req, index, text, first=first, logprobs=body)


def logprob_chunks(
    req: Request, final: FinalEvent, steps: Steps, live: dict[int, LiveLogprobs] | None = None
) -> list[dict[str, Any]]:
    """A streamed request's last chunks when it asked for logprobs, built once its final event has come: what
    ``live`` did not stream yet (all of it with an older worker, which sends logprobs in the final event
    only), one chunk per engine step, each with the logprobs of the tokens its text came with (as OpenAI
    and vLLM stream them), then each choice's finish."""
    live = live or {}
    choices = {c.index: c for c in final.choices}
    pieces = steps.split(final)
    for index, state in live.items():
        if index in choices:
            mine = [p for p in pieces if p[0] == index]
            rest = iter(state.unsent(choices[index], mine))
            pieces = [next(rest) if p[0] == index else p for p in pieces]
    last = {index: i for i, (index, *_rest) in enumerate(pieces)}  # each choice's last piece carries its finish
    started = {index for index, state in live.items() if state.started}
    out = []
    for i, (index, text, lps, at) in enumerate(pieces):
        finish = choices[index] if i == last[index] else None
        if finish is None and not text and not lps:
            continue
        out.append(chunk(req, [logprob_choice(req, index, text, lps, at, first=index not in started, finish=finish)]))
        started.add(index)
    return out
