"""The producer client against hostile reply streams, ``submitted_at``, and waiting for replicas.

* A reply stream is writable by anyone: another producer may name it as its job's ``reply_to``, and anyone
  with Redis access may ``XADD`` to it. The client must return the job's own outcome (the one stored at
  its result key) whatever else is in the stream: another job's events, a forged terminal event with the
  victim's id, entries that are not events at all. Written with raw commands, the genuine outcome the way
  the worker writes it (the terminal event and the result key in one transaction), and, end to end, by a
  real in-process worker running an intruder's job whose ``reply_to`` is the victim's reply stream.
* ``submit`` stamps ``submitted_at`` (the producer's clock) unless the caller gave one.
* ``wait_replicas``: against a real primary + replica pair (Debian's ``redis-server``), and against a lone
  server, where too few replicas acknowledge and :class:`NotReplicated` says so.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from schemas.jobs import Choice, ErrorEvent, FinalEvent, JobRequest, Timings, TokenEvent, Usage
from schemas.keys import EVENT_FIELD, JOB_FIELD, Keys
from tests.redis_servers import RedisServer, debian_redis_server, free_port, redis_server  # noqa: F401
from tests.worker_harness import Ctx, inprocess_worker, make_engine, wait_for
from worker.client import AsyncPagedqClient, NotReplicated, PagedqClient, StreamState, build_job
from worker.consumer import EngineLike

CLIENT_KINDS = ("sync", "async")


@pytest.fixture
def ctx(redis_server: RedisServer) -> Iterator[Ctx]:  # noqa: F811
    c = Ctx(redis_server)
    yield c
    c.close()


def _final(job_id: str, text: str, attempt: int = 1) -> FinalEvent:
    return FinalEvent(
        id=job_id,
        attempt=attempt,
        choices=[Choice(index=0, text=text, token_ids=[1], finish_reason="stop")],
        usage=Usage(prompt_tokens=1, completion_tokens=1),
        timings=Timings(queued_s=0.0, ttft_s=0.1, total_s=0.2),
        worker="w",
    )


def _token(job_id: str, text: str, attempt: int = 1) -> str:
    return TokenEvent(id=job_id, attempt=attempt, index=0, text=text, token_ids=[1]).to_json()


def _intrude(ctx: Ctx, job_id: str) -> None:
    """What a hostile producer can put into ``job_id``'s reply stream before the job has ended: another
    job's events (its ``reply_to`` names this stream), terminal events forged with the victim's id, and
    entries that are no events at all."""
    reply = ctx.keys.reply(job_id)
    entries: list[dict[str, str]] = [
        {EVENT_FIELD: _token("intruder", "HIJACKED ")},
        {EVENT_FIELD: "not json"},
        {EVENT_FIELD: "[]"},
        {EVENT_FIELD: json.dumps({"type": "final", "id": job_id})},  # a final missing its fields
        {EVENT_FIELD: json.dumps({"type": "bogus", "id": job_id, "attempt": 1})},
        {EVENT_FIELD: json.dumps({"type": "token", "id": job_id, "attempt": "1", "index": 0, "text": "x"})},
        {
            EVENT_FIELD: json.dumps(
                {
                    "type": "token",
                    "id": job_id,
                    "attempt": 1,
                    "index": 0,
                    "text": "NaN",
                    "token_ids": [1],
                    "logprobs": [{"token_id": 1, "logprob": float("nan")}],
                }
            )
        },
        {"other": "field"},
        {EVENT_FIELD: _final("intruder", "HIJACKED").to_json()},
        {EVENT_FIELD: _final(job_id, "FORGED", attempt=9).to_json()},  # the victim's id, no result key
        {EVENT_FIELD: ErrorEvent(id=job_id, attempt=9, code="cancelled", message="forged", worker="w").to_json()},
    ]
    for fields in entries:
        ctx.redis.xadd(reply, fields)


def _finish(ctx: Ctx, job_id: str, deltas: list[str], forged_after_tokens: bool = False) -> FinalEvent:
    """The job's genuine run, written as the worker writes it: token events, then the terminal event and
    the result key in one transaction. ``forged_after_tokens``: a forged final with the victim's id lands
    between the tokens and the genuine final (the client finds the result key by then)."""
    reply = ctx.keys.reply(job_id)
    for delta in deltas:
        ctx.redis.xadd(reply, {EVENT_FIELD: _token(job_id, delta)})
    final = _final(job_id, "".join(deltas))
    pipe = ctx.redis.pipeline(transaction=True)
    if forged_after_tokens:
        pipe.xadd(reply, {EVENT_FIELD: _final(job_id, "FORGED LATE", attempt=9).to_json()})
    pipe.xadd(reply, {EVENT_FIELD: final.to_json()})
    pipe.set(ctx.keys.result(job_id), final.to_json())
    pipe.execute()
    return final


def _read(kind: str, ctx: Ctx, job_id: str, what: str, client_name: str | None = None) -> Any:
    """``stream`` (its items), ``events`` (the list) or ``result`` of ``job_id`` through a client of
    ``kind``, on connections named ``client_name``."""
    url = ctx.server.url
    if kind == "sync":
        with PagedqClient(
            redis.Redis.from_url(url, decode_responses=True, client_name=client_name), namespace=ctx.ns
        ) as client:
            if what == "result":
                return client.result(job_id, timeout=30)
            return list(getattr(client, what)(job_id, timeout=30))

    async def read() -> Any:
        conn = redis.asyncio.Redis.from_url(url, decode_responses=True, client_name=client_name)
        async with AsyncPagedqClient(conn, namespace=ctx.ns) as client:
            if what == "result":
                return await client.result(job_id, timeout=30)
            return [item async for item in getattr(client, what)(job_id, timeout=30)]

    return asyncio.run(read())


@pytest.mark.parametrize("kind", CLIENT_KINDS)
def test_readers_return_only_the_jobs_own_outcome(ctx: Ctx, kind: str) -> None:
    job_id = ctx.client.submit("hello", max_tokens=4)
    _intrude(ctx, job_id)
    final = _finish(ctx, job_id, ["Hel", "lo"], forged_after_tokens=True)

    # The reader meets the forged finals (the victim's id) before the genuine tokens; the result key
    # exists by then, so it ends at the first one with the stored final, whose text is the job's own.
    items = _read(kind, ctx, job_id, "stream")
    assert items[-1] == final and "".join(x for x in items if isinstance(x, str)) == "Hello"
    assert _read(kind, ctx, job_id, "result") == final
    events = _read(kind, ctx, job_id, "events")
    assert {e.id for e in events} == {job_id} and events[-1] == final


@pytest.mark.parametrize("kind", CLIENT_KINDS)
def test_a_forged_terminal_event_does_not_end_a_waiting_reader(ctx: Ctx, kind: str) -> None:
    """The reader sees the intruder's entries first (forged final and error with the victim's id among
    them), finds no result key behind them and goes on waiting; the genuine run then ends it."""
    job_id = ctx.client.submit("hello", max_tokens=4)
    _intrude(ctx, job_id)
    name = f"reader-{ctx.ns}"
    out: dict[str, Any] = {}

    def reader() -> None:
        try:
            out["items"] = _read(kind, ctx, job_id, "stream", client_name=name)
        except BaseException as exc:  # reported by the main thread
            out["error"] = exc

    thread = threading.Thread(target=reader, daemon=True)
    thread.start()

    def blocked_past_the_intrusion() -> bool:
        clients = ctx.redis.client_list()
        return not thread.is_alive() or any(c["name"] == name and "b" in c["flags"] for c in clients)

    wait_for(blocked_past_the_intrusion, 30, what="the reader blocked on the reply stream")
    assert thread.is_alive(), f"the reader stopped on the intrusion: {out}"
    final = _finish(ctx, job_id, ["Hel", "lo"])
    thread.join(30)
    assert not thread.is_alive() and "error" not in out, out
    assert out["items"] == ["Hel", "lo", final]


@pytest.mark.parametrize(("kind", "reconnect_s"), [("sync", 30.0), ("async", 30.0), ("sync", 0.0)])
def test_a_waiting_reader_rides_out_a_lost_connection(ctx: Ctx, kind: str, reconnect_s: float) -> None:
    """A Redis restart or failover drops every connection: a reader waiting on a job reconnects and reads on
    from where it was (``reconnect_s``), or, told not to (0, as the gateway is), raises the error at once."""
    job_id = ctx.client.submit("hello", max_tokens=4)
    name = f"rider-{ctx.ns}-{kind}-{reconnect_s}"
    ctx.redis.xadd(ctx.keys.reply(job_id), {EVENT_FIELD: _token(job_id, "Hel")})  # read before the loss
    out: dict[str, Any] = {}

    def reader() -> None:
        url = ctx.server.url
        try:
            if kind == "sync":
                conn = redis.Redis.from_url(url, decode_responses=True, client_name=name)
                with PagedqClient(conn, namespace=ctx.ns, reconnect_s=reconnect_s) as client:
                    out["items"] = list(client.stream(job_id, timeout=30))
                return

            async def read() -> list[Any]:
                conn = redis.asyncio.Redis.from_url(url, decode_responses=True, client_name=name)
                async with AsyncPagedqClient(conn, namespace=ctx.ns, reconnect_s=reconnect_s) as client:
                    return [item async for item in client.stream(job_id, timeout=30)]

            out["items"] = asyncio.run(read())
        except BaseException as exc:  # reported by the main thread
            out["error"] = exc

    def blocked() -> set[str]:
        return {c["id"] for c in ctx.redis.client_list() if c["name"] == name and "b" in c["flags"]}

    thread = threading.Thread(target=reader, daemon=True)
    thread.start()
    first = wait_for(lambda: blocked() or not thread.is_alive(), 30, what="the reader blocked on the reply stream")
    assert thread.is_alive(), out
    for client_id in first:
        ctx.redis.client_kill_filter(_id=client_id)
    if reconnect_s == 0:
        thread.join(30)
        assert isinstance(out.get("error"), redis.ConnectionError), out
        return
    wait_for(lambda: (blocked() - first) or not thread.is_alive(), 30, what="the reader blocked again, reconnected")
    assert thread.is_alive(), out
    ctx.redis.xadd(ctx.keys.reply(job_id), {EVENT_FIELD: _token(job_id, "lo")})
    final = _final(job_id, "Hello")
    ctx.redis.xadd(ctx.keys.reply(job_id), {EVENT_FIELD: final.to_json()})
    ctx.redis.set(ctx.keys.result(job_id), final.to_json())
    thread.join(30)
    assert not thread.is_alive() and "error" not in out, out
    assert out["items"] == ["Hel", "lo", final]  # nothing read twice, nothing skipped


def test_the_result_key_is_authoritative_even_without_a_reply_stream(ctx: Ctx) -> None:
    """Reply streams expire an hour after the end, result keys a day: a late reader gets the result."""
    job_id = ctx.client.submit("hello", max_tokens=4)
    final = _finish(ctx, job_id, ["a", "b"])
    ctx.redis.delete(ctx.keys.reply(job_id))
    with PagedqClient(ctx.server.client(), namespace=ctx.ns, block_ms=20) as client:
        assert client.result(job_id, timeout=5) == final
        assert list(client.stream(job_id, timeout=5)) == ["ab", final]


def test_stream_state_ignores_other_jobs() -> None:
    state = StreamState(job_id="j")
    tok = TokenEvent(id="j", attempt=1, index=0, text="a", token_ids=[1])
    other = TokenEvent(id="k", attempt=2, index=0, text="zzz", token_ids=[1])
    final = _final("j", "ab")
    out = [*state.feed(tok), *state.feed(other), *state.feed(_final("k", "HIJACKED")), *state.feed(final)]
    assert out == ["a", "b", final]


@pytest.fixture(scope="module")
def engine(tiny_model: Any) -> EngineLike:
    return make_engine(Path(tiny_model("llama_gqa")))


def test_an_intruders_job_replying_into_the_victims_stream_is_ignored(ctx: Ctx, engine: EngineLike) -> None:
    """End to end with a real worker: the worker grants a shared reply prefix, and an intruder's job names
    the victim's reply stream under it as its own ``reply_to`` and runs first; the victim's reader still
    gets the victim's own text and final."""
    shared = f"{ctx.ns}-app:replies:"
    victim = build_job("The quick brown fox", max_tokens=8, temperature=0, reply_to=f"{shared}victim")
    intruder = ctx.client.submit("Once upon a time", max_tokens=6, temperature=0, reply_to=victim.reply_to)
    with inprocess_worker(ctx, engine, reply_prefixes=[shared]):
        wait_for(lambda: ctx.result(intruder) is not None, 60, what="the intruder's job to end")
        intrusion = [f[EVENT_FIELD] for _, f in ctx.redis.xrange(f"{shared}victim")]
        assert any(intruder in raw and '"final"' in raw for raw in intrusion), intrusion
        ctx.client.submit_many([victim])
        items = list(ctx.client.stream(victim.id, timeout=60))
    stored = ctx.result(victim.id)
    assert isinstance(stored, FinalEvent) and stored.id == victim.id
    assert items[-1] == stored
    assert "".join(x for x in items if isinstance(x, str)) == stored.text


# ------------------------------------------------------------------------------------------ submitted_at


def test_submit_stamps_submitted_at_unless_given(ctx: Ctx) -> None:
    before = time.time()
    stamped = ctx.client.submit("a")
    many = ctx.client.submit_many(["b", {"prompt": "c", "submitted_at": 1_700_000_000.5}])
    given = ctx.client.submit("d", submitted_at=1_600_000_000.0)
    none = ctx.client.submit("e", submitted_at=None)
    built = JobRequest(id="prebuilt", prompt="f")  # no submitted_at: stamped on submit
    kept = JobRequest(id="prebuilt-kept", prompt="g", submitted_at=1_500_000_000.0)
    ctx.client.submit_many([built, kept])
    after = time.time()
    jobs = {j["id"]: j for j in (json.loads(f[JOB_FIELD]) for _, f in ctx.redis.xrange(ctx.keys.jobs))}
    for job_id in (stamped, many[0], "prebuilt"):
        assert before <= jobs[job_id]["submitted_at"] <= after
    assert jobs[many[1]]["submitted_at"] == 1_700_000_000.5
    assert jobs[given]["submitted_at"] == 1_600_000_000.0
    assert "submitted_at" not in jobs[none]
    assert jobs["prebuilt-kept"]["submitted_at"] == 1_500_000_000.0
    assert before <= (build_job("h").submitted_at or 0) <= time.time()


# ------------------------------------------------------------------------------------------ wait_replicas


def test_a_lone_server_cannot_satisfy_wait_replicas(ctx: Ctx) -> None:
    with pytest.raises(NotReplicated) as caught:
        ctx.client.submit("a", id="lonely-1", wait_replicas=1, wait_timeout_ms=20)
    assert caught.value.acked == 0 and caught.value.wanted == 1 and caught.value.job_ids == ["lonely-1"]
    assert "0 of 1 replica" in str(caught.value)
    with PagedqClient(ctx.server.client(), namespace=ctx.ns, wait_replicas=1, wait_timeout_ms=20) as lonely:
        with pytest.raises(NotReplicated):
            lonely.submit_many(["b", "c"])
        assert lonely.submit("d", wait_replicas=0)  # the call's choice wins over the client's

    async def on_async() -> None:
        async with AsyncPagedqClient(ctx.server.url, namespace=ctx.ns) as client:
            with pytest.raises(NotReplicated):
                await client.submit("e", wait_replicas=1, wait_timeout_ms=20)

    asyncio.run(on_async())
    # the jobs are queued all the same (Redis cannot take a write back): the error says so
    assert ctx.redis.xlen(ctx.keys.jobs) == 5
    with pytest.raises(ValueError):
        PagedqClient(ctx.server.client(), wait_replicas=-1)


class _Pair:
    """A primary and its replica: two Debian ``redis-server`` processes on free ports."""

    def __init__(self, exe: str, tmp: Path) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []
        self.primary_port = self._start(exe, tmp / "primary")
        self.replica_port = self._start(exe, tmp / "replica", "--replicaof", "127.0.0.1", str(self.primary_port))
        self.primary: Any = redis.Redis(port=self.primary_port, decode_responses=True)
        self.replica: Any = redis.Redis(port=self.replica_port, decode_responses=True)

    def _start(self, exe: str, folder: Path, *extra: str) -> int:
        folder.mkdir(parents=True)
        port = free_port()
        args = [exe, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(folder), "--save", "",
                "--appendonly", "no", "--daemonize", "no", "--logfile", str(folder / "redis.log"), *extra]  # fmt: skip
        proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.procs.append(proc)

        def answers() -> bool:
            assert proc.poll() is None, f"redis-server exited; see {folder / 'redis.log'}"
            probe = redis.Redis(port=port, socket_connect_timeout=0.5)
            try:
                return bool(probe.ping())
            except redis.RedisError:
                return False
            finally:
                probe.close()

        wait_for(answers, 20, 0.05, f"redis-server on port {port}")
        return port

    def wait_linked(self) -> None:
        def linked() -> bool:
            info = self.primary.info("replication")
            slave = info.get("slave0") or {}
            return self.replica.info("replication").get("master_link_status") == "up" and slave.get("state") == "online"

        wait_for(linked, 30, 0.05, "the replica to sync with the primary")

    def close(self) -> None:
        self.primary.close()
        self.replica.close()
        for proc in self.procs:
            proc.terminate()
            proc.wait(20)


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[_Pair]:
    exe = debian_redis_server()
    if exe is None:
        pytest.skip("a primary + replica pair needs Debian's redis-server (apt-get install redis-server)")
    p = _Pair(exe, tmp_path)
    try:
        p.wait_linked()
        yield p
    finally:
        p.close()


@pytest.mark.slow  # starts a replica and waits for its sync (~6 s); the lone-server refusal stays default
def test_wait_replicas_returns_once_the_replica_has_the_job(pair: _Pair) -> None:
    url = f"redis://127.0.0.1:{pair.primary_port}/0"
    with PagedqClient(url, namespace="dur", wait_replicas=1, wait_timeout_ms=10_000) as client:
        job_id = client.submit("a")
        ids = client.submit_many(["b", "c"])
        with pytest.raises(NotReplicated) as caught:  # one replica cannot count as two
            client.submit("d", wait_replicas=2, wait_timeout_ms=20)
        assert caught.value.acked == 1 and caught.value.wanted == 2

    async def on_async() -> str:
        async with AsyncPagedqClient(url, namespace="dur") as aclient:
            return await aclient.submit("e", wait_replicas=1, wait_timeout_ms=10_000)

    async_id = asyncio.run(on_async())
    # WAIT returned 1: the replica has applied every write before it, with no need to wait for it here
    on_replica = [json.loads(f[JOB_FIELD])["id"] for _, f in pair.replica.xrange(Keys("dur").jobs_shard(0))]
    assert on_replica[:3] == [job_id, *ids] and async_id in on_replica
