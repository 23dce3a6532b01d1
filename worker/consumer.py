"""The worker loop: Redis stream entries in, engine steps, events out.

One thread owns the engine (it is single-threaded) and does all of the job bookkeeping: it reads jobs only
as fast as the engine can start them, validates them, steps the engine, and queues events in an
:class:`~worker.publisher.Outbox` that is flushed once per step. The keeper thread (:mod:`worker.keeper`)
writes the heartbeat, keeps this worker's pending entries fresh so nobody takes them over, and listens for
cancel notices; it never touches the engine. What a job goes through in the engine is :mod:`worker.job_run`,
shared with the engine thread behind Celery.

Failure model:

* Redis unreachable (:mod:`worker.redis_link`): the engine keeps stepping, events pile up in the outbox,
  Redis calls back off and resume; nothing in flight is dropped.
* An exception from ``engine.step()`` that names a request (``exc.request_id``), or that happens while only
  one job runs, fails that job's attempt only. Any other step exception makes every running job a suspect:
  they are aborted and rerun one at a time, so the culprit is found (and retried, then dead-lettered) while
  the others finish.
* An exception from ``engine.step()`` marked ``engine_fatal`` (a tensor-parallel rank died: the engine can
  never step again) blames no job: every held job is handed back to the group at once, the loop drains
  and :meth:`Worker.run` returns :data:`EXIT_ENGINE_LOST`, so the supervisor restarts the process.
* SIGTERM: stop reading, hand unstarted jobs back at once, finish running ones within ``shutdown_grace_s``
  (less the time kept for the last writes), hand back the rest, exit 0. :mod:`worker.watchdog` ends the
  process with a non-zero code if that has not happened by the end of the grace period, whatever the loop
  is doing, and also when :meth:`Worker.liveness` says the loop stopped making progress.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections import deque
from typing import Any

import redis
import structlog

from schemas.keys import Keys
from worker.held_jobs import HeldJobs, Job
from worker.intake import FUTURE_ENTRY_TOLERANCE_S, Intake, Parsed, job_clock
from worker.job_ledger import JobLedger
from worker.job_run import EngineLike
from worker.keeper import Keeper, OwnedEntries
from worker.publisher import Outbox, Publisher
from worker.reclaimer import Delivery, Reclaimer
from worker.redis_link import REDIS_DOWN, RedisLink, redis_client_when_up
from worker.registry import queue_leave
from worker.sender import Sender
from worker.settings import Settings
from worker.status import LoopTimes, WorkerIdentity, engine_load, heartbeat_snapshot

log = structlog.get_logger("pagedq.worker")

REWIND_RETRY_S = 1.0  # how often to retry moving a stream's ids back while entries ahead of the clock remain
EXIT_NAME_IN_USE = 78  # EX_CONFIG: a live worker has this name; only another --name helps
NAME_POLL_S = 0.2  # how often a starting worker looks at the heartbeat of a worker that had its name
EXIT_ENGINE_LOST = 70  # EX_SOFTWARE, as the watchdog's exit: supervisors restart on any non-zero code

FINAL_FLUSH_RESERVE_S = 2.0
"""Of the shutdown grace period, the end kept for the last writes (at most a quarter of it)."""


class Worker:
    """One replica: a consumer of ``<ns>:jobs:<queue>`` feeding one engine.

    Use :meth:`run` (blocking, until :meth:`request_stop`), or :meth:`startup`, :meth:`tick` and
    :meth:`shutdown` to drive it step by step (tests).
    """

    def __init__(
        self,
        settings: Settings,
        engine: EngineLike,
        redis_url: str | None = None,
        *,
        model_name: str | None = None,
    ) -> None:
        self.settings = settings
        url = redis_url or settings.redis_url
        if not url:
            raise ValueError("redis_url is required (run_worker starts the embedded Redis)")
        self.engine = engine
        self.name = settings.name
        self.model_name = model_name or settings.model or str(getattr(engine, "model_path", type(engine).__name__))
        self.keys = Keys(settings.namespace, settings.queue, settings.queue_shards)
        self.log = log.bind(worker=self.name, queue=settings.queue)
        self.redis = redis_client_when_up(
            url, settings.block_s, backoff_max_s=settings.redis_backoff_max_s, log=self.log
        )
        self.link = RedisLink(self.redis, self.keys, backoff_max_s=settings.redis_backoff_max_s, log=self.log)
        publisher = Publisher(
            self.redis,
            self.keys,
            result_ttl_s=settings.result_ttl_s,
            reply_ttl_s=settings.reply_ttl_s,
            reply_maxlen=settings.reply_maxlen,
            dead_maxlen=settings.dead_maxlen,
        )
        self.reclaimer = Reclaimer(self.redis, self.keys, self.name, reclaim_idle_s=settings.reclaim_idle_s)
        self.owned = OwnedEntries()  # entries this worker owns (the keeper keeps them fresh)
        self.intake = Intake(self.redis, self.keys, self.reclaimer, settings, self.log)
        self.sender = Sender(self.redis, self.keys, self.name, publisher, self.reclaimer, self.owned, self.log)
        self.ledger = JobLedger(log_prompts=settings.log_prompts)

        self.held_jobs = HeldJobs(
            engine, settings, self.keys, self.redis, self.sender, self.ledger, self.link.now, self.log
        )
        self.held_jobs.engine_lost = self._engine_lost
        self.exit_code = 0  # what run() returns: non-zero once the engine is lost
        self.status: dict[str, Any] = {}
        self.identity = WorkerIdentity(self.name, settings.queue, self.model_name)

        self._stop = threading.Event()
        self.stop_requested_at: float | None = None  # monotonic time of the first stop request
        self.last_progress = time.monotonic()  # end of the last tick that completed without an exception
        self._force = False
        self._draining = False
        self._drain_deadline = 0.0
        self._next_cancel_poll = 0.0
        self._next_status = 0.0
        self._rewind_at: float | None = None  # when to try moving a stream's ids back to the clock (None: no need)
        self._recent_n: deque[int] = deque(maxlen=16)  # n of the last jobs read, to size reads in choices
        self._keeper: Keeper | None = None
        self._name_taken = False  # no live worker had this name at startup (shutdown deletes its heartbeat)
        self.loop_times = LoopTimes()
        self.loop_errors = 0  # unexpected exceptions swallowed by the loop

    @property
    def jobs(self) -> dict[str, Job]:
        """Held jobs in the engine, by stream entry id."""
        return self.held_jobs.jobs

    @property
    def backlog(self) -> list[Job]:
        """Held jobs outside the engine: suspects and jobs whose id is busy."""
        return self.held_jobs.backlog

    @property
    def outbox(self) -> Outbox:
        return self.sender.outbox

    @property
    def counts(self) -> dict[str, int]:
        return self.ledger.counts

    def _counters(self) -> dict[str, int]:
        """The heartbeat's ``jobs_*`` counters: the ledger's, and the link's reconnects."""
        return {**self.counts, "reconnects": self.link.reconnects}

    @property
    def errors(self) -> int:
        """Unexpected exceptions the loop swallowed plus commands Redis refused (tests assert 0)."""
        return self.loop_errors + self.link.command_errors

    # -------------------------------------------------------------------------------- lifecycle

    def request_stop(self, force: bool = False) -> None:
        """Begin a graceful drain (safe from signal handlers and other threads); ``force`` skips the wait."""
        if self._stop.is_set() or force:
            self._force = True
        if self.stop_requested_at is None:
            self.stop_requested_at = time.monotonic()
        self._stop.set()

    def run(self) -> int:
        self.startup()
        try:
            while not self.tick():
                pass
        finally:
            self.shutdown()
        return self.exit_code

    def _rank_failure(self) -> str | None:
        """The engine's own word that it can no longer step (a tensor-parallel rank died), if it has one."""
        check = getattr(self.engine, "rank_failure", None)
        return None if check is None else check()

    def _engine_lost(self, exc: BaseException) -> None:
        """The engine can never step again (a rank died): hand every job back and stop at once."""
        handed_back = self.held_jobs.hand_back_all()
        self.log.error(
            "worker.engine_lost",
            error=str(exc),
            handed_back=[job.id for job in handed_back],
            exit_code=EXIT_ENGINE_LOST,
        )
        self.exit_code = EXIT_ENGINE_LOST
        self.request_stop(force=True)

    def startup(self) -> None:
        """Join the group (waiting for Redis if need be), take the worker's name, and start the keeper
        thread. A name a live worker has ends the worker (``exit_code`` :data:`EXIT_NAME_IN_USE`)."""
        if not self.link.join(self._stop.is_set):
            return
        holder = self._live_holder_of_name()
        if holder is not None:
            self.log.error(
                "worker.name_in_use",
                hint="a live worker already has this name (its heartbeat keeps being refreshed): give this one "
                "another --name, or leave it unset for a unique <host>-<pid>",
                holder_host=holder.get("host"),
                holder_pid=holder.get("pid"),
                exit_code=EXIT_NAME_IN_USE,
            )
            self.exit_code = EXIT_NAME_IN_USE
            self.request_stop(force=True)
            return
        self._name_taken = True
        self._update_status(force=True)
        self._keeper = Keeper(
            self.redis,
            self.keys,
            self.name,
            self.reclaimer,
            self.owned,
            self.heartbeat,
            period_s=min(self.settings.heartbeat_interval_s, self.settings.reclaim_idle_s / 3),
            heartbeat_ttl_s=self.settings.heartbeat_ttl_s,
            backoff_max_s=self.settings.redis_backoff_max_s,
            log=self.log,
        )
        self._keeper.start()
        self.log.info("worker.started", model=self.model_name, stream=self.keys.jobs)

    def _live_holder_of_name(self) -> dict[str, Any] | None:
        """The heartbeat of a live worker that has this worker's name, or None once the name is free.

        A worker reads its own pending entries back as its own (so a restart after a crash finishes them),
        so two live workers with one name would each run the other's jobs again. A heartbeat is refreshed
        every ``heartbeat_interval_s`` and expires after 3 of them: one left by a dead worker (this one's
        previous run, restarted within that TTL) is waited out, up to its remaining TTL; one that changes
        meanwhile belongs to a live worker."""
        key = self.keys.heartbeat(self.name)
        try:
            seen = self.redis.get(key)
            if seen is None:
                return None
            deadline = time.monotonic() + max(int(self.redis.pttl(key)), 0) / 1000.0 + 1.0
            self.log.info("worker.name_heartbeat_found", waiting_s=round(deadline - time.monotonic(), 1))
            while time.monotonic() < deadline and not self._stop.wait(NAME_POLL_S):
                self.last_progress = time.monotonic()  # waiting on purpose, not wedged (the watchdog reads it)
                current = self.redis.get(key)
                if current is None:
                    return None
                if current != seen:
                    try:
                        holder = json.loads(current)
                    except ValueError:
                        holder = {}
                    return holder if isinstance(holder, dict) else {}
        except REDIS_DOWN as exc:  # the loop waits out the outage; the check is a guard, not a lock
            self.log.warning("worker.name_check_skipped", error=str(exc))
        except redis.ResponseError as exc:
            if not str(exc).startswith("WRONGTYPE"):
                raise
            # No worker writes anything but a string there, so no live worker holds the name; the keeper's
            # first heartbeat (SET) replaces the key. Said once, as the key's type is lost with it.
            try:
                found = str(self.redis.type(key))
            except redis.RedisError:  # the note is worth no failed start
                found = "unknown"
            self.log.warning("worker.heartbeat_key_replaced", key=key, type=found, expected="string")
        return None  # not refreshed within its TTL (or stopping): its writer is gone

    def shutdown(self) -> None:
        if self._keeper is not None:
            self._keeper.stop()
            self._keeper = None
        if self._name_taken:  # never another live worker's heartbeat
            with contextlib.suppress(*REDIS_DOWN, redis.RedisError):
                pipe = self.redis.pipeline(transaction=False)
                queue_leave(pipe, self.keys, self.name)
                pipe.execute()
        self.redis.close()
        self.log.info("worker.stopped", **{k: v for k, v in self._counters().items() if v})

    def tick(self) -> bool:
        """One iteration of the loop; True once stopped and drained. Never raises: a bug in one iteration
        is logged and counted (``errors``) and the loop goes on."""
        try:
            done = self._tick()
            self.last_progress = time.monotonic()
            return done
        except Exception:
            self.loop_errors += 1
            self.log.exception("worker.loop_error")
            time.sleep(0.1)
            return False

    def _tick(self) -> bool:
        start = time.perf_counter()
        redis_s = step_s = idle_s = 0.0
        now = time.monotonic()
        if self._stop.is_set() and not self._draining:
            self._begin_drain(now)
        if self._draining:
            if self._force or now >= self._drain_deadline:
                self._abandon_all()
            if not self.jobs and not self.backlog:
                return self._final_flush()
        self._drain_keeper_queues()
        if self.link.usable(now):
            t = time.perf_counter()
            with self.link.phase():
                self.sender.send()
                if self.intake.ahead_of_clock:
                    self.intake.ahead_of_clock = False
                    self._rewind_at = now if self._rewind_at is None else self._rewind_at
                if self._rewind_at is not None and now >= self._rewind_at and not self.outbox:
                    self._rewind_ids(now)
                if now >= self._next_cancel_poll:
                    self._poll_cancels(now)
                if self._keeper is not None and self._keeper.vanished_entries:
                    self._settle_vanished(self._keeper.vanished_entries)
                if not self._draining:
                    self._admit(now)
            if self.intake.blocked:  # nothing to do: the read waited for work
                idle_s = time.perf_counter() - t
            else:
                redis_s += time.perf_counter() - t
        self.held_jobs.expire_deadlines()
        self.held_jobs.start_backlog()
        if not self._draining and (failure := self._rank_failure()) is not None:
            self._engine_lost(RuntimeError(failure))  # noticed between steps (the worker may be idle)
        elif self.engine.has_unfinished():
            t = time.perf_counter()
            self.held_jobs.step()
            step_s = time.perf_counter() - t
            # Before this step's terminal events go out: whoever has read one and then scrapes /metrics
            # sees the engine as it is after the step, not as it was up to 0.2 s (plus an idle read) ago.
            self._update_status()
            if self.link.usable(time.monotonic()):
                t = time.perf_counter()
                with self.link.phase():
                    self.sender.send()
                redis_s += time.perf_counter() - t
        elif not self.intake.blocked:
            t = time.perf_counter()
            time.sleep(0.01)  # nothing to step and no blocking read happened: do not spin
            idle_s += time.perf_counter() - t
        self._update_status()
        self.loop_times.add_tick(
            total_s=time.perf_counter() - start, engine_step_s=step_s, redis_s=redis_s, idle_s=idle_s
        )
        return False

    def redis_now(self) -> float:
        return self.link.now()

    def liveness(self) -> tuple[bool, str]:
        """Whether the loop is making progress (read by the health server, the watchdog and the heartbeat,
        from other threads: it only reads two clocks). Not live: no tick completed for ``stall_timeout_s``
        (a wedged step, or every tick raising), or Redis has refused writes for that long."""
        now = time.monotonic()
        bound = self.settings.stall_timeout_s
        stalled = now - self.last_progress
        if stalled > bound:
            return False, f"the worker loop has not completed a tick for {stalled:.0f} s"
        refusing = self.sender.refusing_since
        if refusing is not None and now - refusing > bound:
            return False, f"Redis has been refusing this worker's writes for {now - refusing:.0f} s"
        return True, "live"

    def heartbeat(self) -> dict[str, Any]:
        """The status snapshot the keeper publishes, marked ``unhealthy`` when the loop is not live (the
        snapshot itself is only refreshed by the loop, so it would otherwise go on saying ``ready``)."""
        live, why = self.liveness()
        return self.status if live else {**self.status, "state": "unhealthy", "unhealthy": why}

    # ----------------------------------------------------------------------------- admission

    def unstarted(self) -> int:
        """Jobs held but not running: the engine's waiting queue plus the backlog."""
        return self.engine.num_waiting() + len(self.backlog) + len(self.intake.inbox)

    def held_choices(self) -> int:
        """Sequences this worker holds or will: each held job's ``n``, plus one per unprocessed delivery."""
        return sum(job.request.n or 1 for job in self.held_jobs.all()) + len(self.intake.inbox)

    def capacity(self) -> int:
        """How many more entries to read now: the choices still free of ``max_num_seqs + prefetch``, divided
        by the largest ``n`` of the recent jobs (rounded up).

        This is the backpressure: a worker holds at most ``max_num_seqs + prefetch`` sequences' worth of jobs
        (counted in choices, so jobs of ``n: 64`` fill it as 64 jobs of ``n: 1`` would; a read overshoots by
        less than one job once the jobs' ``n`` is known), leaving the rest of the backlog to others.
        """
        if any(j.suspect for j in self.jobs.values()):
            return 0  # a suspect runs alone
        free = self.settings.max_num_seqs + self.settings.prefetch - self.held_choices()
        if free <= 0:
            return 0
        per_job = max(self._recent_n, default=1)
        return -(-free // per_job)

    def _admit(self, now: float) -> None:
        intake = self.intake
        intake.blocked = False
        if intake.inbox:
            self._process_inbox()
        want = self.capacity()
        if want <= 0:
            return
        busy = self.engine.has_unfinished() or bool(self.backlog) or bool(self.outbox)
        intake.read(now, want, busy, self.capacity)
        if intake.inbox:
            self._process_inbox()

    def accept(self, deliveries: list[Delivery]) -> None:
        """Take deliveries read elsewhere (tests, tools) and process them as the loop's own reads."""
        self.intake.inbox.extend(deliveries)
        self._process_inbox()

    def _process_inbox(self) -> None:
        """Start the deliveries read so far, or answer them at once (invalid, duplicate, cancelled...)."""
        for d in self.intake.inbox:
            self.owned.add(d.entry_id)
        parsed, unusable, gone = self.intake.take(self.redis_now())
        self.outbox.acks.extend(d.entry_id for d in gone)
        for bad in unusable:
            d = bad.delivery
            self.held_jobs.reject(d.entry_id, d.attempt, bad.raw, bad.error, answer=bad.answer, dead=bad.dead)
        if not parsed:
            return
        max_attempts = self.settings.max_attempts
        for item, (has_result, cancelled) in zip(parsed, self.intake.existing_keys(parsed), strict=True):
            job, attempt, req = self._new_job(item), item.delivery.attempt, item.request
            if has_result:  # a redelivery of a job that already ended (or a reused id): do not rerun
                job.log.info("job.duplicate")
                self.counts["duplicate"] += 1
                self.outbox.acks.append(job.entry_id)
            elif req.reply_to is not None and job.reply_to != req.reply_to:
                msg = (
                    f"reply_to {req.reply_to!r} is outside this job's own keys: use {self.keys.reply(req.id)!r} "
                    f"or a key under a prefix the worker grants (reply_prefixes: {self.settings.reply_prefixes})"
                )
                self.held_jobs.end_error(job, "invalid_request", msg, dead=True)
            elif attempt > max_attempts:
                msg = f"delivered {attempt} times, more than max_attempts={max_attempts}"
                self.held_jobs.end_error(job, "dead_lettered", msg, dead=True)
            elif cancelled:
                self.held_jobs.end_error(job, "cancelled", "cancelled before it started")
            elif job.deadline is not None and self.redis_now() >= job.deadline:
                self.held_jobs.end_error(job, "deadline_exceeded", f"deadline of {req.timeout_s}s passed before start")
            elif self.held_jobs.busy_id(req.id):
                self.backlog.append(job)  # same id already running here: wait, then it is a duplicate
            else:
                self.held_jobs.start(job)

    def _new_job(self, item: Parsed) -> Job:
        d, req = item.delivery, item.request
        self.ledger.delivery(d.attempt)
        self._recent_n.append(req.n or 1)
        reply_to = self.keys.reply_target(req.id, req.reply_to, self.settings.reply_prefixes)
        return Job(
            request=req,
            attempt=d.attempt,
            enqueued_at=job_clock(req.submitted_at, d.entry_id, self.redis_now()),
            entry_id=d.entry_id,
            raw=item.raw,
            reply_to=reply_to or self.keys.reply(req.id),  # a refused reply_to is answered on the job's own
            log=self.log.bind(job_id=req.id, attempt=d.attempt, entry_id=d.entry_id),
        )

    def _poll_cancels(self, now: float) -> None:
        """Fallback for missed pub/sub notices (e.g. across a reconnect): look at the cancel keys. And at the
        result keys: a held job whose result exists was ended by another delivery of its id (a producer's
        retried submit, run beside this one by another worker), so this copy's tokens can reach no one (its
        terminal write would only ack the entry, which exactly-once rests on). It stops here, within
        ``cancel_poll_s``, instead of running to its last token; the stop's terminal write acks its entry and
        expires the reply stream if this delivery owns it (worker/publisher.py)."""
        self._next_cancel_poll = now + self.settings.cancel_poll_s
        held = self.held_jobs.all()
        if not held:
            return
        pipe = self.redis.pipeline(transaction=False)
        for job in held:
            pipe.exists(self.keys.cancel(job.id))
            pipe.exists(self.keys.result(job.id))
        found = pipe.execute()
        for job, flagged, ended in zip(held, found[::2], found[1::2], strict=True):
            if not (flagged or ended) or not (job in self.backlog or job.entry_id in self.jobs):
                continue
            if ended:
                job.log.warning("job.ended_elsewhere", reason="another delivery of its id ended the job")
            else:
                job.log.info("job.cancel", via="poll")
            self.held_jobs.stop(job, "cancelled")

    def cancel(self, job_id: str) -> bool:
        """Cancel a job held by this worker (from a notice or the cancel key); False if not held."""
        return self.held_jobs.cancel(job_id)

    def _rewind_ids(self, now: float) -> None:
        """Move the streams' automatic ids back to the clock after entries ahead of it (``Intake.take``).
        Only once every such entry is gone (answered and deleted, here or by another worker), so until then
        it tries again every :data:`REWIND_RETRY_S`: the jobs Redis numbered after a chosen future id are
        served meanwhile, and a stream that keeps getting jobs stays ahead until a quiet moment."""
        rewound, entries_ahead = self.reclaimer.rewind_future_ids(FUTURE_ENTRY_TOLERANCE_S)
        if rewound:
            self.log.warning("stream.ids_rewound", reason="entries with ids ahead of the clock were answered")
        self._rewind_at = now + REWIND_RETRY_S if entries_ahead else None

    def _drain_keeper_queues(self) -> None:
        if self._keeper is None:
            return
        notices, lost = self._keeper.cancel_notices, self._keeper.lost_entries
        while notices:
            self.cancel(notices.popleft())
        while lost:
            entry_id = lost.popleft()
            job = self.held_jobs.find(entry_id)
            if job is None:
                continue
            # Another delivery of the job finished it, or we were presumed dead and it was taken over.
            job.log.warning("job.lost", reason="entry no longer owned by this worker")
            self.held_jobs.take_out(job)
            self.owned.discard([entry_id])
            self.counts["lost"] += 1

    def _settle_vanished(self, vanished: deque[str]) -> None:
        """Held jobs whose entry no consumer holds any more. The rule: such a job is dropped only when its
        result key shows it ended (another delivery finished it; its write acked the entry). Otherwise the
        entry went without an answer: deleted by hand, or lost with the data of a Redis that restarted
        empty (the group is then missing too, until the loop's next read makes it again). Nobody else can
        run the job, so this worker keeps it and publishes its result as usual: a producer still waiting
        (the client retries a lost connection) gets its answer, and exactly-once still rests on the result
        key. The entry leaves ``owned``, so the keeper stops asking about it."""
        entry_ids = [vanished.popleft() for _ in range(len(vanished))]  # the keeper thread may append meanwhile
        jobs = [(entry_id, job) for entry_id in entry_ids if (job := self.held_jobs.find(entry_id)) is not None]
        if not jobs:
            return
        pipe = self.redis.pipeline(transaction=False)
        for _, job in jobs:
            pipe.exists(self.keys.result(job.id))
        try:
            ended = pipe.execute()
        except BaseException:
            vanished.extendleft(reversed(entry_ids))  # asked again at the next tick (the outage is the loop's)
            raise
        for (entry_id, job), done in zip(jobs, ended, strict=True):
            self.owned.discard([entry_id])
            if done:
                job.log.warning("job.lost", reason="another delivery of the job ended it")
                self.held_jobs.take_out(job)
                self.counts["lost"] += 1
            else:
                job.log.warning("job.entry_vanished", reason="its stream entry is gone unanswered; kept running")

    # ------------------------------------------------------------------------------- shutdown

    def _begin_drain(self, now: float) -> None:
        self._draining = True
        grace = self.settings.shutdown_grace_s
        self._drain_deadline = now + grace - min(FINAL_FLUSH_RESERVE_S, grace / 4)
        releases = self.sender.releases
        handed_back = len(self.intake.inbox)
        for d in self.intake.inbox:
            releases[d.entry_id] = d.attempt - 1
        self.intake.inbox = []
        for job in self.held_jobs.all():
            if not job.produced:
                # Nothing was streamed for this attempt: hand it back without using up an attempt.
                self.held_jobs.take_out(job)
                releases[job.entry_id] = job.attempt - 1
                handed_back += 1
        self.log.info(
            "worker.draining",
            grace_s=self.settings.shutdown_grace_s,
            running=len(self.jobs),
            handed_back=handed_back,
        )

    def _abandon_all(self) -> None:
        for job in self.held_jobs.all():
            job.log.warning("job.abandoned", reason="shutdown grace period over")
            self.held_jobs.take_out(job)
            self.sender.releases[job.entry_id] = None

    def _final_flush(self) -> bool:
        """Last writes before exiting; gives up (entries stay pending for others) if Redis stays away."""
        give_up_at = (self.stop_requested_at or time.monotonic()) + self.settings.shutdown_grace_s
        while self.sender:
            with self.link.phase():
                self.sender.send()
            if time.monotonic() > give_up_at:
                self.log.warning("worker.unflushed_at_exit", terminals=len(self.outbox.terminals))
                break
            if self.sender:
                time.sleep(0.1)
        self.log.info("worker.drained")
        return True

    # --------------------------------------------------------------------------------- status

    def _update_status(self, force: bool = False) -> None:
        """Refresh the status snapshot (heartbeat, /metrics): every 0.2 s at most while the engine's load
        stays the same, and at once when its running or waiting count changed."""
        now = time.monotonic()
        counts = (self.engine.num_running(), self.engine.num_waiting())
        changed = counts != (self.status.get("running"), self.status.get("waiting"))
        if not force and not changed and now < self._next_status:
            return
        self._next_status = now + 0.2
        try:
            load = engine_load(self.engine.stats())
        except Exception:
            load = {}
        self.status = heartbeat_snapshot(
            self.identity,
            draining=self._draining,
            running=self.engine.num_running(),
            waiting=self.engine.num_waiting(),
            unstarted=self.unstarted(),
            in_flight=len(self.held_jobs),
            idle=not self.jobs and not self.backlog and not self.outbox and not self.engine.has_unfinished(),
            load=load,
            counts=self._counters(),
            loop=self.loop_times,
            tokens_generated=self.ledger.tokens_generated,
        )
        self.status["shards"] = {"homes": list(self.intake.homes), "stolen": self.intake.stolen}
