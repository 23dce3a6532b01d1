"""pagedq on a real Redis Cluster (3 masters + 3 replicas from Debian's ``redis-server``): the exactly-once
SIGKILL scenario, a failover while jobs run, a cancel notice reaching a worker whatever node it is on, and
the cluster's own terminal scripts on a reply stream of a job id submitted twice.

Almost every test starts worker processes on a cluster of six servers, so the file is in the slow tier."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from tempfile import TemporaryDirectory

import pytest
from redis.crc import key_slot

from schemas.jobs import FinalEvent
from tests.redis_servers import ClusterServers, DebianServer, fresh_redis_cluster, redis_cluster  # noqa: F401
from tests.test_worker_e2e import Workers, assert_exactly_once, sigkill_one_of_two_workers, stream_text_matches
from tests.test_worker_redis import second_copy_ends_first
from tests.worker_harness import Ctx, wait_for
from worker.publisher import Publisher
from worker.reclaimer import ensure_group

pytestmark = pytest.mark.slow  # six redis-server processes and two worker processes per test (~20-40 s each)

SHARDS = 3


@pytest.fixture
def cluster_ctx(redis_cluster: ClusterServers) -> Iterator[Ctx]:  # noqa: F811
    c = Ctx(redis_cluster, shards=SHARDS)
    yield c
    c.close()


@pytest.fixture
def cluster_workers(cluster_ctx: Ctx, model_dir: Path, tmp_path: Path) -> Iterator[Workers]:
    w = Workers(cluster_ctx, model_dir, tmp_path)
    yield w
    w.close()
    print(w.logs())


def test_shard_streams_spread_over_the_masters(cluster_ctx: Ctx, redis_cluster: ClusterServers) -> None:  # noqa: F811
    slots = {key_slot(stream.encode()) for stream in cluster_ctx.keys.job_streams}
    assert len(slots) == SHARDS
    job_keys = {key_slot(k.encode()) for k in (cluster_ctx.keys.reply("a"), cluster_ctx.keys.result("a"))}
    assert len(job_keys) == 1 and job_keys == {key_slot(cluster_ctx.keys.cancel("a").encode())}


def test_a_reply_stream_expires_when_another_copy_of_its_id_ended_the_job(cluster_ctx: Ctx) -> None:
    """As on one server (tests/test_worker_redis.py), through the cluster's split terminal write: the result
    half that finds the job ended still expires the reply stream its delivery owns (same slot)."""
    ctx = cluster_ctx
    ensure_group(ctx.redis, ctx.keys)
    pub = Publisher(ctx.redis, ctx.keys, result_ttl_s=60, reply_ttl_s=30, reply_maxlen=1000)
    assert pub.cluster
    reply = second_copy_ends_first(ctx.redis, ctx.keys, pub)
    assert 0 < ctx.redis.ttl(reply) <= 30


def test_sigkill_on_a_cluster_loses_and_duplicates_nothing(cluster_ctx: Ctx, cluster_workers: Workers) -> None:
    sigkill_one_of_two_workers(cluster_ctx, cluster_workers)


def test_failover_while_jobs_run_loses_and_duplicates_nothing(
    fresh_redis_cluster: ClusterServers,  # noqa: F811
    model_dir: Path,
    tmp_path: Path,
) -> None:
    """``CLUSTER FAILOVER`` on the replica of the master holding shard 0 while two workers stream jobs: every
    job still ends exactly once, and the workers carry on by themselves (redis-py follows the new
    topology; the loop backs off through the switch)."""
    ctx = Ctx(fresh_redis_cluster, shards=SHARDS)
    workers = Workers(ctx, model_dir, tmp_path)
    try:
        a = workers.start("wa", step_delay_s=0.01, reclaim_idle_s=3)
        b = workers.start("wb", step_delay_s=0.01, reclaim_idle_s=3)
        a.wait_ready()
        b.wait_ready()
        ids = ctx.client.submit_many([f"story {i}" for i in range(36)], max_tokens=24, ignore_eos=True, temperature=0)
        wait_for(lambda: sum(ctx.result(j) is not None for j in ids) >= 4, 120, what="some jobs done")
        cluster = fresh_redis_cluster
        slot = key_slot(ctx.keys.jobs_shard(0).encode())
        owner = _slot_master(cluster, slot)
        replica = _replica_of(cluster, owner)
        cluster.failover(replica)
        assert _slot_master(cluster, slot) == replica.port
        assert any(ctx.result(j) is None for j in ids), "the failover should happen while jobs run"
        for job_id in ids:
            assert isinstance(ctx.client.result(job_id, timeout=180), FinalEvent)
        finals = assert_exactly_once(ctx, ids)
        for job_id in ids:
            stream_text_matches(ctx, job_id, finals[job_id])
        assert a.terminate() == 0 and b.terminate() == 0
    finally:
        workers.close()
        print(workers.logs())
        ctx.close()


def _slot_master(cluster: ClusterServers, slot: int) -> int:
    """The port of the master serving ``slot``, as a live node sees the cluster."""
    client = cluster.live_nodes()[0].client()
    try:
        for start, end, master, *_ in client.execute_command("CLUSTER", "SLOTS"):
            if int(start) <= slot <= int(end):
                return int(master[1])
    finally:
        client.close()
    raise AssertionError(f"slot {slot} has no master")


def _replica_of(cluster: ClusterServers, master_port: int) -> DebianServer:
    for node in cluster.replicas():
        client = node.client()
        try:
            if int(client.info("replication").get("master_port", 0)) == master_port:
                return node
        finally:
            client.close()
    raise AssertionError(f"no replica of :{master_port}")


def test_cancel_notice_reaches_a_worker_on_any_node(cluster_ctx: Ctx, cluster_workers: Workers) -> None:
    """Cancel notices are classic pub/sub, which a cluster broadcasts to every node, with the cancel key
    (``<ns>:{<id>}:cancel``, polled every ``cancel_poll_s``) behind it: a running job stops with its partial
    text."""
    worker = cluster_workers.start("w", step_delay_s=0.02, cancel_poll_s=30)  # the notice, not the poll
    worker.wait_ready()
    job_id = cluster_ctx.client.submit("tell me everything", max_tokens=2000, ignore_eos=True, temperature=0)
    wait_for(lambda: len(cluster_ctx.events(job_id)) >= 2, 60, what="the job streaming")
    cluster_ctx.client.cancel(job_id)
    final = cluster_ctx.client.result(job_id, timeout=30)
    assert final.choices[0].finish_reason == "cancelled" and 0 < len(final.choices[0].token_ids) < 2000
    assert worker.terminate() == 0


def test_a_worker_started_while_its_cluster_is_down_waits_for_it(
    fresh_redis_cluster: ClusterServers,  # noqa: F811
    model_dir: Path,
    tmp_path: Path,
) -> None:
    """A worker and its cluster restarted together (a host reboot, a compose ``up``): the cluster client
    reads the slot map as it is made, so the worker exited at start with a traceback, where a worker on a
    single server waits for it. Now it waits (``redis.unavailable``) and serves once the cluster is back."""
    cluster = fresh_redis_cluster
    ctx = Ctx(cluster, shards=SHARDS)
    workers = Workers(ctx, model_dir, tmp_path)
    try:
        cluster.stop()  # every node; AOF and nodes.conf keep the data and the topology
        worker = workers.start("late")
        wait_for(
            lambda: any(line.get("event") == "redis.unavailable" for line in worker.log_lines()),
            60,
            what="the worker to wait for the cluster",
        )
        assert worker.proc.poll() is None, worker.log()
        for node in cluster.nodes:
            node.start()
        cluster.wait_healthy()
        worker.wait_ready()
        job_id = ctx.client.submit("hello again", max_tokens=4, temperature=0)
        final = ctx.client.result(job_id, timeout=120)
        assert isinstance(final, FinalEvent) and len(final.choices[0].token_ids) == 4
        assert worker.terminate() == 0
    finally:
        workers.close()
        print(workers.logs())
        ctx.close()


def test_a_server_that_is_no_cluster_is_an_error_not_a_wait(tmp_path: Path) -> None:
    """``redis+cluster://`` naming a plain server: no wait can fix that, so the worker does not wait; it says
    so in one line and exits 78 (a setting at fault) before it loads a model (here none would load)."""
    import structlog

    from tests.redis_servers import make_server
    from tests.worker_harness import WorkerProcess
    from worker.redis_link import NotAClusterError, redis_client_when_up

    with TemporaryDirectory() as data:
        server = make_server("debian", Path(data) / "plain")
        assert isinstance(server, DebianServer)
        url = f"redis+cluster://127.0.0.1:{server.port}"
        try:
            with pytest.raises(NotAClusterError, match="refused the cluster client's CLUSTER SLOTS"):
                redis_client_when_up(url, 1.0, backoff_max_s=0.1, log=structlog.get_logger())
            ctx = Ctx(server)
            worker = WorkerProcess(ctx, tmp_path / "no-model", tmp_path, "not-a-cluster", redis_url=url)
            try:
                assert worker.proc.wait(timeout=60) == 78, worker.log()
                lines = worker.log_lines()
                (line,) = [x for x in lines if x.get("event") == "worker.redis_not_a_cluster"]
                assert f"Redis at 127.0.0.1:{server.port} refused the cluster client's CLUSTER SLOTS" in line["error"]
                assert "cluster support disabled" in line["error"]
                assert not any(x.get("event") == "worker.model_unavailable" for x in lines)
            finally:
                worker.close()
                ctx.close()
        finally:
            server.stop()
