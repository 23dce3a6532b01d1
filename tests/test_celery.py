"""The Celery front door: a real Celery worker (subprocess, threads pool) on a real Redis broker/backend.

A producer that knows nothing of pagedq but the task name sends ``pagedq.generate``; the results must be the
protocol's final/error events, equal to what the engine gives for the same greedy jobs, and the engine must
have run the concurrent tasks as one batch (its ``max_running`` counter, read through ``pagedq.stats``).

The broker and the result backend are two databases of one server (db 1 and db 2), as in a producer app
configured ``Celery(broker=".../1", backend=".../2")``: results must be stored where the producer's backend
reads them, not merely reach it by pub/sub (which ignores database numbers). Tests that start workers of their
own (a model that cannot load, a worker killed mid-task) use other databases of the same server.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal
from pathlib import Path
from typing import Any
from uuid import UUID

import pytest
import redis
from celery import Celery
from celery.exceptions import TaskRevokedError
from celery.result import AsyncResult

from engine.outputs import RequestDelta
from schemas.jobs import JobRequest
from tests.fault_injection import FACTORY as FAULT_FACTORY
from tests.fault_injection import process_environment
from tests.redis_servers import RedisServer, make_server
from tests.worker_harness import ENGINE_KW, REPO, make_engine, wait_for
from worker.engine_thread import EngineThread
from worker.job_run import EngineLike

BROKER_DB, BACKEND_DB = 1, 2
MISSING_MODEL = "/nonexistent/pagedq-test-model"


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
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server: RedisServer = make_server("debian", tmp_path_factory.mktemp("celery") / "redis")
    try:
        yield server
    finally:
        server.stop()


def start_worker(
    model_dir: Path | str,
    broker: str,
    backend: str,
    log_path: Path,
    *,
    pool: str = "threads",
    hostname: str = "pagedq-test",
    **extra_env: str,
) -> CeleryWorker:
    """A real ``celery -A worker.celery_app worker`` process on ``broker``/``backend``; returns at once."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PAGEDQ_", "CELERY_"))}
    env.update({
        "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
        "PAGEDQ_REDIS_URL": broker, "PAGEDQ_CELERY_RESULT_BACKEND": backend,
        "PAGEDQ_MODEL": str(model_dir), "PAGEDQ_DTYPE": "float32",
        "PAGEDQ_DEVICE": "cpu", "PAGEDQ_LOG_FORMAT": "json",
        "PAGEDQ_MAX_NUM_SEQS": str(ENGINE_KW["max_num_seqs"]),
        "PAGEDQ_MAX_NUM_BATCHED_TOKENS": str(ENGINE_KW["max_num_batched_tokens"]),
        "PAGEDQ_KV_CACHE_BYTES": str(ENGINE_KW["kv_cache_bytes"]),
        **extra_env,
    })  # fmt: skip
    cmd = [
        sys.executable,
        "-m",
        "celery",
        "-A",
        "worker.celery_app",
        "worker",
        "--pool",
        pool,
        "--loglevel",
        "INFO",
        "--without-gossip",
        "--without-mingle",
        "--without-heartbeat",
        "--hostname",
        f"{hostname}@%h",
    ]
    if pool != "threads":
        cmd += ["--concurrency", "1"]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    return CeleryWorker(proc, log_path, client_app(broker, backend), broker, backend)


def wait_ready(worker: CeleryWorker) -> None:
    def ready() -> bool:
        assert worker.proc.poll() is None, f"celery worker exited early:\n{worker.log()[-5000:]}"
        return " ready." in worker.log()

    wait_for(ready, timeout=240, interval=0.2, what="the Celery worker")


def stop_worker(worker: CeleryWorker) -> None:
    """Warm shutdown (running tasks finish, the engine thread stops): exit code 0."""
    worker.proc.send_signal(signal.SIGTERM)
    assert worker.proc.wait(60) == 0, worker.log()[-5000:]


def reap(worker: CeleryWorker) -> None:
    if worker.proc.poll() is None:
        worker.proc.kill()
        worker.proc.wait(30)
    worker.client.close()
    print(worker.log()[-8000:])  # shown when a test failed


@pytest.fixture(scope="module")
def celery_worker(
    model_dir: Path, redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[CeleryWorker]:
    broker, backend = with_db(redis_server.url, BROKER_DB), with_db(redis_server.url, BACKEND_DB)
    worker = start_worker(model_dir, broker, backend, tmp_path_factory.mktemp("celery") / "celery.log")
    try:
        wait_ready(worker)
        yield worker
        stop_worker(worker)
        assert '"engine_thread.stopped"' in worker.log()
    finally:
        reap(worker)


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
    # The engine is empty now and takes no further step: pagedq.stats still read the snapshot of the last
    # step, the cancelled job running and its KV blocks in use.
    stats = app.send_task("pagedq.stats").get(timeout=60)
    assert stats["running"] == 0 and stats["in_flight"] == 0, stats
    assert stats["num_free_blocks"] == stats["num_total_blocks"], stats


@pytest.mark.slow  # a second generation revoked mid-run (~4 s); the plain revoke test stays default
def test_revoke_with_terminate_stops_the_job_and_ends_the_task_revoked(celery_worker: CeleryWorker) -> None:
    """``terminate=True``, the revoke Celery users reach for: the worker says it terminated the task (the stock
    threads pool answered an error, NotImplementedError, and logged a traceback), the task ends REVOKED as
    under prefork, the job stops in the engine (its KV blocks freed), and the state stays REVOKED after the
    task's thread has finished (its cancelled event is not stored over it)."""
    app = celery_worker.client
    log_start = len(celery_worker.log())  # the module's worker logged other tests' tracebacks before
    result = app.send_task(
        "pagedq.generate",
        kwargs={"prompt": "go on", "max_tokens": 1000, "ignore_eos": True, "temperature": 1.0, "seed": 1},
    )
    wait_for(lambda: result.state == "STARTED", timeout=120, what="the task to start")
    replies = app.control.revoke(result.id, terminate=True, signal="KILL", reply=True, timeout=10)
    assert [list(reply.values()) for reply in replies] == [[{"ok": f"terminate: {result.id}"}]], replies
    with pytest.raises(TaskRevokedError):
        result.get(timeout=60)

    def stopped() -> bool:
        lines = celery_worker.log().splitlines()
        return any('"celery.terminated"' in line and result.id in line for line in lines)

    wait_for(stopped, timeout=60, what="the task's thread to stop its job")
    assert AsyncResult(result.id, app=app).state == "REVOKED"
    stats = app.send_task("pagedq.stats").get(timeout=60)
    assert stats["running"] == 0 and stats["in_flight"] == 0, stats
    assert stats["num_free_blocks"] == stats["num_total_blocks"], stats
    own_log = celery_worker.log()[log_start:]
    assert "NotImplementedError" not in own_log and "Traceback" not in own_log, own_log
    assert celery_worker.proc.poll() is None  # signal="KILL" ended nothing but the job


def test_a_celery_time_limit_is_the_jobs_deadline(celery_worker: CeleryWorker) -> None:
    """``send_task(..., soft_time_limit=...)``: the threads pool enforces no time limit, so the generation ran
    to its 1000 tokens whatever the producer set. Now the earlier limit is the job's deadline."""
    result = celery_worker.client.send_task(
        "pagedq.generate",
        kwargs={"prompt": "go on", "max_tokens": 1000, "ignore_eos": True, "temperature": 1.0, "seed": 3},
        soft_time_limit=0.3,
        time_limit=600,
    )
    event = result.get(timeout=120)
    if event["type"] == "error":  # the deadline passed before the first token (a machine far busier than this)
        assert event["code"] == "deadline_exceeded", event
    else:
        assert event["choices"][0]["finish_reason"] == "deadline", event
        assert 0 < event["usage"]["completion_tokens"] < 1000, event["usage"]


def test_the_earlier_time_limit_is_taken() -> None:
    from worker.celery_app import time_limit_s

    class Request:
        def __init__(self, timelimit: object) -> None:
            self.timelimit = timelimit

    assert time_limit_s(Request((None, None))) is None
    assert time_limit_s(Request(None)) is None
    assert time_limit_s(Request((30, 10))) == 10.0
    assert time_limit_s(Request([5, None])) == 5.0
    assert time_limit_s(Request((0, 2.5))) == 2.5  # 0 is Celery's "no limit"
    assert time_limit_s(Request((True, "7"))) is None  # not numbers a producer's Celery sends


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


# ------------------------------------------------------------------------------- bad call shapes


def test_bad_call_shapes_come_back_as_error_events(celery_worker: CeleryWorker) -> None:
    """Positional args, or a kwarg named like the task function's own parameter, made Python raise a
    TypeError before the task's body ran: a Celery FAILURE instead of the promised error event."""
    app = celery_worker.client
    positional = app.send_task("pagedq.generate", args=["hello"])
    both = app.send_task("pagedq.generate", args=[1, 2], kwargs={"prompt": "x", "metadata": {"k": 1}})
    named_task = app.send_task("pagedq.generate", kwargs={"prompt": "hi", "task": 1})
    named_self = app.send_task("pagedq.generate", kwargs={"prompt": "hi", "self": 1})
    stats_args = app.send_task("pagedq.stats", args=["x"])
    for result in (positional, both):
        event = result.get(timeout=120)
        assert result.state == "SUCCESS"
        assert event["type"] == "error" and event["code"] == "invalid_request", event
        assert "takes no positional arguments" in event["message"] and "kwargs" in event["message"], event
        assert event["id"] == result.id
    assert both.get(timeout=1)["metadata"] == {"k": 1}
    for result, field in ((named_task, "task"), (named_self, "self")):
        event = result.get(timeout=120)
        assert event["type"] == "error" and event["code"] == "invalid_request", event
        assert field in event["message"], event  # an unknown job field, named
    event = stats_args.get(timeout=60)
    assert event["type"] == "error" and event["code"] == "invalid_request" and "no arguments" in event["message"]
    # The worker is unhurt: a good job right after.
    good = app.send_task("pagedq.generate", kwargs={"prompt": "ok", "max_tokens": 2})
    assert good.get(timeout=120)["type"] == "final"


def test_kombu_typed_json_values_are_job_fields_not_tracebacks(celery_worker: CeleryWorker) -> None:
    """Kombu's JSON carries datetime, Decimal, UUID and bytes as tagged objects and the worker decoded them back
    into Python objects: a ``datetime`` in ``metadata`` made the job's size check (``json.dumps``) raise a
    TypeError, a task FAILURE with a traceback instead of an event."""
    app = celery_worker.client
    metadata = {"at": datetime(2026, 1, 2, 3, 4, 5), "amount": Decimal("1.5"), "user": UUID(int=7), "raw": b"\x00k"}
    echoed = app.send_task("pagedq.generate", kwargs={"prompt": "x", "max_tokens": 2, "metadata": metadata})
    typed = app.send_task("pagedq.generate", kwargs={"prompt": b"x", "max_tokens": Decimal(2), "metadata": metadata})
    event = echoed.get(timeout=120)
    assert echoed.state == "SUCCESS" and event["type"] == "final", event
    assert event["metadata"] == metadata  # echoed as it was sent: the producer's kombu decodes it again
    event = typed.get(timeout=120)
    assert typed.state == "SUCCESS" and event["type"] == "error" and event["code"] == "invalid_request", event
    assert "prompt" in event["message"] and "max_tokens" in event["message"], event
    assert event["metadata"] == metadata


# ------------------------------------------------------------------------- a model that cannot load


def test_a_worker_whose_model_cannot_load_exits_at_start(redis_server: RedisServer, tmp_path: Path) -> None:
    """It said "ready", took tasks and failed each of them with a FileNotFoundError, loading the model again
    for every one: Celery's signal dispatcher swallowed the exception of the worker_init receiver."""
    url = with_db(redis_server.url, 3)
    worker = start_worker(MISSING_MODEL, url, url, tmp_path / "celery.log", hostname="pagedq-bad")
    try:
        code = worker.proc.wait(240)
        log = worker.log()
        assert code == 1, log[-5000:]
        assert " ready." not in log
        failed = [json.loads(line) for line in log.splitlines() if '"celery.engine_failed"' in line]
        assert len(failed) == 1 and failed[0]["level"] == "error", log[-5000:]
        assert failed[0]["model"] == MISSING_MODEL and "FileNotFoundError" in failed[0]["error"]
        assert '"celery.worker_exit"' in log
    finally:
        reap(worker)


@pytest.mark.slow  # ~7 s (a prefork pool starts a child that tries the load); the threads pool's exit at start
# (test_a_worker_whose_model_cannot_load_exits_at_start) stays in the default tier
def test_tasks_reaching_an_engine_that_cannot_load_get_error_events(redis_server: RedisServer, tmp_path: Path) -> None:
    """A pool that builds the engine in the task's process on first use (prefork) cannot stop the worker at
    start: its tasks get error ``internal``, and the load is tried once, not once per task.

    ``processes`` is prefork's other name: Celery's CLI takes ``--pool prefork`` for "no --pool given" and
    replaces it with the app's configured pool (threads)."""
    broker, backend = with_db(redis_server.url, 4), with_db(redis_server.url, 5)
    worker = start_worker(MISSING_MODEL, broker, backend, tmp_path / "celery.log", pool="processes", hostname="pf")
    try:
        wait_ready(worker)
        app = worker.client
        for i in range(2):  # one after the other: the second finds the remembered failure
            sent = app.send_task("pagedq.generate", kwargs={"prompt": f"p{i}", "max_tokens": 2, "metadata": {"i": i}})
            event = sent.get(timeout=120)
            assert sent.state == "SUCCESS"
            assert event["type"] == "error" and event["code"] == "internal", event
            assert "could not be loaded (FileNotFoundError)" in event["message"], event
            assert MISSING_MODEL not in event["message"]  # paths stay in the worker's log
            assert event["metadata"] == {"i": i} and event["id"] == sent.id
        stats = app.send_task("pagedq.stats").get(timeout=60)
        assert stats["type"] == "error" and stats["code"] == "internal", stats
        assert worker.log().count('"celery.engine_failed"') == 1, worker.log()[-5000:]
        stop_worker(worker)
    finally:
        reap(worker)


# ------------------------------------------------------------------------------ a killed worker


@pytest.mark.slow  # two Celery workers and a visibility timeout (~10 s)
def test_a_killed_workers_task_is_redelivered_after_the_visibility_timeout(
    model_dir: Path, redis_server: RedisServer, tmp_path: Path
) -> None:
    """kombu's Redis transport gives a dead worker's unacked message back once ``visibility_timeout`` has
    passed since its delivery: 1 h, fixed, before ``celery_visibility_timeout_s``. The rerun's events said
    attempt 1, as if nothing had happened."""
    broker, backend = with_db(redis_server.url, 6), with_db(redis_server.url, 7)
    timeout = {"PAGEDQ_CELERY_VISIBILITY_TIMEOUT_S": "3"}
    # The first worker's engine hangs in its step while the job is in it: the task cannot end before the kill.
    first = start_worker(
        model_dir, broker, backend, tmp_path / "first.log", hostname="first",
        PAGEDQ_ENGINE_FACTORY=FAULT_FACTORY, **process_environment(wedge_marker="WEDGE"), **timeout,
    )  # fmt: skip
    second: CeleryWorker | None = None
    try:
        wait_ready(first)
        sent = first.client.send_task(
            "pagedq.generate", kwargs={"prompt": "WEDGE the sea", "max_tokens": 3, "temperature": 0}
        )
        wait_for(lambda: sent.state == "STARTED", timeout=120, what="the task to start")
        first.proc.kill()
        first.proc.wait(30)
        second = start_worker(model_dir, broker, backend, tmp_path / "second.log", hostname="second", **timeout)
        event = sent.get(timeout=240)
        assert event["type"] == "final", event
        assert event["attempt"] == 2, event
        assert event["usage"]["completion_tokens"] == 3 and event["id"] == sent.id
        stop_worker(second)
    finally:
        reap(first)
        if second is not None:
            reap(second)


@pytest.mark.slow  # waits for kombu's restore sweep (every 10 s with the default timeout)
def test_a_message_given_back_after_its_task_ended_is_not_run_again(celery_worker: CeleryWorker) -> None:
    """A task whose ack was lost (the broker connection broke as it ended: kombu keeps the message in its
    ``unacked`` index, and once the visibility timeout has passed a sweep gives it back, flagged redelivered)
    ran a second time: a second generation for nothing (the backend kept the first result, Celery's Redis
    backend does not overwrite a SUCCESS). The state a lost ack leaves is made here as kombu leaves it: the
    task's own message in ``unacked`` / ``unacked_index``, delivered more than a visibility timeout ago."""
    app, broker = celery_worker.client, redis.Redis.from_url(celery_worker.broker_url)
    parked = "pagedq-test-parked"  # a queue no worker reads: the producer's message, byte for byte
    try:
        jobs_before = app.send_task("pagedq.stats").get(timeout=60)["jobs_final"]
        sent = app.send_task(
            "pagedq.generate", kwargs={"prompt": "once only", "max_tokens": 3, "temperature": 0}, queue=parked
        )
        raw = broker.lpop(parked)
        assert isinstance(raw, bytes), raw
        broker.lpush("celery", raw)  # its first delivery, to the worker's queue
        first = sent.get(timeout=120)
        assert first["type"] == "final" and first["attempt"] == 1, first
        wait_for(lambda: broker.hlen("unacked") == 0, timeout=60, what="the first delivery's ack")

        payload = json.loads(raw)
        exchange = routing_key = "celery"  # where kombu's restore puts it back: the worker's queue
        tag = "lost-ack-" + sent.id
        broker.hset("unacked", tag, json.dumps([payload, exchange, routing_key]))
        broker.zadd("unacked_index", {tag: time.time() - 2 * 3600})  # delivered 2 h ago, beyond the 1 h timeout

        def redelivery_handled() -> bool:
            # Given back by the sweep (gone from the index), received (the log says so twice) and acked.
            received = celery_worker.log().count(f"pagedq.generate[{sent.id}] received")
            return received == 2 and broker.zcard("unacked_index") == 0 and broker.hlen("unacked") == 0

        wait_for(redelivery_handled, timeout=90, what="the given-back message to be received and acked")
        assert broker.llen("celery") == 0
        again = AsyncResult(sent.id, app=app)
        assert again.state == "SUCCESS" and again.result == first, again.result
        assert app.send_task("pagedq.stats").get(timeout=60)["jobs_final"] == jobs_before + 1  # generated once
    finally:
        broker.delete(parked)
        broker.close()


def test_the_visibility_timeout_is_a_setting() -> None:
    from worker.celery_app import make_app
    from worker.settings import load_settings

    conf = make_app(load_settings(redis_url="redis://127.0.0.1:1/0", celery_visibility_timeout_s=600)).conf
    assert conf.broker_transport_options["visibility_timeout"] == 600
    # One restore sweep per tenth of the timeout (10 s at most): the sweep, not the timeout, set the delay.
    assert conf.broker_transport_options["unacked_restore_interval"] == 10
    assert conf.broker_transport_options["unacked_restore_throttle"] == 1
    default = make_app(load_settings(redis_url="redis://127.0.0.1:1/0")).conf
    assert default.broker_transport_options["visibility_timeout"] == 3600


# --------------------------------------------------------------------- a result backend out of reach


@pytest.mark.slow  # a second Redis server stopped and started around a task (~6 s)
def test_a_task_received_while_the_result_backend_is_down_runs_once_it_is_back(
    model_dir: Path, redis_server: RedisServer, tmp_path: Path
) -> None:
    """Storing STARTED failed at once on a backend that could not be reached: the task ended outside its
    body, its message stayed unacked (the broker was fine) and its producer waited for the visibility
    timeout, 1 h by default, although the backend was back a moment later."""
    backend = make_server("debian", tmp_path / "backend")
    broker = with_db(redis_server.url, 8)
    worker = start_worker(model_dir, broker, backend.url, tmp_path / "celery.log", hostname="backend-down")
    sender = Celery("web-backend", broker=broker, set_as_current=False)  # sends without a result backend
    sender.conf.update(task_serializer="json")
    try:
        wait_ready(worker)
        backend.stop()
        sent = sender.send_task("pagedq.generate", kwargs={"prompt": "x", "max_tokens": 3, "temperature": 0})
        wait_for(
            lambda: "Failed operation" in worker.log() or "Exception raised outside body" in worker.log(),
            timeout=60,
            what="the worker to find the result backend down",
        )
        backend.start()
        event = worker.client.AsyncResult(sent.id).get(timeout=60)
        assert event["type"] == "final" and event["id"] == sent.id, event
        stop_worker(worker)
    finally:
        sender.close()
        reap(worker)
        backend.stop()


@pytest.mark.slow  # a Redis restarted under a running task, and the worker's reconnect (~12 s)
def test_a_worker_lives_through_a_broker_restart_and_serves_again(model_dir: Path, tmp_path: Path) -> None:
    """Redis restarted (an upgrade, a failover) while a task ran: Celery 5.7 closed the broken connection
    after unlinking it from its address, kombu then failed to build a client ("Unrecoverable error:
    AttributeError: 'NoneType' object has no attribute 'hostname'") and the worker exited; kept alive past
    that, the running task's ack on the dead channel ended it the same way. Now the worker reconnects, the
    running task's answer is stored (its ack skipped: the broker gives the message back after the visibility
    timeout, and it is then acked without running), and the next task is served."""
    server = make_server("debian", tmp_path / "redis")  # broker and result backend, as one Redis serves both
    worker = start_worker(model_dir, with_db(server.url, 1), with_db(server.url, 2), tmp_path / "celery.log")
    try:
        wait_ready(worker)
        running = worker.client.send_task(
            "pagedq.generate",
            kwargs={"prompt": "go on", "max_tokens": 400, "ignore_eos": True, "temperature": 1.0, "seed": 2},
        )
        wait_for(lambda: running.state == "STARTED", timeout=120, what="the task to start")
        server.stop()
        wait_for(lambda: "Connection to broker lost" in worker.log(), timeout=60, what="the worker to see it")
        server.start()
        first = running.get(timeout=120)
        assert first["type"] == "final" and first["usage"]["completion_tokens"] == 400, first
        after = worker.client.send_task("pagedq.generate", kwargs={"prompt": "again", "max_tokens": 3})
        second = after.get(timeout=120)
        assert second["type"] == "final" and second["usage"]["completion_tokens"] == 3, second
        assert worker.proc.poll() is None
        log = worker.log()
        assert "Unrecoverable error" not in log, log[-5000:]
        assert f'"task_id": "{running.id}", "action": "ack"' in log  # its delivery left to the visibility timeout
        stop_worker(worker)
    finally:
        reap(worker)
        server.stop()


# ------------------------------------------------------------------------------ stats after a stop


class GatedEngine:
    """A real engine whose ``step()`` waits for a permit: the test decides how many steps a job gets, so a
    job can neither finish on its own nor outrun a cancel or a deadline."""

    def __init__(self, engine: EngineLike) -> None:
        self.inner = engine
        self.permits = threading.Semaphore(0)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def step(self) -> list[RequestDelta]:
        self.permits.acquire()
        return self.inner.step()


@pytest.mark.parametrize("stop", ["cancelled", "deadline"])
def test_stats_are_fresh_after_a_job_is_stopped(model_dir: Path, stop: str) -> None:
    """The snapshot behind ``stats()`` was taken after steps only: a job stopped by cancel or deadline left
    the engine empty, no step followed, and stats showed it running with its KV blocks in use."""
    gated = GatedEngine(make_engine(model_dir))
    et = EngineThread(gated, max_num_seqs=ENGINE_KW["max_num_seqs"]).start()
    try:
        timeout_s = 0.3 if stop == "deadline" else None
        job = JobRequest(id="j", prompt="tell me about the sea", max_tokens=50, ignore_eos=True, timeout_s=timeout_s)
        handle = et.submit(job, stream=True)
        gated.permits.release()  # the first step: prefill and a first token
        first = next(iter(handle))
        assert first.type == "token", first
        # The engine thread now waits in its second step (or, past its deadline already, stopped the job).
        if stop == "cancelled":
            wait_for(lambda: et.stats().get("running") == 1, timeout=30, what="the first step's snapshot")
            et.cancel(handle)
        else:
            wait_for(lambda: time.time() >= handle.submitted_at + 0.3, timeout=10, what="the job's deadline")
        gated.permits.release()  # the second step returns; the stop is seen before a third
        event = handle.result(60)
        assert event.type == "final" and event.choices[0].finish_reason == stop, event
        stats = et.stats()
        assert stats["running"] == 0 and stats["waiting"] == 0 and stats["in_flight"] == 0, stats
        assert stats["num_free_blocks"] == stats["num_total_blocks"], stats
    finally:
        for _ in range(100):  # never leave the engine thread waiting in a step
            gated.permits.release()
        et.stop()
