"""``pagedq submit`` / ``status`` / ``dead list|replay`` against a real Redis and a real (in-process) worker.

``submit`` runs as a real subprocess on a pseudo-terminal, with the worker stepped by hand from the test, so
"tokens reach the terminal while the job is still running" is checked without any timing assumption: the
worker is paused mid-generation and the terminal must already show the text produced so far.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import json
import os
import pty
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from ops import queue_commands
from schemas.jobs import DeadLetter, ErrorEvent, FinalEvent, parse_event
from schemas.keys import EVENT_FIELD, GROUP, JOB_FIELD, Keys
from tests.redis_servers import RedisServer, free_port, redis_server  # noqa: F401
from tests.worker_harness import REPO, Ctx, inprocess_worker, wait_for
from worker.consumer import Worker
from worker.reclaimer import ensure_group

# One server kind is enough here: these commands are plain Redis clients (the worker tests cover both).
DEBIAN = pytest.mark.parametrize("redis_server", ["debian"], indirect=True)


@pytest.fixture
def ctx(redis_server: RedisServer) -> Iterator[Ctx]:  # noqa: F811
    c = Ctx(redis_server)
    yield c
    c.close()


def cli(ctx: Ctx, *argv: str) -> list[str]:
    return [*argv, "--redis-url", ctx.server.url, "--namespace", ctx.ns]


def subprocess_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PAGEDQ_")}
    env.update({"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"})
    return env


def json_in(out: str) -> Any:
    """The JSON document a command printed, skipping log lines of the in-process worker (structlog's default
    logger prints to stdout too)."""
    start = out.index("{\n") if out.startswith("{\n") else out.index("\n{\n") + 1
    return json.JSONDecoder().raw_decode(out, start)[0]


def json_lines(out: str) -> list[Any]:
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def reply_events(ctx: Ctx, job_id: str) -> list[Any]:
    return [parse_event(f[EVENT_FIELD]) for _, f in ctx.redis.xrange(ctx.keys.reply(job_id))]


def words(text: str) -> str:
    """Text with every run of whitespace as one space: warnings are wrapped to the terminal's width."""
    return " ".join(text.split())


@contextlib.contextmanager
def stdout_bytes() -> Iterator[io.BytesIO]:
    """``sys.stdout`` as the bytes a terminal or pipe gets. ``surrogateescape`` is what Python gives stdout in
    a C/POSIX or UTF-8-mode locale: a string holding undecodable bytes goes out raw there (elsewhere
    printing it raises), which is how ``dead list --json`` wrote a bare 0xC3."""
    buffer = io.BytesIO()
    out = io.TextIOWrapper(buffer, encoding="utf-8", errors="surrogateescape", newline="\n", write_through=True)
    saved, sys.stdout = sys.stdout, out
    try:
        yield buffer
    finally:
        sys.stdout = saved
        out.detach()  # else collecting the wrapper closes the buffer before the test reads it


# ------------------------------------------------------------------------------------------ status


@DEBIAN
def test_status_shows_backlog_dead_letter_consumers_and_workers(
    ctx: Ctx, engine: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    with inprocess_worker(ctx, engine, name="w-status") as worker:
        ctx.redis.xadd(ctx.keys.jobs, {JOB_FIELD: json.dumps({"id": "bad-1", "prompt": 5})})
        wait_for(lambda: ctx.redis.xlen(ctx.keys.dead) == 1, what="the invalid job's dead letter")
        bulk = Keys(ctx.ns, "bulk")  # a queue nobody serves: its jobs stay in the backlog
        for i in range(3):
            ctx.redis.xadd(bulk.jobs, {JOB_FIELD: json.dumps({"id": f"b{i}", "prompt": "hi"})})
        wait_for(lambda: "w-status" in ctx.heartbeats(), what="heartbeat")

        assert queue_commands.main(cli(ctx, "status", "--json")) == 0
        report = json_in(capsys.readouterr().out)
        queues = {q["queue"]: q for q in report["queues"]}
        assert set(queues) == {"default", "bulk"}
        assert queues["bulk"]["backlog"] == 3 and queues["bulk"]["pending"] == 0
        assert queues["bulk"]["consumers"] == [] and queues["bulk"]["workers"] == []
        assert queues["default"]["dead_letters"] == 1
        assert [c["name"] for c in queues["default"]["consumers"]] == ["w-status"]
        assert queues["default"]["consumers"][0]["idle_ms"] >= 0
        live = queues["default"]["workers"]
        assert [w["name"] for w in live] == ["w-status"] and live[0]["state"] == "ready"

        assert queue_commands.main(cli(ctx, "status")) == 0
        text = capsys.readouterr().out
        assert "queue bulk" in text and "queue default" in text
        assert "backlog       3 job(s)" in text
        assert "dead letters  1" in text
        assert "w-status" in text and "live workers  1" in text
        assert worker.counts["error"] == 1


def scan_calls(r: Any) -> int:
    """SCAN commands the server has run since it started (``INFO commandstats``)."""
    return int(r.info("commandstats").get("cmdstat_scan", {}).get("calls", 0))


@DEBIAN
def test_live_workers_are_found_through_the_index_without_a_scan(
    redis_server: RedisServer,  # noqa: F811
    engine: Any,
) -> None:
    """Every reader of the live workers (the worker's intake: homes and tidy, on its main loop; ``pagedq
    status``; the gateway's router and dashboard) SCANned the whole keyspace: 0.54 s for 1M keys of a shared
    Redis, no engine step meanwhile. Now they read the namespace's index ``<ns>:workers`` and GET its members'
    heartbeats: with 50,000 unrelated keys on the server none issues a SCAN, and they list exactly the live
    worker. The heartbeat key is the truth: an indexed worker whose heartbeat expired is not listed, and a
    heartbeat no index lists (a worker of the version before the index) is not either (README). A member
    expired long ago is pruned by the readers; a worker's clean stop removes its own member."""
    from ops.gateway.fleet import Dashboard, live_workers
    from worker.redis_url import connect_async

    ctx = Ctx(redis_server, shards=2)
    index = f"{ctx.ns}:workers"  # the wire names, spelled out: other clients read them (README)
    other = f"{ctx.ns}-other"
    pipe = ctx.redis.pipeline(transaction=False)
    for i in range(50_000):
        pipe.set(f"{other}:{i}", "x")
    pipe.execute()
    try:
        beat = json.dumps({"model": "/models/old", "state": "ready"})
        ctx.redis.set(ctx.keys.heartbeat("w-unindexed"), beat, ex=300)
        ctx.redis.zadd(index, {"default:w-expired": time.time() + 0.05, "default:w-long-gone": time.time() - 120})
        ctx.redis.set(ctx.keys.heartbeat("w-expired"), beat, px=50)
        wait_for(lambda: not ctx.redis.exists(ctx.keys.heartbeat("w-expired")), what="the heartbeat to expire")

        async def gateway_sees() -> list[str]:
            r = connect_async(ctx.server.url, decode_responses=True)
            try:
                return sorted(w.name for w in await live_workers(r, ctx.ns))
            finally:
                await r.aclose()

        with inprocess_worker(ctx, engine, name="w-live") as worker:
            wait_for(lambda: ctx.redis.exists(ctx.keys.heartbeat("w-live")), what="the worker's heartbeat")
            before = scan_calls(ctx.redis)
            seen = (
                worker.intake._live_workers(),
                queue_commands.live_worker_names(ctx.redis, ctx.keys),
                set(asyncio.run(gateway_sees())),
                {key.partition(":")[2] for key in Dashboard(ctx.redis, ctx.ns, queue_shards=2)._beats()},
            )
            assert scan_calls(ctx.redis) - before == 0
            assert seen == ({"w-live"},) * 4
            status = queue_commands.queue_status(ctx.redis, ctx.keys)  # SCANs for shard streams, not workers
            assert [w["name"] for w in status["workers"]] == ["w-live"]
            assert ctx.redis.zscore(index, "default:w-live") is not None
            assert ctx.redis.zscore(index, "default:w-long-gone") is None
        assert ctx.redis.zscore(index, "default:w-live") is None
        assert not ctx.redis.exists(ctx.keys.heartbeat("w-live"))
    finally:
        names = [f"{other}:{i}" for i in range(50_000)]
        for start in range(0, len(names), 10_000):
            ctx.redis.delete(*names[start : start + 10_000])
        ctx.redis.delete(index, ctx.keys.heartbeat("w-unindexed"))
        ctx.close()


@DEBIAN
def test_status_of_an_empty_namespace(ctx: Ctx, capsys: pytest.CaptureFixture[str]) -> None:
    assert queue_commands.main(cli(ctx, "status")) == 0
    assert "no queues" in capsys.readouterr().out
    assert queue_commands.main(cli(ctx, "status", "--queue", "nothing", "--json")) == 0
    (q,) = json_in(capsys.readouterr().out)["queues"]
    assert q["backlog"] == 0 and q["dead_letters"] == 0


@DEBIAN
def test_status_reports_jobs_on_shards_beyond_queue_shards(
    ctx: Ctx, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A producer with queue_shards=4 next to workers (and ``status``) at 1: its jobs on shards 1-3 are never
    read, and ``status`` showed only shard 0's. Now it counts every shard stream there is, names them, and
    says which jobs workers with its queue_shards do not serve and what to do."""
    monkeypatch.delenv("PAGEDQ_QUEUE_SHARDS", raising=False)
    four = Keys(ctx.ns, "mism", 4)
    for shard, count in ((0, 1), (1, 2), (3, 2)):  # shard 2 got nothing: its stream does not exist
        for i in range(count):
            ctx.redis.xadd(four.jobs_shard(shard), {JOB_FIELD: json.dumps({"id": f"m{shard}-{i}", "prompt": "hi"})})
    s0, s1, s3 = four.jobs_shard(0), four.jobs_shard(1), four.jobs_shard(3)

    assert queue_commands.main(cli(ctx, "status", "--json")) == 0
    (q,) = json_in(capsys.readouterr().out)["queues"]
    assert q["queue"] == "mism" and q["shards"] == 1
    assert q["backlog"] == 5 and q["streams"] == [s0, s1, s3]
    assert [(row["shard"], row["backlog"], row["served"]) for row in q["shard_streams"]] == [
        (0, 1, True),
        (1, 2, False),
        (3, 2, False),
    ]
    assert q["unserved"] == {
        "shards": [1, 3],
        "streams": [s1, s3],
        "backlog": 4,
        "dead_letters": 0,
        "live_readers": [],
        "queue_shards_needed": 4,
    }
    (warning,) = q["warnings"]
    assert f"4 job(s) on shard(s) 1, 3 ({s1}: 2, {s3}: 2) are not served by workers with queue_shards=1" in warning
    assert "No live worker reads them" in warning and "PAGEDQ_QUEUE_SHARDS=4" in warning

    for argv in (cli(ctx, "status"), cli(ctx, "status", "--queue", "mism")):
        assert queue_commands.main(argv) == 0
        text = capsys.readouterr().out
        assert f"backlog       5 job(s) in {s0}, {s1}, {s3} (0 pending in workers)" in text
        assert f"warning {warning}" in words(text)

    # This command at 4 shards, the workers at 1 (one started: it made its group on shard 0 only): the backlog
    # line names the four streams, and the shards no worker ever read are pointed out.
    ensure_group(ctx.redis, Keys(ctx.ns, "mism", 1))
    monkeypatch.setenv("PAGEDQ_QUEUE_SHARDS", "4")
    assert queue_commands.main(cli(ctx, "status")) == 0
    text = words(capsys.readouterr().out)
    assert f"backlog 5 job(s) in {ctx.ns}:jobs:{{mism:0..3}} (0 pending in workers, 1 not yet delivered)" in text
    assert "not served" not in text
    assert (
        f"warning 4 job(s) on shard(s) 1, 3 ({s1}: 2, {s3}: 2) have never been read by any worker: no `workers` "
        "consumer group there, while shard(s) 0 have one" in text
    )
    assert "The workers probably run with queue_shards below 4" in text

    # The workers do run with 4 shards (one is reading shard 3) and left a dead letter on shard 2; this command
    # is the one at 1: it must say so rather than send the operator off to reconfigure the workers.
    monkeypatch.delenv("PAGEDQ_QUEUE_SHARDS")
    ensure_group(ctx.redis, four)
    assert ctx.redis.xreadgroup(GROUP, "w4", {s3: ">"}, count=1)
    ctx.redis.set(four.heartbeat("w4"), json.dumps({"name": "w4", "state": "ready", "ts": time.time()}), ex=600)
    ctx.redis.zadd(four.workers, {four.worker_member("w4"): time.time() + 600})  # listed, as workers list themselves
    letter = DeadLetter(job="{oops", reason="job is not valid JSON", code="invalid_request", attempts=1, worker="w4")
    ctx.redis.xadd(four.dead_shard(2), letter.to_fields())
    assert queue_commands.main(cli(ctx, "status", "--json")) == 0
    (q,) = json_in(capsys.readouterr().out)["queues"]
    assert q["dead_letters"] == 1 and q["unserved"]["live_readers"] == ["w4"]
    assert q["unserved"]["shards"] == [1, 2, 3] and q["unserved"]["backlog"] == 4
    jobs_warning, dead_warning = q["warnings"]
    assert "Live worker(s) w4 do read these shards" in jobs_warning and "No live worker" not in jobs_warning
    assert dead_warning == (
        f"1 dead letter(s) in {four.dead_shard(2)} are not shown by `pagedq dead list` with queue_shards=1: "
        "run it with PAGEDQ_QUEUE_SHARDS=3."
    )


# -------------------------------------------------------------------------------------------- dead


@DEBIAN
def test_dead_list_and_replay(ctx: Ctx, engine: Any, capsys: pytest.CaptureFixture[str]) -> None:
    # A valid job that ran out of attempts, exactly as a worker leaves it: dead letter + error result.
    raw = json.dumps({"id": "tired-1", "prompt": "Hello there", "max_tokens": 4, "temperature": 0})
    letter = DeadLetter(
        job=raw,
        reason="delivered 4 times, more than max_attempts=3",
        code="dead_lettered",
        attempts=4,
        worker="w-old",
        job_id="tired-1",
        entry_id="1-0",
    )
    entry = ctx.redis.xadd(ctx.keys.dead, letter.to_fields())
    error = ErrorEvent(id="tired-1", attempt=4, code="dead_lettered", message=letter.reason, worker="w-old")
    ctx.redis.set(ctx.keys.result("tired-1"), error.to_json())
    ctx.redis.xadd(ctx.keys.reply("tired-1"), {EVENT_FIELD: error.to_json()})
    ctx.redis.xadd(
        ctx.keys.dead,
        DeadLetter(
            job="{oops", reason="job is not valid JSON", code="invalid_request", attempts=1, worker="w-old"
        ).to_fields(),
    )

    assert queue_commands.main(cli(ctx, "dead", "list")) == 0
    text = capsys.readouterr().out
    assert "2 dead letter(s)" in text and entry in text and "tired-1" in text and "dead_lettered" in text
    assert queue_commands.main(cli(ctx, "dead", "list", "--json", "--count", "1")) == 0
    (row,) = json_lines(capsys.readouterr().out)
    assert row["entry"] == entry and row["job"] == raw

    assert queue_commands.main(cli(ctx, "dead", "replay")) == 2  # neither ids nor --all
    assert queue_commands.main(cli(ctx, "dead", "replay", "9-9")) == 1
    capsys.readouterr()
    with inprocess_worker(ctx, engine, name="w-replay"):
        assert queue_commands.main(cli(ctx, "dead", "replay", entry)) == 0
        final = ctx.client.result("tired-1", timeout=60)
    assert isinstance(final, FinalEvent) and final.usage.completion_tokens == 4
    assert ctx.redis.xlen(ctx.keys.dead) == 1  # the invalid one is still there
    assert [e.type for e in reply_events(ctx, "tired-1") if e.type != "token"] == ["final"]  # old error gone


@DEBIAN
def test_dead_list_of_a_payload_that_is_not_utf8(ctx: Ctx, engine: Any) -> None:
    """``dead list --json`` wrote the payload's invalid byte raw (``ensure_ascii=False`` over surrogateescape
    text), so its line was neither UTF-8 nor JSON. Every line is both now, ``job`` has U+FFFD for the bad
    byte and ``job_base64`` the exact bytes; the text table shows such bytes as ``\\xNN``; ``dead replay``
    re-queues the payload byte for byte."""
    payload = b'{"id":"u8-1","prompt":"hi \xc3( there"}'
    raw_redis: Any = redis.Redis.from_url(ctx.server.url)  # bytes in and out
    escaped = ctx.server.client(encoding_errors="surrogateescape")  # str holding those bytes, as the worker's
    with inprocess_worker(ctx, engine, name="w-u8"):
        raw_redis.xadd(ctx.keys.jobs.encode(), {JOB_FIELD.encode(): payload})
        wait_for(lambda: ctx.redis.xlen(ctx.keys.dead) == 1, what="the payload's dead letter")
    # A valid non-ASCII payload (kept as text, no base64) and a reason with a byte that is not UTF-8 (anyone can
    # write the stream; the table must not print it raw).
    fine = DeadLetter(
        job='{"prompt": "café ☕"}', reason="bad \udcff byte", code="invalid_request", attempts=1, worker="w"
    )
    fine_entry = escaped.xadd(ctx.keys.dead, fine.to_fields())

    with stdout_bytes() as out:
        assert queue_commands.main(cli(ctx, "dead", "list", "--json")) == 0
    lines = out.getvalue().decode("utf-8").splitlines()  # strict: raises on any byte that is not UTF-8
    (bad, good) = [json.loads(line) for line in lines]
    assert bad["code"] == "invalid_request" and "not valid UTF-8" in bad["reason"] and bad["job_id"] == "u8-1"
    assert bad["job"] == payload.decode("utf-8", "replace") and base64.b64decode(bad["job_base64"]) == payload
    assert good["entry"] == fine_entry and good["job"] == fine.job and good["job_base64"] is None
    assert good["reason"] == "bad \ufffd byte"

    with stdout_bytes() as out:
        assert queue_commands.main(cli(ctx, "dead", "list")) == 0
    text = out.getvalue().decode("utf-8")
    assert "2 dead letter(s)" in text and "u8-1" in text and "bad \\xff byte" in text

    entry = bad["entry"]
    with stdout_bytes() as out:
        assert queue_commands.main(cli(ctx, "dead", "replay", entry)) == 0
    assert f"{entry} -> {ctx.keys.jobs}" in out.getvalue().decode("utf-8")
    ((_, fields),) = raw_redis.xrange(ctx.keys.jobs.encode())
    assert fields[JOB_FIELD.encode()] == payload
    assert ctx.redis.xlen(ctx.keys.dead) == 1  # only the hand-made one is left
    raw_redis.close()
    escaped.close()


@DEBIAN
def test_dead_replay_of_a_truncated_payload_cut_inside_a_character(
    ctx: Ctx, capsys: pytest.CaptureFixture[str]
) -> None:
    """A payload cut at ``dead_payload_bytes`` can end inside a multi-byte character, which the worker keeps as
    surrogateescape text: the "not replayed" warning counted its bytes with a strict ``encode()`` and died
    with a traceback."""
    data = '{"id":"cut-1","prompt":"é"}'.encode()
    kept = data[: data.index(b"\xc3") + 1]  # the first byte of "é" only
    letter = DeadLetter(
        job=kept.decode("utf-8", "surrogateescape"),
        job_bytes=len(data),
        reason="delivered 4 times, more than max_attempts=3",
        code="dead_lettered",
        attempts=4,
        worker="w-old",
        job_id="cut-1",
    )
    assert letter.truncated
    escaped = ctx.server.client(encoding_errors="surrogateescape")
    escaped.xadd(ctx.keys.dead, letter.to_fields())
    escaped.close()
    assert queue_commands.main(cli(ctx, "dead", "replay", "--all")) == 0
    err = capsys.readouterr().err
    assert f"keeps only {len(kept)} of the job's {len(data)} bytes" in err and "replayed 0 dead letter(s)" in err
    assert ctx.redis.xlen(ctx.keys.dead) == 1 and not ctx.redis.exists(ctx.keys.jobs)


@DEBIAN
def test_dead_replay_of_a_malformed_entry_id_is_a_usage_error(ctx: Ctx, capsys: pytest.CaptureFixture[str]) -> None:
    """``dead replay nonsense`` was reported as a Redis error (exit 1), ``1-0@x`` as a traceback: both are usage
    errors (exit 2) naming the id and the form expected, found before anything is replayed."""
    letter = DeadLetter(job="{oops", reason="job is not valid JSON", code="invalid_request", attempts=1, worker="w")
    entry = ctx.redis.xadd(ctx.keys.dead, letter.to_fields())
    for bad in ("nonsense", "1-0@x", "1-0@-1", "1-x", "1-0@", "18446744073709551616-0", f"{entry} "):
        assert queue_commands.main(cli(ctx, "dead", "replay", entry, bad)) == 2, bad
        err = capsys.readouterr().err
        assert f"bad entry id {bad!r}: expected <ms>-<seq>" in err and "@<shard>" in err, err
        assert "Redis error" not in err
    assert ctx.redis.xlen(ctx.keys.dead) == 1 and not ctx.redis.exists(ctx.keys.jobs)  # nothing replayed
    # Well formed but absent stays "not found" (exit 1); on a shard this command does not read, it says why.
    assert queue_commands.main(cli(ctx, "dead", "replay", "1-0@3")) == 1
    assert "shard 3 is beyond queue_shards=1" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------ submit


class PtyProcess:
    """A subprocess whose stdout and stderr are a pseudo-terminal; output is collected by a thread."""

    def __init__(self, argv: list[str]) -> None:
        master, slave = pty.openpty()
        self.proc = subprocess.Popen(
            argv, cwd=REPO, env=subprocess_env(), stdin=subprocess.DEVNULL, stdout=slave, stderr=slave, close_fds=True
        )
        os.close(slave)
        self.master = master
        self.chunks: list[bytes] = []
        self.lock = threading.Lock()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        while True:
            try:
                data = os.read(self.master, 4096)
            except OSError:  # EIO: the child closed the terminal
                return
            if not data:
                return
            with self.lock:
                self.chunks.append(data)

    def output(self) -> str:
        with self.lock:
            return b"".join(self.chunks).decode("utf-8", "replace").replace("\r", "")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)
        self.reader.join(10)
        os.close(self.master)


def _clean(text: str) -> str:
    return text.replace("\r", "")


@DEBIAN
def test_submit_streams_tokens_to_a_terminal_as_they_arrive(ctx: Ctx, engine: Any) -> None:
    worker = Worker(ctx.settings(name="w-pty"), engine)
    worker.startup()
    p = PtyProcess(
        [
            sys.executable,
            "-m",
            "ops.queue_commands",
            "submit",
            "Once upon a time",
            "--max-tokens",
            "40",
            "--temperature",
            "0",
            "--id",
            "pty-1",
            "--redis-url",
            ctx.server.url,
            "--namespace",
            ctx.ns,
        ]
    )
    try:
        # Step the worker until some tokens were published, then pause it mid-generation.
        def some_tokens() -> list[Any]:
            worker.tick()
            events = reply_events(ctx, "pty-1")
            return events if len(events) >= 3 else []

        events = wait_for(some_tokens, timeout=120, interval=0, what="first token events")
        assert all(e.type == "token" for e in events), "the job must still be running"
        so_far = _clean("".join(e.text for e in events))
        assert so_far
        # The job is paused (nobody steps the engine): its text so far must already be on the terminal.
        wait_for(lambda: so_far in p.output(), timeout=60, what=f"{so_far!r} on the terminal")
        assert p.proc.poll() is None
        assert not any(e.type == "final" for e in reply_events(ctx, "pty-1"))

        def finished() -> bool:
            worker.tick()
            return p.proc.poll() is not None

        wait_for(finished, timeout=120, interval=0, what="submit to exit")
        assert p.proc.returncode == 0, p.output()
        final = ctx.result("pty-1")
        assert isinstance(final, FinalEvent) and final.usage.completion_tokens == 40
        p.reader.join(10)
        out = p.output()
        assert out.startswith(_clean(final.text)), out
        assert "finish_reason=length" in out and "40 completion tokens" in out
    finally:
        p.close()
        worker.request_stop(force=True)
        while not worker.tick():
            pass
        worker.shutdown()


@DEBIAN
def test_submit_json_prints_the_final_event(ctx: Ctx, engine: Any, capsys: pytest.CaptureFixture[str]) -> None:
    with inprocess_worker(ctx, engine, name="w-json"):
        code = queue_commands.main(
            cli(
                ctx,
                "submit",
                "Hi",
                "--chat",
                "--system",
                "Be brief",
                "--max-tokens",
                "5",
                "--temperature",
                "0",
                "--json",
                "--wait-s",
                "60",
                "--id",
                "json-1",
            )
        )
        assert code == 0
        (raw,) = json_lines(capsys.readouterr().out)
        final = parse_event(json.dumps(raw))
        assert isinstance(final, FinalEvent) and final.id == "json-1"
        assert final.usage.completion_tokens == 5
        assert reply_events(ctx, "json-1")[0].type == "final"  # --json asks for no token events

        code = queue_commands.main(cli(ctx, "submit", "Hi", "--max-tokens", "0"))
        assert code == 2 and "max_tokens" in capsys.readouterr().err
        code = queue_commands.main(cli(ctx, "submit", "x" * 5000, "--json", "--wait-s", "60", "--id", "long-1"))
        captured = capsys.readouterr()
        assert code == 1 and "prompt_too_long" in captured.err
        assert [e["type"] for e in json_lines(captured.out)] == ["error"]


def test_submit_without_redis_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("PAGEDQ_REDIS_URL", raising=False)
    monkeypatch.setenv("PAGEDQ_DATA_DIR", str(tmp_path))
    assert queue_commands.main(["submit", "hi"]) == 2
    assert "no Redis" in capsys.readouterr().err


@DEBIAN
def test_ctrl_c_in_submit_cancels_the_job(ctx: Ctx) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "ops.queue_commands", *cli(ctx, "submit", "nobody serves this", "--id", "ctrl-c")],
        cwd=REPO,
        env=subprocess_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for(lambda: ctx.redis.xlen(ctx.keys.jobs) == 1, timeout=60, what="the job in the stream")
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130 and "cancelled job ctrl-c" in err
    assert ctx.redis.exists(ctx.keys.cancel("ctrl-c"))


@DEBIAN
def test_cancel_by_id_ends_a_queued_job_before_it_runs(
    ctx: Ctx, engine: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    """``pagedq cancel`` sets the job's v2 flag and sends the notice (the README's snippet had the v1 key, which
    no worker reads, so a queued job ran anyway): the worker that reads it ends it with error cancelled."""
    ctx.client.submit("never run", id="cancel-me", max_tokens=8)
    assert queue_commands.main(cli(ctx, "cancel", "cancel-me")) == 0
    assert capsys.readouterr().out.splitlines() == ["cancelled cancel-me"]
    with inprocess_worker(ctx, engine):
        event = wait_for(lambda: ctx.result("cancel-me"), timeout=60, what="the cancelled job's end")
    assert isinstance(event, ErrorEvent) and event.code == "cancelled", event
    assert not [e for e in ctx.events("cancel-me") if e.type == "token"]
    # An id no job can have is refused before Redis is touched.
    assert queue_commands.main(cli(ctx, "cancel", "has space")) == 2
    assert "not a job id: 'has space'" in capsys.readouterr().err
    readme = (REPO / "README.md").read_text()
    assert "SET pagedq:{a1}:cancel 1 EX 86400" in readme and "SET pagedq:cancel:a1" not in readme


def test_priority_is_described_as_what_it_does(capsys: pytest.CaptureFixture[str]) -> None:
    """``submit --help`` said "higher is served first" (and README "higher first, for admission and
    scheduling"), while workers read the stream first in, first out and priority only orders the jobs one
    worker holds: a priority-100 job behind 12 others started after 11 of them."""
    with pytest.raises(SystemExit) as exit_:
        queue_commands.main(["submit", "--help"])
    assert exit_.value.code == 0
    help_text = words(capsys.readouterr().out)
    (row,) = [line for line in (REPO / "README.md").read_text().splitlines() if line.startswith("| `priority` |")]
    for doc in (help_text, row):
        assert "served first" not in doc and "higher first, for admission" not in doc
        assert "the jobs one worker holds" in doc and "max_num_seqs + prefetch" in doc
        assert "first in, first out" in doc and "separate" in doc and "workers of its own" in doc


# --------------------------------------------------------------------------- first-run rough edges


@DEBIAN
def test_submit_without_a_live_worker_warns_and_gives_up(
    ctx: Ctx, engine: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    """A first ``submit`` with no worker running said nothing and waited forever; now it warns at once and
    gives up after ``--wait-s`` (600 s unless given), leaving the job queued for a worker to come."""
    args = queue_commands.build_parser().parse_args(["submit", "hi"])
    assert args.wait_s == queue_commands.DEFAULT_WAIT_S == 600
    proc = subprocess.run(
        [sys.executable, "-m", "ops.cli", *cli(ctx, "submit", "--chat", "hi", "--wait-s", "0.5", "--id", "lonely")],
        cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 124, proc.stderr
    warning, gave_up = proc.stderr.strip().splitlines()
    assert "warning: no live worker on queue 'default'" in warning and "`pagedq worker`" in warning
    assert "giving up after 0.5 s" in warning and "within 0.5 s (it stays queued)" in gave_up
    assert ctx.redis.xlen(ctx.keys.jobs) == 1
    with inprocess_worker(ctx, engine, name="w-there"):  # with a worker: no warning, and the queued job runs
        wait_for(lambda: "w-there" in ctx.heartbeats(), what="heartbeat")
        code = queue_commands.main(cli(ctx, "submit", "hi", "--max-tokens", "2", "--json"))
        assert code == 0 and "warning" not in capsys.readouterr().err
        assert ctx.client.result("lonely", timeout=60).id == "lonely"


@DEBIAN
def test_status_names_keys_of_the_wrong_type_and_reports_everything_else(
    ctx: Ctx, capsys: pytest.CaptureFixture[str]
) -> None:
    """A producer ``SET`` a job where the jobs stream lives, an operator made a dead-letter stream a list and
    a heartbeat a hash: ``status`` ended with Redis's one WRONGTYPE line and exit 1, hiding every queue. Now
    it reports all it can read, names each such key with the type it holds and the one pagedq keeps there,
    and exits 0 (Redis was reachable, the rest was read: the exit codes of the module's docstring). The keys
    are left as they are, for the operator to inspect."""
    default, broken = ctx.keys, Keys(ctx.ns, "broken")
    for i in range(2):
        ctx.redis.xadd(default.jobs, {JOB_FIELD: json.dumps({"id": f"ok-{i}", "prompt": "hi"})})
    letter = DeadLetter(job="{oops", reason="job is not valid JSON", code="invalid_request", attempts=1, worker="w")
    ctx.redis.xadd(default.dead, letter.to_fields())
    ctx.redis.set(default.heartbeat("w-ok"), json.dumps({"name": "w-ok", "state": "ready", "ts": time.time()}), ex=600)
    ctx.redis.hset(default.heartbeat("w-hash"), mapping={"state": "ready"})
    ctx.redis.set(default.heartbeat("w-list"), "[1, 2]", ex=600)  # a string, valid JSON, but no heartbeat
    ctx.redis.zadd(default.workers, {default.worker_member(n): time.time() + 600 for n in ("w-ok", "w-hash", "w-list")})
    payload = json.dumps({"id": "set-1", "prompt": "hi"})
    ctx.redis.set(broken.jobs, payload)  # SET where XADD was meant
    ctx.redis.rpush(broken.dead, "a", "b")

    assert queue_commands.main(cli(ctx, "status", "--json")) == 0
    queues = {q["queue"]: q for q in json_in(capsys.readouterr().out)["queues"]}
    assert set(queues) == {"default", "broken"}
    ok = queues["default"]
    assert (ok["backlog"], ok["dead_letters"]) == (2, 1)
    assert [(w["name"], w["state"]) for w in ok["workers"]] == [("w-list", None), ("w-ok", "ready")]
    hb = default.heartbeat("w-hash")
    assert ok["wrong_type_keys"] == [
        {"key": hb, "type": "hash", "expected": "string", "role": "heartbeat of worker w-hash"}
    ]
    bad = queues["broken"]
    assert (bad["backlog"], bad["dead_letters"], bad["workers"]) == (0, 0, [])
    assert bad["wrong_type_keys"] == [
        {"key": broken.jobs, "type": "string", "expected": "stream", "role": "jobs stream of shard 0"},
        {"key": broken.dead, "type": "list", "expected": "stream", "role": "dead-letter stream of shard 0"},
    ]
    (row,) = bad["shard_streams"]
    assert (row["shard"], row["wrong_type"]) == (0, {"stream": "string", "dead_stream": "list"})
    assert len(bad["warnings"]) == 2 and len(ok["warnings"]) == 1

    assert queue_commands.main(cli(ctx, "status")) == 0
    text = words(capsys.readouterr().out)
    assert "queue default" in text and "queue broken" in text
    assert "backlog 2 job(s)" in text and "dead letters 1" in text and "live workers 2" in text
    assert (
        f"warning {broken.jobs} is a string, where pagedq keeps a stream (jobs stream of shard 0): it is left out "
        "of the backlog" in text
    )
    assert f"warning {broken.dead} is a list, where pagedq keeps a stream (dead-letter stream of shard 0)" in text
    assert f"warning {hb} is a hash, where pagedq keeps a string (heartbeat of worker w-hash)" in text

    # --prune and --queue go past the key too; nothing of it was changed by any of these.
    assert queue_commands.main(cli(ctx, "status", "--prune", "--queue", "broken")) == 0
    assert f"warning {broken.jobs} is a string" in words(capsys.readouterr().out)
    assert ctx.redis.get(broken.jobs) in (payload, payload.encode())
    assert ctx.redis.lrange(broken.dead, 0, -1) in (["a", "b"], [b"a", b"b"])
    assert ctx.redis.hgetall(hb) in ({"state": "ready"}, {b"state": b"ready"})


@DEBIAN
def test_status_tells_exited_workers_consumers_apart_and_prunes_the_empty_ones(
    ctx: Ctx, engine: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    # Two workers that exited, as they leave the group: one holding a job it had read, one holding nothing.
    ctx.redis.xgroup_create(ctx.keys.jobs, GROUP, id="0", mkstream=True)
    ctx.redis.xadd(ctx.keys.jobs, {JOB_FIELD: json.dumps({"id": "held-1", "prompt": "hi", "max_tokens": 1})})
    assert ctx.redis.xreadgroup(GROUP, "gone-busy", {ctx.keys.jobs: ">"}, count=1)
    ctx.redis.xgroup_createconsumer(ctx.keys.jobs, GROUP, "gone-idle")
    with inprocess_worker(ctx, engine, name="w-live", reclaim_idle_s=600):  # not taking held-1 over here
        wait_for(lambda: "w-live" in ctx.heartbeats(), what="heartbeat")
        assert queue_commands.main(cli(ctx, "status", "--json")) == 0
        (q,) = json_in(capsys.readouterr().out)["queues"]
        consumers = {c["name"]: (c["live"], c["pending"]) for c in q["consumers"]}
        assert consumers == {"gone-busy": (False, 1), "gone-idle": (False, 0), "w-live": (True, 0)}

        assert queue_commands.main(cli(ctx, "status")) == 0
        text = capsys.readouterr().out
        lines = text.splitlines()
        header = next(i for i, line in enumerate(lines) if line.split()[:2] == ["NAME", "WORKER"])
        rows = {line.split()[0]: line.split()[1] for line in lines[header + 1 : header + 4]}
        assert rows["gone-busy"] == "gone" and rows["gone-idle"] == "gone" and rows["w-live"] == "live"
        assert "2 consumer(s) without a heartbeat" in text and "their 1 pending job(s)" in text
        assert "`pagedq status --prune`" in text

        assert queue_commands.main(cli(ctx, "status", "--prune", "--json")) == 0
        captured = capsys.readouterr()
        assert "deleted 1 consumer(s): gone-idle" in captured.err
        (q,) = json_in(captured.out)["queues"]
        assert sorted(c["name"] for c in q["consumers"]) == ["gone-busy", "w-live"]  # the held job keeps its owner
        assert ctx.redis.xpending_range(ctx.keys.jobs, GROUP, "-", "+", 10, "gone-busy")[0]["times_delivered"] == 1


@DEBIAN
def test_malformed_dead_letters_are_shown_and_left_in_place(ctx: Ctx, capsys: pytest.CaptureFixture[str]) -> None:
    """Anyone who may XADD can write a dead-letter stream: an entry that is no dead letter (a field missing,
    ``attempts`` not a number) ended ``dead list``, ``dead list --json`` and ``dead replay --all`` in a
    pydantic traceback, hiding every good letter. Now it is listed as ``malformed`` with what is wrong, a
    replay of it is one line and exit 1 with nothing replayed, ``--all`` replays the good ones and leaves it."""
    good = DeadLetter(
        job=json.dumps({"id": "fine-1", "prompt": "hi"}), reason="r", code="invalid_request", attempts=1, worker="w"
    )
    good_entry = ctx.redis.xadd(ctx.keys.dead, good.to_fields())
    missing = ctx.redis.xadd(ctx.keys.dead, {"foo": "bar"})
    not_int = ctx.redis.xadd(ctx.keys.dead, {**good.to_fields(), "attempts": "many", "job_id": "odd-1"})

    assert queue_commands.main(cli(ctx, "dead", "list")) == 0
    rows = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines()[2:]}
    assert set(rows) == {good_entry, missing, not_int}
    assert rows[missing][3] == "malformed" and "job: Field required" in " ".join(rows[missing])
    assert rows[not_int][2:4] == ["odd-1", "malformed"] and "attempts:" in " ".join(rows[not_int])

    assert queue_commands.main(cli(ctx, "dead", "list", "--json")) == 0
    by_entry = {row["entry"]: row for row in json_lines(capsys.readouterr().out)}
    assert by_entry[good_entry]["job_id"] == "" and "malformed" not in by_entry[good_entry]
    assert by_entry[missing]["fields"] == {"foo": "bar"} and "job: Field required" in by_entry[missing]["malformed"]
    assert by_entry[not_int]["fields"]["attempts"] == "many" and "attempts" in by_entry[not_int]["malformed"]

    # Named: refused before anything is replayed (the good one named with it included).
    assert queue_commands.main(cli(ctx, "dead", "replay", good_entry, not_int)) == 1
    err = capsys.readouterr().err
    assert f"dead letter {not_int} is malformed (attempts:" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1
    assert ctx.redis.xlen(ctx.keys.dead) == 3 and not ctx.redis.exists(ctx.keys.jobs)

    # A ref named twice is replayed once (its job queued once).
    assert queue_commands.main(cli(ctx, "dead", "replay", good_entry, good_entry, "--keep")) == 0
    capsys.readouterr()
    assert ctx.redis.xlen(ctx.keys.jobs) == 1
    ctx.redis.delete(ctx.keys.jobs)

    # --all: the good one replayed, the malformed ones warned about, kept, and the exit code says so.
    assert queue_commands.main(cli(ctx, "dead", "replay", "--all")) == 1
    err = capsys.readouterr().err
    assert "replayed 1 dead letter(s)" in err and "2 malformed dead letter(s) not replayed (left in place)" in err
    assert [e for e, _ in ctx.redis.xrange(ctx.keys.dead)] == [missing, not_int]
    (replayed,) = ctx.redis.xrange(ctx.keys.jobs)
    assert replayed[1] == {JOB_FIELD: good.job}

    with pytest.raises(SystemExit) as exit_info:  # argparse's usage error
        queue_commands.main(cli(ctx, "dead", "list", "--count", "-1"))
    assert exit_info.value.code == 2 and "--count: must be 0 (all) or more" in capsys.readouterr().err


@pytest.mark.parametrize("wait", ["nan", "inf", "-1", "soon"])
def test_a_wait_that_is_no_duration_is_a_usage_error(wait: str, capsys: pytest.CaptureFixture[str]) -> None:
    """``--wait-s nan`` ended in a traceback (``int(nan)`` deep in the client), ``-1`` gave up at once with
    exit 124: argparse's usage error now, before Redis is asked anything."""
    with pytest.raises(SystemExit) as exit_info:
        queue_commands.main(["submit", "hi", "--wait-s", wait, "--redis-url", "redis://127.0.0.1:1/0"])
    assert exit_info.value.code == 2 and "--wait-s: must be a" in capsys.readouterr().err


@pytest.mark.parametrize("command", [["status"], ["dead", "list"], ["dead", "replay", "--all"], ["submit", "hi"]])
def test_an_unreachable_cluster_is_one_line_and_exit_1(command: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """A ``redis+cluster://`` client connects as it is made, and "no node answers" is a
    ``RedisClusterException``, which is not a ``RedisError``: every command ended in a traceback."""
    url = f"redis+cluster://:Zq8-secret@127.0.0.1:{free_port()}"
    assert queue_commands.main([*command, "--redis-url", url]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"pagedq {command[0]}: ") and "Redis Cluster cannot be connected" in err, err
    assert len(err.strip().splitlines()) == 1 and "Zq8-secret" not in err
