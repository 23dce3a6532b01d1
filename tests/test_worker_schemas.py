"""Wire protocol v1 models, settings and the client's stream state machine: pure, no Redis, fast."""

from __future__ import annotations

import datetime
import json

import pytest
from pydantic import ValidationError

from schemas.jobs import (
    Choice,
    DeadLetter,
    ErrorEvent,
    FinalEvent,
    InvalidJob,
    JobRequest,
    Timings,
    TokenEvent,
    Usage,
    parse_event,
    parse_job,
    salvage_reply_target,
)
from schemas.keys import Keys, entry_ref, split_entry_ref
from worker.client import JobFailed, Restart, StreamState, build_job
from worker.settings import SettingsError, load_settings

LIMIT = 1 << 20


def test_documented_example_parses() -> None:
    job = parse_job('{"id":"a1","prompt":"Hello","max_tokens":16,"temperature":0}', LIMIT)
    assert job.id == "a1" and job.prompt == "Hello" and job.max_tokens == 16
    assert job.sampling_kwargs() == {"max_tokens": 16, "temperature": 0.0}
    params = job.sampling_params()
    assert params.max_tokens == 16 and params.greedy


def test_full_job_round_trips() -> None:
    fields = {
        "id": "x.y:z-1_2",
        "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
        "max_tokens": 8,
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 40,
        "min_p": 0.05,
        "repetition_penalty": 1.1,
        "presence_penalty": 0.5,
        "frequency_penalty": -0.5,
        "seed": 7,
        "stop": ["\n\n"],
        "stop_token_ids": [2],
        "ignore_eos": False,
        "min_tokens": 1,
        "logprobs": 3,
        "n": 2,
        "stream": False,
        "reply_to": "my:replies",
        "priority": 5,
        "timeout_s": 2.5,
        "metadata": {"user": "u1", "tags": [1, 2]},
    }
    job = parse_job(json.dumps(fields), LIMIT)
    assert json.loads(job.to_json()) == fields
    assert job.sampling_params().n == 2


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        ("not json", "not valid JSON"),
        ("[1, 2]", "must be a JSON object"),
        ('{"prompt": "x"}', "no id"),
        ('{"id": "", "prompt": "x"}', "id"),
        ('{"id": "has space", "prompt": "x"}', "id"),
        ('{"id": "' + "a" * 129 + '", "prompt": "x"}', "id"),
        ('{"id": 5, "prompt": "x"}', "id"),
        ('{"id": "a"}', "exactly one of prompt, messages, prompt_token_ids"),
        ('{"id": "a", "prompt": "x", "messages": [{"role": "user", "content": "y"}]}', "exactly one"),
        ('{"id": "a", "prompt": ""}', "prompt"),
        ('{"id": "a", "prompt": 5}', "prompt"),
        ('{"id": "a", "messages": []}', "messages"),
        ('{"id": "a", "messages": [{"role": "user"}]}', "messages.0.content"),
        ('{"id": "a", "prompt_token_ids": [1, -2]}', "prompt_token_ids.1"),
        ('{"id": "a", "prompt_token_ids": [1, true]}', "prompt_token_ids.1"),
        ('{"id": "a", "prompt": "x", "max_tokens": "16"}', "max_tokens"),
        ('{"id": "a", "prompt": "x", "max_tokens": 0}', "max_tokens"),
        ('{"id": "a", "prompt": "x", "max_tokens": 1.5}', "max_tokens"),
        ('{"id": "a", "prompt": "x", "temperature": -1}', "temperature"),
        ('{"id": "a", "prompt": "x", "temperature": "hot"}', "temperature"),
        ('{"id": "a", "prompt": "x", "top_p": 0}', "top_p"),
        ('{"id": "a", "prompt": "x", "top_p": 1e400}', "top_p"),
        ('{"id": "a", "prompt": "x", "temperature": NaN}', "NaN"),
        ('{"id": "a", "prompt": "x", "n": 0}', "n"),
        ('{"id": "a", "prompt": "x", "logprobs": 21}', "logprobs"),
        ('{"id": "a", "prompt": "x", "stream": "yes"}', "stream"),
        ('{"id": "a", "prompt": "x", "priority": 1.5}', "priority"),
        ('{"id": "a", "prompt": "x", "timeout_s": 0}', "timeout_s"),
        ('{"id": "a", "prompt": "x", "metadata": [1]}', "metadata"),
        ('{"id": "a", "prompt": "x", "metadata": {"k": "' + "v" * 5000 + '"}}', "metadata is"),
        ('{"id": "a", "prompt": "x", "reply_to": "has space"}', "reply_to"),
        ('{"id": "a", "prompt": "x", "max_token": 3}', "max_token"),
        ('{"id": "a", "prompt": "x", "stop": ""}', "stop"),
        ('{"id": "a", "prompt": "x", "min_tokens": 9, "max_tokens": 3}', "min_tokens"),
        ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
        # JSON lets a name appear twice and json keeps the last: the job would run under the other id.
        ('{"id": "a", "prompt": "x", "id": "b"}', "ambiguous: member 'id' appears twice"),
        ('{"id": "a", "prompt": "x", "metadata": {"k": 1, "k": 2}}', "member 'k' appears twice"),
    ],
)
def test_malformed_jobs_are_rejected_with_a_clear_message(payload: str, message: str) -> None:
    with pytest.raises(InvalidJob) as err:
        parse_job(payload, LIMIT).sampling_params()
    assert message in err.value.message
    assert err.value.code == "invalid_request"


def test_a_byte_order_mark_before_the_job_is_skipped() -> None:
    """RFC 8259 lets a reader ignore a leading BOM, which Windows tools write; json refuses it in a str."""
    assert parse_job('\ufeff{"id": "bom1", "prompt": "x"}', LIMIT).id == "bom1"
    assert salvage_reply_target('\ufeff{"id": "bom2", "prompt": 5}', LIMIT) == ("bom2", None)
    with pytest.raises(InvalidJob, match="prompt"):
        parse_job('\ufeff{"id": "bom2", "prompt": 5}', LIMIT)


def test_size_limit_and_invalid_utf8() -> None:
    with pytest.raises(InvalidJob, match="bytes, the limit is 100"):
        parse_job(json.dumps({"id": "a", "prompt": "x" * 200}), 100)
    raw = b'{"id":"a","prompt":"\xff"}'.decode("utf-8", "surrogateescape")
    with pytest.raises(InvalidJob, match="UTF-8"):
        parse_job(raw, LIMIT)
    assert salvage_reply_target(raw, LIMIT) == ("a", None)


def test_salvage_reply_target() -> None:
    assert salvage_reply_target('{"id": "j1", "temperature": "x"}', LIMIT) == ("j1", None)
    assert salvage_reply_target('{"id": "j1", "reply_to": "r:1", "n": -1}', LIMIT) == ("j1", "r:1")
    assert salvage_reply_target('{"id": "j 1"}', LIMIT) is None
    # A malformed reply_to does not cost the producer its answer: it goes to the job's own stream.
    for bad in ("3", '""', '"a b"', '"' + "x" * 257 + '"', '{"k": 1}'):
        assert salvage_reply_target('{"id": "j1", "reply_to": ' + bad + "}", LIMIT) == ("j1", None), bad
    assert salvage_reply_target("[]", LIMIT) is None
    assert salvage_reply_target("{", LIMIT) is None


def _nested(depth: int, inner: str = "1") -> str:
    return '{"k":' * depth + inner + "}" * depth


@pytest.mark.parametrize(
    "payload",
    [
        # Python's json.dumps writes NaN and Infinity by default; the strict parser refuses them.
        json.dumps({"id": "j1", "prompt": "x", "temperature": float("nan"), "reply_to": "r:1"}),
        '{"id": "j1", "prompt": "x", "top_p": Infinity, "min_p": -Infinity, "reply_to": "r:1"}',
        # Past Python's int-string limit (4300 digits): json raises ValueError.
        '{"id": "j1", "prompt": "x", "max_tokens": ' + "9" * 5000 + ', "reply_to": "r:1"}',
        '{"id": "j1", "prompt": "x", "seed": -' + "9" * 100_000 + ', "reply_to": "r:1"}',
        # Nested past json's recursion limit: RecursionError; the id and reply_to before and after it.
        '{"id": "j1", "prompt": "x", "metadata": ' + _nested(5000) + ', "reply_to": "r:1"}',
        '{"metadata": ' + "[" * 100_000 + "]" * 100_000 + ', "id": "j1", "reply_to": "r:1"}',
        '{"m": [' + _nested(3000, json.dumps(']}]}"\\')) + ', "{"], "id": "j1", "n": NaN, "reply_to": "r:1"}',
    ],
    ids=["nan", "infinity", "long-int", "longer-int", "deep-metadata", "deep-first", "brackets-in-strings"],
)
def test_salvage_reads_payloads_only_the_strict_parser_refuses(payload: str) -> None:
    """A job refused as not strict JSON still has an id its producer waits on: salvage reads it leniently
    (and boundedly), while parse_job still refuses the job, with a message that says why."""
    assert salvage_reply_target(payload, LIMIT) == ("j1", "r:1")
    with pytest.raises(InvalidJob) as err:
        parse_job(payload, LIMIT)
    assert err.value.code == "invalid_request"
    assert any(word in err.value.message for word in ("NaN", "Infinity", "digits", "nested")), err.value.message


def test_refusal_of_a_long_integer_says_what_is_wrong() -> None:
    with pytest.raises(InvalidJob) as err:
        parse_job('{"id": "a", "prompt": "x", "max_tokens": ' + "9" * 5000 + "}", LIMIT)
    assert "integer of 5000 digits" in err.value.message and "set_int_max_str_digits" not in err.value.message


@pytest.mark.parametrize(
    ("payload", "expected"),
    [
        # An id given twice with different values is trusted on no path: parse_job refuses such a job, and its
        # error must not go to one producer's id chosen by order; given twice alike, it is that id.
        ('{"id": "a", "x": NaN, "id": "b"}', None),
        ('{"id": "a", "x": ' + _nested(5000) + ', "id": "b"}', None),
        ('{"id": "a", "x": ' + _nested(5000) + ', "id": 5}', None),
        ('{"id": "a", "x": NaN, "id": "a", "reply_to": "r:1"}', ("a", "r:1")),
        ('{"id": "a", "x": ' + _nested(5000) + ', "id": "a"}', ("a", None)),
        ('{"id": "a", "reply_to": "r:1", "x": NaN, "reply_to": "r:2"}', ("a", None)),
        # Only a top-level id counts, never one inside a nested value or a string.
        ('{"x": ' + _nested(5000, '{"id": "inner"}') + "}", None),
        ('{"x": ' + _nested(5000, '"\\"id\\": \\"inner\\""') + "}", None),
        ('{"id": 7, "x": NaN}', None),
        ('{"id": "a", "reply_to": "a b", "x": ' + _nested(5000) + "}", ("a", None)),
        # Not JSON however leniently read: unbalanced, mismatched, unterminated, trailing garbage.
        ('{"id": "a", "x": ' + '{"k":' * 5000 + "1" + "}" * 4999, None),
        ('{"id": "a", "x": ' + "[" * 5000 + "}" * 5000 + "}", None),
        ('{"id": "a", "x": ' + "[" * 5000 + '"' + "]" * 5000 + "}", None),
        ('{"id": "a", "x": ' + _nested(5000) + "} trailing", None),
        ('{"id": "a", "x": ' + _nested(5000) + ",}", None),
        ('{"id": "a", "x": NaN', None),
        ("[NaN, " + _nested(5000) + "]", None),
    ],
    ids=[
        "duplicate-lenient",
        "duplicate-deep",
        "duplicate-deep-invalid",
        "duplicate-alike-lenient",
        "duplicate-alike-deep",
        "duplicate-reply-to",
        "id-in-nested-object",
        "id-in-string",
        "number-id",
        "bad-reply-to-deep",
        "unbalanced",
        "mismatched",
        "unterminated-string",
        "trailing-garbage",
        "trailing-comma",
        "truncated",
        "not-an-object",
    ],
)
def test_lenient_salvage_trusts_only_a_top_level_id(payload: str, expected: tuple[str, str | None] | None) -> None:
    assert salvage_reply_target(payload, LIMIT) == expected


def test_lenient_salvage_is_bounded() -> None:
    """A payload that would keep the scan busy (each level costs a step) is given up on after
    SALVAGE_SCAN_STEPS steps: a dead letter only, as for one over the size bound, never an unbounded CPU bill
    (no recursion: a million levels raise no RecursionError)."""
    from schemas.jobs import SALVAGE_SCAN_STEPS

    within = SALVAGE_SCAN_STEPS // 4  # three tokens a level: '{', '"k":', then the closers in one run
    assert salvage_reply_target('{"x": ' + _nested(within) + ', "id": "a"}', 64 << 20) == ("a", None)
    assert salvage_reply_target('{"x": ' + _nested(SALVAGE_SCAN_STEPS) + ', "id": "a"}', 64 << 20) is None
    assert salvage_reply_target('{"x": ' + "[" * 1_000_000 + "]" * 1_000_000 + ', "id": "a"}', 64 << 20) == (
        "a",
        None,
    )


def _final(text: str, attempt: int = 1) -> FinalEvent:
    return FinalEvent(
        id="j",
        attempt=attempt,
        choices=[Choice(index=0, text=text, token_ids=[1], finish_reason="stop")],
        usage=Usage(prompt_tokens=1, completion_tokens=1),
        timings=Timings(queued_s=0.0, ttft_s=0.1, total_s=0.2),
        worker="w",
    )


def test_events_round_trip_and_ignore_unknown_fields() -> None:
    for event in (
        TokenEvent(id="j", attempt=1, index=0, text="hi", token_ids=[5]),
        _final("hi"),
        ErrorEvent(id="j", attempt=2, code="cancelled", message="m", worker="w"),
    ):
        assert parse_event(event.to_json()) == event
        data = json.loads(event.to_json())
        assert list(data)[:3] == ["type", "id", "attempt"]
        data["future_field"] = 1
        assert parse_event(json.dumps(data)) == event


def test_dead_letter_fields_round_trip() -> None:
    dead = DeadLetter(job="{}", reason="r", code="invalid_request", attempts=2, worker="w", job_id="j")
    fields = dead.to_fields()
    assert all(isinstance(v, str) for v in fields.values())
    assert DeadLetter.from_fields(fields) == dead


def _tok(text: str, attempt: int = 1, index: int = 0) -> TokenEvent:
    return TokenEvent(id="j", attempt=attempt, index=index, text=text, token_ids=[1])


def _run(events: list[TokenEvent | FinalEvent | ErrorEvent]) -> list[object]:
    state = StreamState()
    out: list[object] = []
    for e in events:
        out += state.feed(e)
    return out


def test_stream_state_plain() -> None:
    final = _final("Hello world")
    assert _run([_tok("Hel"), _tok("lo"), _tok(" world", index=1), _tok(" world"), final]) == [
        "Hel",
        "lo",
        " world",
        final,
    ]


def test_stream_state_redelivery_same_text_is_not_repeated() -> None:
    final = _final("abcdef", attempt=2)
    out = _run([_tok("ab"), _tok("cd"), _tok("a", 2), _tok("bc", 2), _tok("def", 2), final])
    assert out == ["ab", "cd", "ef", final]
    assert "".join(x for x in out if isinstance(x, str)) == final.text


def test_stream_state_redelivery_divergent_text_restarts() -> None:
    final = _final("xyz", attempt=2)
    out = _run([_tok("ab"), _tok("x", 2), _tok("yz", 2), _tok("late", 1), final])
    assert out == ["ab", Restart(2), "x", "yz", final]


def test_stream_state_final_fills_missing_deltas_and_errors_raise() -> None:
    final = _final("abc")
    assert _run([_tok("a"), final]) == ["a", "bc", final]
    with pytest.raises(JobFailed) as err:
        _run([_tok("a"), ErrorEvent(id="j", attempt=1, code="dead_lettered", message="gave up")])
    assert err.value.code == "dead_lettered"


def test_build_job_dispatches_on_prompt_type() -> None:
    assert build_job("hi").prompt == "hi"
    assert build_job([1, 2, 3]).prompt_token_ids == [1, 2, 3]
    msgs = [{"role": "user", "content": "hi"}]
    job = build_job(msgs, max_tokens=4, id="fixed")
    assert job.messages is not None and job.messages[0].content == "hi" and job.id == "fixed"
    assert len(build_job("x").id) == 32
    assert isinstance(build_job("x", temperature=0), JobRequest)
    # A Python value JSON cannot carry is a validation error, not a TypeError from inside the validator.
    with pytest.raises(ValidationError, match="metadata is not valid JSON"):
        build_job("x", metadata={"at": datetime.datetime(2026, 1, 1)})
    # The engine's own rules are a producer's error at once, not an error event after a round trip.
    for bad in ({"stop": [""]}, {"min_tokens": 5, "max_tokens": 2}):
        with pytest.raises(ValidationError):
            build_job("x", **bad)


def test_keys_and_reserved_reply_targets() -> None:
    keys = Keys("pq", "q1")
    # Wire protocol v2: a queue's shard streams carry the queue and shard as their hash tag, a job's keys
    # its id, so every script's keys share one slot on a cluster.
    assert keys.jobs == "pq:jobs:{q1:0}" and keys.dead == "pq:dead:{q1:0}"
    assert Keys("pq", "q1", 3).job_streams == ["pq:jobs:{q1:0}", "pq:jobs:{q1:1}", "pq:jobs:{q1:2}"]
    assert Keys("pq", "q1", 3).shard_of_stream("pq:jobs:{q1:2}") == 2
    assert keys.jobs_v1 == "pq:jobs:q1"
    assert keys.reply("a") == "pq:{a}:reply" and keys.result("a") == "pq:{a}:result"
    assert keys.cancel("a") == "pq:{a}:cancel"
    assert entry_ref(0, "1-0") == "1-0" and entry_ref(2, "1-0") == "1-0@2"
    assert split_entry_ref("1-0") == (0, "1-0") and split_entry_ref("1-0@2") == (2, "1-0")
    with pytest.raises(ValueError):
        Keys("pq", "q1", 0)
    # A job reaches its own reply stream, and a key under a granted prefix that pagedq uses for nothing else.
    assert keys.reply_target("a", None) == keys.reply_target("a", "pq:{a}:reply") == "pq:{a}:reply"
    assert keys.reply_target("a", "pq:{other}:reply") is None  # another job's stream
    assert keys.reply_target("a", "elsewhere:x") is None  # not granted
    assert keys.reply_target("a", "app:replies:a", ["app:replies:"]) == "app:replies:a"
    granted = ["pq:"]  # even an operator granting the whole namespace does not open pagedq's own keys
    assert keys.reply_target("a", "pq:custom:a", granted) == "pq:custom:a"
    reserved_keys = ("pq:jobs:{q1:0}", "pq:{a}:result", "pq:{b}:reply", "pq:dead:{q1:0}", "pq:{a}:cancel")
    for reserved in (*reserved_keys, "pq:worker:q1:w", "pq:jobs:q1", "pq:reply:b", "pq:result:a"):
        assert keys.reply_target("a", reserved, granted) is None, reserved
    with pytest.raises(ValueError):
        Keys("a:b")


def test_settings_errors_name_the_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGEDQ_MAX_NUM_SEQS", "-1")
    with pytest.raises(SettingsError, match=r"max_num_seqs \(PAGEDQ_MAX_NUM_SEQS\)"):
        load_settings()
    monkeypatch.delenv("PAGEDQ_MAX_NUM_SEQS")
    # Overrides are flags (load_settings' contract): the error names the flag, not a variable that is unset.
    with pytest.raises(SettingsError, match=r"redis_url \(--redis-url\)"):
        load_settings(redis_url="http://localhost")
    with pytest.raises(SettingsError, match=r"redis_url \(--redis-url\)"):
        load_settings(redis_url="redis://localhost:notaport")
    with pytest.raises(SettingsError, match=r"reclaim_idle_s \(--reclaim-idle-s\)"):
        load_settings(reclaim_idle_s=0)
    with pytest.raises(SettingsError, match="unknown setting"):
        load_settings(bogus=1)
    s = load_settings(redis_url="rediss://user:secret@host:6380/1", max_num_seqs="8")
    assert s.max_num_seqs == 8
    assert "secret" not in json.dumps(s.redacted()) and "***" in s.redacted()["redis_url"]
