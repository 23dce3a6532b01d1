"""Raw job-stream entries for the fuzz test of a live worker (issue #17), and what each one must lead to.

The worker's own parser is never the oracle: an entry is built from a valid job by mutations whose effect
the generator knows (each field written carries a :data:`Validity`), and what the entry must lead to
(:class:`Expect`) follows from the rules of wire protocol v1. Whether an entry has a *readable id* is
decided separately from its raw bytes (:func:`readable_ids`), by the protocol's definition: a ``job`` field
holding a JSON object whose ``id`` is a string of ``[A-Za-z0-9._:-]{1,128}``. Where the protocol leaves the
answer open (duplicate keys, a BOM, NaN, invalid UTF-8 outside the id, nesting deeper than a parser goes)
the id is only *possible*, and only the properties that hold either way are checked for it.

Strategies produce :class:`Draft` values with symbolic ids and ``reply_to`` targets (fresh, a duplicate
of an earlier id, a victim's stream...); :class:`World` turns them into bytes, so one hypothesis strategy
serves any namespace and the ids stay unique or repeat exactly where the draft says so.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

from hypothesis import strategies as st

VOCAB_SIZE = 512
"""Vocabulary of the tiny test models (tests/tiny_models.py): token ids at or above it are invalid."""
MAX_NUM_SEQS = 4
"""``max_num_seqs`` of the fuzzed worker: ``n`` above it is invalid."""
INT32_MAX = 2**31 - 1
MAX_PAYLOAD_BYTES = 1 << 20
"""The worker's default ``max_payload_bytes``."""
ID_RE = re.compile(r"[A-Za-z0-9._:-]{1,128}")
GRANTED_PREFIX = "fzreply:"
"""The ``reply_prefixes`` the fuzzed worker is started with: a prefix outside its namespace."""
FUTURE_ENTRY_ID = "9999999999999-0"
JOB = b"job"

Validity = Literal["valid", "invalid", "unsure"]
"""What a field value (or a whole payload) is under the protocol: ``unsure`` where it may go either way
(poison values a worker may run or refuse, spellings the protocol does not settle)."""


def combine(values: Iterable[Validity]) -> Validity:
    """The validity of a payload from its parts: one invalid part makes it invalid."""
    out: Validity = "valid"
    for v in values:
        if v == "invalid":
            return "invalid"
        if v == "unsure":
            out = "unsure"
    return out


@dataclass(frozen=True)
class Raw:
    """A JSON fragment written as is: numbers JSON allows but ``json.dumps`` never writes (``1e400``,
    ``-0``), literals it must not contain (``NaN``), nesting deeper than ``json.dumps`` recurses."""

    text: str


def dumps(obj: Any, *, ascii_only: bool = True, indent: int | None = None) -> str:
    """``json.dumps`` with :class:`Raw` fragments spliced in verbatim."""
    raws: list[str] = []

    def sub(o: Any) -> Any:
        if isinstance(o, Raw):
            raws.append(o.text)
            return f"\x00RAW{len(raws) - 1}\x00"
        if isinstance(o, dict):
            return {k: sub(v) for k, v in o.items()}
        if isinstance(o, list):
            return [sub(v) for v in o]
        return o

    separators = (",", ":") if indent is None else (",", ": ")
    text = json.dumps(sub(obj), ensure_ascii=ascii_only, indent=indent, separators=separators)
    for i, raw in enumerate(raws):
        text = text.replace(json.dumps(f"\x00RAW{i}\x00"), raw)
    return text


# ------------------------------------------------------------------------------------------- drafts


@dataclass(frozen=True)
class Mutation:
    """Set (or, with ``value`` :data:`DROP`, remove) one field of a job; ``validity`` of the result."""

    field: str
    value: Any
    validity: Validity
    name: str


DROP = Raw("<drop>")
"""Marker value of a :class:`Mutation` that removes its field."""

IdSpec = tuple[str, Any]
"""("fresh", None) | ("dup", k) | ("victim_done", k) | ("odd_valid", id) | ("bad", value) | ("missing", None)"""
ReplySpec = tuple[str, Any]
"""("absent", None) | ("own", None) | ("granted_fresh", suffix) | ("either", (name, k)) | ("refused", name) |
("refused_literal", value) | ("bad", value) | ("null", None); see :data:`EITHER_NAMES` and the catalogues."""


@dataclass(frozen=True)
class Draft:
    """A job before the world gives it an id and a reply target: its fields (with the validity of
    each), then how it goes on the wire and into the stream entry."""

    body: dict[str, Any]
    labels: dict[str, Validity]
    mutations: tuple[str, ...]
    id_spec: IdSpec
    reply: ReplySpec
    wire: tuple[str, Any] = ("compact", None)
    shape: tuple[str, Any] = ("job", None)


PROMPT_KINDS = ("prompt", "messages", "prompt_token_ids")
INT_FIELDS = ("max_tokens", "min_tokens", "top_k", "seed", "logprobs", "n", "priority")
FLOAT_FIELDS = (
    "temperature",
    "top_p",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "timeout_s",
)
BOOL_FIELDS = ("ignore_eos", "skip_special_tokens", "stream")
NULL_INVALID = ("stream", "priority")
"""Fields without ``null`` in their type (every other optional field takes ``null`` as "not set")."""

_chars = st.characters(exclude_categories=["Cs"])
_short_text = st.text(_chars, min_size=1, max_size=40)
_small_json: st.SearchStrategy[Any] = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(10**6), 10**6),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(_chars, max_size=10),
)
_metadata = st.dictionaries(st.text(_chars, max_size=6), _small_json, max_size=3)


_ROLES = st.sampled_from(["user", "system", "assistant"]) | st.text(_chars, min_size=1, max_size=8)
_PROMPTS: dict[str, st.SearchStrategy[Any]] = {
    "prompt": _short_text,
    "messages": st.lists(
        st.fixed_dictionaries({"role": _ROLES, "content": st.text(_chars, max_size=40)}), min_size=1, max_size=3
    ),
    "prompt_token_ids": st.lists(st.integers(0, VOCAB_SIZE - 1), min_size=1, max_size=24),
}
_OPTIONAL: dict[str, st.SearchStrategy[Any]] = {
    "min_tokens": st.integers(0, 1),
    "temperature": st.sampled_from([0, 0.0, 0.7, 1, 2.5, 100]) | st.floats(0, 2),
    "top_p": st.floats(0.05, 1.0),
    "top_k": st.integers(-1, 64),
    "min_p": st.floats(0, 1),
    "repetition_penalty": st.floats(0.5, 2),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "seed": st.integers(0, 2**63 - 1),
    "stop": st.text(_chars, min_size=1, max_size=4) | st.lists(st.text(_chars, min_size=1, max_size=4), max_size=3),
    "stop_token_ids": st.lists(st.integers(0, VOCAB_SIZE - 1), max_size=4),
    "ignore_eos": st.booleans(),
    "logprobs": st.integers(0, 5),
    "skip_special_tokens": st.booleans(),
    "n": st.integers(1, 2),
    "stream": st.booleans(),
    "priority": st.integers(-INT32_MAX, INT32_MAX),
    "timeout_s": st.floats(900, 1e6),  # beyond any run: only the poison list has tight deadlines
    "metadata": _metadata,
}
_OPTIONAL_NAMES = st.lists(st.sampled_from(sorted(_OPTIONAL)), max_size=5, unique=True)


@st.composite
def valid_bodies(draw: st.DrawFn) -> dict[str, Any]:
    """A valid job without ``id``/``reply_to``: short prompts, ``max_tokens <= 4`` (every valid job is cheap)."""
    kind = draw(st.sampled_from(PROMPT_KINDS))
    body: dict[str, Any] = {kind: draw(_PROMPTS[kind]), "max_tokens": draw(st.integers(1, 4))}
    for name in draw(_OPTIONAL_NAMES):
        body[name] = draw(_OPTIONAL[name])
    return body


def _set(name: str, values: st.SearchStrategy[Any], validity: Validity, what: str) -> st.SearchStrategy[Mutation]:
    return values.map(lambda v: Mutation(name, v, validity, f"{name}:{what}"))


_wrong_for_int = st.one_of(
    st.text(max_size=4),
    st.booleans(),
    st.sampled_from([0.5, 1.5, -2.25, 3.75]),
    st.lists(st.integers(0, 3), max_size=2),
    st.dictionaries(st.text(max_size=2), st.integers(), max_size=1),
)
_wrong_for_float = st.one_of(
    st.text(max_size=4), st.booleans(), st.lists(st.floats(0, 1), max_size=2), st.just({"v": 1})
)
_wrong_for_bool = st.one_of(st.integers(0, 2), st.sampled_from(["true", "false", ""]), st.just([True]))

OUT_OF_RANGE: dict[str, list[Any]] = {
    "max_tokens": [0, -1, 2**31, 2**64, -(2**63)],
    "min_tokens": [-1, 2**31],
    "temperature": [-0.001, 100.001, 1e308, -1e308, Raw("1e400")],
    "top_p": [0, -0.5, 1.0000001, 1e308, Raw("-1e400")],
    "top_k": [-2, -(2**40), 2**31],
    "min_p": [-0.1, 1.01],
    "repetition_penalty": [0, -1, 100.5, 1e308],
    "presence_penalty": [2.01, -2.01, 1e308],
    "frequency_penalty": [2.01, -2.01, -1e308],
    "seed": [-1, 2**63, 2**64],
    "logprobs": [-1, 21, 2**31],
    "n": [0, -1, 65, MAX_NUM_SEQS + 1, 64],
    "priority": [2**31, -(2**31), 2**63, Raw("1e400")],
    "timeout_s": [0, -1, -1e308, Raw("-0.0")],
}
"""Values outside each field's range (README, "Submitting a job"), all invalid."""

VALID_EDGES: dict[str, list[Any]] = {
    "priority": [INT32_MAX, -INT32_MAX, Raw("-0")],
    "seed": [0, 2**63 - 1],
    "temperature": [0, 100, Raw("0.0e5")],
    "top_p": [1, 1e-3],
    "top_k": [0, -1, 1],
    "min_p": [0, 1],
    "repetition_penalty": [100, 0.01],
    "presence_penalty": [-2, 2],
    "frequency_penalty": [-2, 2],
    "logprobs": [0, 20],
    "timeout_s": [1e308, 86400.5],
    "stop": [["a"] * 16, "\x00", ["\U0001f600", "é"]],
    "stop_token_ids": [list(range(64)), []],
    "metadata": [{}, {"k": "x" * 4000}, {"a": {"b": {"c": [1, [2, [3]]]}}}, {"\x00": None}],
}
"""Values at the edge of each field's range, all valid."""

POISON: list[tuple[dict[str, Any], str]] = [
    ({"repetition_penalty": 1e-300, "temperature": 1}, "nan-producing repetition_penalty"),
    ({"temperature": 5e-324}, "denormal temperature"),
    ({"top_p": 5e-324, "temperature": 1}, "denormal top_p"),
    ({"top_k": INT32_MAX}, "top_k beyond the vocabulary"),
    ({"timeout_s": 1e-9}, "tiny timeout"),
    ({"timeout_s": 5e-324}, "denormal timeout"),
    ({"prompt": "\ud800", "messages": None, "prompt_token_ids": None}, "lone surrogate prompt"),
    ({"metadata": {"s": "\udfff"}}, "lone surrogate in metadata"),
    ({"stop": ["\udbff"]}, "lone surrogate stop string"),
    ({"stop_token_ids": [VOCAB_SIZE, INT32_MAX]}, "stop token ids beyond the vocabulary"),
    ({"metadata": Raw('{"a":' * 17 + "1" + "}" * 17)}, "metadata 17 deep"),
    ({"metadata": Raw('{"a":' * 300 + "1" + "}" * 300)}, "metadata 300 deep"),
    ({"min_tokens": 4, "max_tokens": 4, "stop_token_ids": list(range(64))}, "min_tokens over every stop id"),
    ({"n": MAX_NUM_SEQS, "logprobs": 20, "max_tokens": 4}, "widest result within limits"),
    ({"max_tokens": Raw("1E2")}, "integral float for an int"),
    ({"n": Raw("1.0")}, "integral float for n"),
    ({"stop_token_ids": [Raw("2.0")]}, "integral float token id"),
]
"""Valid or nearly valid values a worker may run or refuse, but which must fail at most their own job."""


def _invalid_mutations() -> list[st.SearchStrategy[Mutation]]:
    out: list[st.SearchStrategy[Mutation]] = []
    for name in INT_FIELDS:
        out.append(_set(name, _wrong_for_int, "invalid", "wrong type"))
    for name in FLOAT_FIELDS:
        out.append(_set(name, _wrong_for_float, "invalid", "wrong type"))
    for name in BOOL_FIELDS:
        out.append(_set(name, _wrong_for_bool, "invalid", "wrong type"))
    for name, values in OUT_OF_RANGE.items():
        out.append(_set(name, st.sampled_from(values), "invalid", "out of range"))
    bad_prompt = st.one_of(st.integers(), st.booleans(), st.lists(st.integers(0, 5), max_size=2), st.just(""))
    out.append(_set("prompt", bad_prompt, "invalid", "wrong type"))
    bad_messages = st.sampled_from(
        [
            "hello",
            [],
            ["hello"],
            [{"role": "user"}],
            [{"role": "user", "content": 1}],
            [{"role": "", "content": "x"}],
            [{"role": "user", "content": "x", "name": "y"}],
            {"role": "user", "content": "x"},
        ]
    )
    out.append(_set("messages", bad_messages, "invalid", "malformed"))
    bad_ids = st.sampled_from(["1", [], ["1"], [1.5], [-1], [VOCAB_SIZE], [2**31], [True], [2**64], [[1]], [None]])
    out.append(_set("prompt_token_ids", bad_ids, "invalid", "malformed"))
    out.append(_set("stop", st.sampled_from([5, [1], [""], ["a"] * 17, "", {"a": 1}, [None]]), "invalid", "malformed"))
    bad_stop_ids = st.sampled_from(["1", [1] * 65, [1.5], 5])
    out.append(_set("stop_token_ids", bad_stop_ids, "invalid", "malformed"))
    # The README gives stop token ids no range, and 1e400 is a JSON number (that no float holds).
    out.append(_set("stop_token_ids", st.sampled_from([[-1], [2**31]]), "unsure", "out of range"))
    out.append(_set("metadata", st.sampled_from([[1], "x", 5, True, {"k": "x" * 5000}]), "invalid", "malformed"))
    out.append(_set("metadata", st.just({"v": Raw("1e400")}), "unsure", "overflowing number"))
    extra_names = st.sampled_from(["bogus", "Prompt", "max-tokens", "maxTokens", "id ", "", "model", "best_of", "user"])
    extra = st.one_of(extra_names, st.text(max_size=6).map(lambda s: "x_" + s))
    out.append(st.tuples(extra, _small_json).map(lambda kv: Mutation(kv[0], kv[1], "invalid", "extra field")))
    out.append(st.just(Mutation("min_tokens", 5, "valid", "min_tokens over max_tokens")))  # settled in realise
    second = st.sampled_from(
        [("prompt", "again"), ("messages", [{"role": "user", "content": "x"}]), ("prompt_token_ids", [1])]
    )
    out.append(second.map(lambda kv: Mutation(kv[0], kv[1], "valid", "second prompt kind")))  # settled in realise
    return out


def _other_mutations() -> list[st.SearchStrategy[Mutation]]:
    out: list[st.SearchStrategy[Mutation]] = []
    for name, values in VALID_EDGES.items():
        out.append(_set(name, st.sampled_from(values), "valid", "edge"))
    nullable = st.sampled_from([*INT_FIELDS, *FLOAT_FIELDS, *BOOL_FIELDS, "stop", "stop_token_ids", "metadata"])
    # pydantic reads null as "not set"; the README's "types must match exactly" does not say.
    out.append(nullable.map(lambda n: Mutation(n, None, "invalid" if n in NULL_INVALID else "unsure", f"{n}:null")))
    out.append(st.sampled_from(PROMPT_KINDS).map(lambda n: Mutation(n, DROP, "valid", f"{n}:dropped")))
    return out


_INVALID = st.one_of(_invalid_mutations())
_MUTATION = st.one_of(_INVALID, _INVALID, st.one_of(_other_mutations()))

ODD_VALID_IDS = ["a" * 128, "a:b:c", ".", "..", "-", "_", "0", "A.b-C_d:9", ":", "x:", "reply", "jobs:default"]
BAD_IDS: list[Any] = [
    "a" * 129,
    "",
    " ",
    "a b",
    "a\n",
    "\na",
    "é",
    "a/b",
    "a\x00",
    "\ud800",
    "ａ",
    5,
    -1,
    1.5,
    None,
    True,
    [],
    {},
    ["a"],
    {"id": "a"},
]
"""``id`` values that are not readable ids (JSON ``null`` included: an id must be a string)."""

REFUSED_NAMES = [
    "fz:str",
    "fz:bin",
    "fz:hash",
    "fz:list",
    "fz:set",
    "fz:zset",
    "fz:stream",
    "fz:ttl",
    "fz:new",
    "otherns:jobs:default",
    "otherns:reply:x",
    "otherns:result:x",
    "ns:jobs:default",
    "ns:dead:default",
    "ns:result:x",
    "ns:worker:default:w0",
    "ns:cancel",
    "ns:cancel:x",
    "ns",
    "ns:",
    "fzreply",
    "FZREPLY:x",
    "x" * 256,
    "ns:reply",
    "ns:jobs:{default:0}",
    "ns:dead:{default:0}",
    "ns:{x}:result",
    "ns:{x}:cancel",
    "otherns:{x}:reply",
    "otherns:jobs:{default:0}",
]
"""``reply_to`` values that are well-formed strings outside every granted prefix (``ns`` stands for the
namespace): refused, answered with an error on the job's own reply stream, dead-lettered."""

BAD_REPLY_TO: list[Any] = [
    "",
    " ",
    "\t",
    "a b",
    "fzreply:a b",
    "fzreply:x\n",
    "x" * 257,
    "fzreply:" + "x" * 249,
    5,
    1.5,
    True,
    [],
    ["fzreply:x"],
    {"a": 1},
]
"""``reply_to`` values the schema refuses (not a string of 1-256 characters without whitespace)."""

EITHER_NAMES = ["victim", "other_fuzz", "ns:reply:", "fzreply:taken", "fzreply:str", "fzreply:hash", "own:x"]
"""``reply_to`` targets the rules leave open: another job's reply stream (a victim's, another fuzzed
job's: granted or refused depending on the reading of ``reply_prefixes``), a key under the granted prefix
that pagedq did not create. Never written to; the job's outcome is not checked."""


KINDS: dict[str, frozenset[str]] = {}
"""Every kind of id, ``reply_to``, wire form and entry shape the strategies draw, by the tag that
:meth:`World.realise` writes into an entry's ``why`` (``id:dup``, ``wire:nan``...): a campaign checks it met
them all, so a change of the strategies cannot quietly narrow the fuzzing."""


def missing_kinds(whys: Iterable[str]) -> list[str]:
    """The ``tag:kind`` pairs of :data:`KINDS` that no entry's ``why`` mentions."""
    seen = {word for why in whys for word in why.split()}
    return sorted(f"{tag}:{kind}" for tag, kinds in KINDS.items() for kind in kinds if f"{tag}:{kind}" not in seen)


def _id_specs() -> st.SearchStrategy[IdSpec]:
    weighted = ["fresh"] * 14 + ["dup", "dup", "victim_done", "odd_valid", "bad", "bad", "missing"]
    KINDS["id"] = frozenset(weighted)

    @st.composite
    def spec(draw: st.DrawFn) -> IdSpec:
        kind = draw(st.sampled_from(weighted))
        if kind in ("dup", "victim_done"):
            return kind, draw(st.integers(0, 10**6))
        if kind == "odd_valid":
            return kind, draw(st.sampled_from(ODD_VALID_IDS))
        if kind == "bad":
            return kind, draw(st.sampled_from(BAD_IDS))
        return kind, None

    return spec()


def _reply_specs() -> st.SearchStrategy[ReplySpec]:
    weighted = ["absent"] * 12 + ["own", "granted_fresh", "granted_fresh", "either", "refused", "refused"]
    weighted += ["refused_literal", "bad", "null"]
    KINDS["reply_to"] = frozenset(weighted)

    @st.composite
    def spec(draw: st.DrawFn) -> ReplySpec:
        kind = draw(st.sampled_from(weighted))
        if kind == "granted_fresh":
            return kind, draw(st.sampled_from(["", "é", "😀", ":deep:er", "x" * 200]))
        if kind == "either":
            return kind, (draw(st.sampled_from(EITHER_NAMES)), draw(st.integers(0, 10**6)))
        if kind == "refused":
            return kind, draw(st.sampled_from(REFUSED_NAMES))
        if kind == "refused_literal":
            return kind, draw(st.text(st.characters(min_codepoint=33, max_codepoint=126), min_size=1, max_size=30))
        if kind == "bad":
            return kind, draw(st.sampled_from(BAD_REPLY_TO))
        return kind, None

    return spec()


BAD_UTF8 = [b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\xc0\xaf", b"\x80", b"\xe2\x82", b"caf\xe9"]


def _wires() -> st.SearchStrategy[tuple[str, Any]]:
    """How the job goes on the wire: mostly plain JSON, sometimes broken or respelled."""
    weighted = ["compact"] * 24 + ["pretty", "utf8"] * 2
    weighted += [
        "truncate",
        "bad_utf8_prompt",
        "bad_utf8_id",
        "nan",
        "dup_key",
        "dup_id",
        "bom",
        "utf16",
        "leading_zero",
    ]
    KINDS["wire"] = frozenset(weighted)

    @st.composite
    def wire(draw: st.DrawFn) -> tuple[str, Any]:
        kind = draw(st.sampled_from(weighted))
        if kind == "truncate":
            return kind, draw(st.floats(0, 0.999))
        if kind in ("bad_utf8_prompt", "bad_utf8_id"):
            return kind, draw(st.sampled_from(BAD_UTF8))
        if kind == "nan":
            return kind, draw(st.sampled_from(["NaN", "Infinity", "-Infinity"]))
        return kind, None

    return wire()


def _shapes() -> st.SearchStrategy[tuple[str, Any]]:
    """The stream entry around the job: one ``job`` field, mostly."""
    weighted = ["job"] * 40 + ["no_job_field", "extra_field", "two_job_fields", "binary_name", "empty_job"]
    weighted += ["non_object", "garbage"]
    KINDS["entry"] = frozenset(weighted)

    @st.composite
    def shape(draw: st.DrawFn) -> tuple[str, Any]:
        kind = draw(st.sampled_from(weighted))
        if kind == "no_job_field":
            return kind, draw(st.sampled_from([b"jobs", b"Job", b"data", b"", b"job "]))
        if kind == "non_object":
            return kind, draw(st.sampled_from(["[]", '"job"', "1", "null", "true", "{}", "[{}]", '""', "-0"]))
        if kind == "garbage":
            return kind, draw(st.binary(max_size=64))
        return kind, None

    return shape()


_VALID_BODIES = valid_bodies()
_ID_SPECS = _id_specs()
_REPLY_SPECS = _reply_specs()
_WIRES = _wires()
_SHAPES = _shapes()


@st.composite
def drafts(draw: st.DrawFn) -> Draft:
    """One fuzzed entry, symbolically: a valid job, 0-3 mutations, an id, a reply target, a wire form."""
    body = draw(_VALID_BODIES)
    labels: dict[str, Validity] = dict.fromkeys(body, "valid")
    names: list[str] = []
    count = draw(st.sampled_from([0, 0, 1, 1, 1, 2, 3]))
    for _ in range(count):
        m = draw(_MUTATION)
        names.append(m.name)
        if m.value is DROP:
            body.pop(m.field, None)
            labels.pop(m.field, None)
        else:
            body[m.field] = m.value
            labels[m.field] = m.validity
    if draw(st.integers(0, 19)) == 0:
        poison, what = draw(st.sampled_from(POISON))
        names.append(f"poison:{what}")
        for k, v in poison.items():
            if v is None:
                body.pop(k, None)
                labels.pop(k, None)
            else:
                body[k] = v
                labels[k] = "unsure"
    return Draft(
        body=body,
        labels=labels,
        mutations=tuple(names),
        id_spec=draw(_ID_SPECS),
        reply=draw(_REPLY_SPECS),
        wire=draw(_WIRES),
        shape=draw(_SHAPES),
    )


# ------------------------------------------------------------------------------------------ entries


Outcome = Literal["final", "error", "any"]
DeadRule = Literal["one", "none", "any"]
DeadCause = Literal["", "payload", "reply", "unreadable", "future"]


@dataclass(frozen=True)
class Expect:
    """What an entry must lead to. ``result``: the type of ``<ns>:result:<id>`` when the id is readable
    (and used by this entry alone); ``dead``: dead letters carrying this entry's id; ``dead_cause``: why
    one is owed (a refused ``reply_to`` of a repeated id is left open, see the test's docstring);
    ``target``: the reply stream that must hold the job's one terminal event, when the rules say which."""

    result: Outcome
    dead: DeadRule
    dead_cause: DeadCause = ""
    dead_code: str | None = None
    target: str | None = None


@dataclass
class Entry:
    """One raw stream entry as sent (field/value pairs, in order) and what it must lead to."""

    fields: list[tuple[bytes, bytes]]
    expect: Expect
    why: str
    explicit_id: str | None = None
    reply_to: Any = None  # the reply_to value sent, when the payload holds one
    entry_id: str = ""

    @property
    def job(self) -> bytes | None:
        """The one ``job`` field's value; None when there is none or more than one."""
        values = [v for k, v in self.fields if k == JOB]
        return values[0] if len(values) == 1 else None

    def show(self, limit: int = 160) -> str:
        """The entry for a failure report: its mutations and its payload, shortened."""
        parts = []
        for k, v in self.fields:
            shown = v if len(v) <= limit else v[:limit] + b"...(%d bytes)" % len(v)
            parts.append(f"{k!r}={shown!r}")
        explicit = f" id={self.explicit_id}" if self.explicit_id else ""
        return f"[{self.why}]{explicit} " + " ".join(parts)


def _strict_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _no_duplicate_id(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    if sum(1 for k, _ in pairs if k == "id") > 1:
        raise _DuplicateId([v for k, v in pairs if k == "id"])
    return dict(pairs)


class _DuplicateId(ValueError):
    def __init__(self, values: list[Any]) -> None:
        super().__init__("duplicate id")
        self.values = values


def _id_of(data: Any) -> str | None:
    if isinstance(data, dict):
        value = data.get("id")
        if isinstance(value, str) and ID_RE.fullmatch(value):
            return value
    return None


_ID_PEEK = re.compile(rb'^\s*\{\s*"id"\s*:\s*"([A-Za-z0-9._:-]{1,128})"')


def readable_ids(fields: list[tuple[bytes, bytes]]) -> tuple[str | None, frozenset[str]]:
    """(the entry's readable id or None, the ids a worker might read from it where the protocol leaves the
    reading open). Readable: exactly one ``job`` field, strict UTF-8, strict JSON (no NaN), an object
    with a string ``id`` matching ``[A-Za-z0-9._:-]{1,128}`` and no second ``id`` key."""
    values = [v for k, v in fields if k == JOB]
    maybe: set[str] = set()
    if len(values) != 1:  # several job fields: each readable id gets an error (check_several_job_fields)
        for v in values:
            definite, possible = readable_ids([(JOB, v)])
            maybe |= possible | ({definite} if definite else set())
        return None, frozenset(maybe)
    raw = values[0]
    if raw.count(b"[") + raw.count(b"{") > 5000:
        # Nesting beyond what JSON parsers go (Python's stops near 1000): the id is read or not.
        peek = _ID_PEEK.match(raw)
        return None, frozenset([peek.group(1).decode()] if peek else [])
    try:
        data = json.loads(raw.decode("utf-8"), parse_constant=_strict_constant, object_pairs_hook=_no_duplicate_id)
        return _id_of(data), frozenset()
    except _DuplicateId as dup:
        maybe |= {v for v in dup.values if isinstance(v, str) and ID_RE.fullmatch(v)}
        return None, frozenset(maybe)
    except (ValueError, RecursionError):
        pass
    # Not strict JSON: what a lenient reader (invalid bytes replaced, NaN accepted, a BOM skipped) gets.
    for text in (raw.decode("utf-8", "surrogateescape"), raw.decode("utf-8", "replace")):
        try:
            data = json.loads(text.lstrip("\ufeff"))
        except (ValueError, RecursionError):
            continue
        if (found := _id_of(data)) is not None:
            maybe.add(found)
    return None, frozenset(maybe)


@dataclass
class World:
    """The namespace a campaign runs in and the ids it has handed out; turns drafts into raw entries."""

    ns: str
    running_victims: list[str]
    done_victims: list[str]
    ids: list[str] = field(default_factory=list)  # readable ids handed out so far, in order
    counters: Counter[str] = field(default_factory=Counter)

    def fresh(self, prefix: str = "fz") -> str:
        """A new name: drafted jobs get ``fz1``, ``fz2``... in drafting order, whatever else is named."""
        self.counters[prefix] += 1
        return f"{prefix}{self.counters[prefix]}"

    def resolve_name(self, name: str) -> str:
        """``ns`` in a catalogue name stands for the namespace."""
        if name == "ns" or name.startswith("ns:"):
            return self.ns + name[2:]
        return name

    def realise(self, d: Draft) -> Entry:
        body = dict(d.body)
        why = list(d.mutations)
        validity = combine(d.labels.get(k, "valid") for k in body)
        given = [k for k in PROMPT_KINDS if body.get(k) is not None]
        if len(given) != 1:
            validity = "invalid"
            why.append(f"prompt kinds {given}")
        mt = 16 if body.get("max_tokens") is None else body["max_tokens"]  # the default when absent
        mn = body.get("min_tokens")
        if type(mt) is int and type(mn) is int and mn > mt:
            validity = "invalid"
            why.append("min_tokens > max_tokens")

        # --- id
        kind, arg = d.id_spec
        job_id: str | None = None
        if kind == "fresh":
            job_id = self.fresh()
        elif kind == "dup":
            job_id = self.ids[arg % len(self.ids)] if self.ids else self.fresh()
        elif kind == "victim_done":
            job_id = self.done_victims[arg % len(self.done_victims)]
        elif kind == "odd_valid":
            job_id = arg
        why.append(f"id:{kind}")
        obj: dict[str, Any] = {}
        if kind == "bad":
            obj["id"] = arg
        elif kind != "missing":
            obj["id"] = job_id
        obj.update(body)

        # --- reply_to
        rkind, rarg = d.reply
        reply_to: Any = None
        target_kind = "default"  # where the terminal event must go: default | granted | none (open)
        refused: DeadCause = ""
        own = f"{self.ns}:{{{job_id if job_id is not None else ''}}}:reply"
        if rkind == "own":
            reply_to = own
        elif rkind == "granted_fresh":
            reply_to = f"{GRANTED_PREFIX}{rarg}{self.fresh('g')}"
            target_kind = "granted"
        elif rkind == "either":
            name, k = rarg
            target_kind = "none"
            if name == "victim":
                victims = self.running_victims + self.done_victims
                reply_to = f"{self.ns}:{{{victims[k % len(victims)]}}}:reply"
            elif name == "other_fuzz":
                reply_to = f"{self.ns}:{{{self.ids[k % len(self.ids)] if self.ids else 'nobody'}}}:reply"
            elif name == "own:x":
                reply_to = own + ":x"
            else:
                reply_to = self.resolve_name(name)
        elif rkind == "refused":
            reply_to = self.resolve_name(rarg)
            refused = "reply"
        elif rkind == "refused_literal":
            reply_to = rarg
            refused = "reply"
        elif rkind == "bad":
            reply_to = rarg
            refused = "payload"
            target_kind = "none"
        if rkind != "absent":
            obj["reply_to"] = reply_to  # "null" leaves None: the default stream, if null reads as "not set"
        if rkind == "null":
            validity = combine([validity, "unsure"])
        why.append(f"reply_to:{rkind}")
        if refused == "reply" and (not isinstance(reply_to, str) or reply_to.startswith(GRANTED_PREFIX)):
            refused, target_kind = "", "none"  # a generated literal that happens to be granted

        # --- result and dead-letter rules for a well-formed payload with this id
        if validity == "invalid" or refused == "payload":
            result: Outcome = "error"
            dead: DeadRule = "one"
            cause: DeadCause = "payload"
        elif refused == "reply":
            result, dead, cause = "error", "one", "reply"
        elif target_kind == "none" or validity == "unsure":
            result, dead, cause = "any", "any", ""
        else:
            result, dead, cause = "final", "none", ""
        if job_id is None:  # no readable id: nothing can be run or answered, only dead-lettered
            result, dead, cause = "any", "one", "unreadable"
        if target_kind == "granted" and validity != "valid":
            target_kind = "none"  # an invalid job's error may go to its own stream or to reply_to
        if validity == "invalid" and refused == "" and rkind not in ("absent", "own", "null"):
            target_kind = "none"
        target: str | None = None
        if job_id is not None and target_kind == "default":
            target = f"{self.ns}:{{{job_id}}}:reply"
        elif job_id is not None and target_kind == "granted":
            target = reply_to

        # --- wire form
        surrogates = "\\ud" in json.dumps(obj, default=str)
        wkind, warg = d.wire
        why.append(f"wire:{wkind}")
        expect = Expect(result, dead, cause, None, target)
        if wkind in ("compact", "pretty", "utf8") or (wkind == "leading_zero" and "priority" in obj):
            payload = dumps(obj, ascii_only=wkind != "utf8" or surrogates, indent=2 if wkind == "pretty" else None)
            if wkind == "leading_zero":
                payload = payload.replace('"priority":', '"priority":0', 1)
                expect = Expect("any", "one", "unreadable")
            data = payload.encode("utf-8", "surrogatepass")
        elif wkind == "leading_zero":
            data = dumps(obj).encode()
        elif wkind == "truncate":
            full = dumps(obj).encode()
            data = full[: int(len(full) * warg)]
            expect = Expect("any", "one", "unreadable")
        elif wkind == "bad_utf8_prompt":
            obj.pop("messages", None)
            obj.pop("prompt_token_ids", None)
            obj["prompt"] = "x\x01y"
            data = dumps(obj).encode().replace(b"\\u0001", warg, 1)
            expect = Expect("any", "one", "payload")
        elif wkind == "bad_utf8_id":
            obj["id"] = "bad\x01id"
            data = dumps(obj).encode().replace(b"\\u0001", warg, 1)
            expect = Expect("any", "one", "unreadable")
        elif wkind == "nan":
            obj["temperature"] = Raw(warg)
            data = dumps(obj).encode("utf-8", "surrogatepass")
            expect = Expect("any", "one", "payload")
        elif wkind == "dup_key":
            text = dumps(obj)
            data = (text[:-1] + (',"max_tokens":"x"}' if len(text) > 2 else '"max_tokens":1}')).encode()
            expect = Expect("any", "any")
        elif wkind == "dup_id":
            text = dumps(obj)
            data = (text[:-1] + (',"id":"' if len(text) > 2 else '"id":"') + self.fresh("dupkey") + '"}').encode()
            expect = Expect("any", "any")
        elif wkind == "bom":
            data = b"\xef\xbb\xbf" + dumps(obj).encode("utf-8", "surrogatepass")
            expect = Expect("any", "any")
        else:  # utf16
            data = dumps(obj).encode("utf-16")
            expect = Expect("any", "one", "unreadable")

        # --- the stream entry
        skind, sarg = d.shape
        why.append(f"entry:{skind}")
        fields: list[tuple[bytes, bytes]] = [(JOB, data)]
        if skind == "no_job_field":
            fields = [(sarg, data)]
            expect = Expect("any", "one", "unreadable")
        elif skind == "extra_field":
            fields = [(JOB, data), (b"trace", b"1"), (b"\x00", b"\xff")]
            expect = Expect("any", "any", target=_default_only(expect.target, self.ns))
        elif skind == "two_job_fields":
            fields = [(JOB, data), (JOB, dumps({"id": self.fresh("twin"), "prompt": "x"}).encode())]
            expect = Expect("any", "any")
        elif skind == "binary_name":
            fields = [(b"\xff\xfe", b"\xc3"), (JOB, data)]
            expect = Expect("any", "any", target=_default_only(expect.target, self.ns))
        elif skind == "empty_job":
            fields = [(JOB, b"")]
            expect = Expect("any", "one", "unreadable")
        elif skind == "non_object":
            fields = [(JOB, sarg.encode())]
            expect = Expect("any", "one", "unreadable")
        elif skind == "garbage":
            fields = [(JOB, sarg)]
            expect = Expect("any", "one", "unreadable")

        entry = Entry(fields, expect, " ".join(why), reply_to=reply_to if "reply_to" in obj else None)
        self.note_ids(entry)
        return entry

    def note_ids(self, entry: Entry) -> None:
        """Remember the entry's readable id, so later drafts can repeat it."""
        definite, _ = readable_ids(entry.fields)
        if definite is not None and definite not in self.running_victims and definite not in self.ids:
            self.ids.append(definite)

    # ----------------------------------------------------------------------------- fixed entries

    def job(self, why: str, expect: Expect, **fields: Any) -> Entry:
        """A hand-written entry with a fresh id (unless ``fields`` names one), its target the default stream."""
        obj: dict[str, Any] = {"id": self.fresh("seed")}
        obj.update(fields)
        target = expect.target
        if target is None and ("reply_to" not in obj or expect.dead_cause == "reply"):
            target = f"{self.ns}:{{{obj['id']}}}:reply"  # no reply_to, or a refused one: the job's own stream
        return Entry([(JOB, dumps(obj).encode())], _with_target(expect, target), why, reply_to=obj.get("reply_to"))

    def raw(self, why: str, expect: Expect, fields: list[tuple[bytes, bytes]], explicit_id: str | None = None) -> Entry:
        """A hand-written entry, bytes as given. Like :meth:`job`, its id is never repeated by a draft, so
        each fixed entry's outcome is checked on its own."""
        return Entry(fields, expect, why, explicit_id=explicit_id)

    def seeds(self, *, slow: bool) -> list[Entry]:
        """Entries every campaign sends whatever hypothesis draws: the large, the poisonous, the odd."""
        error = Expect("error", "one", "payload")
        final = Expect("final", "none")
        either = Expect("any", "any")
        unreadable = Expect("any", "one", "unreadable")
        small = {"max_tokens": 2, "temperature": 0}
        mib = MAX_PAYLOAD_BYTES
        out = [
            self.job("over 1 MiB: prompt", error, prompt="a" * mib, max_tokens=1),
            self.job("over 1 MiB: metadata", error, prompt="hi", metadata={"blob": "b" * (3 * mib // 2)}),
            self.job("9 MiB payload", error, prompt="c" * (9 * mib), max_tokens=1),
            self.raw("1.2 MiB of 0xff", unreadable, [(JOB, b"\xff" * (6 * mib // 5))]),
            self.job("prompt longer than the context", error, prompt="word " * 100_000, max_tokens=1),
            self.job("2000 prompt token ids", error, prompt_token_ids=[5] * 2000, max_tokens=1),
            self.job("NaN sampling", either, prompt="poison", repetition_penalty=1e-300, temperature=1, max_tokens=4),
            self.job("metadata 300 deep", either, prompt="deep", metadata=Raw('{"a":' * 300 + "1" + "}" * 300)),
            self.job(
                "metadata 100k deep",
                Expect("any", "one", "payload"),
                prompt="deep",
                metadata=Raw("[" * 100_000 + "]" * 100_000),
            ),
            self.job(
                "huge n*logprobs*max_tokens",
                either,
                prompt="wide",
                n=MAX_NUM_SEQS,
                logprobs=20,
                max_tokens=INT32_MAX,
                ignore_eos=True,
            ),
            self.job("n over max_num_seqs", error, prompt="n", n=MAX_NUM_SEQS + 1, max_tokens=1),
            self.job("timeout 1e-9", either, prompt="late", timeout_s=1e-9, **small),
            self.job("timeout 1e308", final, prompt="patient", timeout_s=1e308, **small),
            self.job("priority max", final, prompt="first", priority=INT32_MAX, **small),
            self.job("priority min", final, prompt="last", priority=-INT32_MAX, **small),
            self.job("seed max", final, prompt="seeded", seed=2**63 - 1, temperature=1, max_tokens=2),
            self.job("NUL prompt", final, prompt="\x00", **small),
            self.job("special tokens as text", final, prompt="<|im_start|><|endoftext|><|im_end|>", **small),
            self.job("all 64 stop ids", final, prompt="stop", stop_token_ids=list(range(64)), max_tokens=2),
            self.job("65 stop ids", error, prompt="stop", stop_token_ids=list(range(65)), max_tokens=2),
            self.job("widest logprobs", final, prompt="lp", n=MAX_NUM_SEQS, logprobs=20, max_tokens=4),
            self.job("metadata 4000 B", final, prompt="meta", metadata={"k": "x" * 4000}, **small),
            self.job("metadata 5000 B", error, prompt="meta", metadata={"k": "x" * 5000}, **small),
            self.job("lone surrogate prompt", either, prompt="\ud800", **small),
            self.job("lone surrogate metadata", either, prompt="s", metadata={"s": "\udfff"}, **small),
            self.job("1e400 temperature", error, prompt="inf", temperature=Raw("1e400"), **{"max_tokens": 1}),
            self.job(
                "reply_to at a string key", Expect("error", "one", "reply"), prompt="r", reply_to="fz:str", **small
            ),
            self.job(
                "reply_to at another namespace's jobs stream",
                Expect("error", "one", "reply", target=None),
                prompt="r",
                reply_to="otherns:jobs:default",
                **small,
            ),
            self.job(
                "reply_to at own jobs stream",
                Expect("error", "one", "reply"),
                prompt="r",
                reply_to=f"{self.ns}:jobs:{{default:0}}",
                **small,
            ),
            self.job(
                "expired, reply_to at own jobs stream",
                Expect("error", "one", "reply"),
                prompt="r",
                timeout_s=1e-9,
                reply_to=f"{self.ns}:jobs:{{default:0}}",
                **small,
            ),
            self.job(
                "reply_to at a running victim",
                either,
                prompt="r",
                reply_to=f"{self.ns}:{{{self.running_victims[0]}}}:reply",
                **small,
            ),
            self.job(
                "reply_to at a finished victim",
                either,
                prompt="r",
                reply_to=f"{self.ns}:{{{self.done_victims[0]}}}:reply",
                **small,
            ),
            self.job("reply_to granted but taken", either, prompt="r", reply_to=f"{GRANTED_PREFIX}taken", **small),
            self.job("reply_to 257 chars", error, prompt="r", reply_to="r" * 257, **small),
            self.job("reply_to nested object", error, prompt="r", reply_to={"a": {"b": 1}}, **small),
            self.job(
                "id of a finished victim", Expect("any", "none"), id=self.done_victims[0], prompt="again", **small
            ),
            self.job(
                "invalid with a finished victim's id",
                Expect("any", "one", "payload"),
                id=self.done_victims[-1],
                prompt="again",
                temperature="hot",
            ),
            self.raw("no job field", unreadable, [(b"payload", b'{"id":"nofield","prompt":"x"}')]),
            self.raw(
                "several fields",
                Expect("any", "any"),
                [
                    (b"a", b"1"),
                    (JOB, dumps({"id": self.fresh("multi"), "prompt": "x", "max_tokens": 1}).encode()),
                    (b"b", b"2"),
                ],
            ),
            self.raw("top-level array 100k deep", unreadable, [(JOB, b"[" * 100_000 + b"]" * 100_000)]),
            self.raw(
                "UTF-16 job", unreadable, [(JOB, dumps({"id": self.fresh("u16"), "prompt": "x"}).encode("utf-16"))]
            ),
            self.raw("empty job field", unreadable, [(JOB, b"")]),
        ]
        if slow:
            out += [
                self.job(
                    "max_tokens max, ignore_eos",
                    either,
                    prompt="long",
                    max_tokens=INT32_MAX,
                    min_tokens=INT32_MAX,
                    ignore_eos=True,
                ),
                self.job("32 MiB payload", error, prompt="d" * (32 * mib), max_tokens=1),
                self.job("top_k max", either, prompt="k", top_k=INT32_MAX, max_tokens=2),
            ]
        return out

    def future_entries(self, *, slow: bool) -> list[Entry]:
        """Entries with explicit ids far in the future (sent last: every later ``*`` id follows them)."""
        code = "entry_id_in_future"
        out = [
            self.raw(
                "explicit entry id in the future",
                Expect("error", "one", "future", code),
                [(JOB, dumps({"id": self.fresh("future"), "prompt": "from the future", "max_tokens": 1}).encode())],
                explicit_id=FUTURE_ENTRY_ID,
            )
        ]
        if slow:
            out.append(
                self.raw(  # two reasons to refuse it: which code wins is open, one dead letter is not
                    "future entry, not JSON",
                    Expect("any", "one", "future"),
                    [(JOB, b"{nope")],
                    explicit_id="9999999999999-5",
                )
            )
        return out


def _with_target(expect: Expect, target: str | None) -> Expect:
    return Expect(expect.result, expect.dead, expect.dead_cause, expect.dead_code, target)


def is_own_reply_stream(key: str, ns: str) -> bool:
    """Whether ``key`` is a job's own reply stream of namespace ``ns`` (``<ns>:{<id>}:reply``)."""
    return key.startswith(f"{ns}:{{") and key.endswith("}:reply")


def _default_only(target: str | None, ns: str) -> str | None:
    """Keep a target only when it is the job's own stream: whether extra entry fields make a job invalid is
    not settled, and an invalid job's error may go to its own stream instead of a granted ``reply_to``."""
    return target if target is not None and is_own_reply_stream(target, ns) else None
