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
  the broker's ``visibility_timeout`` (``celery_visibility_timeout_s``, 1 h by default) is redelivered while
  still running, and a redelivered task generates again from the start (no idempotency key check as in the
  streams worker, except for a task whose result is already stored: a redelivered message of an ended task
  is acked without running it again). Kombu's Redis transport redelivers a dead worker's message only once
  that timeout has passed since the message was delivered; the rerun's events say ``attempt`` 2 (kombu
  flags a redelivery, it does not count them).
* **A model that cannot load stops the worker at start** (threads/solo pools: non-zero exit, before
  "ready"), rather than consuming tasks it can only fail. Where the engine is built lazily (other pools),
  the failure is remembered and every task is answered with error ``internal``, without loading again.
* **A result backend out of reach is waited out** (``result_backend_always_retry``, for up to about the
  visibility timeout) rather than ending the task outside its body, unacked, its producer waiting for the
  visibility timeout; a warm shutdown waits on those retries too.
* **A broker that restarts is lived through**: the worker reconnects and goes on (:class:`Consumer`); the
  tasks running then finish and store their results, their acks impossible on the closed channel
  (:class:`Request`), and once the visibility timeout gives their messages back they are acked unrun.
* **JSON only**: ``accept_content=["json"]``; a message in any other serializer is refused by the worker,
  never deserialized.
* **No token streaming** through Celery (a result backend stores one value); use the Redis-streams
  protocol to stream. ``reply_to`` is therefore refused. ``stream`` is accepted and ignored.
* **Celery's time limits are the job's deadline** (:func:`time_limit_s`): the threads pool enforces none.
* **Job fields are kwargs only**: positional ``args`` are answered with error ``invalid_request``, and any
  kwarg name (``task`` and ``self`` included) is a job field, checked like the others.
* **Cancellation** is Celery's: ``app.control.revoke(task_id)`` stops a running generation within
  ``REVOKE_POLL_S`` (the task polls the worker's revoked set), with ``finish_reason`` ``cancelled`` and the
  partial text. ``revoke(task_id, terminate=True)`` stops it the same way and ends the task ``REVOKED``, as
  prefork's kill would: no thread is killed (Python cannot, and the engine must free the job's KV blocks), so
  the worker runs :class:`ThreadPool`, Celery's threads pool whose ``terminate_job`` leaves the stopping to
  that poll instead of refusing. ``timeout_s`` counts from when the engine thread received the job.
  ``priority`` orders jobs inside the engine only.
* Everything the task needs comes from the same ``PAGEDQ_*`` settings as ``pagedq worker`` (model, engine
  size, ``redis_url`` for the broker, ``celery_result_backend`` for the result backend (the broker's URL
  when unset: it must be the backend the producers' apps name), ``result_ttl_s`` for result expiry,
  ``celery_visibility_timeout_s`` for the broker's visibility timeout).
"""

from __future__ import annotations

import json
import threading
import uuid
from typing import Any

import structlog
from celery import Celery, Task, signals, states
from celery.concurrency import get_implementation
from celery.concurrency.thread import TaskPool as CeleryThreadPool
from celery.exceptions import Ignore, WorkerShutdown
from celery.platforms import EX_FAILURE
from celery.utils.threads import bound_open_broker_sockets
from celery.worker.consumer.consumer import COLLECT_SOCKET_TIMEOUT
from celery.worker.consumer.consumer import Consumer as CeleryConsumer
from celery.worker.request import Request as CeleryRequest
from pydantic import ValidationError

from schemas.jobs import JOB_ID_PATTERN, ErrorCode, ErrorEvent, describe_validation_error
from worker.engine_thread import EngineThread
from worker.redis_url import is_cluster_url
from worker.settings import Settings, load_settings

log = structlog.get_logger("pagedq.celery")

TASK_NAME = "pagedq.generate"
STATS_TASK_NAME = "pagedq.stats"
REVOKE_POLL_S = 0.25
RESTORE_SWEEP_MAX_S = 10.0
DEFAULT_REDIS_URL = "redis://localhost:6379/0"
BACKEND_RETRY_MAX_SLEEP_S = 1.0


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


def broker_transport_options(settings: Settings) -> dict[str, Any]:
    """Kombu Redis transport options: the visibility timeout, and how often overdue messages are looked for.

    A message a worker received and never acked (it was killed) sits in kombu's ``unacked`` index until some
    worker of the queue, sweeping, finds it older than ``visibility_timeout`` and puts it back. Kombu sweeps
    every ``unacked_restore_interval`` x ``unacked_restore_throttle`` seconds (10 x 10 by default): with a
    short timeout the sweep period, not the timeout, would set the delay, so one sweep is made every tenth
    of the timeout (between 1 and 10 s), each a single bounded ZRANGE. Kombu versions without these two
    options ignore them.
    """
    timeout = settings.celery_visibility_timeout_s
    return {
        "visibility_timeout": timeout,
        "unacked_restore_interval": min(RESTORE_SWEEP_MAX_S, max(1.0, timeout / 10)),
        "unacked_restore_throttle": 1,
    }


class Request(CeleryRequest):
    """Celery's task request, which leaves a message alone once the channel it came on is closed.

    A delivery tag belongs to its channel: once a broken broker connection closed that channel
    (:class:`Consumer`), the tasks still running (or waiting for a thread) can no longer ack or reject their
    messages, and trying builds a Redis client from a transport unlinked from its address (AttributeError,
    which ended the worker). Kombu's Redis transport keeps such a message in its unacked index and gives it
    back once the visibility timeout has passed; a task that ended by then stored its result, and the
    redelivery is acked without running again (``worker_deduplicate_successful_tasks``).
    """

    def _channel_closed(self, action: str) -> bool:
        channel = getattr(self._message, "channel", None)
        if channel is None or not getattr(channel, "closed", False):
            return False
        self.acknowledged = True  # nothing more can be sent for this delivery
        log.warning("celery.stale_delivery", task_id=self.id, action=action, reason="its broker channel is closed")
        return True

    def acknowledge(self) -> None:
        if not self.acknowledged and self._channel_closed("ack"):
            return
        super().acknowledge()

    def reject(self, requeue: bool = False) -> None:
        if not self.acknowledged and self._channel_closed("reject"):
            return
        super().reject(requeue=requeue)


class PagedqTask(Task):
    """The tasks' class: only so that a kwarg named ``self`` reaches the task as a job field.

    Celery's own ``Task.__call__(self, *args, **kwargs)`` (and the worker's wrapper of it) raise a TypeError
    for such a call before any task code runs: a task FAILURE instead of the error event producers are
    promised. Here ``self`` is positional-only. In a worker the request (delivery info included) is already
    on the stack, pushed by Celery's tracer, and ``run`` is called directly, as Celery's wrapper does. Its
    requests are :class:`Request`: a broker connection that broke must not end the worker at the next ack.
    """

    Request = f"{__name__}:Request"

    def __call__(self, /, *args: Any, **kwargs: Any) -> Any:
        request = self.request_stack.top
        if request is not None and not request.called_directly:
            return self.run(*args, **kwargs)
        self.push_request(args=args, kwargs=kwargs)  # called as a function: a request for this call
        try:
            return self.run(*args, **kwargs)
        finally:
            self.pop_request()


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
        # A message given back after its task had ended (its ack lost with a broker connection that broke, or
        # a worker killed between storing the result and acking) is not run again when the backend holds the
        # task's SUCCESS (every pagedq result, error events included): one terminal event per job, as on the
        # streams path. One GET per redelivered message; a task still running when it comes back runs again.
        worker_deduplicate_successful_tasks=True,
        worker_prefetch_multiplier=1,
        worker_pool="threads",
        worker_consumer=f"{__name__}:Consumer",
        worker_concurrency=settings.max_num_seqs + settings.prefetch,
        task_track_started=True,
        result_expires=settings.result_ttl_s,
        broker_transport_options=broker_transport_options(settings),
        result_backend_transport_options={"visibility_timeout": settings.celery_visibility_timeout_s},
        # A result backend that cannot be reached when a task starts (STARTED) or ends (its event) is waited
        # out, once a second at most, for up to about the visibility timeout: Celery's default raises at once,
        # the task ends outside its body, and its message stays unacked until the visibility timeout with
        # its producer waiting (a worker's SIGTERM waits on the retries too; SIGQUIT does not).
        result_backend_always_retry=True,
        result_backend_max_sleep_between_retries_ms=int(BACKEND_RETRY_MAX_SLEEP_S * 1000),
        result_backend_max_retries=max(1, int(settings.celery_visibility_timeout_s / BACKEND_RETRY_MAX_SLEEP_S)),
        broker_connection_retry_on_startup=True,
        worker_hijack_root_logger=False,
        # pagedq logs with structlog to stderr (JSON off a terminal), as ``pagedq worker`` does; Celery's
        # redirect would wrap each of those lines in a second, WARNING-level, log line.
        worker_redirect_stdouts=False,
    )
    app.pagedq_settings = settings
    app.task(name=TASK_NAME, bind=True, acks_late=True, base=PagedqTask)(generate)
    app.task(name=STATS_TASK_NAME, bind=True, base=PagedqTask)(stats)
    return app


class ThreadPool(CeleryThreadPool):
    """Celery's threads pool, able to take ``revoke(..., terminate=True)``.

    Celery's control thread answers a terminating revoke by adding the task id to the worker's revoked set,
    then calling ``terminate_job`` and, when that returns, marking the task ``REVOKED`` in the result backend
    and acking its message. The stock threads pool raises ``NotImplementedError`` there (a thread cannot be
    killed), so the producer's revoke got an error reply and the worker logged a traceback, though the job
    stopped anyway. Nothing needs killing: every ``pagedq.generate`` task polls the revoked set and cancels
    its own job (``generate``), which stops it within ``REVOKE_POLL_S`` and frees its KV blocks, and then
    leaves the ``REVOKED`` state Celery stored in place. The process id Celery passes names no task here
    (every thread shares it), and a signal would end the whole worker, so both are ignored.
    """

    def terminate_job(self, pid: int, signal: int | None = None) -> None:
        return None


def use_terminable_threads(pool_cls: Any) -> Any:
    """The pool class a worker started with ``pool_cls`` runs: :class:`ThreadPool` for Celery's threads pool
    (``--pool threads`` names Celery's class, whatever the app's ``worker_pool`` says), else ``pool_cls``."""
    try:
        resolved = get_implementation(pool_cls)
    except (ImportError, AttributeError, ValueError):
        return pool_cls  # an unknown pool: Celery itself reports it, right after worker_init
    return ThreadPool if resolved is CeleryThreadPool else pool_cls


class Consumer(CeleryConsumer):
    """Celery's consumer, surviving a broker connection that breaks (a Redis restart, a failover).

    Celery 5.7 answers a lost broker connection by ``collect()``-ing the kombu connection and then closing it.
    The collect unlinks kombu's Redis transport from the connection's address; the close then closes the
    channel, which puts back the unacked messages it holds and for that builds a Redis client from the
    unlinked address: ``AttributeError: 'NoneType' object has no attribute 'hostname'``, not an error the
    close ignores, so the worker ended ("Unrecoverable error") instead of reconnecting. Here the broken
    connection is closed first, while the transport still knows its address (its sockets bounded, as
    Celery's own teardown does, so that a silent peer cannot hang it): the put-back is tried against the
    broker (it fails while Redis is away; kombu's visibility timeout gives those messages back later), and
    Celery's collect and close then find the channel closed already.
    """

    def on_connection_error_after_connected(self, exc: Exception) -> None:
        connection = self.connection
        if connection is not None:
            bound_open_broker_sockets(connection, COLLECT_SOCKET_TIMEOUT)
            try:
                connection.close()
            except Exception as close_error:  # a teardown: whatever it raises, Celery's reconnect must run
                log.warning("celery.broker_close_failed", error=repr(close_error))
        super().on_connection_error_after_connected(exc)


# --------------------------------------------------------------------------------- the engine thread


class EngineUnavailable(RuntimeError):
    """This process's engine could not be built; ``str()`` is safe to send to producers (no paths)."""


_engine: EngineThread | None = None
_engine_failure: str | None = None
_engine_lock = threading.Lock()


def engine_thread(settings: Settings | None = None) -> EngineThread:
    """This process's engine thread, built on first use (model load) and shared by every task.

    Raises :class:`EngineUnavailable` when the engine cannot be built. The failure is remembered: what fails
    a model load (a missing folder, a bad checkpoint, too little memory) fails the next one the same way, and
    each try would cost a model load and a traceback per task. Restart the worker once it is fixed.
    """
    global _engine, _engine_failure
    with _engine_lock:
        if _engine_failure is not None:
            raise EngineUnavailable(_engine_failure)
        if _engine is None or not _engine.alive:
            from worker.run import build_engine

            settings = settings or getattr(app, "pagedq_settings", None) or load_settings()
            try:
                engine: Any = build_engine(settings)
            except Exception as exc:
                log.error(
                    "celery.engine_failed",
                    model=None if settings.model is None else str(settings.model),
                    error=f"{type(exc).__name__}: {exc}",
                    exc_info=True,
                )
                _engine_failure = (
                    f"this worker's engine could not be loaded ({type(exc).__name__}); see the worker's log "
                    "(celery.engine_failed)"
                )
                raise EngineUnavailable(_engine_failure) from exc
            _engine = EngineThread(
                engine, worker_name=f"celery-{settings.name}", max_num_seqs=settings.max_num_seqs
            ).start()
        return _engine


def stop_engine_thread() -> None:
    """Stop this process's engine thread; the next use builds one again (a remembered failure included)."""
    global _engine, _engine_failure
    with _engine_lock:
        _engine_failure = None
        if _engine is not None:
            _engine.stop()
            _engine = None


# --------------------------------------------------------------------------------------------- tasks


def _error(
    job_id: str, message: str, metadata: Any = None, *, attempt: int = 1, code: ErrorCode = "invalid_request"
) -> dict[str, Any]:
    event = ErrorEvent(
        id=job_id,
        attempt=attempt,
        code=code,
        message=message,
        metadata=metadata if isinstance(metadata, dict) else None,
    )
    result: dict[str, Any] = json.loads(event.to_json())
    return result


def delivery_attempt(request: Any) -> int:
    """The ``attempt`` of a task's events: 2 when the broker delivered its message before, else 1.

    Kombu's Redis transport sets ``redelivered`` on a message it puts back (its worker died, or shut down
    holding it) but keeps no count, so a third delivery says 2 too. Celery's ``retries`` is not added: it
    counts ``Task.retry`` calls, which pagedq never makes (errors are returned, not retried).
    """
    info = getattr(request, "delivery_info", None)
    return 2 if isinstance(info, dict) and info.get("redelivered") else 1


def time_limit_s(request: Any) -> float | None:
    """The earlier of the task's Celery time limits (``apply_async(time_limit=..., soft_time_limit=...)``,
    or the producer app's ``task_time_limit`` / ``task_soft_time_limit``), or None.

    The threads pool enforces neither (it cannot interrupt a thread), so a limit the producer set was silently
    ignored: a generation ran on past it, its producer's deadline long gone. It becomes the job's deadline
    instead (the earlier one wins when the job has a ``timeout_s`` of its own): the job stops there and the
    result is its ``final`` event, ``finish_reason`` ``deadline``, with the text so far (or error
    ``deadline_exceeded`` before its first token), rather than Celery's TimeLimitExceeded failure, which would
    throw that text away.
    """
    limits = getattr(request, "timelimit", None)
    if not isinstance(limits, (list, tuple)):
        return None
    given = [float(x) for x in limits if isinstance(x, (int, float)) and not isinstance(x, bool) and x > 0]
    return min(given) if given else None


def _is_revoked(task_id: str | None) -> bool:
    if not task_id:
        return False
    from celery.worker import state as worker_state

    return task_id in worker_state.revoked


def as_wire_json(fields: dict[str, Any]) -> dict[str, Any]:
    """The job fields as the JSON the message carried, every value a plain JSON one.

    Kombu's JSON serializer tags the values JSON has no type for (``datetime``, ``date``, ``Decimal``,
    ``UUID``, ``bytes``: ``{"__type__": ..., "__value__": ...}``) and turns them back into Python objects when
    the worker decodes the message. A producer's ``metadata={"at": datetime.now()}`` then reached the job's
    strict validation as a ``datetime``, whose size check (``json.dumps``) raised a TypeError: a task FAILURE
    with a traceback instead of the promised event. Validated as tagged JSON, such metadata is echoed in the
    result as it came (the producer's kombu turns it back into its ``datetime``), and a tagged value in any
    other field is refused by the field's own type check.
    """
    from kombu.utils.json import dumps

    plain: dict[str, Any] = json.loads(dumps(fields))
    return plain


def generate(task: Any, /, *args: Any, **fields: Any) -> dict[str, Any]:
    """Run one job through the shared engine thread; returns its terminal event as a JSON object.

    ``task`` is positional-only and ``*args`` is taken so that no call shape makes Python raise before this
    body runs (a TypeError there is a task FAILURE, not the error event producers are promised): a kwarg
    named ``task`` is then a job field like any other, and positional arguments are refused here.
    """
    from schemas.jobs import JobRequest

    task_id = getattr(task.request, "id", None)
    attempt = delivery_attempt(task.request)
    fields = as_wire_json(fields)
    if "id" not in fields:
        import re

        fields["id"] = task_id if task_id and re.match(JOB_ID_PATTERN, task_id) else uuid.uuid4().hex
    job_id = str(fields["id"])
    if args:
        return _error(
            job_id,
            f"{TASK_NAME} takes no positional arguments (got {len(args)}): pass the job fields as kwargs, "
            f"e.g. send_task({TASK_NAME!r}, kwargs={{'prompt': ..., 'max_tokens': ...}})",
            fields.get("metadata"),
            attempt=attempt,
        )
    try:
        job = JobRequest.model_validate(fields)
    except ValidationError as exc:
        return _error(job_id, describe_validation_error(exc), fields.get("metadata"), attempt=attempt)
    if job.reply_to is not None:
        return _error(
            job.id,
            "reply_to is not supported through Celery (the result goes to the result backend)",
            job.metadata,
            attempt=attempt,
        )
    limit = time_limit_s(task.request)
    if limit is not None and (job.timeout_s is None or limit < job.timeout_s):
        job = job.model_copy(update={"timeout_s": limit})
    try:
        et = engine_thread()
    except EngineUnavailable as exc:
        return _error(job.id, str(exc), job.metadata, attempt=attempt, code="internal")
    handle = et.submit(job, attempt=attempt)
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
    if cancelled and _terminated(task, task_id):
        # Celery already stored REVOKED and acked the message; storing the cancelled event now would turn the
        # state the producer may have read into SUCCESS. Ignore leaves it as the terminating revoke set it.
        log.info("celery.terminated", task_id=task_id, job_id=job.id)
        raise Ignore()
    result: dict[str, Any] = json.loads(event.to_json())
    return result


def _terminated(task: Any, task_id: str | None) -> bool:
    """Whether a revoked running task was revoked with ``terminate=True``: only that path stores ``REVOKED``
    for a task that has started (a plain revoke of a running task leaves its state to the task). A terminate
    that lands after this check finds the cancelled event stored, and a backend that cannot answer counts
    as no: the task then ends with its cancelled event, a complete answer either way."""
    if not task_id:
        return False
    try:
        return bool(task.AsyncResult(task_id).state == states.REVOKED)
    except Exception as exc:  # the backend's own errors vary by backend; the event is stored instead
        log.warning("celery.revoked_state_unread", task_id=task_id, error=str(exc))
        return False


def stats(task: Any, /, *args: Any, **kwargs: Any) -> dict[str, Any]:
    """The engine thread's counters (``max_running`` > 1 shows tasks were batched), for ops and tests; an
    ``error`` event (id: the task's) when called with arguments or when the engine could not be loaded."""
    task_id = str(getattr(task.request, "id", None) or uuid.uuid4().hex)
    if args or kwargs:
        return _error(task_id, f"{STATS_TASK_NAME} takes no arguments")
    try:
        return engine_thread().stats()
    except EngineUnavailable as exc:
        return _error(task_id, str(exc), code="internal")


# ------------------------------------------------------------------------------------------- signals


@signals.worker_init.connect
def _on_worker_init(sender: Any = None, **_: Any) -> None:
    """Load the model before consuming (tasks never wait on it) when all tasks share this process."""
    from worker.run import configure_logging

    settings: Settings = getattr(app, "pagedq_settings", None) or load_settings()
    configure_logging(settings)
    if sender is not None and getattr(sender, "pool_cls", None) is not None:
        sender.pool_cls = use_terminable_threads(sender.pool_cls)  # resolved by Celery right after this signal
    pool = str(getattr(sender, "pool_cls", "") or "")
    if "thread" in pool.lower() or "solo" in pool.lower():
        try:
            engine_thread(settings)
        except EngineUnavailable:
            # Celery's signal dispatcher logs and swallows an Exception from this receiver, and the worker
            # then says "ready" and fails every task it takes. A SystemExit passes through the dispatcher;
            # raised here, inside the WorkController's constructor (no consumer, no pool yet), it ends the
            # process with this code before any message is taken, as ``pagedq worker`` does.
            log.critical(
                "celery.worker_exit",
                exit_code=EX_FAILURE,
                reason="the engine could not be loaded (celery.engine_failed above): not consuming tasks",
            )
            raise WorkerShutdown(EX_FAILURE) from None
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
