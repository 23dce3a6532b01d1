"""Response mapping: a job's terminal event -> the OpenAI Batch output or errors-file record.

An answer is one output line ``{id, custom_id, response: {status_code, request_id, body}, error}`` whose body
is shaped like an OpenAI ``chat.completion`` / ``text_completion`` object with ``usage`` (a ``/v1/responses``
line's like a ``response`` object, shaped by the gateway's own :func:`ops.gateway.responses_api.response_body`,
so the batch and ``pagedq serve`` cannot answer the same request in two shapes); a failure is an
errors-file line ``{id, custom_id, response: null, error: {code, message, line}}``.

**The body's ``model`` is the model that served the request**, as OpenAI's is (a request for ``gpt-4o`` is
answered with ``"model": "gpt-4o-2024-08-06"``), never the request's own ``model``, which is accepted
whatever it says: a worker serves one model, and an OpenAI batch file names OpenAI's models. The served
name is the one the worker reports (``--model`` / ``PAGEDQ_MODEL`` as given, else its model folder).

Token strings in ``logprobs`` need the worker's tokenizer (events carry token ids): ``--local`` has the
engine's; queue mode loads ``--tokenizer``, else the serving worker's model folder when it is readable here,
else the ``PAGEDQ_MODEL`` folder, with :func:`load_token_text`. ``text_offset`` (completions) and ``bytes``
(chat) are computed from those token texts, so they agree with ``tokens`` / ``token`` as in vLLM. When no
tokenizer can be had, tokens are written as ``"token_id:<id>"`` (vLLM's ``return_tokens_as_token_ids``
convention), so logprobs stay usable, and ``text_offset`` and ``bytes`` are ``null`` (both nullable in
OpenAI's schema): offsets and bytes of placeholder strings would be wrong numbers, not missing ones.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ops.batch.requests import BatchLine
from ops.gateway.responses_api import ResponsesRequest
from ops.gateway.responses_api import response_body as responses_api_body
from schemas.jobs import ErrorEvent, FinalEvent

TerminalEvent = FinalEvent | ErrorEvent
"""What ends a job: its answer or its error (token events are never awaited: batch jobs do not stream)."""

TokenText = Callable[[int], str]
"""Token id -> the string written for it in ``logprobs`` (events carry ids only)."""


def token_id_text(token_id: int) -> str:
    """The stand-in when no tokenizer is at hand: the id itself, as vLLM's ``return_tokens_as_token_ids``."""
    return f"token_id:{token_id}"


def has_token_texts(text: TokenText) -> bool:
    """Whether ``text`` gives the tokens' real texts (a tokenizer), not :func:`token_id_text`'s stand-ins."""
    return text is not token_id_text


def _usage(event: FinalEvent) -> dict[str, Any]:
    u = event.usage
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
    }


def _chat_logprobs(choice: Any, text: TokenText) -> dict[str, Any]:
    real = has_token_texts(text)

    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        s = text(token_id)
        return {"token": s, "logprob": logprob, "bytes": list(s.encode("utf-8", "replace")) if real else None}

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
        "text_offset": offsets if has_token_texts(text) else None,
    }


def response_body(line: BatchLine, event: FinalEvent, served_model: str, text: TokenText) -> dict[str, Any]:
    """The OpenAI ``chat.completion`` / ``text_completion`` object for a job's final event: the two differ
    only in their id prefix, object name and how a choice carries its text and logprobs. ``model`` is
    ``served_model`` whatever the request named (module doc). A ``responses`` line's is a ``response``
    object (:func:`_response_object`)."""
    created = int(time.time())
    if line.kind == "responses":
        return _response_object(line, event, served_model, created)
    choices: list[dict[str, Any]]
    if line.kind == "chat":
        id_prefix, object_name = "chatcmpl", "chat.completion"
        choices = [
            {
                "index": c.index,
                "message": {"role": "assistant", "content": c.text},
                "logprobs": _chat_logprobs(c, text) if c.logprobs is not None else None,
                "finish_reason": c.finish_reason,
            }
            for c in event.choices
        ]
    else:
        id_prefix, object_name = "cmpl", "text_completion"
        choices = [
            {
                "index": c.index,
                "text": c.text,
                "logprobs": _completion_logprobs(c, text) if c.logprobs is not None else None,
                "finish_reason": c.finish_reason,
            }
            for c in event.choices
        ]
    return {
        "id": f"{id_prefix}-{event.id}",
        "object": object_name,
        "created": created,
        "model": served_model,
        "choices": choices,
        "usage": _usage(event),
        "system_fingerprint": None,
    }


def _response_object(line: BatchLine, event: FinalEvent, served_model: str, created: int) -> dict[str, Any]:
    """The Responses API's ``response`` object, as the gateway makes it: ``completed``, or ``incomplete``
    with ``max_output_tokens`` for an answer cut at its limit. The gateway's request type carries what the
    object names: its ids come from the job id's hex (``resp_<hex>``, ``msg_<hex>``: ``batch-<hex>`` read
    as the gateway's ``resp-<hex>``), its ``model`` is the served one, its echo the line's."""
    hex_id = event.id.split("-", 1)[-1]
    req = ResponsesRequest(
        "chat", served_model, {"id": f"resp-{hex_id}"}, False, False, created=created, echo=dict(line.echo or {})
    )
    return responses_api_body(req, event)


def _record_id() -> str:
    return f"batch_req_{uuid.uuid4().hex}"


def output_record(line: BatchLine, event: FinalEvent, served_model: str, text: TokenText) -> dict[str, Any]:
    body = response_body(line, event, served_model, text)
    return {
        "id": _record_id(),
        "custom_id": line.custom_id,
        "response": {"status_code": 200, "request_id": event.id, "body": body},
        "error": None,
    }


def error_record(
    custom_id: str | None,
    line_no: int,
    code: str,
    message: str,
    request_id: str | None = None,
    line_sha256: str | None = None,
) -> dict[str, Any]:
    """An errors-file line. One for a line without a usable custom_id carries ``line_sha256`` (the line's
    content key, :func:`ops.batch.files.line_sha256`): that, not ``line``, is what a resume skips it by."""
    error: dict[str, Any] = {"code": code, "message": message, "line": line_no}
    if request_id is not None:
        error["request_id"] = request_id
    if line_sha256 is not None:
        error["line_sha256"] = line_sha256
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
