"""Celery front door: web backends that already run Celery call pagedq as the task ``pagedq.generate``.

Producer side (any Celery app on the same broker, JSON serializer)::

    result = app.send_task("pagedq.generate", kwargs={"prompt": "Hello", "max_tokens": 32, "temperature": 0})
    event = result.get(timeout=60)   # {"type": "final", "choices": [...], "usage": ..., ...} or {"type": "error", ...}

Worker side::

    PAGEDQ_REDIS_URL=redis://host:6379/0 PAGEDQ_MODEL=/models/x \\
        celery -A worker.celery_app worker --pool threads --concurrency 18

``kwargs`` are the job fields of wire protocol v1 (``README.md``, "Wire protocol v1"), validated by the same
:class:`~schemas.jobs.JobRequest` (``id`` defaults to the Celery task id); the task's result is the very
``final`` / ``error`` event JSON a queue producer gets. Failures are *returned* as error events, not raised:
the caller gets one JSON shape whatever happened, and Celery's retry machinery is not triggered by bad input.

Trade-offs chosen (worker/CELERY.md has the longer version):

* **Batching through one engine thread.** Celery runs a task per pool slot; with the ``threads`` pool all
  slots share one process, and each task only submits its job to the process's single
  :class:`~worker.engine_thread.EngineThread` and waits for its terminal event. Tasks waiting at the same
  time are sequences of the same engine batch (continuous batching); the GIL is released in torch kernels.
  ``prefork`` would give every child its own engine and model copy and no batching across them, so the
  app defaults to ``threads`` and warns otherwise.
* **Concurrency = max_num_seqs + prefetch**: enough tasks in flight to fill the batch, plus a few waiting
  in the engine so a finished sequence is replaced at the next step rather than after a broker round trip;
  more would only queue inside the engine, where Celery can no longer give them to another worker.
* **acks_late, prefetch multiplier 1**: a message is acked when its generation has ended, so a worker that
  dies mid-generation gets its tasks redelivered (at least once, as the Redis-streams path); and an idle
  worker of a pool is never starved by a busy one hoarding reserved messages. The cost: a task longer than
  the broker's ``visibility_timeout`` (set to 1 h here) is redelivered while still running, and a
  redelivered task generates again from the start (no idempotency key check as in the streams worker).
* **JSON only**: ``accept_content=["json"]``; a message in any other serializer is refused by the worker,
  never deserialized.
* **No token streaming** through Celery (a result backend stores one value); use the Redis-streams
  protocol to stream. ``reply_to`` is therefore refused. ``stream`` is accepted and ignored.
* **Cancellation** is Celery's: ``app.control.revoke(task_id)`` stops a running generation within
  ``REVOKE_POLL_S`` (the task polls the worker's revoked set; the threads pool cannot kill a thread), with
  ``finish_reason`` ``cancelled`` and the partial text. ``timeout_s`` counts from when the engine thread
  received the job. ``priority`` orders jobs inside the engine only.
* Everything the task needs comes from the same ``PAGEDQ_*`` settings as ``pagedq worker`` (model, engine
  size, ``redis_url`` for the broker, ``celery_result_backend`` for the result backend (the broker's URL
  when unset: it must be the backend the producers' apps name), ``result_ttl_s`` for result expiry).
"""

from __future__ import annotations

import json
import threading
import uuid
from typing import Any

import structlog
from celery import Celery, signals
from pydantic import ValidationError

from schemas.jobs import JOB_ID_PATTERN, ErrorEvent, describe_validation_error
from worker.engine_thread import EngineThread
from worker.redis_url import is_cluster_url
from worker.settings import Settings, load_settings

log = structlog.get_logger("pagedq.celery")

TASK_NAME = "pagedq.generate"
STATS_TASK_NAME = "pagedq.stats"
REVOKE_POLL_S = 0.25
VISIBILITY_TIMEOUT_S = 3600
DEFAULT_REDIS_URL = "redis://localhost:6379/0"


def celery_url(url: str) -> str:
    """Celery's spelling of a pagedq Redis URL: kombu wants ``redis+socket://`` for unix sockets. Kombu has
    no Redis Cluster transport: a ``redis+cluster://`` URL is refused here with a clear message instead of
    failing somewhere inside kombu (the Celery front door uses Celery's own keys, not pagedq's)."""
    if is_cluster_url(url):
        raise ValueError(
            "the Celery front door cannot use a Redis Cluster (kombu has no cluster transport): give it one "
            "Redis server's redis:// URL, or use the Redis-streams worker (`pagedq worker`) on the cluster"
        )
    if url.startswith("unix://"):
        return "redis+socket://" + url[len("unix://") :]
    return url


def result_backend_url(settings: Settings) -> str:
    """Where results go: ``celery_result_backend`` when set, else the broker's URL.

    A producer reads a task's state and result from *its* app's result backend (``AsyncResult(id).state``
    is a GET there). Writing them to the broker instead only looks right: ``result.get()`` is woken by a
    pub/sub message, and Redis pub/sub ignores database numbers, so a producer whose backend is another
    database of the same server still receives the value, while ``state`` stays ``PENDING`` forever and the
    stored result sits in a database nobody reads (and outside any ACL scoped to the backend's keys).
    """
    backend = getattr(settings, "celery_result_backend", None) or settings.redis_url or DEFAULT_REDIS_URL
    return celery_url(str(backend))


def make_app(settings: Settings | None = None) -> Celery:
    """A Celery app configured for pagedq (see the module doc for why each setting)."""
    settings = settings or load_settings()
    broker = celery_url(settings.redis_url or DEFAULT_REDIS_URL)
    app = Celery("pagedq", broker=broker, backend=result_backend_url(settings), set_as_current=False)
    app.conf.update(
        task_serializer="json",
        result_serializer="json",
        accept_content=["json"],
        result_accept_content=["json"],
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        worker_pool="threads",
        worker_concurrency=settings.max_num_seqs + settings.prefetch,
        task_track_started=True,
        result_expires=settings.result_ttl_s,
        broker_transport_options={"visibility_timeout": VISIBILITY_TIMEOUT_S},
        result_backend_transport_options={"visibility_timeout": VISIBILITY_TIMEOUT_S},
        broker_connection_retry_on_startup=True,
        worker_hijack_root_logger=False,
        # pagedq logs with structlog to stderr (JSON off a terminal), as ``pagedq worker`` does; Celery's
        # redirect would wrap each of those lines in a second, WARNING-level, log line.
        worker_redirect_stdouts=False,
    )
    app.pagedq_settings = settings
    app.task(name=TASK_NAME, bind=True, acks_late=True)(generate)
    app.task(name=STATS_TASK_NAME)(stats)
    return app


# --------------------------------------------------------------------------------- the engine thread

_engine: EngineThread | None = None
_engine_lock = threading.Lock()


def engine_thread(settings: Settings | None = None) -> EngineThread:
    """This process's engine thread, built on first use (model load) and shared by every task."""
    global _engine
    with _engine_lock:
        if _engine is None or not _engine.alive:
            from worker.run import build_engine

            settings = settings or getattr(app, "pagedq_settings", None) or load_settings()
            engine: Any = build_engine(settings)
            _engine = EngineThread(
                engine, worker_name=f"celery-{settings.name}", max_num_seqs=settings.max_num_seqs
            ).start()
        return _engine


def stop_engine_thread() -> None:
    global _engine
    with _engine_lock:
        if _engine is not None:
            _engine.stop()
            _engine = None


# --------------------------------------------------------------------------------------------- tasks


def _error(job_id: str, message: str, metadata: Any = None) -> dict[str, Any]:
    event = ErrorEvent(
        id=job_id,
        attempt=1,
        code="invalid_request",
        message=message,
        metadata=metadata if isinstance(metadata, dict) else None,
    )
    result: dict[str, Any] = json.loads(event.to_json())
    return result


def _is_revoked(task_id: str | None) -> bool:
    if not task_id:
        return False
    from celery.worker import state as worker_state

    return task_id in worker_state.revoked


def generate(task: Any, **fields: Any) -> dict[str, Any]:
    """Run one job through the shared engine thread; returns its terminal event as a JSON object."""
    from schemas.jobs import JobRequest

    task_id = getattr(task.request, "id", None)
    if "id" not in fields:
        import re

        fields["id"] = task_id if task_id and re.match(JOB_ID_PATTERN, task_id) else uuid.uuid4().hex
    job_id = str(fields["id"])
    try:
        job = JobRequest.model_validate(fields)
    except ValidationError as exc:
        return _error(job_id, describe_validation_error(exc), fields.get("metadata"))
    if job.reply_to is not None:
        return _error(
            job.id, "reply_to is not supported through Celery (the result goes to the result backend)", job.metadata
        )
    et = engine_thread()
    handle = et.submit(job)
    cancelled = False
    while True:
        try:
            event = handle.result(timeout=REVOKE_POLL_S)
            break
        except TimeoutError:
            if not cancelled and _is_revoked(task_id):
                cancelled = True
                log.info("celery.revoked", task_id=task_id, job_id=job.id)
                et.cancel(handle)
    result: dict[str, Any] = json.loads(event.to_json())
    return result


def stats() -> dict[str, Any]:
    """The engine thread's counters (``max_running`` > 1 shows tasks were batched), for ops and tests."""
    return engine_thread().stats()


# ------------------------------------------------------------------------------------------- signals


@signals.worker_init.connect
def _on_worker_init(sender: Any = None, **_: Any) -> None:
    """Load the model before consuming (tasks never wait on it) when all tasks share this process."""
    from worker.run import configure_logging

    settings: Settings = getattr(app, "pagedq_settings", None) or load_settings()
    configure_logging(settings)
    pool = str(getattr(sender, "pool_cls", "") or "")
    if "thread" in pool.lower() or "solo" in pool.lower():
        engine_thread(settings)
    else:
        log.warning(
            "celery.pool_not_threads",
            pool=pool,
            hint="use --pool threads: other pools give each child its own engine and no batching",
        )


@signals.worker_shutdown.connect
def _on_worker_shutdown(**_: Any) -> None:
    stop_engine_thread()


app = make_app()
"""The app ``celery -A worker.celery_app worker`` runs (settings from ``PAGEDQ_*``)."""
