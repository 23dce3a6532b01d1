"""One engine, many callers: the engine's step loop on a dedicated thread, fed through a thread-safe ``submit``.

Why a thread of its own: ``engine.Engine`` is single-threaded by design (no locks on the hot path), and
continuous batching only happens when many requests sit in the *same* engine at once. Front doors that run
each request on a caller thread of their own (Celery's ``threads`` pool, ``pagedq batch --local``) must
therefore not call the engine themselves: they hand a validated :class:`~schemas.jobs.JobRequest` to this
thread and wait on the returned :class:`JobHandle`. The engine thread admits every submitted job at its
next step, so N callers waiting at once are N sequences in one batch, not N turns.

What comes back is exactly wire protocol v1 (``README.md``, "Wire protocol v1"): optional ``token`` events and one
terminal ``final`` or ``error`` event, built from the same pydantic models as the Redis worker's, so a Celery
result and a queue result are the same JSON. ``attempt`` is what the caller passes to :meth:`EngineThread.submit`
(1 unless its front door knows the job was delivered before: nothing is redelivered here) and timings count
from :meth:`EngineThread.submit` (there is no stream entry time).

Failure policy, simpler than the queue worker's on purpose: an exception from ``engine.step()`` fails every
job in the engine with error ``internal`` (there is no redelivery here to retry with; the caller's own
retry policy, e.g. Celery's, decides), then the loop goes on.
"""

from __future__ import annotations

import itertools
import os
import queue
import socket
import threading
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import structlog

from schemas.jobs import ErrorCode, ErrorEvent, FinalEvent, FinishReason, InvalidJob, JobRequest, TokenEvent
from worker.job_run import EngineLike, JobRun, apply_deltas
from worker.status import engine_load

log = structlog.get_logger("pagedq.engine_thread")

TerminalEvent = FinalEvent | ErrorEvent
Event = TokenEvent | FinalEvent | ErrorEvent


def default_worker_name() -> str:
    """``<host>-<pid>``, the ``worker`` field of the events this thread produces."""
    return f"{socket.gethostname()}-{os.getpid()}"


class JobHandle:
    """What :meth:`EngineThread.submit` returns: a future of the terminal event, and (when asked for) the
    stream of every event in order.

    ``future`` resolves to a :class:`FinalEvent` or :class:`ErrorEvent` (never raises: failures are error
    events, as on the wire). With ``stream=True``, iterating the handle yields the ``token`` events and then
    the terminal one.
    """

    def __init__(self, job: JobRequest, stream: bool, attempt: int = 1) -> None:
        self.job = job
        self.attempt = attempt
        self.submitted_at = time.time()  # timings count from here
        self.future: Future[TerminalEvent] = Future()
        self.events: queue.SimpleQueue[Event] | None = queue.SimpleQueue() if stream else None

    @property
    def id(self) -> str:
        return self.job.id

    def done(self) -> bool:
        return self.future.done()

    def result(self, timeout: float | None = None) -> TerminalEvent:
        """The terminal event; raises ``TimeoutError`` if it has not come within ``timeout`` seconds."""
        return self.future.result(timeout)

    def __iter__(self) -> Iterator[Event]:
        if self.events is None:
            raise ValueError("submit(..., stream=True) to iterate over events")
        while True:
            event = self.events.get()
            yield event
            if not isinstance(event, TokenEvent):
                return


@dataclass(eq=False, kw_only=True)
class _ThreadJob(JobRun):
    """A submitted job from the moment the engine thread sees it until its terminal event."""

    handle: JobHandle


class EngineThread:
    """Owns ``engine`` and steps it on one daemon thread; :meth:`submit` and :meth:`cancel` are thread-safe.

    ``max_num_seqs`` (the engine's) rejects jobs with a larger ``n`` up front: such a job could never be
    scheduled. Use as a context manager, or :meth:`start` / :meth:`stop`.
    """

    def __init__(
        self,
        engine: EngineLike,
        *,
        worker_name: str | None = None,
        max_num_seqs: int | None = None,
        thread_name: str = "pagedq-engine",
        idle_wait_s: float = 0.1,
    ) -> None:
        self.engine = engine
        self.worker_name = worker_name or default_worker_name()
        self.max_num_seqs = max_num_seqs
        self.idle_wait_s = idle_wait_s
        self._inbox: deque[tuple[str, JobHandle]] = deque()  # ("submit" | "cancel", handle)
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=thread_name, daemon=True)
        self._active: dict[JobHandle, _ThreadJob] = {}
        self._by_request: dict[str, _ThreadJob] = {}
        self._ids = itertools.count()
        self._closed = False
        self._lock = threading.Lock()  # orders submit() against stop() so no job is left unanswered
        self.counts: dict[str, int] = {"final": 0, "error": 0, "steps": 0, "step_failures": 0}
        self.max_running = 0
        self._snapshot: dict[str, Any] = {}
        self.started_at = time.time()

    # ------------------------------------------------------------------------------ lifecycle

    def start(self) -> EngineThread:
        self._thread.start()
        return self

    def stop(self, timeout: float = 30.0) -> None:
        """Stop stepping; jobs still in flight end with error ``internal`` ("engine stopped")."""
        with self._lock:
            self._closed = True
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        self._fail_all("internal", "the engine thread stopped before the job finished")

    def __enter__(self) -> EngineThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    # ---------------------------------------------------------------------------- caller API

    def submit(self, job: JobRequest, *, stream: bool = False, attempt: int = 1) -> JobHandle:
        """Queue ``job`` for the engine; returns at once. The engine picks it up at its next step.

        ``attempt`` goes into every event of the job: a front door whose broker redelivered it says so."""
        if attempt < 1:
            raise ValueError(f"attempt must be at least 1, got {attempt}")
        handle = JobHandle(job, stream, attempt)
        with self._lock:
            if self._closed:
                self._resolve(handle, self._error(handle, "internal", "the engine thread is stopped"))
                return handle
            self._inbox.append(("submit", handle))
        self._wake.set()
        return handle

    def cancel(self, handle: JobHandle) -> None:
        """Stop a job: one that produced tokens ends ``final`` with finish_reason ``cancelled`` and its partial
        text, one that did not with error ``cancelled``. No-op once it has ended."""
        self._inbox.append(("cancel", handle))
        self._wake.set()

    def stats(self) -> dict[str, Any]:
        """JSON-ready counters: engine load at the last step, and ``max_running``, the most sequences the
        engine ran in one step since start (> 1 is the evidence of batching)."""
        return {
            "worker": self.worker_name,
            "max_running": self.max_running,
            "in_flight": len(self._active) + len(self._inbox),
            "uptime_s": round(time.time() - self.started_at, 3),
            **{f"jobs_{k}" if k in ("final", "error") else k: v for k, v in self.counts.items()},
            **self._snapshot,
        }

    # ------------------------------------------------------------------------------ the loop

    def _run(self) -> None:
        log.info("engine_thread.started", worker=self.worker_name)
        while not self._stop.is_set():
            try:
                self._iteration()
            except Exception:  # a bug here must not kill the only engine thread of the process
                log.exception("engine_thread.loop_error")
                self._fail_all("internal", "engine thread error (see the worker log)")
                time.sleep(0.1)
        log.info("engine_thread.stopped", **self.counts)

    def _iteration(self) -> None:
        if not self._inbox and not self.engine.has_unfinished() and not self._active:
            self._wake.wait(self.idle_wait_s)
        self._wake.clear()
        while self._inbox:
            kind, handle = self._inbox.popleft()
            if kind == "submit":
                self._start(handle)
            else:
                self._cancel(handle)
        self._expire_deadlines()
        if self.engine.has_unfinished():
            self._step()

    def _start(self, handle: JobHandle) -> None:
        run = _ThreadJob(request=handle.job, attempt=handle.attempt, enqueued_at=handle.submitted_at, handle=handle)
        request_id = f"{run.id}#{next(self._ids)}"
        try:
            run.start(self.engine, request_id, max_num_seqs=self.max_num_seqs, now=time.time(), owner="engine")
        except InvalidJob as exc:
            self._finish(run, run.error_event(exc.code, exc.message, self.worker_name))
            return
        except Exception as exc:
            log.exception("engine_thread.add_request_failed", job_id=run.id)
            self._finish(run, run.error_event("internal", f"could not start: {exc!r}", self.worker_name))
            return
        self._active[handle] = run
        self._by_request[request_id] = run

    def _step(self) -> None:
        try:
            deltas = self.engine.step()
        except Exception as exc:
            self.counts["step_failures"] += 1
            log.exception("engine_thread.step_failed", jobs=[run.id for run in self._active.values()])
            for failed in list(self._active.values()):
                self._abort(failed)
                self._finish(failed, failed.error_event("internal", f"engine step failed: {exc!r}", self.worker_name))
            return
        self.counts["steps"] += 1
        finished_seqs = 0
        for run, delta in apply_deltas(deltas, self._by_request, time.time()):
            finished_seqs += sum(out.finish_reason is not None for out in delta.outputs)
            stream = run.handle.events
            if stream is not None:
                for event in run.take_token_events():
                    stream.put(event)
            if delta.finished:
                self._by_request.pop(delta.request_id, None)
                if delta.error is not None:  # its own input broke its sampling: it alone fails
                    self._finish(run, run.error_event("invalid_request", delta.error, self.worker_name))
                else:
                    self._finish(run, run.final_event(None, time.time(), self.worker_name))
        # Sequences that ended during this step were part of its batch too.
        self.max_running = max(self.max_running, self.engine.num_running() + finished_seqs)
        self._snapshot = self._engine_snapshot()

    def _engine_snapshot(self) -> dict[str, Any]:
        try:
            st = self.engine.stats()
        except Exception:
            return {}
        return {"running": st.running, "waiting": st.waiting, **engine_load(st)}

    def _expire_deadlines(self) -> None:
        now = time.time()
        for run in list(self._active.values()):
            deadline = run.deadline
            if deadline is not None and now >= deadline:
                self._stop_job(run, "deadline")

    def _cancel(self, handle: JobHandle) -> None:
        run = self._active.get(handle)
        if run is not None:
            self._stop_job(run, "cancelled")

    def _stop_job(self, run: _ThreadJob, reason: FinishReason) -> None:
        self._abort(run)
        self._finish(run, run.stopped_event(reason, time.time(), self.worker_name))

    def _abort(self, run: _ThreadJob) -> None:
        if run.request_id:
            self._by_request.pop(run.request_id, None)
            try:
                self.engine.abort(run.request_id)
            except Exception:
                log.exception("engine_thread.abort_failed", request_id=run.request_id)
            # The snapshot is otherwise taken after a step only, and an engine left empty by this abort
            # takes no further step: stats() would go on showing the job running and its KV blocks in use.
            # Refreshed before the job's terminal event is resolved, so a caller woken by it reads the
            # engine as it is now.
            self._snapshot = self._engine_snapshot()

    # ---------------------------------------------------------------------------- endings

    def _error(self, handle: JobHandle, code: ErrorCode, message: str) -> ErrorEvent:
        """An error for a job that never became a run (thread stopped before it was picked up)."""
        job = handle.job
        return ErrorEvent(
            id=job.id,
            attempt=handle.attempt,
            code=code,
            message=message,
            metadata=job.metadata,
            worker=self.worker_name,
        )

    def _finish(self, run: _ThreadJob, event: TerminalEvent) -> None:
        self._active.pop(run.handle, None)
        self.counts["final" if isinstance(event, FinalEvent) else "error"] += 1
        self._resolve(run.handle, event)

    @staticmethod
    def _resolve(handle: JobHandle, event: TerminalEvent) -> None:
        if handle.future.done():
            return
        if handle.events is not None:
            handle.events.put(event)
        handle.future.set_result(event)

    def _fail_all(self, code: ErrorCode, message: str) -> None:
        """Answer every job still held (engine thread stopped or broken): nobody waits forever."""
        while self._inbox:
            kind, handle = self._inbox.popleft()
            if kind == "submit":
                self._resolve(handle, self._error(handle, code, message))
        for run in list(self._active.values()):
            self._abort(run)
            self._finish(run, run.error_event(code, message, self.worker_name))
