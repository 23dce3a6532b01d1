"""Structured output against hostile or careless producers: one job's constraint must not hurt another's.

A grammar's compile walks the whole vocabulary for every rule: a 20,000-value enum took 2.8 s on
SmolLM2's vocabulary, and while it ran on the engine's thread every other request's tokens stopped
(a plain request's longest gap between tokens: 2078 ms, against a median of 0.7 ms). Compiles now run on
a compile thread and the request waits out of the scheduler. Schemas whose keywords the grammar
compiler would not hold (it drops ``allOf`` of several schemas, ``not``, ``uniqueItems``... and the
output could violate the schema) are refused at submission, by the wire model and by the engine.

The tests gate the compile thread on an event instead of timing a slow compile: deterministic, and
bounded (a gate not opened times out after a few seconds, and the test fails).
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest
from pydantic import ValidationError

from engine import Engine, EngineConfig
from engine.outputs import RequestDelta
from engine.structured import SYNC_PARSE_CHARS, GrammarCache
from ops.gateway.openai_api import ApiError, parse_request
from schemas.jobs import JobRequest
from schemas.sampling import SamplingParams
from tests.tiny_models import make_tiny_checkpoint
from tests.tiny_tokenizer import make_tokenizer

GATE_TIMEOUT_S = 3.0

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"kind": {"enum": ["a", "b"]}, "n": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["kind", "n"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    path = tmp_path_factory.mktemp("tiny-structured-robustness")
    make_tiny_checkpoint(path, "llama_gqa", vocab_size=544)
    make_tokenizer(path)
    return Engine(EngineConfig(model=str(path), max_num_seqs=8, max_num_batched_tokens=256, kv_cache_bytes=8 << 20))


@pytest.fixture(autouse=True)
def clean_engine(engine: Engine) -> Iterator[None]:
    """A failed test's requests are aborted, so the next test starts from an empty engine."""
    yield
    for request_id in list(engine.requests):
        engine.abort(request_id)


def outputs(deltas: list[RequestDelta]) -> dict[int, tuple[str, list[int], str | None]]:
    """Per choice: (text, token ids, finish reason)."""
    out: dict[int, tuple[str, list[int], str | None]] = {}
    for delta in deltas:
        for c in delta.outputs:
            text, ids, _ = out.get(c.index, ("", [], None))
            out[c.index] = (text + c.text, ids + list(c.token_ids), c.finish_reason)
    return out


def drain(engine: Engine, deltas: dict[str, list[RequestDelta]]) -> None:
    while engine.has_unfinished():
        for delta in engine.step():
            deltas.setdefault(delta.request_id, []).append(delta)


def gate_compiles(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> tuple[threading.Event, list[bool]]:
    """Hold every compile of ``engine`` until the returned event is set; the list records, per compile as
    it goes on, whether it had to give up waiting (then the step loop waited on it: it ran on the
    engine's thread). Empty while a compile is held."""
    grammars = engine.grammars
    gate = threading.Event()
    timed_out: list[bool] = []
    compiler = grammars.compiler

    class GatedCompiler:
        def __getattr__(self, name: str) -> Any:
            method = getattr(compiler, name)
            if not name.startswith("compile_"):
                return method

            def gated(*args: Any, **kwargs: Any) -> Any:
                timed_out.append(not gate.wait(GATE_TIMEOUT_S))
                return method(*args, **kwargs)

            return gated

    monkeypatch.setattr(grammars, "compiler", GatedCompiler())
    return gate, timed_out


def test_a_compiling_grammar_does_not_stall_other_requests(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """While a constraint compiles, an unconstrained request runs to its end, token for token what it is
    alone; the constrained one (n=2: both samples get a matcher) then runs, valid, once its grammar is in."""
    plain = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone: dict[str, list[RequestDelta]] = {}
    engine.add_request("alone", "The quick brown", plain)
    drain(engine, alone)

    gate, timed_out = gate_compiles(engine, monkeypatch)
    engine.add_request("plain", "The quick brown", plain)
    deltas: dict[str, list[RequestDelta]] = {}
    for delta in engine.step():
        deltas.setdefault(delta.request_id, []).append(delta)
    schema = {**SCHEMA, "title": "gated"}  # a constraint no other test compiled: not in the cache
    json_params = SamplingParams(temperature=1.0, seed=3, max_tokens=64, n=2, json_schema=schema)
    engine.add_request("json", "Object:", json_params)
    assert engine.num_waiting() == 1  # it waits for its grammar, out of the scheduler
    while "plain" in engine.requests:
        for delta in engine.step():
            deltas.setdefault(delta.request_id, []).append(delta)
    assert timed_out == []  # the compile is still held: the steps went on without it
    assert "json" in engine.requests and "json" not in deltas
    gate.set()
    drain(engine, deltas)
    assert timed_out == [False]
    assert outputs(deltas["plain"]) == outputs(alone["alone"])
    samples = outputs(deltas["json"])
    assert len(samples) == 2
    for text, _, reason in samples.values():
        assert reason == "stop", text
        jsonschema.validate(json.loads(text), schema)
    assert engine.kv.num_free_blocks == engine.kv.num_total_blocks


def test_a_compiling_request_the_scheduler_could_never_run_is_refused_at_once(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """n above max_num_seqs is refused by ``add_request`` (the scheduler's check), also while the grammar
    compiles: admitted later, inside a step, the refusal would have failed that step for every request."""
    gate, _ = gate_compiles(engine, monkeypatch)
    params = SamplingParams(temperature=1.0, max_tokens=8, n=9, json_schema={**SCHEMA, "title": "too many"})
    with pytest.raises(ValueError, match="larger than max_num_seqs"):
        engine.add_request("wide", "Object:", params)
    gate.set()
    assert "wide" not in engine.requests and not engine._compiling


def test_an_aborted_request_leaves_its_compile_to_the_cache(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """A job cancelled while its grammar compiles ends at once; the compile finishes into the cache, and
    the next job with that schema finds it there."""
    gate, _ = gate_compiles(engine, monkeypatch)
    schema = {**SCHEMA, "title": "aborted"}
    params = SamplingParams(temperature=0, max_tokens=64, json_schema=schema)
    engine.add_request("gone", "Object:", params)
    assert engine.abort("gone") and not engine.has_unfinished() and engine.num_waiting() == 0
    gate.set()
    compiled = engine.grammars.num_compiled
    grammar = engine.grammars.compile(params)  # waits for the compile already in flight
    assert grammar is not None and engine.grammars.num_compiled == compiled + 1
    engine.add_request("again", "Object:", params)
    assert engine.num_waiting() == 1 and not engine._compiling  # cached: straight into the scheduler
    deltas: dict[str, list[RequestDelta]] = {}
    drain(engine, deltas)
    ((text, _, reason),) = outputs(deltas["again"]).values()
    assert reason == "stop" and json.loads(text)["kind"] in ("a", "b")


def test_a_long_constraint_that_does_not_parse_fails_its_request_alone(engine: Engine) -> None:
    """A constraint longer than SYNC_PARSE_CHARS is parsed on the compile thread: one that does not parse
    ends its own request with the parser's message (``invalid_request`` on the wire); its neighbour
    gets what it gets alone. A short one is refused by ``add_request`` itself."""
    with pytest.raises(ValueError, match=re.escape("regex: Regex parsing error")):
        engine.add_request("short", "x", SamplingParams(regex="(a|b"))
    long_regex = "(" + "|".join(f"w{i}" for i in range(SYNC_PARSE_CHARS // 4)) + "|x"  # the "(" is never closed
    assert len(long_regex) > SYNC_PARSE_CHARS
    plain = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    alone: dict[str, list[RequestDelta]] = {}
    engine.add_request("alone", "Once upon a", plain)
    drain(engine, alone)
    engine.add_request("bad", "x", SamplingParams(regex=long_regex))
    engine.add_request("plain", "Once upon a", plain)
    deltas: dict[str, list[RequestDelta]] = {}
    drain(engine, deltas)
    (bad,) = deltas["bad"]
    assert bad.finished and bad.error is not None
    assert bad.error.startswith("regex: ") and "parenthesis is not closed" in bad.error, bad.error
    assert [c.finish_reason for c in bad.outputs] == ["error"]
    assert outputs(deltas["plain"]) == outputs(alone["alone"])
    assert engine.kv.num_free_blocks == engine.kv.num_total_blocks


UNHELD: list[tuple[dict[str, Any], str]] = [
    ({"allOf": [{"type": "integer"}, {"minimum": 3, "maximum": 4}]}, "'allOf' of 2 schemas"),
    ({"type": "number", "multipleOf": 0.5}, "'multipleOf' (at the root) is supported with"),
    ({"type": "array", "items": {"enum": [1, 2]}, "uniqueItems": True}, "'uniqueItems'"),
    ({"type": "array", "contains": {"const": 1}}, "'contains' (array containment"),
    ({"type": "object", "properties": {"a": {"not": {"type": "string"}}}}, "at the root > properties > a"),
    ({"if": {"type": "integer"}, "then": {"minimum": 1}}, "'if' (conditional subschemas"),
    (
        {"type": "object", "properties": {"a": {"type": "integer"}, "b": {}}, "dependentRequired": {"a": ["b"]}},
        "'dependentRequired'",
    ),
    ({"anyOf": []}, "'anyOf' (at the root) is empty"),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a", "zz"]}, "names 'zz'"),
]


@pytest.mark.parametrize(("schema", "message"), UNHELD)
def test_schemas_the_grammar_would_not_hold_are_refused_everywhere(
    engine: Engine, schema: dict[str, Any], message: str
) -> None:
    """xgrammar drops or loosens these keywords (its grammar accepts documents the schema refuses, or an
    empty output), so they are refused at submission: by the engine (offline API, ``invalid_request`` from
    a worker), by the wire model and by the gateway (400, naming ``response_format``)."""
    with pytest.raises(ValueError, match=re.escape(message)):
        engine.add_request("unheld", "x", SamplingParams(json_schema=schema))
    assert not engine.has_unfinished()
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    with pytest.raises(ValidationError, match=re.escape(message)):
        JobRequest.model_validate({"id": "a", "prompt": "x", "response_format": fmt})
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "response_format": fmt}
    with pytest.raises(ApiError) as refused:
        parse_request("chat", body, default_max_tokens=16, timeout_s=60.0)
    assert refused.value.status == 400 and refused.value.param == "response_format"
    assert message in refused.value.message


@pytest.mark.parametrize(
    "schema",
    [
        {"allOf": [{"$ref": "#/$defs/a"}], "$defs": {"a": {"enum": [1, 2]}}},  # pydantic v1's one-$ref allOf
        {"type": "integer", "multipleOf": 3, "minimum": 0, "maximum": 9},
        {"type": "array", "items": {"type": "boolean"}, "uniqueItems": False, "maxItems": 2},
        {"type": "object", "properties": {"not": {"const": {"if": 1}}}, "required": ["not"]},  # names, data
    ],
)
def test_schemas_it_holds_are_accepted_and_held(engine: Engine, schema: dict[str, Any]) -> None:
    """Neighbours of the refused keywords that the grammar does hold run, and their output validates."""
    JobRequest.model_validate({"id": "a", "prompt": "x", "response_format": {"type": "json_object"}})
    deltas: dict[str, list[RequestDelta]] = {}
    engine.add_request("held", "x", SamplingParams(temperature=1.0, seed=5, max_tokens=48, json_schema=schema))
    drain(engine, deltas)
    ((text, _, reason),) = outputs(deltas["held"]).values()
    assert reason == "stop", text
    jsonschema.validate(json.loads(text), schema)


def test_max_tokens_too_small_to_close_the_json_ends_with_length(engine: Engine) -> None:
    """The output is then a prefix of a valid document: finish_reason "length", no error."""
    deltas: dict[str, list[RequestDelta]] = {}
    engine.add_request("short", "x", SamplingParams(temperature=0, max_tokens=3, json_schema=SCHEMA, n=2))
    drain(engine, deltas)
    for text, ids, reason in outputs(deltas["short"]).values():
        assert reason == "length" and len(ids) == 3 and text and '{"kind": '.startswith(text), text
    assert all(d.error is None for d in deltas["short"])


def test_grammar_cache_compile_waits_for_its_future(engine: Engine) -> None:
    """``GrammarCache.compile`` (bench, tools) still hands back a compiled grammar, cached once."""
    grammars: GrammarCache = engine.grammars
    params = SamplingParams(regex="[0-9]{2}-cache")
    before = grammars.num_compiled
    first = grammars.compile(params)
    assert grammars.compile(params) is first and grammars.num_compiled == before + 1
