"""The Celery front door: a real Celery worker (subprocess, threads pool) on a real Redis broker/backend.

A producer that knows nothing of pagedq but the task name sends ``pagedq.generate``; the results must be the
protocol's final/error events, equal to what the engine gives for the same greedy jobs, and the engine must
have run the concurrent tasks as one batch (its ``max_running`` counter, read through ``pagedq.stats``).

The broker and the result backend are two databases of one server (db 1 and db 2), as in a producer app
configured ``Celery(broker=".../1", backend=".../2")``: results must be stored where the producer's backend
reads them, not merely reach it by pub/sub (which ignores database numbers).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery
from celery.result import AsyncResult

from schemas.jobs import JobRequest
from tests.redis_servers import RedisServer, make_server
from tests.worker_harness import ENGINE_KW, REPO, make_engine, wait_for
from worker.engine_thread import EngineThread

BROKER_DB, BACKEND_DB = 1, 2


@dataclass
class CeleryWorker:
    proc: subprocess.Popen[bytes]
    log_path: Path
    client: Celery
    broker_url: str
    backend_url: str

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def with_db(url: str, db: int) -> str:
    """``redis://host:port/0`` -> the same server's database ``db``."""
    base, _, _ = url.rpartition("/")
    return f"{base}/{db}"


def client_app(broker: str, backend: str, *accept: str) -> Celery:
    """A producer's own Celery app: it only shares the broker, the backend and the task name."""
    app = Celery("web-backend", broker=broker, backend=backend, set_as_current=False)
    app.conf.update(task_serializer="json", result_serializer="json", accept_content=["json", *accept])
    return app


@pytest.fixture(scope="module")
def model_dir(tiny_model: Any) -> Path:
    return Path(tiny_model("llama_gqa"))


@pytest.fixture(scope="module")
def celery_worker(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[CeleryWorker]:
    tmp = tmp_path_factory.mktemp("celery")
    server: RedisServer = make_server("debian", tmp / "redis")
    broker, backend = with_db(server.url, BROKER_DB), with_db(server.url, BACKEND_DB)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PAGEDQ_", "CELERY_"))}
    env.update({
        "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
        "PAGEDQ_REDIS_URL": broker, "PAGEDQ_CELERY_RESULT_BACKEND": backend,
        "PAGEDQ_MODEL": str(model_dir), "PAGEDQ_DTYPE": "float32",
        "PAGEDQ_DEVICE": "cpu", "PAGEDQ_LOG_FORMAT": "json",
        "PAGEDQ_MAX_NUM_SEQS": str(ENGINE_KW["max_num_seqs"]),
        "PAGEDQ_MAX_NUM_BATCHED_TOKENS": str(ENGINE_KW["max_num_batched_tokens"]),
        "PAGEDQ_KV_CACHE_BYTES": str(ENGINE_KW["kv_cache_bytes"]),
    })  # fmt: skip
    log_path = tmp / "celery.log"
    cmd = [
        sys.executable,
        "-m",
        "celery",
        "-A",
        "worker.celery_app",
        "worker",
        "--pool",
        "threads",
        "--loglevel",
        "INFO",
        "--without-gossip",
        "--without-mingle",
        "--without-heartbeat",
        "--hostname",
        "pagedq-test@%h",
    ]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    worker = CeleryWorker(proc, log_path, client_app(broker, backend), broker, backend)
    try:

        def ready() -> bool:
            assert proc.poll() is None, f"celery worker exited early:\n{worker.log()[-5000:]}"
            return " ready." in worker.log()

        wait_for(ready, timeout=240, interval=0.2, what="the Celery worker")
        yield worker
        proc.send_signal(signal.SIGTERM)  # warm shutdown: running tasks finish, the engine thread stops
        assert proc.wait(60) == 0, worker.log()[-5000:]
        assert '"engine_thread.stopped"' in worker.log()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
        worker.client.close()
        server.stop()
        print(worker.log()[-8000:])  # shown when a test failed


PROMPTS: list[dict[str, Any]] = [
    {"prompt": f"Request number {i} asks about the sea", "max_tokens": 4 + i % 9}
    if i % 3
    else {"messages": [{"role": "user", "content": f"Chat {i}: hello robot"}], "max_tokens": 6}
    for i in range(20)
]


def expected_finals(model_dir: Path) -> list[dict[str, Any]]:
    """The same greedy jobs straight through an engine in this process."""
    with EngineThread(make_engine(model_dir), max_num_seqs=ENGINE_KW["max_num_seqs"]) as et:
        handles = [et.submit(JobRequest(id=f"x{i}", temperature=0, **p)) for i, p in enumerate(PROMPTS)]
        return [h.result(120).model_dump() for h in handles]


@pytest.mark.slow  # twenty tasks through a Celery worker (~9 s); the result-backend test stays default
def test_twenty_concurrent_tasks_run_batched_with_correct_results(celery_worker: CeleryWorker, model_dir: Path) -> None:
    app = celery_worker.client
    results = [
        app.send_task("pagedq.generate", kwargs={**p, "temperature": 0, "metadata": {"i": i}})
        for i, p in enumerate(PROMPTS)
    ]
    events = [r.get(timeout=240) for r in results]
    for i, (event, want, sent) in enumerate(zip(events, expected_finals(model_dir), results, strict=True)):
        assert event["type"] == "final", event
        assert event["id"] == sent.id  # the Celery task id is the job id when none is given
        assert event["metadata"] == {"i": i} and event["attempt"] == 1
        assert [(c["text"], c["token_ids"], c["finish_reason"]) for c in event["choices"]] == [
            (c["text"], c["token_ids"], c["finish_reason"]) for c in want["choices"]
        ]
        assert event["usage"]["prompt_tokens"] == want["usage"]["prompt_tokens"]
        assert event["usage"]["completion_tokens"] == want["usage"]["completion_tokens"]
        assert set(event["timings"]) >= {"queued_s", "total_s"}
    stats = app.send_task("pagedq.stats").get(timeout=60)
    assert stats["max_running"] > 1, stats  # the tasks shared engine steps
    assert stats["max_running"] <= ENGINE_KW["max_num_seqs"]
    assert stats["jobs_final"] >= 20 and stats["step_failures"] == 0
    assert stats["num_free_blocks"] == stats["num_total_blocks"]  # nothing leaked


def test_bad_jobs_come_back_as_error_events(celery_worker: CeleryWorker) -> None:
    app = celery_worker.client
    cases = {
        "max_tokens": {"prompt": "x", "max_tokens": "8"},
        "exactly one of prompt": {"max_tokens": 3},
        "reply_to is not supported": {"prompt": "x", "reply_to": "my:stream"},
        "larger than this engine's max_num_seqs": {"prompt": "x", "n": 64},
        "prompt is": {"prompt": "x" * 4000},
    }
    sent = {needle: app.send_task("pagedq.generate", kwargs=kw) for needle, kw in cases.items()}
    named = app.send_task("pagedq.generate", kwargs={"id": "my-own-id", "prompt": "x", "max_tokens": 2})
    for needle, result in sent.items():
        event = result.get(timeout=120)
        assert event["type"] == "error" and needle in event["message"], event
        assert event["code"] == ("prompt_too_long" if needle == "prompt is" else "invalid_request")
    assert named.get(timeout=120)["id"] == "my-own-id"


def test_pickled_messages_are_refused(celery_worker: CeleryWorker) -> None:
    from worker.celery_app import app as worker_app

    assert worker_app.conf.accept_content == ["json"] and worker_app.conf.result_accept_content == ["json"]
    producer = client_app(celery_worker.broker_url, celery_worker.backend_url, "pickle")
    try:
        pickled = producer.send_task("pagedq.generate", kwargs={"prompt": "p", "max_tokens": 2}, serializer="pickle")
        plain = producer.send_task("pagedq.generate", kwargs={"prompt": "j", "max_tokens": 2})
        assert plain.get(timeout=120)["type"] == "final"
        wait_for(
            lambda: "Refusing to deserialize untrusted content of type pickle" in celery_worker.log(),
            timeout=60,
            what="the worker to refuse the pickled message",
        )
        assert pickled.state == "PENDING"  # never ran
    finally:
        producer.close()


def test_revoke_cancels_a_running_generation(celery_worker: CeleryWorker) -> None:
    app = celery_worker.client
    # Sampled, not greedy: one token per step (greedy decoding of the tiny model loops, and its drafts then
    # finish all 1000 tokens in a fifth of a second, before a revoke can arrive).
    result = app.send_task(
        "pagedq.generate",
        kwargs={"prompt": "go on", "max_tokens": 1000, "ignore_eos": True, "temperature": 1.0, "seed": 0},
    )
    wait_for(lambda: result.state == "STARTED", timeout=120, what="the task to start")
    app.control.revoke(result.id)
    event = result.get(timeout=120)
    if event["type"] == "error":  # revoked before its first token (unlikely: tokens come within milliseconds)
        assert event["code"] == "cancelled", event
    else:
        assert event["choices"][0]["finish_reason"] == "cancelled", event
        assert 0 < event["usage"]["completion_tokens"] < 1000


def test_results_are_stored_in_the_producers_result_backend(celery_worker: CeleryWorker) -> None:
    """The producer's backend (db 2) holds the result and its state; the broker's database (db 1) none."""
    sent = celery_worker.client.send_task("pagedq.generate", kwargs={"prompt": "state", "max_tokens": 2})
    event = sent.get(timeout=120)  # woken by pub/sub, which would deliver it whatever the database
    assert event["type"] == "final", event
    # The backend stores the value before it publishes it (one MULTI/EXEC), so it is readable now. Another
    # app, with the backend only, reads it by GET: no pub/sub involved.
    reader = Celery("reader", backend=celery_worker.backend_url, set_as_current=False)
    reader.conf.update(result_serializer="json", accept_content=["json"], result_accept_content=["json"])
    try:
        stored = AsyncResult(sent.id, app=reader)
        assert stored.state == "SUCCESS"
        assert stored.result == event
    finally:
        reader.close()
    key = f"celery-task-meta-{sent.id}"
    broker_db = redis.Redis.from_url(celery_worker.broker_url)
    backend_db = redis.Redis.from_url(celery_worker.backend_url)
    try:
        assert backend_db.exists(key) == 1
        assert broker_db.exists(key) == 0
        assert not list(broker_db.scan_iter("celery-task-meta-*"))  # no result of any task went to the broker
    finally:
        broker_db.close()
        backend_db.close()
