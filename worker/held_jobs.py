"""The jobs a worker holds, and every move a job makes while held: start, step, retry, stop, end.

A held job is either in the engine (``jobs``, by stream entry id, and ``by_request``, by engine request id)
or waiting outside it (``backlog``): a suspect to rerun alone after a step failure that named no request,
or a job whose id is already running here. Each end queues exactly one terminal write in the sender's
outbox and one record in the ledger; nothing here talks to Redis but the duplicate check of a job that
waited for its id.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from schemas.jobs import DeadLetter, ErrorCode, ErrorEvent, FinalEvent, FinishReason, InvalidJob, salvage_reply_target
from schemas.keys import Keys
from worker.job_ledger import JobLedger
from worker.job_run import EngineLike, JobRun, apply_deltas
from worker.publisher import DeadOnly, Terminal
from worker.redis_link import REDIS_DOWN
from worker.sender import Sender
from worker.settings import Settings


@dataclass(eq=False, kw_only=True)
class Job(JobRun):
    """A job this worker holds: waiting to start, in the engine, or suspect (to rerun alone)."""

    entry_id: str
    raw: str  # the payload as delivered, byte for byte (dead letters keep it)
    reply_to: str
    log: Any
    last_publish: float = 0.0
    suspect: bool = False

    def reset(self, attempt: int) -> None:
        super().reset(attempt)
        self.log = self.log.bind(attempt=attempt)


@dataclass(eq=False)
class HeldJobs:
    """The held jobs of one worker over its engine (the loop thread's alone: no locks)."""

    engine: EngineLike
    settings: Settings
    keys: Keys
    redis: Any
    sender: Sender
    ledger: JobLedger
    clock: Callable[[], float]  # the Redis server's time (entry ids, deadlines and timings use it)
    log: Any
    jobs: dict[str, Job] = field(default_factory=dict)  # by entry id: in the engine
    by_request: dict[str, Job] = field(default_factory=dict)  # by engine request id
    backlog: list[Job] = field(default_factory=list)  # held, not in the engine: suspects and jobs whose id is busy
    # Called when a step raised an error marked ``engine_fatal`` (a tensor-parallel rank died): no job is to
    # blame and the engine cannot step again; the worker hands everything back and exits.
    engine_lost: Callable[[BaseException], None] | None = None

    @property
    def name(self) -> str:
        return self.settings.name

    def __len__(self) -> int:
        return len(self.jobs) + len(self.backlog)

    def find(self, entry_id: str) -> Job | None:
        return self.jobs.get(entry_id) or next((j for j in self.backlog if j.entry_id == entry_id), None)

    def take_out(self, job: Job) -> None:
        """Out of the backlog and the engine, without an end (lost, handed back, abandoned)."""
        if job in self.backlog:
            self.backlog.remove(job)
        self.abort(job)

    def busy_id(self, job_id: str) -> bool:
        return any(j.id == job_id for j in self.jobs.values())

    def reject(
        self,
        entry_id: str,
        attempt: int,
        raw: str,
        exc: InvalidJob,
        job: Job | None = None,
        *,
        answer: str | None = None,
        dead: bool = True,
    ) -> None:
        """Answer an unusable job: error event (when its id can be read), dead letter, ack.

        The error goes to the job's own reply stream, or to its ``reply_to`` when that is valid and allowed,
        so a producer whose ``reply_to`` was the problem still hears why. The id and ``reply_to`` are read
        from ``answer`` when given (one of several jobs of an entry whose dead letter keeps ``raw``, the
        whole entry); ``dead`` False: the error event only, another call writes the entry's dead letter."""
        source = raw if answer is None else answer
        target = (job.id, job.reply_to) if job else salvage_reply_target(source, self.settings.max_payload_bytes)
        job_id = target[0] if target else ""
        letter = self.dead_letter(raw, exc.code, exc.message, attempt, entry_id, job_id) if dead else None
        self.ledger.rejected(exc.code)
        if target is None:
            self.log.warning("job.rejected", entry_id=entry_id, reason=exc.message, reply=False)
            if letter is not None:
                self.sender.outbox.dead_only.append(DeadOnly(entry_id, letter))
            return
        reply_to = self.keys.reply_target(job_id, target[1], self.settings.reply_prefixes) or self.keys.reply(job_id)
        event = ErrorEvent(id=job_id, attempt=attempt, code=exc.code, message=exc.message, worker=self.name)
        self.log.warning("job.rejected", job_id=job_id, entry_id=entry_id, code=exc.code, reason=exc.message)
        self.sender.outbox.terminals.append(Terminal(entry_id, job_id, reply_to, event.to_json(), dead=letter))

    def dead_letter(
        self, raw: str, code: ErrorCode, reason: str, attempts: int, entry_id: str, job_id: str
    ) -> DeadLetter:
        """The dead-letter entry of a payload and why it could not be run. The payload is kept byte for byte
        up to ``dead_payload_bytes``; beyond that it is cut, and its full length and SHA-256 are kept, so
        the dead-letter stream stays bounded (it is also capped at ``dead_maxlen`` entries)."""
        data = raw.encode("utf-8", "surrogateescape")
        limit = self.settings.dead_payload_bytes
        kept = raw if len(data) <= limit else data[:limit].decode("utf-8", "surrogateescape")
        return DeadLetter(
            job=kept,
            job_bytes=len(data),
            job_sha256=hashlib.sha256(data).hexdigest(),
            reason=reason[:2000],
            code=code,
            attempts=attempts,
            worker=self.name,
            job_id=job_id,
            entry_id=entry_id,
        )

    def start(self, job: Job) -> None:
        """Hand a job to the engine; bad input is answered, any other failure costs one attempt."""
        try:
            job.start(
                self.engine,
                f"{job.entry_id}/{job.attempt}",
                max_num_seqs=self.settings.max_num_seqs,
                now=self.clock(),
                owner="worker",
                max_result_bytes=self.settings.max_result_bytes,
            )
        except InvalidJob as exc:
            self.reject(job.entry_id, job.attempt, job.raw, exc, job)
            return
        except Exception as exc:
            job.log.exception("job.start_failed")
            self.fail_attempt(job, exc)
            return
        self.jobs[job.entry_id] = job
        self.by_request[job.request_id] = job

    def start_backlog(self) -> None:
        """Start held jobs when allowed: a suspect only into an empty engine, and then alone."""
        if not self.backlog or any(j.suspect for j in self.jobs.values()):
            return
        self.backlog.sort(key=lambda j: (-j.request.priority, j.entry_id))
        for job in list(self.backlog):
            if job.suspect:
                if self.jobs or self.engine.has_unfinished():
                    continue
                self.backlog.remove(job)
                job.log.info("job.rerun_alone")
                self.start(job)
                return
            if not self.busy_id(job.id):
                self.backlog.remove(job)
                self.start_unless_duplicate(job)

    def start_unless_duplicate(self, job: Job) -> None:
        """A job that waited for its id to be free: it is most likely a duplicate by now."""
        try:
            exists = self.redis.exists(self.keys.result(job.id))
        except REDIS_DOWN:
            self.backlog.append(job)
            return
        if exists:
            self.ledger.counts["duplicate"] += 1
            self.sender.outbox.acks.append(job.entry_id)
        else:
            self.start(job)

    # ------------------------------------------------------------------------------- stepping

    def step(self) -> None:
        try:
            deltas = self.engine.step()
        except Exception as exc:
            self.step_failed(exc)
            return
        # Output tokens of every held job, however it ends: the heartbeat's tokens/s (a dashboard sparkline).
        self.ledger.tokens_generated += sum(len(out.token_ids) for delta in deltas for out in delta.outputs)
        for job, delta in apply_deltas(deltas, self.by_request, self.clock()):
            if delta.error is not None:  # this job's own input broke its sampling: it alone fails
                job.log.warning("job.failed_in_engine", error=delta.error)
                self.end_error(job, "invalid_request", delta.error, dead=True)
            elif delta.finished:
                self.end_final(job)
            elif job.request.stream and time.monotonic() - job.last_publish >= self.settings.stream_interval_s:
                self.emit_tokens(job)

    def step_failed(self, exc: Exception) -> None:
        if getattr(exc, "engine_fatal", False) and self.engine_lost is not None:
            self.engine_lost(exc)
            return
        culprit = self.by_request.get(str(getattr(exc, "request_id", "")))
        running = list(self.jobs.values())
        if culprit is None and len(running) == 1:
            culprit = running[0]
        if culprit is not None:
            culprit.log.error("job.step_failed", error=repr(exc))
            self.fail_attempt(culprit, exc)
            return
        self.log.error("engine.step_failed", error=repr(exc), suspects=[j.id for j in running])
        for job in running:  # unknown culprit: rerun each alone to find it
            self.abort(job)
            self.retry(job)

    def fail_attempt(self, job: Job, exc: BaseException) -> None:
        self.abort(job)
        if job.attempt >= self.settings.max_attempts:
            msg = f"failed {job.attempt} times; last error: {exc!r}"
            self.end_error(job, "dead_lettered", msg, dead=True)
        else:
            self.retry(job)

    def retry(self, job: Job) -> None:
        """Run the job again as a new attempt (the PEL counts the delivery), alone in the engine."""
        self.sender.claims.append(job.entry_id)
        job.reset(job.attempt + 1)
        self.ledger.delivery(job.attempt)
        job.suspect = True
        self.backlog.append(job)
        job.log.warning("job.retry")

    def abort(self, job: Job) -> None:
        """Take a job out of the engine; the tokens it produced but did not publish yet go out first."""
        if job.request_id:
            try:
                self.engine.abort(job.request_id)
            except Exception:
                self.log.exception("engine.abort_failed", request_id=job.request_id)
        self.forget(job)
        if job.has_pending_tokens() and job.request.stream and job.produced:
            self.emit_tokens(job)

    def emit_tokens(self, job: Job) -> None:
        payloads = [event.to_json() for event in job.take_token_events()]
        self.sender.outbox.add_tokens(job.reply_to, job.entry_id, job.id, payloads)
        job.last_publish = time.monotonic()

    # -------------------------------------------------------------------------------- endings

    def forget(self, job: Job) -> None:
        if job.request_id:
            self.by_request.pop(job.request_id, None)
        self.jobs.pop(job.entry_id, None)

    def end_final(self, job: Job, stopped: FinishReason | None = None) -> None:
        """End a job the engine finished, or one ``stopped`` from outside (cancelled, deadline): ``final``
        with what it produced (its last tokens published first), or the matching error if nothing."""
        self.forget(job)
        if job.request.stream:
            self.emit_tokens(job)
        now = self.clock()
        event = job.final_event(None, now, self.name) if stopped is None else job.stopped_event(stopped, now, self.name)
        self.end(job, event)

    def end_error(self, job: Job, code: ErrorCode, message: str, *, dead: bool = False) -> None:
        """End a job with an error event; ``dead`` also dead-letters it (in the same atomic write)."""
        self.forget(job)
        letter = self.dead_letter(job.raw, code, message, job.attempt, job.entry_id, job.id) if dead else None
        self.end(job, job.error_event(code, message, self.name), letter)

    def end(self, job: Job, event: FinalEvent | ErrorEvent, letter: DeadLetter | None = None) -> None:
        """Queue the terminal write (with the dead letter, if any) and account for the job.

        The event is serialised here, so an event that cannot be (whatever slipped through admission)
        fails its own job with an ``internal`` error instead of every flush that would carry it."""
        try:
            payload = event.to_json()
        except Exception as exc:
            job.log.exception("job.unserialisable_event")
            message = f"the job's {event.type} event could not be serialised: {type(exc).__name__}"
            event = ErrorEvent(id=job.id, attempt=job.attempt, code="internal", message=message, worker=self.name)
            payload = event.to_json()
        self.sender.outbox.terminals.append(Terminal(job.entry_id, job.id, job.reply_to, payload, dead=letter))
        self.ledger.ended(job.log, job.request, event, dead_lettered=letter is not None)

    def stop(self, job: Job, reason: FinishReason) -> None:
        """Cancel or time out a job: a final with its partial text if it produced any, else an error."""
        self.take_out(job)
        self.end_final(job, stopped=reason)

    def hand_back_all(self) -> list[Job]:
        """Take every held job out and queue its entry for release to the group, claimable by any worker
        at once: a job that produced nothing keeps its attempt count (it was not its fault), one that
        streamed tokens is redelivered as its next attempt. Returns the jobs handed back."""
        held = self.all()
        for job in held:
            self.take_out(job)
            self.sender.releases[job.entry_id] = None if job.produced else job.attempt - 1
        return held

    def all(self) -> list[Job]:
        return [*self.jobs.values(), *self.backlog]

    def expire_deadlines(self) -> None:
        now = self.clock()
        for job in self.all():
            deadline = job.deadline
            if deadline is not None and now >= deadline:
                job.log.info("job.deadline")
                self.stop(job, "deadline")

    def cancel(self, job_id: str) -> bool:
        """Cancel a job held by this worker (from a notice or the cancel key); False if not held."""
        found = False
        for job in self.all():
            if job.id == job_id:
                job.log.info("job.cancel")
                self.stop(job, "cancelled")
                found = True
        return found
