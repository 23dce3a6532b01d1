"""The README's wire protocol says what a reader really gets (issue #24, point 6): each sentence below is
checked twice, in the README and against a real worker (an in-process one on a tiny model, a real Redis).

* a ``token`` event may carry an empty ``text`` with non-empty ``token_ids`` (held-back text);
* ``metadata`` is absent from the final event when the job gave none (the example used to show ``{}``);
* an ``error`` event goes to the default reply stream when the job names no ``reply_to``;
* ``pagedq batch`` takes ``/v1/completions`` lines, not only chat ones;
* with ``logprobs`` asked, each ``token`` event carries the logprobs of exactly its ``token_ids``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ops.batch import command as batch
from schemas.jobs import ErrorEvent, FinalEvent, TokenEvent, parse_event
from schemas.keys import EVENT_FIELD, JOB_FIELD
from tests.redis_servers import RedisServer, redis_server  # noqa: F401
from tests.worker_harness import REPO, Ctx, inprocess_worker, wait_for

README = (REPO / "README.md").read_text()

# Plain Redis clients and one in-process worker: one server kind is enough (the worker tests run both).
DEBIAN = pytest.mark.parametrize("redis_server", ["debian"], indirect=True)


def section(title: str) -> str:
    """The README text under heading ``title`` (any level), up to the next heading, blank lines joined."""
    found = re.search(rf"^#+ {re.escape(title)}\n(.*?)(?=^#+ |\Z)", README, re.S | re.M)
    assert found, f"no section {title!r} in README.md"
    return " ".join(found.group(1).split())


@pytest.fixture
def ctx(redis_server: RedisServer) -> Iterator[Ctx]:  # noqa: F811
    c = Ctx(redis_server)
    yield c
    c.close()


def raw_events(ctx: Ctx, stream: str) -> list[dict[str, Any]]:
    return [json.loads(fields[EVENT_FIELD]) for _, fields in ctx.redis.xrange(stream)]


@DEBIAN
def test_a_token_event_may_have_empty_text_with_token_ids(ctx: Ctx, engine: Any) -> None:
    # A stop string longer than anything generated holds every character back until the job ends (it could
    # still be the start of one), so the first token events carry ids and no text.
    never = "<" + "never generated " * 3 + ">"
    with inprocess_worker(ctx, engine, name="w-held"):
        job_id = ctx.client.submit("Hello there", max_tokens=6, temperature=0, stop=[never])
        final = ctx.client.result(job_id, timeout=60)
    assert isinstance(final, FinalEvent) and final.usage.completion_tokens == 6
    tokens = [e for e in ctx.events(job_id) if isinstance(e, TokenEvent)]
    assert tokens[0].text == "" and tokens[0].token_ids, tokens[0]
    assert "".join(e.text for e in tokens) == final.text  # the held text comes in a later event
    events = section("Events")
    assert re.search(r"token event may have an empty `text` and non-empty `token_ids`", events), events


@DEBIAN
def test_metadata_is_absent_from_the_final_event_when_none_was_given(ctx: Ctx, engine: Any) -> None:
    with inprocess_worker(ctx, engine, name="w-meta"):
        plain = ctx.client.submit("Hello", max_tokens=2, temperature=0)
        tagged = ctx.client.submit("Hello", max_tokens=2, temperature=0, metadata={"user": "u1"})
        ctx.client.result(plain, timeout=60)
        ctx.client.result(tagged, timeout=60)
    (final_plain,) = [e for e in raw_events(ctx, ctx.keys.reply(plain)) if e["type"] == "final"]
    (final_tagged,) = [e for e in raw_events(ctx, ctx.keys.reply(tagged)) if e["type"] == "final"]
    assert "metadata" not in final_plain and final_tagged["metadata"] == {"user": "u1"}
    events = section("Events")
    assert '"metadata":{}' not in events  # the example final event was a job without metadata
    assert "`metadata` only when the job gave one (absent otherwise, not `{}`)" in events


@DEBIAN
def test_an_error_event_goes_to_the_default_reply_stream_without_reply_to(ctx: Ctx, engine: Any) -> None:
    with inprocess_worker(ctx, engine, name="w-err"):
        ctx.redis.xadd(ctx.keys.jobs, {JOB_FIELD: json.dumps({"id": "bad-1", "prompt": 5})})
        wait_for(lambda: ctx.redis.exists(ctx.keys.result("bad-1")), what="the invalid job's result")
    (event,) = ctx.events("bad-1")  # read from <namespace>:{bad-1}:reply, the default stream
    assert isinstance(event, ErrorEvent) and event.code == "invalid_request"
    assert parse_event(ctx.redis.get(ctx.keys.result("bad-1"))) == event
    documented = ctx.keys.reply("<id>").replace(ctx.ns, "pagedq", 1)  # the README writes the default namespace
    events = section("Events")
    assert f"it goes to `{documented}` when the job names no `reply_to`" in events, events


@DEBIAN
def test_batch_runs_completions_lines(
    ctx: Ctx, engine: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    line = {"custom_id": "p1", "method": "POST", "url": "/v1/completions",
            "body": {"model": "tiny", "prompt": "The paged cache", "max_tokens": 3, "temperature": 0}}  # fmt: skip
    inp.write_text(json.dumps(line) + "\n")
    with inprocess_worker(ctx, engine, name="w-batch"):
        code = batch.main(
            [str(inp), str(out), "--redis-url", ctx.server.url, "--namespace", ctx.ns, "--progress", "none"]
        )
    assert code == 0, capsys.readouterr().err
    (record,) = [json.loads(x) for x in out.read_text().splitlines()]
    body = record["response"]["body"]
    assert record["custom_id"] == "p1" and body["object"] == "text_completion" and body["choices"][0]["text"]
    commands = section("Commands")
    assert "OpenAI Batch format (`/v1/chat/completions`, `/v1/completions` and `/v1/responses` lines)" in commands


@DEBIAN
def test_token_events_carry_their_tokens_logprobs(ctx: Ctx, engine: Any) -> None:
    # Held-back text (a stop string never generated) and coalesced steps: each token event's logprobs are
    # still those of exactly its token ids, and one attempt's concatenate to the final event's.
    never = "<" + "never generated " * 3 + ">"
    with inprocess_worker(ctx, engine, name="w-logprobs"):
        asked = ctx.client.submit(
            "Hello there", max_tokens=7, n=2, temperature=0.8, seed=5, logprobs=2, stop=[never], ignore_eos=True
        )
        plain = ctx.client.submit("Hello there", max_tokens=3, temperature=0)
        final = ctx.client.result(asked, timeout=60)
        ctx.client.result(plain, timeout=60)
    assert isinstance(final, FinalEvent) and final.usage.completion_tokens == 14
    tokens = [e for e in ctx.events(asked) if isinstance(e, TokenEvent)]
    assert tokens[0].text == "" and tokens[0].token_ids  # text held back, logprobs not
    for event in tokens:
        assert event.logprobs is not None
        assert [lp.token_id for lp in event.logprobs] == event.token_ids, event
        assert all(len(lp.top) == 2 for lp in event.logprobs)
    for choice in final.choices:
        mine = [e for e in tokens if e.index == choice.index]
        assert [lp for e in mine for lp in e.logprobs or ()] == choice.logprobs
        assert [t for e in mine for t in e.token_ids] == choice.token_ids
    # A job that did not ask for logprobs sends none: the field is absent, as older readers knew the event.
    plain_tokens = [e for e in raw_events(ctx, ctx.keys.reply(plain)) if e["type"] == "token"]
    assert plain_tokens and all("logprobs" not in e for e in plain_tokens)
    events = section("Events")
    assert "a token event also has `logprobs`: the logprobs of exactly its `token_ids`, one each, in order" in events
