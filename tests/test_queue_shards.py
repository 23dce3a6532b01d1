"""Wire protocol v2 on one Redis: sharded queues, the v1 producer's clear error, prefix-affinity routing and
home shards by rendezvous hashing (issue #22). The Redis Cluster runs are in ``tests/test_cluster.py``."""

from __future__ import annotations

import json
import random
from collections import Counter
from collections.abc import Iterator

import pytest

from schemas.affinity import affinity_key, home_shards, shard_for_job, shard_owner
from schemas.jobs import DeadLetter, FinalEvent, JobRequest
from schemas.keys import JOB_FIELD
from tests.redis_servers import RedisServer, redis_server  # noqa: F401
from tests.worker_harness import Ctx, inprocess_worker, job_counts, wait_for
from worker.client import build_job
from worker.consumer import EngineLike
from worker.protocol_v1 import answer_v1_entries
from worker.redis_url import parse_redis_url
from worker.settings import mask_url


@pytest.fixture
def sharded(redis_server: RedisServer) -> Iterator[Ctx]:  # noqa: F811
    c = Ctx(redis_server, shards=4)
    yield c
    c.close()


def test_a_sharded_queue_runs_every_job_once_from_every_shard(sharded: Ctx, engine: EngineLike) -> None:
    """Jobs spread over four shards by their affinity keys; one worker reads them all, acks and deletes each
    entry on its own shard, and the dead letter of a bad entry lands on that entry's shard."""
    ctx = sharded
    with inprocess_worker(ctx, engine, steal_after_s=0.0) as worker:
        prompts = [f"prefix {i % 8}: question {i}" for i in range(24)]
        ids = ctx.client.submit_many(prompts, max_tokens=3, temperature=0)
        used = {shard_for_job(build_job(p, id="x"), ctx.shards) for p in prompts}
        assert len(used) > 1, "the prompts should land on several shards"
        ctx.redis.xadd(ctx.keys.jobs_shard(3), {JOB_FIELD: "{not json"})
        for job_id in ids:
            assert isinstance(ctx.client.result(job_id, timeout=60), FinalEvent)
        wait_for(lambda: ctx.pending() == 0 and ctx.backlog() == 0, what="every shard drained")
        assert worker.errors == 0
    assert set(job_counts(ctx.redis, ctx.keys, ids).values()) == {(1, True)}
    (letter,) = ctx.redis.xrange(ctx.keys.dead_shard(3))
    assert letter[1]["entry_id"].endswith("@3") and letter[1]["job"] == "{not json"
    assert all(ctx.redis.xlen(ctx.keys.dead_shard(k)) == 0 for k in range(3))


def test_a_v1_producer_gets_a_clear_error_not_a_hang(sharded: Ctx, engine: EngineLike) -> None:
    """A producer still on protocol v1 (``<ns>:jobs:<queue>``, ``<ns>:reply:<id>``) is answered on its v1 reply
    stream and result key with an error that names v2; the entry is dead-lettered and deleted."""
    ctx = sharded
    with inprocess_worker(ctx, engine) as worker:
        # A payload too deep for json ahead of the honest producer's job: it must not hold the answer back,
        # nor cost the loop its ticks.
        ctx.redis.xadd(ctx.keys.jobs_v1, {JOB_FIELD: "[" * 100_000})
        ctx.redis.xadd(ctx.keys.jobs_v1, {JOB_FIELD: json.dumps({"id": "old1", "prompt": "hi"})})
        ctx.redis.xadd(ctx.keys.jobs_v1, {JOB_FIELD: "garbage"})
        reply = ctx.redis.xread({ctx.keys.v1_reply("old1"): "0"}, block=20_000, count=1)
        wait_for(lambda: ctx.redis.xlen(ctx.keys.jobs_v1) == 0, what="the v1 entries answered")
        assert worker.errors == 0
    (_, entries), *_ = reply
    event = json.loads(entries[0][1]["event"])
    assert event["type"] == "error" and event["code"] == "invalid_request" and "protocol v2" in event["message"]
    assert json.loads(ctx.redis.get(ctx.keys.v1_result("old1")))["id"] == "old1"
    letters = [fields for _, fields in ctx.redis.xrange(ctx.keys.dead_shard(0))]
    assert sorted(f["code"] for f in letters) == ["protocol_v1"] * 3


def test_a_malformed_v1_entry_is_dead_lettered_and_the_next_one_answered(sharded: Ctx) -> None:
    """An entry whose payload defeats ``json`` (nesting too deep: RecursionError) is dead-lettered and deleted
    like any other, and the v1 producer queued after it still gets its error. It used to raise out of every
    look, stay at the stream's head for ever, and hold back every later v1 entry."""
    ctx = sharded
    poison = ctx.redis.xadd(ctx.keys.jobs_v1, {JOB_FIELD: "[" * 100_000})
    honest = ctx.redis.xadd(ctx.keys.jobs_v1, {JOB_FIELD: json.dumps({"id": "honest1", "prompt": "hi"})})
    assert answer_v1_entries(ctx.redis, ctx.keys, "w1", result_ttl_s=60, reply_ttl_s=30) == 2
    assert ctx.redis.xlen(ctx.keys.jobs_v1) == 0
    assert json.loads(ctx.redis.get(ctx.keys.v1_result("honest1")))["code"] == "invalid_request"
    assert 0 < ctx.redis.ttl(ctx.keys.v1_reply("honest1")) <= 30
    letters = {f["entry_id"]: DeadLetter.from_fields(f) for _, f in ctx.redis.xrange(ctx.keys.dead_shard(0))}
    assert set(letters) == {f"v1:{poison}", f"v1:{honest}"}
    assert all(letter.code == "protocol_v1" for letter in letters.values())
    assert letters[f"v1:{poison}"].job_id == "" and letters[f"v1:{poison}"].job_bytes == 100_000
    assert letters[f"v1:{honest}"].job_id == "honest1"


def test_affinity_keys_route_shared_prefixes_to_one_shard() -> None:
    system = [{"role": "system", "content": "You are a contract lawyer."}]
    a = build_job([*system, {"role": "user", "content": "doc 1"}], id="a")
    b = build_job([*system, {"role": "user", "content": "doc 2"}], id="b")
    assert affinity_key(a) == affinity_key(b) and shard_for_job(a, 16) == shard_for_job(b, 16)
    prefix = "x" * 300
    assert shard_for_job(build_job(prefix + "1", id="c"), 16) == shard_for_job(build_job(prefix + "2", id="d"), 16)
    explicit = build_job("anything", id="e", affinity="chat-42")
    assert affinity_key(explicit) == "chat-42"
    assert shard_for_job(build_job([1, 2, 3], id="f"), 1) == 0
    with pytest.raises(ValueError):
        JobRequest.model_validate({"id": "g", "prompt": "x", "affinity": ""})
    # Spread: 200 distinct prefixes over 8 shards leave none empty.
    spread = Counter(shard_for_job(build_job(f"{i} " + prefix, id="h"), 8) for i in range(200))
    assert len(spread) == 8


def test_a_worker_leaving_moves_only_its_shards() -> None:
    """Rendezvous hashing: every shard has exactly one home among the live workers, and when one worker
    leaves (or joins) only the shards it held (or wins) change owner."""
    rng = random.Random(22)
    for _ in range(20):
        shards = rng.randint(4, 64)
        fleet = [f"w{rng.randint(0, 10**6)}" for _ in range(rng.randint(2, 8))]
        before = {k: shard_owner(k, fleet) for k in range(shards)}
        homes = {w: home_shards(w, fleet, shards) for w in fleet}
        assert sorted(k for h in homes.values() for k in h) == list(range(shards))
        leaving = rng.choice(fleet)
        rest = [w for w in fleet if w != leaving]
        after = {k: shard_owner(k, rest) for k in range(shards)}
        moved = {k for k in range(shards) if before[k] != after[k]}
        assert moved == set(homes[leaving])
        joined = [*fleet, "newcomer"]
        gained = {k for k in range(shards) if shard_owner(k, joined) != before[k]}
        assert gained == set(home_shards("newcomer", joined, shards))


def test_cluster_urls_parse_and_mask() -> None:
    target = parse_redis_url("redis+cluster://u:secret@10.0.0.1:7000,10.0.0.2:7001")
    assert target.cluster and target.nodes == (("10.0.0.1", 7000), ("10.0.0.2", 7001))
    assert target.url == "redis://u:secret@10.0.0.1:7000"
    assert parse_redis_url("rediss+cluster://h:1").url.startswith("rediss://")
    assert not parse_redis_url("redis://localhost:6379/0").cluster
    for bad in ("redis+cluster://h", "redis+cluster://h:0", "redis+cluster://h:1/3", "http://h"):
        with pytest.raises(ValueError):
            parse_redis_url(bad)
    masked = mask_url("redis+cluster://u:secret@10.0.0.1:7000,10.0.0.2:7001")
    assert "secret" not in masked and "10.0.0.2:7001" in masked
