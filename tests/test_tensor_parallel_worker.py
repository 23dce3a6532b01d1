"""A worker process serving through Redis with its model split over two ranks (gloo on CPU), and the death
of a rank: the worker hands every job back and exits non-zero, another worker finishes them, and each
job has exactly one terminal event.

Slow tier: a tensor-parallel worker is two interpreters (the worker, which is rank 0, and rank 1), each
importing torch and loading its shard: ~15-25 s on 2 cores before the first job.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.redis_servers import RedisServer, redis_server  # noqa: F401
from tests.test_worker_e2e import Workers, assert_exactly_once, freeze, mid_generation, stream_text_matches
from tests.worker_harness import STACK_DUMP_HEADER, Ctx, wait_for

pytestmark = pytest.mark.slow  # worker processes with two model ranks each (see the module doc)

EXIT_ENGINE_LOST = 70  # worker.consumer.EXIT_ENGINE_LOST


@pytest.fixture(scope="session")
def model_dir(tiny_model: Any) -> Path:
    return Path(tiny_model("llama_gqa"))


@pytest.fixture
def ctx(redis_server: RedisServer) -> Iterator[Ctx]:  # noqa: F811
    c = Ctx(redis_server)
    yield c
    c.close()


@pytest.fixture
def workers(ctx: Ctx, model_dir: Path, tmp_path: Path) -> Iterator[Workers]:
    w = Workers(ctx, model_dir, tmp_path)
    yield w
    w.close()
    print(w.logs())  # captured: shown only when the test failed


def rank_pids(worker: Any) -> list[int]:
    """The pids of the worker's ranks (rank 0 is the worker itself), from its ``distributed.ready`` line."""
    lines = [line for line in worker.log_lines() if line.get("event") == "distributed.ready"]
    assert lines, "the worker logged no distributed.ready line"
    pids: list[int] = lines[-1]["rank_pids"]
    return pids


def exit_code_within(worker: Any, timeout: float) -> int:
    """The worker's exit code; a worker still running after ``timeout`` is asked for its stacks (SIGUSR1: the
    log shown on failure then names the wait it sits in) before the test fails."""
    try:
        code: int = worker.proc.wait(timeout)
        return code
    except subprocess.TimeoutExpired:
        worker.proc.send_signal(signal.SIGUSR1)
        wait_for(lambda: STACK_DUMP_HEADER in worker.log(), 10, 0.1, f"{worker.name}'s stacks")
        raise


def test_worker_with_two_ranks_serves_jobs(ctx: Ctx, workers: Workers) -> None:
    worker = workers.start("tp2", tensor_parallel_size=2)
    worker.wait_ready(180)
    pids = rank_pids(worker)
    assert len(pids) == 2 and pids[0] == worker.proc.pid
    heartbeat = ctx.heartbeats()["tp2"]
    assert heartbeat["tensor_parallel_size"] == 2
    assert len(heartbeat["rank_weight_bytes"]) == 2 and all(b > 0 for b in heartbeat["rank_weight_bytes"])
    assert len(heartbeat["rank_kv_bytes"]) == 2 and heartbeat["rank_kv_bytes"][0] == heartbeat["rank_kv_bytes"][1]
    ids = ctx.client.submit_many([f"split job {i}" for i in range(8)], max_tokens=16, temperature=0)
    for job_id in ids:
        ctx.client.result(job_id, timeout=120)
    finals = assert_exactly_once(ctx, ids)
    assert all(f.worker == "tp2" and f.attempt == 1 for f in finals.values())
    assert worker.terminate() == 0
    wait_for(lambda: not os.path.exists(f"/proc/{pids[1]}") or _zombie(pids[1]), 30, 0.1, "rank 1 to exit")


def test_rank_killed_mid_generation_hands_jobs_back_and_exits(ctx: Ctx, workers: Workers) -> None:
    victim = workers.start("victim", tensor_parallel_size=2, step_delay_s=0.02, distributed_timeout_s=20)
    victim.wait_ready(180)
    rank1 = rank_pids(victim)[1]
    ids = ctx.client.submit_many(
        [f"job {i}: tell me a story" for i in range(12)], max_tokens=40, ignore_eos=True, temperature=0
    )

    def frozen_mid_generation() -> list[str] | None:
        """Stop rank 0 (SIGSTOP) while it holds 2+ jobs that streamed tokens and did not end; then the kill
        of rank 1 lands mid-generation, with nothing timed by a sleep."""
        freeze(victim)
        if len(mid := mid_generation(ctx, "victim")) >= 2:
            return mid
        victim.proc.send_signal(signal.SIGCONT)
        return None

    cut_off = wait_for(frozen_mid_generation, 120, 0.02, "the victim mid-generation on 2+ jobs")
    os.kill(rank1, signal.SIGKILL)
    killed_at = time.monotonic()
    victim.proc.send_signal(signal.SIGCONT)
    assert exit_code_within(victim, 60) == EXIT_ENGINE_LOST
    exited_after = time.monotonic() - killed_at
    print(f"rank 1 killed mid-generation of {cut_off}; the worker exited {exited_after:.1f} s later")
    assert exited_after < 30
    lost = [line for line in victim.log_lines() if line.get("event") == "worker.engine_lost"]
    assert lost and "rank" in lost[0]["error"], lost
    assert set(cut_off) <= set(lost[0]["handed_back"])

    workers.start("survivor").wait_ready()
    for job_id in ids:
        ctx.client.result(job_id, timeout=120)
    finals = assert_exactly_once(ctx, ids)
    # The jobs cut off mid-generation were redelivered to the survivor as their next attempt.
    assert all(finals[j].worker == "survivor" and finals[j].attempt == 2 for j in cut_off), cut_off
    for job_id in ids:
        stream_text_matches(ctx, job_id, finals[job_id])


def test_rank_killed_while_idle_the_worker_exits_before_taking_jobs(ctx: Ctx, workers: Workers) -> None:
    """An idle worker notices a dead rank between steps (rank 0 polls its ranks' processes) and exits,
    rather than reading a job it cannot run; a job submitted afterwards goes to another worker."""
    idle = workers.start("idle", tensor_parallel_size=2)
    idle.wait_ready(180)
    os.kill(rank_pids(idle)[1], signal.SIGKILL)
    killed_at = time.monotonic()
    assert exit_code_within(idle, 60) == EXIT_ENGINE_LOST
    assert time.monotonic() - killed_at < 30
    lost = [line for line in idle.log_lines() if line.get("event") == "worker.engine_lost"]
    assert lost and lost[0]["handed_back"] == [] and "rank 1" in lost[0]["error"], lost
    (job_id,) = ctx.client.submit_many(["after the loss"], max_tokens=8, temperature=0)
    workers.start("successor").wait_ready()
    ctx.client.result(job_id, timeout=120)
    assert assert_exactly_once(ctx, [job_id])[job_id].worker == "successor"


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True
