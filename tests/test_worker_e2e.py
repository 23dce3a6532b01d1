"""Real worker processes (``python -m worker``) with the tiny model, against both Redis servers.

Worker death (SIGKILL), graceful drain (SIGTERM), a Redis restart on the same data folder (AOF),
backpressure between two workers, and the embedded-Redis default. Every job is counted: exactly one
terminal event in its reply stream and one result key.

Starting a worker process costs several seconds (torch import, model load), so the Debian-server
variants of the drain and backpressure tests are marked slow (``pytest -m slow`` runs them).
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import signal
import subprocess
import sys
import threading
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from schemas.jobs import FinalEvent
from schemas.keys import GROUP, JOB_FIELD
from tests.redis_servers import DEBIAN_VARIANT_SLOW, RedisServer, fresh_redis_server, redis_server  # noqa: F401
from tests.worker_harness import REPO, Ctx, WorkerProcess, job_counts, logs_shown_on_failure, wait_for
from worker.client import PagedqClient, Restart


@pytest.fixture(scope="session")
def model_dir(tiny_model: Any) -> Path:
    return Path(tiny_model("llama_gqa"))


@pytest.fixture
def ctx(redis_server: RedisServer) -> Iterator[Ctx]:  # noqa: F811
    c = Ctx(redis_server)
    yield c
    c.close()


class Workers:
    """Worker processes of one test, killed and their logs shown on failure."""

    def __init__(self, ctx: Ctx, model: Path, tmp: Path) -> None:
        self.ctx, self.model, self.tmp = ctx, model, tmp
        self.procs: list[WorkerProcess] = []

    def start(self, name: str, **settings: Any) -> WorkerProcess:
        proc = WorkerProcess(self.ctx, self.model, self.tmp, name, **settings)
        self.procs.append(proc)
        return proc

    def close(self) -> None:
        for p in self.procs:
            p.close()

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.log()}" for p in self.procs)


@pytest.fixture
def workers(ctx: Ctx, model_dir: Path, tmp_path: Path) -> Iterator[Workers]:
    w = Workers(ctx, model_dir, tmp_path)
    yield w
    w.close()
    print(w.logs())  # captured: shown only when the test failed


def assert_exactly_once(ctx: Ctx, job_ids: list[str]) -> dict[str, FinalEvent]:
    counts = job_counts(ctx.redis, ctx.keys, job_ids)
    bad = {j: c for j, c in counts.items() if c != (1, True)}
    assert not bad, f"jobs without exactly one terminal event and result: {bad}"
    finals: dict[str, FinalEvent] = {j: ctx.result(j) for j in job_ids}
    assert all(isinstance(f, FinalEvent) for f in finals.values())
    assert ctx.pending() == 0 and ctx.backlog() == 0
    return finals


def stream_text_matches(ctx: Ctx, job_id: str, final: FinalEvent) -> None:
    """Replaying the reply stream through the client gives the final text (no repeat, no garbling)."""
    items = list(ctx.client.stream(job_id, timeout=10))
    restarts = [i for i, x in enumerate(items) if isinstance(x, Restart)]
    tail = items[restarts[-1] + 1 :] if restarts else items
    assert "".join(x for x in tail if isinstance(x, str)) == final.text


def freeze(proc: WorkerProcess) -> None:
    """SIGSTOP the worker process and wait until the kernel reports every one of its threads stopped."""
    proc.proc.send_signal(signal.SIGSTOP)
    tasks = Path(f"/proc/{proc.proc.pid}/task")

    def stopped() -> bool:
        states = []
        for stat in tasks.glob("*/stat"):
            with contextlib.suppress(OSError):  # a thread that just ended
                states.append(stat.read_text().rsplit(")", 1)[1].split()[0])
        return bool(states) and all(s in ("T", "t") for s in states)

    wait_for(stopped, 10, 0.001, f"{proc.name} stopped")


def mid_generation(ctx: Ctx, consumer: str) -> list[str]:
    """Jobs whose stream entries ``consumer`` holds (on any shard) that streamed tokens and have no terminal
    event yet."""
    out = []
    for stream in ctx.keys.job_streams:
        for row in ctx.redis.xpending_range(stream, GROUP, "-", "+", 100, consumername=consumer):
            entry = ctx.redis.xrange(stream, row["message_id"], row["message_id"])
            if not entry:
                continue
            job_id = json.loads(entry[0][1][JOB_FIELD])["id"]
            events = ctx.events(job_id)
            if events and all(e.type == "token" for e in events):
                out.append(job_id)
    return out


@pytest.mark.parametrize("redis_server", DEBIAN_VARIANT_SLOW, indirect=True)
def test_sigkill_one_of_two_workers_loses_and_duplicates_nothing(ctx: Ctx, workers: Workers) -> None:
    sigkill_one_of_two_workers(ctx, workers)


def sigkill_one_of_two_workers(ctx: Ctx, workers: Workers) -> None:
    """SIGKILL a worker mid-generation on 2+ jobs: the survivor takes them over, and every job has exactly one
    terminal event and one result (shared with the Redis Cluster variant, tests/test_cluster.py)."""
    slow = {"step_delay_s": 0.01, "reclaim_idle_s": 1.5}
    a = workers.start("victim", **slow)
    b = workers.start("survivor", **slow)
    a.wait_ready()
    b.wait_ready()
    ids = ctx.client.submit_many(
        [f"job {i}: tell me a story" for i in range(40)], max_tokens=24, ignore_eos=True, temperature=0
    )
    wait_for(lambda: ctx.heartbeats().get("victim", {}).get("running", 0) >= 2, what="victim running jobs")

    def frozen_mid_generation() -> list[str] | None:
        """Stop the victim (SIGSTOP) and keep it stopped if it holds 2+ jobs that streamed tokens but did not
        end: the moment of the SIGKILL is then pinned mid-generation instead of guessed by a sleep."""
        freeze(a)
        if len(mid := mid_generation(ctx, "victim")) >= 2:
            return mid
        a.proc.send_signal(signal.SIGCONT)
        return None

    wait_for(frozen_mid_generation, 60, 0.02, "the victim mid-generation on 2+ jobs")
    a.kill()
    cut_off = mid_generation(ctx, "victim")  # as the victim left them: partial token streams, no terminal
    assert len(cut_off) >= 2, cut_off
    print(f"killed mid-generation of {cut_off}")
    held = Counter[str]()
    for stream in ctx.keys.job_streams:
        held.update({c["name"]: int(c["pending"]) for c in ctx.redis.xinfo_consumers(stream, GROUP)})
    assert held.get("victim", 0) > 0, held
    for job_id in ids:
        ctx.client.result(job_id, timeout=120)
    finals = assert_exactly_once(ctx, ids)
    taken_over = [f for f in finals.values() if f.attempt > 1]
    assert taken_over and all(f.worker == "survivor" for f in taken_over)
    # Every job cut off mid-generation was taken over and finished by the survivor (its stream restarts).
    assert all(finals[j].attempt == 2 and finals[j].worker == "survivor" for j in cut_off), cut_off
    for job_id in ids:
        stream_text_matches(ctx, job_id, finals[job_id])
    assert b.terminate() == 0


@pytest.mark.slow  # two workers, one drained mid-run (~18 s); SIGKILL and Redis restart stay default
@pytest.mark.parametrize("redis_server", DEBIAN_VARIANT_SLOW, indirect=True)
def test_sigterm_drains_running_jobs_and_hands_back_the_rest(ctx: Ctx, workers: Workers) -> None:
    a = workers.start("draining", step_delay_s=0.02, shutdown_grace_s=60)
    a.wait_ready()
    ids = ctx.client.submit_many([f"drain {i}" for i in range(10)], max_tokens=30, ignore_eos=True)
    wait_for(lambda: ctx.heartbeats().get("draining", {}).get("running", 0) == 4, what="4 running")
    # The running jobs have streamed tokens: the drain must let them finish, not hand them back.
    streaming = wait_for(lambda: len(s := [j for j in ids if ctx.events(j)]) >= 4 and s, what="4 jobs streaming tokens")
    a.proc.send_signal(signal.SIGTERM)
    b = workers.start("successor")  # starts while the first one drains, and takes the handed-back jobs
    assert a.proc.wait(60) == 0
    by_a = [j for j in ids if (r := ctx.result(j)) is not None and r.worker == "draining"]
    assert 4 <= len(by_a) < 10, "the running jobs finish, the others are left for other workers"
    assert set(streaming) <= set(by_a), "a job that had streamed tokens was not finished by the draining worker"
    for job_id in ids:
        ctx.client.result(job_id, timeout=60)
    finals = assert_exactly_once(ctx, ids)
    # Jobs handed back before they produced anything did not use up an attempt.
    assert all(f.attempt == 1 for f in finals.values())
    # The drain ended because the jobs it kept were done (all to full length), not because the 60 s grace
    # period ran out: nothing was abandoned, every job it kept finished between "draining" and "drained".
    assert all(finals[j].usage.completion_tokens == 30 for j in by_a)
    lines = a.log_lines()
    names = [x.get("event") for x in lines]
    assert "job.abandoned" not in names
    assert [e for e in names if e in ("worker.draining", "worker.drained")] == ["worker.draining", "worker.drained"]
    begin, end = names.index("worker.draining"), names.index("worker.drained")
    finished_in_drain = {x["job_id"] for x in lines[begin:end] if x.get("event") == "job.finished"}
    assert lines[begin]["running"] == len(finished_in_drain) > 0, lines[begin]
    assert finished_in_drain <= set(by_a) and "job.finished" not in names[end:]
    assert b.terminate() == 0


@pytest.mark.slow  # a Redis restart under a running worker (~12 s); SIGKILL stays default
@pytest.mark.parametrize("fresh_redis_server", DEBIAN_VARIANT_SLOW, indirect=True)
def test_redis_restart_mid_run(fresh_redis_server: RedisServer, model_dir: Path, tmp_path: Path) -> None:  # noqa: F811
    ctx = Ctx(fresh_redis_server)
    w = Workers(ctx, model_dir, tmp_path)
    with logs_shown_on_failure(w.logs, w.close, ctx.close):
        a = w.start("steadfast", step_delay_s=0.01)
        a.wait_ready()
        ids = ctx.client.submit_many([f"restart {i}" for i in range(12)], max_tokens=32, ignore_eos=True)
        wait_for(lambda: ctx.heartbeats().get("steadfast", {}).get("running", 0) >= 2, what="running")
        ctx.close()
        fresh_redis_server.restart(downtime_s=1.5)
        ctx.__post_init__()  # new connections
        for job_id in ids:
            ctx.client.result(job_id, timeout=120)
        assert_exactly_once(ctx, ids)
        events = [x.get("event") for x in a.log_lines()]
        assert "redis.connection_lost" in events and "redis.reconnected" in events
        assert a.terminate() == 0


@pytest.mark.slow  # a Redis that restarts empty under a running job (~10 s)
@pytest.mark.parametrize("fresh_redis_server", ["debian"], indirect=True)  # its data files are known
def test_a_redis_restarted_empty_still_gets_the_running_jobs_answer(
    fresh_redis_server: RedisServer,  # noqa: F811
    model_dir: Path,
    tmp_path: Path,
) -> None:
    """Redis back without its data (no persistence, a failover to a replica that never had the job): the
    job's entry and the consumer group are gone, yet the worker running the job keeps it and publishes its
    result (it used to drop it as "lost"), and a client waiting on it rides out the outage
    (``reconnect_s``) and gets it (it used to raise ConnectionError)."""
    ctx = Ctx(fresh_redis_server)
    w = Workers(ctx, model_dir, tmp_path)
    with logs_shown_on_failure(w.logs, w.close, ctx.close):
        a = w.start("amnesia", step_delay_s=0.02)
        a.wait_ready()
        job_id = ctx.client.submit("amnesia", max_tokens=300, ignore_eos=True)
        outcome: dict[str, Any] = {}

        def wait() -> None:
            with PagedqClient(fresh_redis_server.url, namespace=ctx.ns) as waiter:
                try:
                    outcome["final"] = waiter.result(job_id, timeout=120)
                except BaseException as exc:  # shown by the assertion below
                    outcome["error"] = exc

        waiting = threading.Thread(target=wait, daemon=True)
        waiting.start()
        wait_for(lambda: ctx.events(job_id), what="the job's first tokens")
        ctx.close()
        fresh_redis_server.kill()
        for name in ("appendonlydir", "dump.rdb"):  # the data Redis would come back with
            target = fresh_redis_server.data_dir / name
            if target.is_dir():
                shutil.rmtree(target)
            target.unlink(missing_ok=True)
        fresh_redis_server.start()
        ctx.__post_init__()  # new connections
        waiting.join(120)
        assert "error" not in outcome and "final" in outcome, outcome
        final = outcome["final"]
        assert final.attempt == 1 and final.usage.completion_tokens == 300
        events = [x.get("event") for x in a.log_lines()]
        assert "job.entry_vanished" in events and "job.lost" not in events
        assert "keeper.failed" not in events  # the missing group is a vanished entry, not a traceback
        assert a.terminate() == 0


@pytest.mark.slow  # scaling: two worker processes sharing a backlog
def test_backpressure_two_workers_share_a_backlog(ctx: Ctx, workers: Workers) -> None:
    bound = 4 + 2  # max_num_seqs + prefetch
    a = workers.start("bp-a")
    b = workers.start("bp-b")
    a.wait_ready()
    b.wait_ready()
    ids = ctx.client.submit_many([f"backlog {i}" for i in range(100)], max_tokens=8, ignore_eos=True)
    peak: Counter[str] = Counter()
    stop = threading.Event()

    def watch() -> None:
        """Samples every worker's pending and unstarted counts (the peaks checked below) until stopped;
        the interval is the sampling rate, not a wait for anything."""
        r = ctx.server.client()
        while True:
            try:
                for c in r.xinfo_consumers(ctx.keys.jobs, GROUP):
                    peak[c["name"]] = max(peak[c["name"]], int(c["pending"]))
                for name, beat in ctx.heartbeats().items():
                    peak[f"{name}.unstarted"] = max(peak[f"{name}.unstarted"], beat["unstarted"])
            except redis.RedisError:
                pass
            if stop.wait(0.02):
                break
        r.close()

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        for job_id in ids:
            ctx.client.result(job_id, timeout=120)
    finally:
        stop.set()
        watcher.join()
    finals = assert_exactly_once(ctx, ids)
    per_worker = Counter(f.worker for f in finals.values())
    assert per_worker["bp-a"] >= 10 and per_worker["bp-b"] >= 10, per_worker
    assert 0 < peak["bp-a"] <= bound and 0 < peak["bp-b"] <= bound, peak
    assert peak["bp-a.unstarted"] <= bound and peak["bp-b.unstarted"] <= bound, peak
    # Idle again: no KV block leaked in either worker.
    for name in ("bp-a", "bp-b"):

        def idle(n: str = name) -> dict[str, Any] | None:
            beat = ctx.heartbeats().get(n)
            return beat if beat and beat["idle"] else None

        beat = wait_for(idle, what=f"{name} idle")
        assert beat["num_free_blocks"] == beat["num_total_blocks"]
    assert a.terminate() == 0 and b.terminate() == 0


@pytest.mark.slow  # a worker process with its own embedded server (~11 s); every other test starts one
def test_worker_alone_starts_an_embedded_redis(model_dir: Path, tmp_path: Path) -> None:
    data = tmp_path / "data"
    log = tmp_path / "worker.log"
    env_cmd = [
        sys.executable, "-m", "worker", "--model", str(model_dir), "--data-dir", str(data),
        "--name", "solo", "--max-num-seqs", "2", "--kv-cache-bytes", str(4 << 20), "--log-format", "json",
    ]  # fmt: skip
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            env_cmd,
            cwd=REPO,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"},
        )
        try:
            url = wait_for(
                lambda: (m := re.search(r'"url": "(unix://[^"]+)"', log.read_text())) and m.group(1),
                120,
                0.1,
                "embedded redis url in the log",
            )
            client = PagedqClient(url)
            job_id = client.submit("hello embedded", max_tokens=4)
            final = client.result(job_id, timeout=120)
            assert final.worker == "solo" and final.usage.completion_tokens >= 1
            client.close()
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(60) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
    assert (data / "appendonly.aof").exists() or (data / "appendonlydir").exists()
    assert not Path(url.removeprefix("unix://")).exists(), "embedded redis still running after exit"
