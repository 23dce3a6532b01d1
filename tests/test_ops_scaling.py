"""Scaling without Docker: 3 ``python -m worker`` processes on one Redis server share 300 jobs.

Every job ends exactly once (one terminal event, one result key), each worker does at least 20 % of them
(the consumer admits only what its free engine slots plus ``prefetch`` allow, so no replica hogs the
stream), and the job counters of the three ``/metrics`` endpoints add up to 300.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from schemas.jobs import FinalEvent
from tests.ops_helpers import http_get, metric_sum
from tests.redis_servers import RedisServer, free_port, make_server
from tests.worker_harness import Ctx, WorkerProcess, job_counts, wait_for

N_WORKERS = 3
N_JOBS = 300


@pytest.fixture
def server(tmp_path: Path) -> Iterator[RedisServer]:
    """One Debian redis-server (skips where it is not installed); the embedded one is covered elsewhere."""
    s = make_server("debian", tmp_path / "redis")
    yield s
    s.stop()


@pytest.mark.slow  # scaling: three worker processes and 300 jobs
def test_three_workers_share_300_jobs(server: RedisServer, tiny_model: Any, tmp_path: Path) -> None:
    ctx = Ctx(server)
    model = Path(tiny_model("llama_gqa"))
    procs: list[tuple[WorkerProcess, int]] = []
    started = time.monotonic()
    try:
        for i in range(N_WORKERS):
            port = free_port()
            procs.append((WorkerProcess(ctx, model, tmp_path, f"w{i}", metrics_port=port, prefetch=1), port))

        def ready(port: int) -> bool:
            return http_get(port, "/readyz")[0] == 200

        for proc, port in procs:
            proc.wait_ready()
            wait_for(lambda p=port: ready(p), 60, 0.1, "readyz")  # type: ignore[misc]
        ids = ctx.client.submit_many([f"scaling job {i}" for i in range(N_JOBS)], max_tokens=4, temperature=0.0)

        def all_done() -> bool:
            return all(c != (0, False) for c in job_counts(ctx.redis, ctx.keys, ids).values())

        wait_for(all_done, 240, 0.25, "all 300 jobs")
        counts = job_counts(ctx.redis, ctx.keys, ids)
        assert set(counts.values()) == {(1, True)}, Counter(counts.values())

        by_worker: Counter[str] = Counter()
        for job_id in ids:
            result = ctx.result(job_id)
            assert isinstance(result, FinalEvent)
            by_worker[str(result.worker)] += 1
        print(f"\njobs per worker: {dict(by_worker)}; {time.monotonic() - started:.1f}s incl. start-up")
        assert sum(by_worker.values()) == N_JOBS
        for proc, _ in procs:
            assert by_worker[proc.name] >= 0.2 * N_JOBS, (proc.name, dict(by_worker))

        scraped = {}
        for proc, port in procs:

            def counted(port: int, name: str) -> str | None:
                text = http_get(port, "/metrics")[1]
                return text if metric_sum(text, "pagedq_jobs_total") == by_worker[name] else None

            text = wait_for(lambda p=port, n=proc.name: counted(p, n), 10, 0.1, f"{proc.name} metrics")  # type: ignore[misc]
            scraped[proc.name] = metric_sum(text, "pagedq_jobs_total", outcome="final")
        assert scraped == {name: float(n) for name, n in by_worker.items()}
        assert sum(scraped.values()) == N_JOBS
        for proc, _ in procs:
            assert proc.terminate() == 0
    except BaseException:
        for proc, _ in procs:
            print(f"--- {proc.name}\n{proc.log()[-2000:]}")
        raise
    finally:
        for proc, _ in procs:
            proc.close()
        ctx.close()
