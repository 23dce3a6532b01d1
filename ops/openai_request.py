"""The parts of an OpenAI request body that ``pagedq serve`` and ``pagedq batch`` read the same way.

Both front ends turn OpenAI's chat and completions bodies into job fields; they differ in what surrounds
that (the gateway answers HTTP errors and streams, a batch line has a ``custom_id`` and a stable job id), not
in what a message, a prompt or a sampling field means. Keeping those here means a field cannot be accepted
by one and silently dropped by the other. Pure functions over JSON values: no torch, no Redis (the gateway
must not load torch).
"""

from __future__ import annotations

from typing import Any

from schemas import chat_content

PASSTHROUGH_FIELDS = (
    "temperature", "top_p", "n", "stop", "seed", "presence_penalty", "frequency_penalty",
    # vLLM's extras that pagedq's engine has
    "top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos", "priority", "stop_token_ids",
    "skip_special_tokens", "response_format", "guided_regex", "guided_choice", "logit_bias",
)  # fmt: skip
"""Body fields copied onto the job as they are; the job's own validation (``schemas.jobs``) checks values."""

CHAT_ROLES = ("system", "developer", "user", "assistant")
MESSAGE_FIELDS = frozenset({"role", "content", "name"})


class RequestFieldError(ValueError):
    """A body value that cannot become a job field; ``param`` is where it is (``messages[0].content``)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


def text_content(content: Any, where: str) -> str:
    """A message's ``content`` as text (``schemas.chat_content``, the engine's rule too), its refusal as a
    :class:`RequestFieldError` at ``where``."""
    try:
        return chat_content.text_content(content, where)
    except chat_content.ContentError as exc:
        raise RequestFieldError(str(exc), exc.where) from None


def chat_messages(raw: Any, where: str = "messages") -> list[dict[str, str]]:
    """The job's ``messages``; OpenAI's newer ``developer`` role becomes ``system``, the role open models'
    chat templates know for the same thing. ``name`` is accepted and dropped: templates have no place for it."""
    if not isinstance(raw, list) or not raw:
        raise RequestFieldError(f"{where}: a non-empty list of messages is required", where)
    out = []
    for i, message in enumerate(raw):
        at = f"{where}[{i}]"
        if not isinstance(message, dict):
            raise RequestFieldError(f"{at}: must be an object", at)
        for key, value in message.items():
            # null means "not given" (an assistant message echoed back by an SDK has tool_calls: null...)
            if key not in MESSAGE_FIELDS and value is not None:
                raise RequestFieldError(f"pagedq does not support the field {key!r} in messages", f"{at}.{key}")
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise RequestFieldError(f"{at}.role: pagedq supports {', '.join(CHAT_ROLES)}; got {role!r}", at)
        content = text_content(message.get("content"), f"{at}.content")
        out.append({"role": "system" if role == "developer" else role, "content": content})
    return out


def completion_prompt(raw: Any, where: str = "prompt") -> dict[str, Any]:
    """A completions prompt as job fields: ``prompt`` (a string) or ``prompt_token_ids``, also given as a
    one-element list of either. Several prompts in one request are refused: one request is one job."""
    if isinstance(raw, list) and len(raw) == 1 and isinstance(raw[0], (str, list)):
        raw = raw[0]
    if isinstance(raw, str):
        return {"prompt": raw}
    if isinstance(raw, list) and raw and all(isinstance(t, int) and not isinstance(t, bool) for t in raw):
        return {"prompt_token_ids": raw}
    if isinstance(raw, list) and len(raw) > 1 and all(isinstance(p, (str, list)) for p in raw):
        raise RequestFieldError(f"{where}: one prompt per request (send several prompts as several requests)", where)
    raise RequestFieldError(f"{where}: one string or one list of token ids", where)


SEED_RANGE = 2**63
"""OpenAI's ``seed`` is any signed 64-bit integer; a job's is unsigned, below 2**63 (``schemas.jobs``)."""


def job_seed(seed: Any) -> Any:
    """OpenAI's ``seed`` as a job's: a negative one (``-1`` is a common "any seed" that OpenAI takes as a seed
    like any other) moved up by 2**63 into the job's range, so that it is still one fixed seed; anything
    else as it is, for the job's validation to judge (``2**64``: too large, ``"5"``: not an integer)."""
    if isinstance(seed, int) and not isinstance(seed, bool) and -SEED_RANGE <= seed < 0:
        return seed + SEED_RANGE
    return seed


def passthrough_fields(body: dict[str, Any]) -> dict[str, Any]:
    """The :data:`PASSTHROUGH_FIELDS` the body sets (JSON ``null`` means "not given", as in OpenAI's API)."""
    fields = {name: body[name] for name in PASSTHROUGH_FIELDS if body.get(name) is not None}
    if "seed" in fields:
        fields["seed"] = job_seed(fields["seed"])
    return fields


METADATA_PAIRS, METADATA_KEY_CHARS, METADATA_VALUE_CHARS = 16, 64, 512
"""OpenAI's limits on a request's ``metadata``: 16 pairs, keys of 64 characters, values of 512."""


def openai_metadata(raw: Any, where: str = "metadata") -> dict[str, str]:
    """OpenAI's ``metadata`` (string tags on the request), checked against OpenAI's limits: the job's own
    ``metadata``, echoed in its result and events."""
    if not isinstance(raw, dict):
        raise RequestFieldError(f"{where}: must be an object of string values", where)
    if len(raw) > METADATA_PAIRS:
        raise RequestFieldError(f"{where}: at most {METADATA_PAIRS} key-value pairs, got {len(raw)}", where)
    for key, value in raw.items():
        if len(key) > METADATA_KEY_CHARS:
            raise RequestFieldError(f"{where}: keys are at most {METADATA_KEY_CHARS} characters", where)
        if not isinstance(value, str):
            raise RequestFieldError(f"{where}.{key}: must be a string", where)
        if len(value) > METADATA_VALUE_CHARS:
            raise RequestFieldError(f"{where}.{key}: at most {METADATA_VALUE_CHARS} characters", where)
    return dict(raw)


TAG_FIELDS = ("user", "safety_identifier", "metadata", "prompt_cache_key")
"""Fields that tag a request rather than shape its answer: ``user`` and ``safety_identifier`` (OpenAI's newer
name for what ``user`` was) and ``metadata`` become the job's ``metadata``, ``prompt_cache_key`` its
``affinity`` (:func:`openai_tags`)."""

TAG_CHARS = 256
"""How much of ``user`` / ``safety_identifier`` the job's metadata keeps (OpenAI's ids are shorter)."""


def openai_tags(body: dict[str, Any], where: str = "") -> dict[str, Any]:
    """The job's ``metadata`` and ``affinity`` from the body's :data:`TAG_FIELDS` (``where``: the body's place,
    prefixed to the names in errors, ``body.`` in a batch line). ``metadata`` is taken as it is (OpenAI's
    limits), ``user`` and ``safety_identifier`` are added to it under their names (cut to :data:`TAG_CHARS`
    characters); ``prompt_cache_key``, "requests that share it share a cache", is what a job's affinity key
    is: jobs with the same one queue on the same shard, where one worker's prefix cache has their prefix.

    One reader for the gateway and ``pagedq batch``: a tag the one takes, the other takes the same way."""
    out: dict[str, Any] = {}
    metadata = openai_metadata(body["metadata"], f"{where}metadata") if body.get("metadata") is not None else {}
    for name in ("user", "safety_identifier"):
        value = body.get(name)
        if value is None:
            continue
        if not isinstance(value, str):
            raise RequestFieldError(f"{where}{name}: must be a string", f"{where}{name}")
        if metadata.get(name, value[:TAG_CHARS]) != value[:TAG_CHARS]:
            raise RequestFieldError(
                f"{where}metadata.{name}: the job's metadata holds the request's {name} under that key; leave it "
                f"out of metadata or give the same value",
                f"{where}metadata",
            )
        metadata[name] = value[:TAG_CHARS]
    if metadata:
        out["metadata"] = metadata
    key = body.get("prompt_cache_key")
    if key is not None:
        if not isinstance(key, str):
            raise RequestFieldError(f"{where}prompt_cache_key: must be a string", f"{where}prompt_cache_key")
        if key:  # "" asks for no particular cache: the job's own prefix makes its key
            out["affinity"] = key
    return out


def max_tokens_fields(max_tokens: Any, default_max_tokens: int) -> dict[str, Any]:
    """The job's ``max_tokens``: the client's own (``None``: not given) must fit in the model's context with
    the prompt, or the job is refused (``strict_max_tokens``; the gateway's 400 ``context_length_exceeded``,
    OpenAI's answer); the front end's default only caps a choice, which stops at the context if it gets
    there first (``finish_reason`` ``length``)."""
    if max_tokens is None:
        return {"max_tokens": default_max_tokens}
    return {"max_tokens": max_tokens, "strict_max_tokens": True}
