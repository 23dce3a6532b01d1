"""Real worker processes (``python -m worker``) with the tiny model, against both Redis servers.

Worker death (SIGKILL), graceful drain (SIGTERM), a Redis restart on the same data folder (AOF),
backpressure between two workers, and the embedded-Redis default. Every job is counted: exactly one
terminal event in its reply stream and one result key.

Starting a worker process costs several seconds (torch import, model load), so the Debian-server
variants of the drain and backpressure tests are marked slow (``pytest -m slow`` runs them).
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from schemas.jobs import FinalEvent
from schemas.keys import GROUP
from tests.redis_servers import RedisServer, fresh_redis_server, redis_server  # noqa: F401
from tests.worker_harness import REPO, Ctx, WorkerProcess, job_counts, wait_for
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
    counts = job_counts(ctx.r, ctx.keys, job_ids)
    bad = {j: c for j, c in counts.items() if c != (1, True)}
    assert not bad, f"jobs without exactly one terminal event and result: {bad}"
    finals: dict[str, FinalEvent] = {j: ctx.result(j) for j in job_ids}
    assert all(isinstance(f, FinalEvent) for f in finals.values())
    assert ctx.pending() == 0 and ctx.r.xlen(ctx.keys.jobs) == 0
    return finals


def stream_text_matches(ctx: Ctx, job_id: str, final: FinalEvent) -> None:
    """Replaying the reply stream through the client gives the final text (no repeat, no garbling)."""
    items = list(ctx.client.stream(job_id, timeout=10))
    restarts = [i for i, x in enumerate(items) if isinstance(x, Restart)]
    tail = items[restarts[-1] + 1 :] if restarts else items
    assert "".join(x for x in tail if isinstance(x, str)) == final.text


def test_sigkill_one_of_two_workers_loses_and_duplicates_nothing(ctx: Ctx, workers: Workers) -> None:
    slow = {"step_delay_s": 0.01, "reclaim_idle_s": 1.5}
    a = workers.start("victim", **slow)
    b = workers.start("survivor", **slow)
    a.wait_ready()
    b.wait_ready()
    ids = ctx.client.submit_many(
        [f"job {i}: tell me a story" for i in range(40)], max_tokens=24, ignore_eos=True, temperature=0
    )
    wait_for(lambda: ctx.heartbeats().get("victim", {}).get("running", 0) >= 2, what="victim running jobs")
    time.sleep(0.3)  # mid-generation
    a.kill()
    held = {c["name"]: c["pending"] for c in ctx.r.xinfo_consumers(ctx.keys.jobs, GROUP)}
    assert held.get("victim", 0) > 0, held
    for job_id in ids:
        ctx.client.result(job_id, timeout=120)
    finals = assert_exactly_once(ctx, ids)
    taken_over = [f for f in finals.values() if f.attempt > 1]
    assert taken_over and all(f.worker == "survivor" for f in taken_over)
    for job_id in ids:
        stream_text_matches(ctx, job_id, finals[job_id])
    assert b.terminate() == 0


@pytest.mark.parametrize("redis_server", ["embedded", pytest.param("debian", marks=pytest.mark.slow)], indirect=True)
def test_sigterm_drains_running_jobs_and_hands_back_the_rest(ctx: Ctx, workers: Workers) -> None:
    a = workers.start("draining", step_delay_s=0.02, shutdown_grace_s=60)
    a.wait_ready()
    ids = ctx.client.submit_many([f"drain {i}" for i in range(10)], max_tokens=30, ignore_eos=True)
    wait_for(lambda: ctx.heartbeats().get("draining", {}).get("running", 0) == 4, what="4 running")
    time.sleep(0.2)
    t0 = time.monotonic()
    a.proc.send_signal(signal.SIGTERM)
    b = workers.start("successor")  # starts while the first one drains, and takes the handed-back jobs
    assert a.proc.wait(60) == 0
    assert time.monotonic() - t0 < 30
    by_a = [j for j in ids if (r := ctx.result(j)) is not None and r.worker == "draining"]
    assert 4 <= len(by_a) < 10, "the running jobs finish, the others are left for other workers"
    for job_id in ids:
        ctx.client.result(job_id, timeout=60)
    finals = assert_exactly_once(ctx, ids)
    # Jobs handed back before they produced anything did not use up an attempt.
    assert all(f.attempt == 1 for f in finals.values())
    lines = [x for x in a.log_lines() if x.get("event") in ("worker.draining", "worker.drained")]
    assert [x["event"] for x in lines] == ["worker.draining", "worker.drained"]
    assert b.terminate() == 0


def test_redis_restart_mid_run(fresh_redis_server: RedisServer, model_dir: Path, tmp_path: Path) -> None:  # noqa: F811
    ctx = Ctx(fresh_redis_server)
    w = Workers(ctx, model_dir, tmp_path)
    try:
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
    except BaseException:
        print(w.logs())
        raise
    finally:
        w.close()
        ctx.close()


@pytest.mark.parametrize("redis_server", ["embedded", pytest.param("debian", marks=pytest.mark.slow)], indirect=True)
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
        r = ctx.server.client()
        while not stop.is_set():
            try:
                for c in r.xinfo_consumers(ctx.keys.jobs, GROUP):
                    peak[c["name"]] = max(peak[c["name"]], int(c["pending"]))
                for name, beat in ctx.heartbeats().items():
                    peak[f"{name}.unstarted"] = max(peak[f"{name}.unstarted"], beat["unstarted"])
            except redis.RedisError:
                pass
            time.sleep(0.02)
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
