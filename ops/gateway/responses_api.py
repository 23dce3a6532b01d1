"""OpenAI's Responses API (``POST /v1/responses``) over pagedq's chat jobs (pure: no I/O).

A Responses request asks for what a chat request asks for, in other words: ``instructions`` is a system
message, ``input`` the conversation (a string, one user message, or a list of message items), and
``max_output_tokens`` is ``max_tokens``. So it is turned into a chat body and read by
:func:`ops.gateway.openai_api.parse_request`, the one reader of sampling fields, tags and seeds: a field the
chat endpoint checks one way cannot be checked another way here. What only the Responses API has, and
pagedq cannot do (tools, ``previous_response_id`` and conversations, which need stored responses, background
mode, images and files, reasoning options), is refused by name as the chat endpoint refuses its unsupported
fields (400, ``param`` = the field); fields the SDKs send with a neutral value pass when neutral.

The answer and the streamed events follow the shapes of the ``openai`` SDK's ``types/responses`` (which
``response.output_text`` and ``client.responses.stream`` read) and vLLM's ``serving_responses``: one
``message`` output item with one ``output_text`` part; a job cut at ``max_tokens`` is ``incomplete`` with
``reason: max_output_tokens``, as OpenAI reports it.

Ids: a response's id must be ``resp_...``, and job ids may not hold ``_`` (:data:`schemas.jobs.JOB_ID_PATTERN`),
so the job is ``resp-<hex>`` and its response ``resp_<hex>`` (the ``x-request-id`` header names the job).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from ops.gateway.openai_api import ApiError, Request, bad_request, parse_request, shown
from ops.openai_request import PASSTHROUGH_FIELDS, TAG_FIELDS, RequestFieldError, text_content
from schemas.jobs import FinalEvent, Usage

# Fields read as the chat endpoint reads them. ``n`` and ``response_format`` are chat's: a response has one
# output, and its format is ``text.format``.
RESPONSES_FIELDS = frozenset(
    {"model", "input", "instructions", "max_output_tokens", "stream", *TAG_FIELDS}
    | (set(PASSTHROUGH_FIELDS) - {"n", "response_format"})
)

# Fields accepted only with these values: what the SDKs send, or what pagedq does anyway. ``store`` is
# accepted either way (true is OpenAI's default) but nothing is kept: ``previous_response_id`` is refused.
RESPONSES_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "tools": ([],),
    "tool_choice": ("none", "auto"),
    "parallel_tool_calls": (False, True),
    "max_tool_calls": (),
    "store": (False, True),
    "background": (False,),
    "reasoning": (),
    "include": ([],),
    "truncation": ("disabled",),
    "service_tier": ("auto", "default"),
    "text": ({"format": {"type": "text"}}, {}),
    "top_logprobs": (0,),
    "stream_options": ({}, {"include_obfuscation": False}),
    "previous_response_id": (),
    "conversation": (),
    "prompt": (),
}

ROLES = ("system", "developer", "user", "assistant")
TEXT_PARTS = ("input_text", "output_text")  # an assistant item echoed back holds output_text parts


@dataclass
class ResponsesRequest(Request):
    """A Responses request as a chat job, with what its answer echoes back (``instructions``,
    ``max_output_tokens``, ``temperature``...)."""

    echo: dict[str, Any] = field(default_factory=dict)

    @property
    def response_id(self) -> str:
        return "resp_" + self.job_id.removeprefix("resp-")

    @property
    def message_id(self) -> str:
        return "msg_" + self.job_id.removeprefix("resp-")


def input_messages(raw: Any) -> list[dict[str, str]]:
    """``input`` as chat messages: a string is one user message; a list holds message items (``type``
    ``message`` or absent), each a role and a content: a string, or ``input_text`` parts (joined)."""
    if isinstance(raw, str):
        return [{"role": "user", "content": raw}]
    if not isinstance(raw, list) or not raw:
        raise bad_request("input: a string or a non-empty list of message items is required", "input")
    out = []
    for i, item in enumerate(raw):
        at = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad_request(f"{at}: must be an object", at)
        kind = item.get("type", "message")
        if kind != "message":
            raise bad_request(
                f"{at}.type: pagedq supports message items only, not {shown(str(kind))!r}", at, "unsupported_field"
            )
        for key, value in item.items():
            # id, status: an output item sent back as history; phase: OpenAI asks clients to resend it
            if key not in ("type", "role", "content", "id", "status", "phase") and value is not None:
                raise bad_request(f"pagedq does not support the field {shown(key)!r} in input items", f"{at}.{key}")
        role = item.get("role")
        if role not in ROLES:
            raise bad_request(f"{at}.role: pagedq supports {', '.join(ROLES)}; got {shown(str(role))!r}", at)
        content = item.get("content")
        if isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                where = f"{at}.content[{j}]"
                kind = part.get("type") if isinstance(part, dict) else None
                if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
                    raise bad_request(
                        f"{where}: pagedq supports text parts (input_text) only, not {shown(str(kind))!r}",
                        where,
                        "unsupported_field",
                    )
                parts.append({"type": "text", "text": part["text"]})
            content = parts
        try:
            text = text_content(content, f"{at}.content")
        except RequestFieldError as exc:
            raise bad_request(exc.message, exc.param) from None
        out.append({"role": "system" if role == "developer" else role, "content": text})
    return out


_CHAT_NAME = re.compile(r"\b(max_completion_tokens|max_tokens)\b|\bmessages(?:\[(\d+)\](\.content)?)?")


def responses_names(text: str, instructions: bool = False) -> str:
    """``text`` (an error's message or param) in the Responses API's names: ``max_tokens`` and
    ``max_completion_tokens`` are ``max_output_tokens``, ``messages[i]`` is ``input[i]``, one less where
    ``instructions`` became the first message (whose content is ``instructions`` itself)."""

    def rename(match: re.Match[str]) -> str:
        if match.group(1):
            return "max_output_tokens"
        if match.group(2) is None:
            return "input"
        index = int(match.group(2)) - instructions
        return "instructions" if index < 0 else f"input[{index}]{match.group(3) or ''}"

    return _CHAT_NAME.sub(rename, text)


def renamed_error(exc: ApiError, instructions: bool = False) -> ApiError:
    """A chat reader's error in the Responses API's names (:func:`responses_names`): the request's and the
    worker's (a prompt too long names ``messages``; OpenAI's sentence for it stays as clients parse it)."""
    if exc.code != "context_length_exceeded":
        exc.message = responses_names(exc.message, instructions)
        exc.args = (exc.message,)
    if exc.param is not None:
        exc.param = responses_names(exc.param, instructions)
    return exc


def responses_chat_body(body: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """A Responses request body as (the chat body it asks for, what its answer echoes back); :class:`ApiError`
    (400) names the field that is wrong or that pagedq cannot do. Shared by the gateway and ``pagedq batch``'s
    ``/v1/responses`` lines, so both refuse the same requests by the same names."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    body = {name: value for name, value in body.items() if value is not None}  # null: not given, as in chat
    for name, value in body.items():
        if name in RESPONSES_FIELDS or (name in RESPONSES_NEUTRAL and value in RESPONSES_NEUTRAL[name]):
            continue
        raise bad_request(
            f"pagedq does not support the field {shown(name)!r} (or this value of it) in /v1/responses",
            shown(name),
            "unsupported_field",
        )
    if "input" not in body:
        raise bad_request("input: required", "input")
    messages = input_messages(body["input"])
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise bad_request("instructions: must be a string", "instructions")
        messages.insert(0, {"role": "system", "content": instructions})
    dropped = {"input", "instructions", "max_output_tokens", *RESPONSES_NEUTRAL}
    chat = {k: v for k, v in body.items() if k not in dropped}
    chat["messages"] = messages
    if "max_output_tokens" in body:
        chat["max_completion_tokens"] = body["max_output_tokens"]
    echo = {
        "instructions": instructions,
        "max_output_tokens": body.get("max_output_tokens"),
        "temperature": body.get("temperature", 1.0),
        "top_p": body.get("top_p", 1.0),
        "metadata": body.get("metadata", {}),
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "tool_choice": body.get("tool_choice", "auto"),
        "user": body.get("user"),
        "safety_identifier": body.get("safety_identifier"),
        "prompt_cache_key": body.get("prompt_cache_key"),
    }
    return chat, echo


def parse_responses_request(
    body: Any, *, default_max_tokens: int, timeout_s: float, random_seed: int | None = None
) -> ResponsesRequest:
    """Check a Responses request body and build its chat job's fields; :class:`ApiError` (400) names the
    field that is wrong or that pagedq cannot do."""
    chat, echo = responses_chat_body(body)
    try:
        spec = parse_request(
            "chat", chat, default_max_tokens=default_max_tokens, timeout_s=timeout_s, random_seed=random_seed
        )
    except ApiError as exc:
        raise renamed_error(exc, echo["instructions"] is not None) from None
    spec.fields["id"] = "resp-" + spec.job_id.split("-", 1)[1]
    return ResponsesRequest(
        spec.kind, spec.model, spec.fields, spec.stream, spec.include_usage, created=spec.created, echo=echo
    )


# ------------------------------------------------------------------------------------------ answers


def response_usage(u: Usage) -> dict[str, Any]:
    return {
        "input_tokens": u.prompt_tokens,
        "input_tokens_details": {"cached_tokens": u.cached_tokens, "cache_write_tokens": 0},
        "output_tokens": u.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": u.prompt_tokens + u.completion_tokens,
    }


def _message(req: ResponsesRequest, text: str | None, status: str) -> dict[str, Any]:
    """The one output item; ``text`` None: before its part was added (``response.output_item.added``)."""
    content = [] if text is None else [_part(text)]
    return {"type": "message", "id": req.message_id, "status": status, "role": "assistant", "content": content}


def _part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def response_object(
    req: ResponsesRequest, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None
) -> dict[str, Any]:
    """The ``response`` object: the answer itself, and what the lifecycle events carry."""
    return {
        "id": req.response_id,
        "object": "response",
        "created_at": req.created,
        "model": req.model,
        "status": status,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "output": output,
        "usage": usage,
        "tools": [],
        "text": {"format": {"type": "text"}},
        "truncation": "disabled",
        "reasoning": None,
        "previous_response_id": None,
        "store": False,  # nothing is kept: it cannot be retrieved or continued
        "background": False,
        "service_tier": "default",
        **req.echo,
    }


def _status(final: FinalEvent) -> str:
    """``incomplete`` for a job cut at its token limit (finish ``length``), as OpenAI reports
    ``max_output_tokens``; ``completed`` otherwise (the deadline and cancel endings are errors already)."""
    return "incomplete" if any(c.finish_reason == "length" for c in final.choices) else "completed"


def response_body(req: ResponsesRequest, final: FinalEvent) -> dict[str, Any]:
    """The non-streaming answer."""
    text = final.choices[0].text if final.choices else ""
    status = _status(final)
    return response_object(req, status, [_message(req, text, _item_status(status))], response_usage(final.usage))


def _item_status(status: str) -> str:
    """The message's status: ``incomplete`` when the response is (its text was cut), as OpenAI marks it."""
    return "incomplete" if status == "incomplete" else "completed"


@dataclass
class ResponseEvents:
    """A streamed response's events, each numbered (``sequence_number``) in the order they are made."""

    req: ResponsesRequest
    seq: int = 0
    text: str = ""

    def _event(self, kind: str, **body: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self.seq, **body}
        self.seq += 1
        return event

    def _where(self) -> dict[str, Any]:
        return {"item_id": self.req.message_id, "output_index": 0, "content_index": 0}

    def opening(self) -> list[dict[str, Any]]:
        """What comes before the first text: the response created and in progress, its message, its part."""
        started = response_object(self.req, "in_progress", [], None)
        return [
            self._event("response.created", response=started),
            self._event("response.in_progress", response=started),
            self._event("response.output_item.added", output_index=0, item=_message(self.req, None, "in_progress")),
            self._event("response.content_part.added", **self._where(), part=_part("")),
        ]

    def delta(self, text: str) -> dict[str, Any]:
        self.text += text
        return self._event("response.output_text.delta", **self._where(), delta=text, logprobs=[])

    def closing(self, final: FinalEvent) -> list[dict[str, Any]]:
        """The text, part and item done, then ``response.completed`` (or ``response.incomplete``) with the
        whole answer. The text is what was streamed: the final event's is the same (the client's
        :class:`worker.client.StreamState` follows redeliveries without repeating text)."""
        status = _status(final)
        item = _message(self.req, self.text, _item_status(status))
        whole = response_object(self.req, status, [item], response_usage(final.usage))
        return [
            self._event("response.output_text.done", **self._where(), text=self.text, logprobs=[]),
            self._event("response.content_part.done", **self._where(), part=_part(self.text)),
            self._event("response.output_item.done", output_index=0, item=item),
            self._event(f"response.{status}", response=whole),
        ]

    def error(self, exc: ApiError) -> dict[str, Any]:
        """A failure after the response started (its status can no longer change): OpenAI's ``error`` event."""
        return self._event("error", code=exc.code, message=exc.message, param=exc.param)
