"""Wire models of protocol v1: the job a producer sends, the events a worker answers with, dead letters.

Everything on the wire is JSON (never pickle), so producers in any language can speak it with plain Redis
commands. Validation is strict (no ``"16"`` for ``16``, no ``true`` for ``1``) so that a malformed job is
rejected with a message naming the field instead of being half-understood.
"""

from __future__ import annotations

import json
import math
import re
import time
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt, StringConstraints, TypeAdapter, model_validator

from schemas.sampling import MAX_LOGIT_BIAS, MAX_LOGIT_BIAS_ENTRIES

if TYPE_CHECKING:
    from schemas.sampling import SamplingParams

JOB_ID_PATTERN = r"^[A-Za-z0-9._:-]{1,128}$"
MAX_METADATA_BYTES = 4096
MAX_METADATA_DEPTH = 16
"""Deepest nesting of ``metadata`` (objects and lists): deeper JSON is tiny on the wire but too deep to
serialise safely with the event it is echoed in."""
MAX_STOP_STRINGS = 16
"""Most stop strings a job may give, as in OpenAI's API."""
INT32_MAX = 2**31 - 1
MAX_SCHEMA_DEPTH = 64
"""Deepest nesting of a ``response_format`` JSON schema: the grammar compiler recurses over it."""
MAX_CHOICES = 256
SALVAGE_MAX_BYTES = 64 << 20
"""Largest payload whose id a worker still reads to answer it (an error event), however far over the job size
limit: parsing costs about as much memory again as the entry a worker already read. Beyond, dead letter only."""
SALVAGE_SCAN_STEPS = 100_000
"""Most tokens the salvage scanner (JSON nested past what ``json`` decodes) reads before giving up: a few
tens of milliseconds, and far more than a job needs (its fields, plus bracket runs and keys of a nesting of
tens of thousands of levels). A payload needing more gets a dead letter only, like an oversized one."""

DEFAULT_MAX_TOKENS = 16  # SamplingParams' default
TOKEN_JSON_BYTES = 24  # a token's text (a few characters, escaped) and id, in the final and its token event
LOGPROB_JSON_BYTES = 40  # {"token_id":12345,"logprob":-1.2345678}, for the sampled token and each alternative

JobId = Annotated[str, StringConstraints(pattern=JOB_ID_PATTERN)]
TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]
TokenIdKey = Annotated[str, StringConstraints(pattern=r"^(0|[1-9][0-9]{0,9})$")]
"""A token id as a JSON object key (``logit_bias``): a decimal string."""
ReplyTo = Annotated[str, StringConstraints(min_length=1, max_length=256, pattern=r"^\S+$")]

SAMPLING_FIELDS: tuple[str, ...] = (
    "n",
    "max_tokens",
    "min_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "logprobs",
    "skip_special_tokens",
)
"""Job fields passed through, flat, to the engine's ``SamplingParams`` (``logit_bias`` too, its keys made ints)."""

FinishReason = Literal["stop", "length", "cancelled", "deadline"]
ErrorCode = Literal[
    "invalid_request",
    "prompt_too_long",
    "deadline_exceeded",
    "cancelled",
    "dead_lettered",
    "entry_id_in_future",
    "internal",
]


class InvalidJob(ValueError):
    """A job payload that cannot be run; ``message`` is safe to send back to the producer."""

    def __init__(self, message: str, code: ErrorCode = "invalid_request") -> None:
        super().__init__(message)
        self.message = message
        self.code: ErrorCode = code


class ChatMessage(BaseModel):
    """One chat turn; the model's chat template turns a list of these into the prompt."""

    model_config = ConfigDict(extra="forbid", strict=True)

    role: Annotated[str, StringConstraints(min_length=1, max_length=64)]
    content: str


class JsonSchemaFormat(BaseModel):
    """OpenAI's ``response_format.json_schema``: the schema the output must validate against. ``name``
    and ``strict`` are accepted for compatibility; the output is always held to the schema."""

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)

    name: Annotated[str, StringConstraints(min_length=1, max_length=64)] = "response"
    description: str | None = None
    # "schema" would shadow BaseModel.schema(); on the wire it is "schema".
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's ``response_format``: ``{"type": "json_schema", "json_schema": {...}}``, ``{"type":
    "json_object"}`` (any JSON object) or ``{"type": "text"}`` (no constraint)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_iff_json_schema(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError('json_schema is required with type "json_schema", and only then')
        if self.json_schema is not None:
            depth = json_depth(self.json_schema.schema_, MAX_SCHEMA_DEPTH + 1)
            if depth > MAX_SCHEMA_DEPTH:
                raise ValueError(f"json_schema.schema is nested more than {MAX_SCHEMA_DEPTH} levels deep")
            if (why := unheld_schema_keyword(self.json_schema.schema_)) is not None:
                raise ValueError(f"json_schema.schema: {why}")
        return self

    def json_schema_value(self) -> dict[str, Any] | None:
        """The schema SamplingParams gets: the given one, any JSON object for json_object, None for text."""
        if self.type == "json_object":
            return {"type": "object"}
        return None if self.json_schema is None else self.json_schema.schema_


class JobRequest(BaseModel):
    """A job as producers put it in field ``job`` of an entry of a job stream ``<ns>:jobs:{<queue>:<k>}``.

    Sampling fields left out take the engine's defaults; ranges here are the wire contract, and the
    engine's ``SamplingParams`` re-checks its own invariants when the worker builds it.
    """

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    id: JobId
    prompt: Annotated[str, StringConstraints(min_length=1)] | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    prompt_token_ids: Annotated[list[TokenId], Field(min_length=1)] | None = None

    n: Annotated[int, Field(ge=1, le=64)] | None = None
    max_tokens: Annotated[int, Field(ge=1, le=INT32_MAX)] | None = None
    # True: refuse (prompt_too_long) a job whose prompt plus max_tokens overflows the model's context, as
    # OpenAI's API does, instead of stopping it at the context with finish_reason "length".
    strict_max_tokens: bool | None = None
    min_tokens: Annotated[int, Field(ge=0, le=INT32_MAX)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=100.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=-1, le=INT32_MAX)] | None = None
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0, le=100.0)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    seed: Annotated[int, Field(ge=0, le=2**63 - 1)] | None = None
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stop_token_ids: Annotated[list[TokenId], Field(max_length=64)] | None = None
    ignore_eos: bool | None = None
    logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    # OpenAI's logit_bias: token ids as JSON object keys (decimal strings), values -100 to 100.
    logit_bias: (
        Annotated[
            dict[TokenIdKey, Annotated[float, Field(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS)]],
            Field(max_length=MAX_LOGIT_BIAS_ENTRIES),
        ]
        | None
    ) = None
    skip_special_tokens: bool | None = None
    # Structured output (at most one): OpenAI's response_format, and vLLM's guided_regex / guided_choice.
    response_format: ResponseFormat | None = None
    guided_regex: Annotated[str, StringConstraints(min_length=1)] | None = None
    guided_choice: (
        Annotated[list[Annotated[str, StringConstraints(min_length=1)]], Field(min_length=1, max_length=MAX_CHOICES)]
        | None
    ) = None

    stream: bool = True
    reply_to: ReplyTo | None = None
    priority: Annotated[int, Field(ge=-INT32_MAX, le=INT32_MAX)] = 0
    # Which shard of a sharded queue the job goes to (schemas/affinity.py); jobs sharing one go to the same
    # worker's prefix cache. Read by producers only: a worker takes a job from whichever shard it is on.
    affinity: Annotated[str, StringConstraints(min_length=1, max_length=1024)] | None = None
    timeout_s: Annotated[float, Field(gt=0.0)] | None = None
    submitted_at: Annotated[float, Field(ge=0.0, le=1e11)] | None = None
    metadata: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _one_prompt_and_small_metadata(self) -> JobRequest:
        given = [f for f in ("prompt", "messages", "prompt_token_ids") if getattr(self, f) is not None]
        if len(given) != 1:
            raise ValueError(
                "exactly one of prompt, messages, prompt_token_ids is required, got " + (", ".join(given) or "none")
            )
        if self.metadata is not None:
            depth = json_depth(self.metadata, MAX_METADATA_DEPTH + 1)
            if depth > MAX_METADATA_DEPTH:
                raise ValueError(f"metadata is nested more than {MAX_METADATA_DEPTH} levels deep")
            try:
                encoded = json.dumps(self.metadata, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
            except (ValueError, TypeError) as exc:  # TypeError: a non-JSON value (a datetime...) built in Python
                raise ValueError(f"metadata is not valid JSON: {exc}") from exc
            size = len(encoded.encode())
            if size > MAX_METADATA_BYTES:
                raise ValueError(f"metadata is {size} bytes of JSON, the limit is {MAX_METADATA_BYTES}")
        constraints = [f for f in ("response_format", "guided_regex", "guided_choice") if getattr(self, f) is not None]
        if self.response_format is not None and self.response_format.type == "text":
            constraints.remove("response_format")
        if len(constraints) > 1:
            raise ValueError(
                f"at most one of response_format, guided_regex, guided_choice, got {', '.join(constraints)}"
            )
        if isinstance(self.stop, str) and not self.stop:
            raise ValueError("stop must not be empty")
        return self

    def result_bytes_bound(self, max_model_len: int) -> int:
        """An upper estimate of this job's result in bytes of JSON, before it runs: every choice at its
        token limit (``max_tokens``, or the model's context), each token with its text, id and, when asked,
        its logprob and ``logprobs`` alternatives. Workers refuse jobs above their ``max_result_bytes``: the
        result is stored twice (result key and reply stream) and held in memory until it is written."""
        tokens = min(self.max_tokens or DEFAULT_MAX_TOKENS, max_model_len)
        per_token = TOKEN_JSON_BYTES
        if self.logprobs is not None:
            per_token += LOGPROB_JSON_BYTES * (1 + self.logprobs)
        return (self.n or 1) * tokens * per_token

    def sampling_kwargs(self) -> dict[str, Any]:
        """The sampling fields the producer set, for ``SamplingParams(**kwargs)``."""
        kwargs = {f: getattr(self, f) for f in SAMPLING_FIELDS if getattr(self, f) is not None}
        if self.response_format is not None and (schema := self.response_format.json_schema_value()) is not None:
            kwargs["json_schema"] = schema
        if self.guided_regex is not None:
            kwargs["regex"] = self.guided_regex
        if self.guided_choice is not None:
            kwargs["choice"] = list(self.guided_choice)
        if self.logit_bias:
            kwargs["logit_bias"] = {int(token): bias for token, bias in self.logit_bias.items()}
        return kwargs

    def sampling_params(self) -> SamplingParams:
        """Build the engine's ``SamplingParams``; its own validation errors become :class:`InvalidJob`."""
        from pydantic import ValidationError

        from schemas.sampling import SamplingParams

        try:
            return SamplingParams(**self.sampling_kwargs())
        except ValidationError as exc:
            raise InvalidJob(describe_validation_error(exc)) from exc
        except (ValueError, TypeError) as exc:
            raise InvalidJob(str(exc)) from exc

    def to_json(self) -> str:
        """Compact JSON with unset optional fields left out, as producers should send it."""
        return self.model_dump_json(exclude_none=True, exclude_defaults=True, by_alias=True)


def json_depth(value: Any, limit: int) -> int:
    """Nesting depth of a decoded JSON value (a scalar is 0), counted up to ``limit`` and no further, so
    a hostile value costs at most ``limit`` levels of work (and no recursion)."""
    depth = 0
    level = [value]
    while level and depth < limit:
        children: list[Any] = []
        for item in level:
            if isinstance(item, dict):
                children.extend(item.values())
            elif isinstance(item, list):
                children.extend(item)
        if not children and not any(isinstance(item, (dict, list)) for item in level):
            break
        depth += 1
        level = children
    return depth


# Subschemas a JSON schema holds, by where they sit: one schema, a list of them, or a map of names to them.
_SCHEMA_KEYWORDS = ("items", "additionalProperties", "additionalItems", "unevaluatedProperties", "propertyNames")
_SCHEMA_LIST_KEYWORDS = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
_SCHEMA_MAP_KEYWORDS = ("properties", "patternProperties", "$defs", "definitions")
# Keywords the grammar compiler (xgrammar 0.2.9) drops or loosens: with them, an output the grammar allows
# could still fail the schema (checked string by string against jsonschema), so a schema using them is
# refused rather than silently held to less than it says, as vLLM refuses them for xgrammar.
_UNHELD_KEYWORDS = {
    "not": "negation",
    "if": "conditional subschemas",
    "then": "conditional subschemas",
    "else": "conditional subschemas",
    "dependentRequired": "dependencies between properties",
    "dependentSchemas": "dependencies between properties",
    "dependencies": "dependencies between properties",
    "contains": "array containment",
    "minContains": "array containment",
    "maxContains": "array containment",
}


def unheld_schema_keyword(schema: Any) -> str | None:
    """Why structured output cannot hold its output to ``schema`` (a decoded JSON schema), or None.

    The grammar compiler ignores some keywords and loosens others, and then the output can violate the
    schema it was constrained by: ``not``, ``if``/``then``/``else``, ``dependentRequired`` (and the other
    dependencies), ``contains``, ``uniqueItems: true``, ``multipleOf`` on a non-integer, ``allOf`` of
    more than one schema (one is inlined), ``required`` naming a property ``properties`` does not
    declare; and an empty ``anyOf`` / ``oneOf`` lets the output be empty. Only schema positions are
    walked (a ``const``, ``enum`` or ``default`` value is data, whatever keys it has), without recursion:
    the offline API's schemas have no depth limit."""
    stack: list[tuple[Any, str]] = [(schema, "the root")]
    while stack:
        node, where = stack.pop()
        if not isinstance(node, dict):
            continue
        for keyword, what in _UNHELD_KEYWORDS.items():
            if keyword in node:
                return f"{keyword!r} ({what}, at {where}) is not supported: the output could not be held to it"
        if node.get("uniqueItems") is True:
            return f"'uniqueItems' (at {where}) is not supported: the output could not be held to it"
        if "multipleOf" in node and node.get("type") != "integer":
            return f'\'multipleOf\' (at {where}) is supported with "type": "integer" only'
        all_of = node.get("allOf")
        if isinstance(all_of, list) and len(all_of) > 1:
            return f"'allOf' of {len(all_of)} schemas (at {where}) is not supported: give one schema, merged"
        for keyword in ("anyOf", "oneOf"):
            if node.get(keyword) == []:
                return f"{keyword!r} (at {where}) is empty: no output could match it"
        required, properties = node.get("required"), node.get("properties")
        if isinstance(required, list) and required:
            declared = properties if isinstance(properties, dict) else {}
            missing = [name for name in required if name not in declared]
            if missing:
                return f"'required' (at {where}) names {missing[0]!r}, which 'properties' does not declare"
        for keyword in _SCHEMA_KEYWORDS:
            if isinstance(node.get(keyword), dict):
                stack.append((node[keyword], f"{where} > {keyword}"))
        for keyword in _SCHEMA_LIST_KEYWORDS:
            if isinstance(node.get(keyword), list):
                stack.extend((sub, f"{where} > {keyword}[{i}]") for i, sub in enumerate(node[keyword]))
        for keyword in _SCHEMA_MAP_KEYWORDS:
            if isinstance(node.get(keyword), dict):
                stack.extend((sub, f"{where} > {keyword} > {name}") for name, sub in node[keyword].items())
    return None


def describe_validation_error(exc: Any, limit: int = 3) -> str:
    """A short one-line description of a pydantic ``ValidationError`` (field path and message)."""
    parts = []
    for err in exc.errors()[:limit]:
        loc = ".".join(str(p) for p in err.get("loc", ())) or "job"
        parts.append(f"{loc}: {err.get('msg', 'invalid')}")
    more = exc.error_count() - limit
    if more > 0:
        parts.append(f"and {more} more")
    return "; ".join(parts)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


class DuplicateMember(ValueError):
    """A JSON object names one member twice: valid JSON, but which value was meant cannot be known."""


def _unique_members(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """An object whose member names are unique. JSON allows a name twice; Python's ``json`` then keeps the
    last value without a word, so ``{"id": "b3", ..., "id": "b4"}`` would run as b4 while its producer waits
    on b3. Which one was meant cannot be known: the job is refused."""
    members: dict[str, Any] = {}
    for key, value in pairs:
        if key in members:
            raise DuplicateMember(f"member {key!r} appears twice in one object")
        members[key] = value
    return members


def loads_strict(raw: str | bytes) -> Any:
    """``json.loads`` that refuses NaN and Infinity, which Python accepts but JSON does not have, and a
    member name given twice in one object (:func:`_unique_members`). A leading byte order mark is skipped,
    as RFC 8259 lets a reader do (Windows tools write one; ``json`` refuses it in a ``str``)."""
    if isinstance(raw, str):
        raw = raw.removeprefix("\ufeff")
    return json.loads(raw, parse_constant=_reject_constant, object_pairs_hook=_unique_members)


_INT_DIGITS = re.compile(r"integer string conversion: value has (\d+) digits")


def long_integer_problem(exc: ValueError) -> str | None:
    """What is wrong, when ``json`` refused a text for Python's integer-length guard (over 4300 digits); None
    for any other reason. The guard's own message points at ``sys.set_int_max_str_digits()``, a setting of
    the reader's interpreter, which is no help to whoever sent the JSON."""
    if match := _INT_DIGITS.search(str(exc)):
        return f"an integer of {match.group(1)} digits is out of range for every field"
    return None


def _utf8(raw: str | bytes) -> bytes:
    """The payload's bytes; a worker decodes with ``surrogateescape`` so invalid UTF-8 survives to here."""
    return raw.encode("utf-8", "surrogateescape") if isinstance(raw, str) else raw


def parse_job(raw: str | bytes, max_bytes: int) -> JobRequest:
    """Decode and validate a job payload; every failure is an :class:`InvalidJob` with a clear message."""
    from pydantic import ValidationError

    data_bytes = _utf8(raw)
    if len(data_bytes) > max_bytes:
        raise InvalidJob(f"job payload is {len(data_bytes)} bytes, the limit is {max_bytes}")
    try:
        text = data_bytes.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidJob(f"job is not valid UTF-8: {exc.reason} at byte {exc.start}") from exc
    try:
        data = loads_strict(text)
    except DuplicateMember as exc:
        raise InvalidJob(f"job JSON is ambiguous: {exc}") from exc
    except ValueError as exc:
        raise InvalidJob(f"job is not valid JSON: {long_integer_problem(exc) or exc}") from exc
    except RecursionError as exc:
        raise InvalidJob("job JSON is nested too deeply") from exc
    if not isinstance(data, dict):
        raise InvalidJob(f"job must be a JSON object, got {type(data).__name__}")
    if "id" not in data:
        raise InvalidJob("job has no id")
    try:
        request = JobRequest.model_validate(data)
    except ValidationError as exc:
        raise InvalidJob(describe_validation_error(exc)) from exc
    except RecursionError as exc:  # absurdly nested JSON
        raise InvalidJob("job is nested too deeply") from exc
    # The engine's own invariants (min_tokens <= max_tokens...) are checked here too, so that a payload is
    # either runnable or unusable when it is read: an unusable one is dead-lettered even when its id is
    # already taken, instead of passing as a "duplicate" because the check came after the id lookup.
    request.sampling_params()
    return request


def salvage_reply_target(raw: str | bytes, max_bytes: int) -> tuple[str, str | None] | None:
    """From a job that failed validation, recover ``(id, reply_to)``: the id if it is itself valid, and
    ``reply_to`` only if that is valid too (None otherwise: the job's own reply stream is used).

    Lets the worker send an ``error`` event to a producer whose job had, say, a bad ``temperature`` or a
    malformed ``reply_to``; returns None when no id can be trusted (the job then only goes to the
    dead-letter stream).

    The payload is read leniently (:func:`_salvage_members`): a job refused for ``NaN``, an integer too long
    for Python, or nesting too deep for ``json`` still has an id its producer waits on.
    """
    data_bytes = _utf8(raw)
    if len(data_bytes) > max(8 * max_bytes, SALVAGE_MAX_BYTES):  # an oversized job is still answered, within reason
        return None
    members = _salvage_members(data_bytes.decode("utf-8", "replace").removeprefix("\ufeff"))
    if members is None:
        return None
    job_id = members.get("id")
    if not _valid(_JOB_ID, job_id):
        return None
    reply_to = members.get("reply_to")
    return str(job_id), str(reply_to) if _valid(_REPLY_TO, reply_to) else None


_SALVAGED = ("id", "reply_to")
# Lenient where the strict loader refuses what a producer's JSON library may well write. json's defaults
# already decode NaN and (-)Infinity (as floats); _LENIENT also decodes integers as floats, so a 5000-digit
# one costs a float() instead of tripping Python's int-string limit (ValueError). Neither field salvage
# reads is a number. It is the second try only: a Python call per integer makes it ~4x slower than json's
# defaults on a payload of token ids.
_AMBIGUOUS = object()
"""A salvaged member given twice with different values: neither can be trusted (``_valid`` refuses it)."""


def _salvaged_value(members: dict[str, Any], key: str, value: Any) -> Any:
    """What ``members[key]`` becomes when ``key`` comes (again) with ``value``: the value, but
    :data:`_AMBIGUOUS` for a salvaged member given twice with different values (the strict loader refuses the
    job for it; its error must not go to either id). Once ambiguous it stays so: _AMBIGUOUS equals no value."""
    return _AMBIGUOUS if key in _SALVAGED and key in members and members[key] != value else value


def _salvage_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """An object as ``json`` builds it, salvaged members by :func:`_salvaged_value`."""
    members: dict[str, Any] = {}
    for key, value in pairs:
        members[key] = _salvaged_value(members, key, value)
    return members


_DEFAULT = json.JSONDecoder(object_pairs_hook=_salvage_pairs)
_LENIENT = json.JSONDecoder(parse_int=float, object_pairs_hook=_salvage_pairs)
_WHITESPACE = re.compile(r"[ \t\n\r]*")  # json's
_NESTED_TOKEN = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|[\[{]+|[\]}]+|[^"\[\]{}]+', re.DOTALL)
"""A token of a value the scanner skips: a whole string (brackets in it do not count), a run of openers,
a run of closers (a run is one step, so ``[[[[...`` costs nothing per level), or anything else."""
_CLOSER = bytes.maketrans(b"[{", b"]}")


def _salvage_members(text: str) -> dict[str, Any] | None:
    """The ``id`` and ``reply_to`` members (those present) of the JSON object ``text``, or None when it is
    not one, even read leniently.

    ``json`` reads it first (C speed, linear; twice at most). Only when it gives up on depth
    (``RecursionError``: metadata nested past the interpreter's limit) does an iterative scan of the
    top-level object take over (:func:`_scan_top_level`). Not a regular expression for ``"id"`` over the
    whole payload: that would find ids inside strings and nested objects too, and the last ``"id"``
    member wins, as in ``json``, so the scan must know where each top-level member starts and ends.
    """
    for decoder in (_DEFAULT, _LENIENT):
        try:
            data = decoder.decode(text)
        except ValueError:
            continue  # maybe an integer too long for int(): the next decoder reads it as a float
        except RecursionError:
            return _scan_top_level(text)
        if not isinstance(data, dict):
            return None
        return {key: data[key] for key in _SALVAGED if key in data}
    return None


def _scan_top_level(text: str) -> dict[str, Any] | None:
    """:func:`_salvage_members` for JSON too deep for ``json``, without recursion and in at most
    :data:`SALVAGE_SCAN_STEPS` steps: the top-level object is walked member by member, each value decoded
    by ``json`` (C), and a value too deep for it skipped by matching its brackets (:func:`_skip_nested`).
    A skipped value's scalars are not checked: it is never used, and its brackets and strings must still
    balance, so where each top-level member starts is read right."""
    steps = SALVAGE_SCAN_STEPS
    found: dict[str, Any] = {}
    i = _skip_ws(text, 0)
    if text[i : i + 1] != "{":
        return None
    i = _skip_ws(text, i + 1)
    if text[i : i + 1] == "}":
        i += 1
    else:
        while True:
            steps -= 1
            if steps < 0 or text[i : i + 1] != '"':
                return None
            try:
                key, i = _LENIENT.raw_decode(text, i)  # a string: the opening quote is checked above
            except ValueError:
                return None
            i = _skip_ws(text, i)
            if text[i : i + 1] != ":":
                return None
            i = _skip_ws(text, i + 1)
            try:
                value, i = _LENIENT.raw_decode(text, i)
            except ValueError:
                return None
            except RecursionError:
                value = None
                end = _skip_nested(text, i, steps)
                if end is None:
                    return None
                i, steps = end
            if key in _SALVAGED:
                found[key] = _salvaged_value(found, key, value)
            i = _skip_ws(text, i)
            sep = text[i : i + 1]
            i = _skip_ws(text, i + 1)
            if sep == "}":
                break
            if sep != ",":
                return None
    return found if _skip_ws(text, i) == len(text) else None


def _skip_ws(text: str, pos: int) -> int:
    match = _WHITESPACE.match(text, pos)
    return pos if match is None else match.end()  # never None: the pattern matches the empty string


def _skip_nested(text: str, start: int, steps: int) -> tuple[int, int] | None:
    """(end of the array or object at ``start``, steps left), or None when its brackets or strings do not
    balance before the text, or ``steps``, run out. Openers not yet closed are kept in a bytearray (one
    byte a level, at most the payload's size), never on the call stack."""
    opened = bytearray()
    pos = start
    while steps > 0:
        steps -= 1
        match = _NESTED_TOKEN.match(text, pos)
        if match is None:  # an unterminated string
            return None
        token = match.group()
        if token[0] in "[{":
            opened += token.encode()
        elif token[0] in "]}":
            n = min(len(token), len(opened))
            if opened[len(opened) - n :].translate(_CLOSER)[::-1] != token[:n].encode():
                return None  # a ] closing a {, or the reverse
            del opened[len(opened) - n :]
            if not opened:
                return match.start() + n, steps
        pos = match.end()
    return None


_JOB_ID: TypeAdapter[str] = TypeAdapter(JobId)
_REPLY_TO: TypeAdapter[str] = TypeAdapter(ReplyTo)


def _valid(adapter: TypeAdapter[str], value: Any) -> bool:
    try:
        adapter.validate_python(value, strict=True)
    except ValueError:
        return False
    return True


# ---------------------------------------------------------------------------------------------- events


class _Event(BaseModel):
    # Readers ignore fields they do not know, so later protocol versions can add some.
    model_config = ConfigDict(extra="ignore")

    def to_json(self) -> str:
        return self.model_dump_json(exclude_none=True)


class TokenEvent(_Event):
    """New output of one choice during one engine step (several tokens may be coalesced)."""

    type: Literal["token"] = "token"
    id: str
    attempt: int
    index: int
    text: str
    token_ids: list[int]
    # The logprobs of exactly these tokens, in order, when the job asked for logprobs (else absent). Added
    # after protocol v2's first workers: a reader must not count on it (an older worker sends logprobs in
    # the final event only), and an older reader ignores it.
    logprobs: list[Logprob] | None = None
    # With logprobs, where each of these tokens' text starts in the choice's text, counting text the worker
    # still holds back for a stop string: with one, an event's ``text`` is not its tokens' text (it lags by
    # up to the longest stop string's length), and these place each token's logprob against the text (the
    # gateway's ``text_offset`` and the chunk a token's logprob goes out with). Added after ``logprobs``;
    # absent from older workers.
    text_offsets: list[NonNegativeInt] | None = None


class TopLogprob(BaseModel):
    # A logprob is finite (the engine leaves masked alternatives out): NaN or infinity is a forged event,
    # which readers skip, rather than a value the gateway would write out as invalid JSON.
    model_config = ConfigDict(allow_inf_nan=False)

    token_id: int
    logprob: float


class Logprob(BaseModel):
    """Log-probability of one sampled token and the most likely alternatives at its position."""

    model_config = ConfigDict(allow_inf_nan=False)  # as TopLogprob

    token_id: int
    logprob: float
    top: list[TopLogprob] = Field(default_factory=list)


class Choice(BaseModel):
    index: int
    text: str
    token_ids: list[int]
    finish_reason: FinishReason
    logprobs: list[Logprob] | None = None


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0


class Timings(BaseModel):
    """Seconds, all counted from the job's stream entry time (the Redis server clock)."""

    queued_s: float
    ttft_s: float | None = None
    total_s: float


class FinalEvent(_Event):
    """The successful terminal event; also stored at ``<ns>:result:<id>``."""

    type: Literal["final"] = "final"
    id: str
    attempt: int
    choices: list[Choice]
    usage: Usage
    timings: Timings
    metadata: dict[str, Any] | None = None
    worker: str

    @property
    def text(self) -> str:
        """Text of the first choice, for the common ``n == 1`` case."""
        return self.choices[0].text if self.choices else ""


class ErrorEvent(_Event):
    """The failing terminal event; also stored at ``<ns>:result:<id>``."""

    type: Literal["error"] = "error"
    id: str
    attempt: int
    code: ErrorCode
    message: str
    metadata: dict[str, Any] | None = None
    worker: str | None = None


Event = Annotated[TokenEvent | FinalEvent | ErrorEvent, Field(discriminator="type")]
TerminalEvent = FinalEvent | ErrorEvent
_EVENT = TypeAdapter[TokenEvent | FinalEvent | ErrorEvent](Event)


def parse_event(raw: str | bytes) -> TokenEvent | FinalEvent | ErrorEvent:
    """Decode one event as found in field ``event`` of a reply stream entry or in a result key."""
    return _EVENT.validate_json(raw)


# ------------------------------------------------------------------------------------------ dead letters


class DeadLetter(BaseModel):
    """An entry of ``<ns>:dead:<queue>``: the raw job and why it was given up on.

    Stored as flat stream fields (strings) so operators can read it with ``XRANGE`` and re-queue the
    ``job`` field as is, unless it was cut (``job_bytes`` larger than ``job``'s length in bytes).
    """

    job: str
    reason: str
    code: str
    attempts: int
    worker: str
    job_id: str = ""
    entry_id: str = ""
    job_bytes: int = 0  # length of the whole payload: more than ``job`` holds when it was cut
    job_sha256: str = ""  # of the whole payload
    ts_ms: int = Field(default_factory=lambda: int(time.time() * 1000))

    def to_fields(self) -> dict[str, str]:
        return {k: str(v) for k, v in self.model_dump().items()}

    @classmethod
    def from_fields(cls, fields: dict[str, str]) -> DeadLetter:
        return cls.model_validate(fields, strict=False)

    @property
    def truncated(self) -> bool:
        """Whether ``job`` is only the start of the payload (it cannot be re-queued as is)."""
        return self.job_bytes > len(self.job.encode("utf-8", "surrogateescape"))


def finite_or_none(value: float | None) -> float | None:
    """Round a timing for the wire; NaN/inf (clock trouble) become None rather than invalid JSON."""
    if value is None or not math.isfinite(value):
        return None
    return round(value, 6)
