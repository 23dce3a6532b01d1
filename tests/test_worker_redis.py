"""Publisher (Lua terminal atomicity), reclaimer, producer client and embedded Redis against real servers.

No engine here: these tests play the worker's part with the same building blocks the worker uses.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import redis

from schemas.jobs import Choice, DeadLetter, ErrorEvent, FinalEvent, Timings, TokenEvent, Usage, parse_event
from schemas.keys import EVENT_FIELD, GROUP, JOB_FIELD, Keys
from tests.redis_servers import (  # noqa: F401
    RedisServer,
    fresh_redis_server,
    redis_server,
    unique_namespace,
)
from tests.worker_harness import wait_for
from worker.client import AsyncPagedqClient, JobFailed, PagedqClient, Restart
from worker.embedded_redis import EmbeddedRedis
from worker.publisher import DeadOnly, Outbox, Publisher, Terminal
from worker.reclaimer import Reclaimer, ensure_group


def _final(job_id: str, text: str, attempt: int = 1, worker: str = "w1") -> FinalEvent:
    return FinalEvent(
        id=job_id,
        attempt=attempt,
        choices=[Choice(index=0, text=text, token_ids=[1, 2], finish_reason="stop")],
        usage=Usage(prompt_tokens=3, completion_tokens=2),
        timings=Timings(queued_s=0.0, ttft_s=0.01, total_s=0.02),
        worker=worker,
    )


class Fixture:
    def __init__(self, server: RedisServer) -> None:
        self.server = server
        self.ns = unique_namespace()
        self.keys = Keys(self.ns, "default")
        self.redis: Any = server.client()
        ensure_group(self.redis, self.keys)
        self.pub = Publisher(self.redis, self.keys, result_ttl_s=60, reply_ttl_s=30, reply_maxlen=1000)

    def add(self, job: dict[str, object]) -> str:
        return str(self.redis.xadd(self.keys.jobs, {JOB_FIELD: json.dumps(job)}))

    def reply_events(self, job_id: str) -> list[object]:
        return [parse_event(f[EVENT_FIELD]) for _, f in self.redis.xrange(self.keys.reply(job_id))]


@pytest.fixture
def fx(redis_server: RedisServer) -> Fixture:  # noqa: F811
    return Fixture(redis_server)


# ------------------------------------------------------------------------------------------- publisher


def test_terminal_is_atomic_and_written_once(fx: Fixture) -> None:
    entry = fx.add({"id": "j1", "prompt": "x"})
    rec = Reclaimer(fx.redis, fx.keys, "w1", reclaim_idle_s=30)
    assert [d.entry_id for d in rec.read_new(10, None)] == [entry]

    token = TokenEvent(id="j1", attempt=1, index=0, text="ab", token_ids=[1, 2])
    outbox = Outbox()
    outbox.add_tokens(fx.keys.reply("j1"), entry, "j1", [token.to_json()])
    outbox.terminals.append(Terminal(entry, "j1", fx.keys.reply("j1"), _final("j1", "ab").to_json()))
    assert fx.pub.flush(outbox) == []
    assert not outbox
    # Result key, reply stream (token then final), TTLs, ack and deletion all happened together.
    assert parse_event(fx.redis.get(fx.keys.result("j1"))) == _final("j1", "ab")
    assert 0 < fx.redis.ttl(fx.keys.result("j1")) <= 60
    assert 0 < fx.redis.ttl(fx.keys.reply("j1")) <= 30
    assert [e.type for e in fx.reply_events("j1")] == ["token", "final"]  # type: ignore[attr-defined]
    assert fx.redis.xpending(fx.keys.jobs, GROUP)["pending"] == 0
    assert fx.redis.xlen(fx.keys.jobs) == 0

    # A second delivery of the same job (another worker, a retry after a lost reply) writes nothing.
    entry2 = fx.add({"id": "j1", "prompt": "x"})
    rec.read_new(10, None)
    assert (
        fx.pub.terminal(Terminal(entry2, "j1", fx.keys.reply("j1"), _final("j1", "other", attempt=2).to_json()))
        is False
    )
    assert parse_event(fx.redis.get(fx.keys.result("j1"))).attempt == 1
    assert len(fx.reply_events("j1")) == 2
    assert fx.redis.xpending(fx.keys.jobs, GROUP)["pending"] == 0


def test_terminal_with_dead_letter_and_foreign_reply_key(fx: Fixture) -> None:
    entry = fx.add({"id": "j2", "prompt": "x"})
    Reclaimer(fx.redis, fx.keys, "w1", reclaim_idle_s=30).read_new(10, None)
    foreign = f"{fx.ns}-foreign-string"
    fx.redis.set(foreign, "not a stream")
    err = ErrorEvent(id="j2", attempt=3, code="dead_lettered", message="gave up", worker="w1")
    dead = DeadLetter(job='{"id":"j2"}', reason="gave up", code="dead_lettered", attempts=3, worker="w1", job_id="j2")
    assert fx.pub.terminal(Terminal(entry, "j2", foreign, err.to_json(), dead=dead)) is True
    assert fx.redis.get(foreign) == "not a stream"  # a non-stream reply_to is left alone
    assert parse_event(fx.redis.get(fx.keys.result("j2"))) == err
    ((_, fields),) = fx.redis.xrange(fx.keys.dead)
    assert DeadLetter.from_fields(fields).attempts == 3 and fields["job_id"] == "j2"


def second_copy_ends_first(client: Any, keys: Keys, pub: Publisher) -> str:
    """A producer's retried submit (two entries, one id) run side by side by two workers, as they write it:
    copy 1 streams a token (its entry owns the reply stream), copy 2 finds the stream is not its own and
    ends the job first, copy 1 ends later. Returns the reply stream."""
    job = {"id": "same", "prompt": "hi", "max_tokens": 4}
    e1, e2 = (str(client.xadd(keys.jobs, {JOB_FIELD: json.dumps(job)})) for _ in range(2))
    assert [d.entry_id for d in Reclaimer(client, keys, "w1", reclaim_idle_s=30).read_new(1, None)] == [e1]
    assert [d.entry_id for d in Reclaimer(client, keys, "w2", reclaim_idle_s=30).read_new(1, None)] == [e2]
    reply = keys.reply("same")
    tokens = {}
    for entry in (e1, e2):
        tokens[entry] = Outbox()
        tokens[entry].add_tokens(
            reply, entry, "same", [TokenEvent(id="same", attempt=1, index=0, text="x", token_ids=[1]).to_json()]
        )
    assert pub.flush(tokens[e1]) == [] and pub.flush(tokens[e2]) == []
    assert pub.terminal(Terminal(e2, "same", reply, _final("same", "xx", worker="w2").to_json())) is True
    assert pub.terminal(Terminal(e1, "same", reply, _final("same", "xx").to_json())) is False
    assert parse_event(client.get(keys.result("same"))).worker == "w2"  # type: ignore[union-attr]
    assert client.xlen(reply) == 1  # copy 1's token, and no terminal event: copy 2 could not write there
    assert sum(client.xpending(stream, GROUP)["pending"] for stream in keys.job_streams) == 0
    return reply


def test_a_reply_stream_expires_when_another_copy_of_its_id_ended_the_job(fx: Fixture) -> None:
    """The copy that owns the reply stream finds the job ended by the other copy: its terminal write, which
    only acks, still expires the stream ``reply_ttl_s`` later (it was never expired: leaked for good). A
    stream the ending delivery does not own is never expired by it."""
    reply = second_copy_ends_first(fx.redis, fx.keys, fx.pub)
    assert 0 < fx.redis.ttl(reply) <= 30  # reply_ttl_s, not the longer safety TTL of its token event

    foreign = f"{fx.ns}-foreign-stream"
    fx.redis.xadd(foreign, {"made": "by someone else"})
    entry = fx.add({"id": "same", "prompt": "hi", "reply_to": foreign})
    Reclaimer(fx.redis, fx.keys, "w3", reclaim_idle_s=30).read_new(1, None)
    assert fx.pub.terminal(Terminal(entry, "same", foreign, _final("same", "yy").to_json())) is False
    assert fx.redis.ttl(foreign) == -1


def test_a_reply_stream_no_terminal_write_reaches_still_expires(fx: Fixture) -> None:
    """A terminal write degraded to leave the reply stream alone (``Sender._refused``), or one that never
    comes (a worker gone for good): the stream its token events created expires ``result_ttl_s`` after
    the first of them, and the degraded write neither shortens nor removes that."""
    entry = fx.add({"id": "deg", "prompt": "x"})
    Reclaimer(fx.redis, fx.keys, "w1", reclaim_idle_s=30).read_new(1, None)
    outbox = Outbox()
    token = TokenEvent(id="deg", attempt=1, index=0, text="a", token_ids=[1])
    outbox.add_tokens(fx.keys.reply("deg"), entry, "deg", [token.to_json()])
    assert fx.pub.flush(outbox) == []
    assert 30 < fx.redis.ttl(fx.keys.reply("deg")) <= 60  # result_ttl_s: longer than a job's reply_ttl_s
    degraded = Terminal(entry, "deg", fx.keys.reply("deg"), _final("deg", "a").to_json(), write_reply=False)
    assert fx.pub.terminal(degraded) is True
    assert 30 < fx.redis.ttl(fx.keys.reply("deg")) <= 60
    assert [e.type for e in fx.reply_events("deg")] == ["token"]  # type: ignore[attr-defined]


def test_dead_only_and_script_reload_after_flush(fx: Fixture) -> None:
    entry = fx.add({"no": "id"})
    Reclaimer(fx.redis, fx.keys, "w1", reclaim_idle_s=30).read_new(10, None)
    fx.redis.script_flush()  # as after a Redis restart: scripts are reloaded transparently
    dead = DeadLetter(job='{"no":"id"}', reason="job has no id", code="invalid_request", attempts=1, worker="w1")
    outbox = Outbox(dead_only=[DeadOnly(entry, dead)])
    assert fx.pub.flush(outbox) == []
    assert fx.pub.flush(Outbox(dead_only=[DeadOnly(entry, dead)])) == []  # idempotent: acked already
    assert fx.redis.xlen(fx.keys.dead) == 1
    assert fx.redis.xpending(fx.keys.jobs, GROUP)["pending"] == 0


# ------------------------------------------------------------------------------------------- reclaimer


def test_reclaim_dead_consumer_but_never_a_live_one(fx: Fixture) -> None:
    ids = [fx.add({"id": f"r{i}", "prompt": "x"}) for i in range(4)]
    live = Reclaimer(fx.redis, fx.keys, "live", reclaim_idle_s=1.0)
    dead = Reclaimer(fx.redis, fx.keys, "dead", reclaim_idle_s=1.0)
    thief = Reclaimer(fx.redis, fx.keys, "thief", reclaim_idle_s=1.0)
    assert len(live.read_new(2, None)) == 2
    assert len(dead.read_new(2, None)) == 2

    def live_kept_fresh_dead_gone_idle() -> bool:
        """The live worker keeps its entries fresh (as its keeper does) until the dead one's entries have
        been idle past reclaim_idle_s (Redis's own idle clock, XPENDING)."""
        assert live.keep_fresh(ids[:2]) == ([], [])
        rows = fx.redis.xpending_range(fx.keys.jobs, GROUP, "-", "+", 10, consumername="dead")
        return len(rows) == 2 and all(r["time_since_delivered"] > thief.min_idle_ms for r in rows)

    wait_for(live_kept_fresh_dead_gone_idle, 30, 0.05, "the dead consumer's entries to go idle")
    assert live.keep_fresh(ids[:2]) == ([], [])
    claimed = thief.autoclaim(10)
    assert sorted(d.entry_id for d in claimed) == sorted(ids[2:])
    assert all(d.attempt == 2 for d in claimed)
    # The dead worker, come back, learns it no longer owns them; the live one still owns its own.
    taken, vanished = dead.keep_fresh(ids[2:])
    assert sorted(taken) == sorted(ids[2:]) and vanished == []
    assert live.keep_fresh(ids[:2]) == ([], [])
    # An entry nobody holds (acked, deleted, or gone with a Redis that lost its data) is "vanished", not taken;
    # so is every entry of a stream whose group is missing.
    fx.redis.xack(fx.keys.jobs, GROUP, ids[0])
    assert live.keep_fresh(ids[:2]) == ([], [ids[0]])
    fx.redis.xgroup_destroy(fx.keys.jobs, GROUP)
    assert live.keep_fresh(ids[:2]) == ([], ids[:2])


def test_own_pending_first_retry_and_release(fx: Fixture) -> None:
    ids = [fx.add({"id": f"p{i}", "prompt": "x"}) for i in range(3)]
    first = Reclaimer(fx.redis, fx.keys, "same-name", reclaim_idle_s=30)
    first.read_new(3, None)
    again = Reclaimer(fx.redis, fx.keys, "same-name", reclaim_idle_s=30)  # the restarted process
    got, cursor = again.read_own_pending("0", 2)
    assert [d.entry_id for d in got] == ids[:2] and all(d.attempt == 2 for d in got)
    got2, cursor = again.read_own_pending(str(cursor), 2)
    assert [d.entry_id for d in got2] == ids[2:]
    assert again.read_own_pending(str(cursor), 2) == ([], None)

    retried = again.retry(ids[0])
    assert retried is not None and retried.attempt == 3 and retried.fields is not None

    # Released entries are immediately claimable, with the delivery count chosen by the releaser.
    assert again.release({ids[0]: 2, ids[1]: None}) == 2
    other = Reclaimer(fx.redis, fx.keys, "other", reclaim_idle_s=30)
    claimed = {d.entry_id: d.attempt for d in other.autoclaim(10)}
    assert claimed == {ids[0]: 3, ids[1]: 3}


def test_autoclaim_acks_deleted_entries(fx: Fixture) -> None:
    entry = fx.add({"id": "gone", "prompt": "x"})
    Reclaimer(fx.redis, fx.keys, "a", reclaim_idle_s=0.05).read_new(1, None)
    fx.redis.xdel(fx.keys.jobs, entry)
    wait_for(
        lambda: fx.redis.xpending_range(fx.keys.jobs, GROUP, "-", "+", 1)[0]["time_since_delivered"] > 50,
        what="the deleted entry to be idle past reclaim_idle_s",
    )
    assert Reclaimer(fx.redis, fx.keys, "b", reclaim_idle_s=0.05).autoclaim(10) == []
    assert fx.redis.xpending(fx.keys.jobs, GROUP)["pending"] == 0


# ---------------------------------------------------------------------------------------------- client


def _fake_worker(
    fx: Fixture, events: list[list[TokenEvent | FinalEvent | ErrorEvent]], delay: float = 0.05
) -> threading.Thread:
    """Publishes batches of events to reply streams, as a worker would, from another thread."""

    def run() -> None:
        for batch in events:
            # Part of the scenario, not synchronisation: batches arrive spread out over time, as from a
            # worker, so the client reads them across several blocking reads. What it must yield does not
            # depend on the timing (the reply stream keeps the order).
            time.sleep(delay)
            outbox = Outbox()
            for e in batch:
                if isinstance(e, TokenEvent):
                    outbox.add_tokens(fx.keys.reply(e.id), "", e.id, [e.to_json()])
                else:
                    outbox.terminals.append(Terminal("", e.id, fx.keys.reply(e.id), e.to_json()))
            fx.pub.flush(outbox)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_client_submit_stream_result_cancel(fx: Fixture) -> None:
    client = PagedqClient(fx.server.client(), namespace=fx.ns)
    job_id = client.submit("Hello", max_tokens=4, temperature=0, metadata={"k": 1})
    ((_, fields),) = fx.redis.xrange(fx.keys.jobs)
    sent = json.loads(fields[JOB_FIELD])
    assert abs(sent.pop("submitted_at") - time.time()) < 60  # the job's clock, from the producer
    assert sent == {
        "id": job_id, "prompt": "Hello", "max_tokens": 4, "temperature": 0.0, "metadata": {"k": 1}
    }  # fmt: skip
    ids = client.submit_many(
        ["a", [1, 2], {"messages": [{"role": "user", "content": "hi"}], "priority": 2}], max_tokens=2
    )
    assert len(ids) == 3 and fx.redis.xlen(fx.keys.jobs) == 4

    tok = lambda text, attempt=1: TokenEvent(id=job_id, attempt=attempt, index=0, text=text, token_ids=[1])
    final = _final(job_id, "Hello there", attempt=2)
    _fake_worker(fx, [[tok("Hel")], [tok("lo")], [tok("Hello", 2)], [tok(" there", 2), final]])
    got = list(client.stream(job_id, timeout=10))
    assert got == ["Hel", "lo", " there", final]
    assert client.result(job_id, timeout=1) == final  # from the result key now

    with pytest.raises(TimeoutError):
        client.result("never-submitted", timeout=0.3)

    client.cancel(ids[0])
    assert fx.redis.get(fx.keys.cancel(ids[0])) == "1" and 0 < fx.redis.ttl(fx.keys.cancel(ids[0])) <= 86_400

    err = ErrorEvent(id=ids[1], attempt=1, code="invalid_request", message="bad")
    _fake_worker(fx, [[err]])
    with pytest.raises(JobFailed) as failed:
        client.result(ids[1], timeout=10)
    assert failed.value.code == "invalid_request"


def test_client_reads_tokens_published_with_the_terminal_after_an_empty_read(fx: Fixture) -> None:
    """The job ends between the client's empty blocking read and its look at the result key (the
    last token events and the terminal land together): those tokens still reach the caller, sync and
    asyncio. Reproduced exactly by publishing from inside the client's first (empty) XREAD."""
    job_id = "race-1"
    tok = TokenEvent(id=job_id, attempt=1, index=0, text=" last", token_ids=[7, 8])
    final = _final(job_id, "first last")

    def publish_after_first_read(redis_client: Any, is_async: bool) -> None:
        real = redis_client.xread
        calls = {"n": 0}

        def flush() -> None:
            calls["n"] += 1
            if calls["n"] == 1:  # the read came back empty: now the worker publishes
                outbox = Outbox()
                outbox.add_tokens(fx.keys.reply(job_id), "", job_id, [tok.to_json()])
                outbox.terminals.append(Terminal("", job_id, fx.keys.reply(job_id), final.to_json()))
                fx.pub.flush(outbox)

        if is_async:

            async def xread_async(*args: Any, **kwargs: Any) -> Any:
                reply = await real(*args, **kwargs)
                flush()
                return reply

            redis_client.xread = xread_async
        else:

            def xread(*args: Any, **kwargs: Any) -> Any:
                reply = real(*args, **kwargs)
                flush()
                return reply

            redis_client.xread = xread

    client = PagedqClient(fx.server.client(), namespace=fx.ns, block_ms=50)
    publish_after_first_read(client.redis, is_async=False)
    assert list(client.events(job_id, timeout=5)) == [tok, final]

    fx.redis.delete(fx.keys.reply(job_id), fx.keys.result(job_id))

    async def main() -> list[object]:
        aclient = AsyncPagedqClient(fx.server.url, namespace=fx.ns, block_ms=50)
        publish_after_first_read(aclient.redis, is_async=True)
        try:
            return [event async for event in aclient.events(job_id, timeout=5)]
        finally:
            await aclient.close()

    assert asyncio.run(main()) == [tok, final]


def test_client_stream_divergent_redelivery_yields_restart(fx: Fixture) -> None:
    client = PagedqClient(fx.server.client(), namespace=fx.ns, block_ms=100)
    job_id = client.submit("x")
    tok = lambda text, attempt: TokenEvent(id=job_id, attempt=attempt, index=0, text=text, token_ids=[1])
    final = _final(job_id, "BC", attempt=2)
    _fake_worker(fx, [[tok("A", 1)], [tok("B", 2)], [tok("C", 2), final]])
    assert list(client.stream(job_id, timeout=10)) == ["A", Restart(2), "B", "C", final]


def test_async_client(fx: Fixture) -> None:
    async def main() -> None:
        client = AsyncPagedqClient(fx.server.url, namespace=fx.ns)
        try:
            job_id = await client.submit([{"role": "user", "content": "hi"}], max_tokens=3)
            (ids,) = [await client.submit_many(["a", "b"])]
            assert len(ids) == 2
            tok = TokenEvent(id=job_id, attempt=1, index=0, text="yo", token_ids=[7])
            final = _final(job_id, "yo")
            _fake_worker(fx, [[tok], [final]])
            got = [item async for item in client.stream(job_id, timeout=10)]
            assert got == ["yo", final]
            assert await client.result(job_id, timeout=1) == final
            await client.cancel(ids[0])
            assert await client.redis.exists(fx.keys.cancel(ids[0])) == 1
        finally:
            await client.close()

    asyncio.run(main())


# -------------------------------------------------------------------------------------- embedded redis


def test_stopping_the_embedded_redis_waits_out_connections_that_are_leaving(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """stop() leaves the server to other workers still connected, but a connection on its way out (the worker's
    own, closed just before its exit stops the server) no longer keeps it running: before, one read of the
    client list counted it, and the server outlived every worker."""
    from worker import embedded_redis

    server = EmbeddedRedis(tmp_path / "data")
    url = server.start()
    try:
        staying = redis.Redis.from_url(url)
        staying.ping()
        monkeypatch.setattr(embedded_redis, "OTHERS_SETTLE_S", 0.2)
        server.stop()  # another worker's connection stays: the server keeps running for it
        assert server.process is not None and staying.ping()

        monkeypatch.setattr(embedded_redis, "OTHERS_SETTLE_S", 30.0)
        listed = threading.Event()
        original = redis.Redis.client_list

        def client_list(self: redis.Redis, *args: Any, **kwargs: Any) -> Any:
            clients = original(self, *args, **kwargs)
            listed.set()  # stop() has counted `staying` once
            return clients

        monkeypatch.setattr(redis.Redis, "client_list", client_list)

        def leave() -> None:
            if listed.wait(30):
                staying.close()

        leaving = threading.Thread(target=leave)
        leaving.start()
        server.stop()  # `staying` leaves after the first count: the server stops, well inside the 30 s
        leaving.join(30)
        assert server.process is None
    finally:
        server.stop(force=True)


def test_embedded_redis_persists_across_restart_and_is_reused(tmp_path: Path) -> None:
    data = tmp_path / "a-rather-long-folder-name-to-push-the-socket-path" / ("x" * 60) / "redis-data"
    server = EmbeddedRedis(data)
    url = server.start()
    try:
        assert len(str(server.socket_path)) <= 100
        r = redis.Redis.from_url(url, decode_responses=True)
        r.xadd("s", {"k": "v"})
        assert r.config_get("appendonly")["appendonly"] == "yes"
        assert EmbeddedRedis(data).start() == url  # a second worker on the folder reuses the server
        r.close()
        server.stop()
        assert server.process is None
        server.start()
        r = redis.Redis.from_url(url, decode_responses=True)
        assert r.xlen("s") == 1  # the AOF brought the stream back
        r.close()
    finally:
        server.stop(force=True)


def test_an_outage_logs_each_new_reason_once(redis_server: RedisServer) -> None:  # noqa: F811
    """The worker logged the first failure of an outage and then nothing until Redis came back: a server
    back up that refused its (changed) password looked like the same outage. Each new reason is logged once."""
    import structlog
    from structlog.testing import capture_logs

    from worker.redis_link import RedisLink

    client = redis_server.client()
    link = RedisLink(client, Keys(unique_namespace(), "default"), backoff_max_s=0.1, log=structlog.get_logger())
    closed = redis.ConnectionError("Connection closed by server.")
    refused = redis.AuthenticationError("invalid username-password pair or user is disabled.")
    with capture_logs() as logs:
        for failure in (closed, closed, refused, refused, closed):
            with link.phase():
                raise failure
        with link.phase():
            client.ping()
    seen = [(entry["event"], entry.get("error")) for entry in logs]
    assert seen == [
        ("redis.connection_lost", str(closed)),
        ("redis.still_down", str(refused)),
        ("redis.still_down", str(closed)),
        ("redis.reconnected", None),
    ]
    assert link.down_since is None and link.reconnects == 1
    client.close()
