"""The worker loop: Redis stream entries in, engine steps, events out.

One thread owns the engine (it is single-threaded) and does all of the job bookkeeping: it reads jobs only
as fast as the engine can start them, validates them, steps the engine, and queues events in an
:class:`~worker.publisher.Outbox` that is flushed once per step. A second thread (the keeper) writes the
heartbeat, keeps this worker's pending entries fresh so nobody takes them over, and listens for cancel
notices; it never touches the engine.

Failure model:

* Redis unreachable: the engine keeps stepping, events pile up in the outbox, Redis calls back off and
  resume; nothing in flight is dropped.
* An exception from ``engine.step()`` that names a request (``exc.request_id``), or that happens while only
  one job runs, fails that job's attempt only. Any other step exception makes every running job a suspect:
  they are aborted and rerun one at a time, so the culprit is found (and retried, then dead-lettered) while
  the others finish.
* SIGTERM: stop reading, hand unstarted jobs back at once, finish running ones within ``shutdown_grace_s``,
  hand back the rest, exit 0.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import socket
import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import redis
import structlog
from redis.backoff import NoBackoff
from redis.retry import Retry

from engine.outputs import EngineStats, RequestDelta
from schemas.jobs import (
    DeadLetter,
    ErrorCode,
    ErrorEvent,
    FinalEvent,
    FinishReason,
    InvalidJob,
    JobRequest,
    Timings,
    TokenEvent,
    Usage,
    finite_or_none,
    parse_job,
    salvage_reply_target,
)
from schemas.keys import GROUP, JOB_FIELD, Keys
from worker.choices import ChoiceState, final_choices
from worker.metrics import WorkerMetrics
from worker.publisher import Outbox, Publisher, Terminal
from worker.reclaimer import Delivery, Reclaimer, ensure_group
from worker.settings import Settings

try:
    from engine.errors import PromptTooLongError
except ImportError:  # the engine package may not define it yet

    class PromptTooLongError(ValueError):  # type: ignore[no-redef]
        """Placeholder matching ``engine.errors.PromptTooLongError`` by name (see ``_too_long``)."""


log = structlog.get_logger("pagedq.worker")

REDIS_DOWN = (redis.ConnectionError, redis.TimeoutError, ConnectionError, TimeoutError, OSError)


class EngineLike(Protocol):
    """What the worker needs from ``engine.Engine`` (injected, so tests can pass a fake one)."""

    tokenizer: Any
    max_model_len: int

    def add_request(self, request_id: str, prompt: str | list[int], params: Any, priority: int = 0) -> None: ...
    def step(self) -> list[RequestDelta]: ...
    def abort(self, request_id: str) -> None: ...
    def has_unfinished(self) -> bool: ...
    def num_waiting(self) -> int: ...
    def num_running(self) -> int: ...
    def stats(self) -> EngineStats: ...


def redis_client(url: str, settings: Settings) -> redis.Redis:
    """The worker's Redis client: str values, invalid UTF-8 kept byte-exact, no hidden retries (the loop
    does its own backoff, and a silent retry could duplicate token events)."""
    return redis.Redis.from_url(
        url,
        decode_responses=True,
        encoding_errors="surrogateescape",
        socket_timeout=settings.block_s + 10,
        socket_connect_timeout=2,
        health_check_interval=30,
        retry=Retry(NoBackoff(), 0),
    )


def _too_long(exc: BaseException) -> bool:
    return isinstance(exc, PromptTooLongError) or type(exc).__name__ == "PromptTooLongError"


# ------------------------------------------------------------------------------------------- job state


@dataclass(eq=False)
class Job:
    """A job this worker holds: waiting to start, in the engine, or suspect (to rerun alone)."""

    entry_id: str
    raw: str
    req: JobRequest
    attempt: int
    reply_to: str
    enqueued_at: float  # Redis clock, from the entry id
    log: Any
    request_id: str = ""  # engine request id while in the engine
    started_at: float | None = None
    first_token_at: float | None = None
    last_publish: float = 0.0
    choices: dict[int, ChoiceState] = field(default_factory=dict)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    stop_reason: FinishReason | None = None
    suspect: bool = False

    @property
    def id(self) -> str:
        return self.req.id

    @property
    def deadline(self) -> float | None:
        return None if self.req.timeout_s is None else self.enqueued_at + self.req.timeout_s

    @property
    def produced(self) -> bool:
        return self.first_token_at is not None

    def reset(self, attempt: int) -> None:
        """Forget the output of a failed attempt before rerunning."""
        self.attempt = attempt
        self.request_id = ""
        self.started_at = self.first_token_at = None
        self.choices.clear()
        self.stop_reason = None
        self.log = self.log.bind(attempt=attempt)


def _entry_time(entry_id: str) -> float:
    try:
        return int(entry_id.split("-", 1)[0]) / 1000.0
    except ValueError:
        return time.time()


# ------------------------------------------------------------------------------------------ test hooks


class _TestHooks:
    """TEST-ONLY engine wrapper (``test_fault_marker``, ``test_step_delay_s``).

    ``step()`` raises a plain RuntimeError, naming no request, while a request whose prompt contains the
    marker is in the engine: the worst case, which the worker must isolate on its own.
    """

    def __init__(self, engine: EngineLike, marker: str | None, delay_s: float) -> None:
        self._engine = engine
        self._marker = marker
        self._delay_s = delay_s
        self._faulty: set[str] = set()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def add_request(self, request_id: str, prompt: str | list[int], params: Any, priority: int = 0) -> None:
        self._engine.add_request(request_id, prompt, params, priority)
        text = prompt if isinstance(prompt, str) else self._engine.tokenizer.decode(prompt)
        if self._marker and self._marker in text:
            self._faulty.add(request_id)

    def abort(self, request_id: str) -> None:
        self._faulty.discard(request_id)
        self._engine.abort(request_id)

    def step(self) -> list[RequestDelta]:
        if self._delay_s:
            time.sleep(self._delay_s)
        if self._faulty:
            raise RuntimeError("injected fault (test_fault_marker)")
        return self._engine.step()


# ---------------------------------------------------------------------------------------------- worker


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
        self.s = settings
        url = redis_url or settings.redis_url
        if not url:
            raise ValueError("redis_url is required (run_worker starts the embedded Redis)")
        self.engine: EngineLike = (
            _TestHooks(engine, settings.test_fault_marker, settings.test_step_delay_s)
            if settings.test_fault_marker or settings.test_step_delay_s
            else engine
        )
        self.name = settings.name
        self.model_name = model_name or settings.model or str(getattr(engine, "model_path", type(engine).__name__))
        self.keys = Keys(settings.namespace, settings.queue)
        self.r = redis_client(url, settings)
        self.publisher = Publisher(
            self.r,
            self.keys,
            result_ttl_s=settings.result_ttl_s,
            reply_ttl_s=settings.reply_ttl_s,
            reply_maxlen=settings.reply_maxlen,
        )
        self.reclaimer = Reclaimer(self.r, self.keys, self.name, reclaim_idle_s=settings.reclaim_idle_s)
        self.log = log.bind(worker=self.name, queue=settings.queue)

        self.jobs: dict[str, Job] = {}  # by entry id: in the engine
        self.by_request: dict[str, Job] = {}  # by engine request id
        self.backlog: list[Job] = []  # held, not in the engine: suspects and jobs whose id is busy
        self.inbox: list[Delivery] = []  # read from Redis, not yet looked at (survives a Redis outage)
        self.outbox = Outbox()
        self._claims: list[str] = []  # entries to count a new delivery of (retries)
        self._releases: dict[str, int | None] = {}  # entries to hand back

        self._held: set[str] = set()  # entry ids this worker owns (kept fresh by the keeper)
        self._held_lock = threading.Lock()
        self._notices: deque[str] = deque()  # job ids from cancel notices (keeper -> main)
        self._lost: deque[str] = deque()  # entry ids no longer ours (keeper -> main)
        self.status: dict[str, Any] = {}

        self._stop = threading.Event()
        self._force = False
        self._draining = False
        self._drain_deadline = 0.0
        self._history: str | None = "0"  # cursor in our own PEL; None once walked
        self._next_poll = 0.0
        self._next_reclaim = 0.0
        self._next_cancel_poll = 0.0
        self._next_status = 0.0
        self._next_tidy = time.monotonic() + 60.0
        self._redis_down_since: float | None = None
        self._redis_retry_at = 0.0
        self._backoff = 0.1
        self._clock_offset = 0.0
        self._keeper: _Keeper | None = None
        self._blocked = False
        self.started = time.time()
        self.counts: dict[str, int] = {"final": 0, "error": 0, "duplicate": 0, "lost": 0, "reconnects": 0}
        # Where the loop's time goes (status "loop"): engine steps (with their outputs' bookkeeping), Redis
        # round trips, blocking reads of an idle worker, the rest of the tick. Cumulative seconds.
        self.loop_s: dict[str, float] = {"engine_step": 0.0, "redis": 0.0, "idle": 0.0, "other": 0.0}
        self.ticks = 0
        self.errors = 0  # unexpected exceptions swallowed by the loop (tests assert this stays 0)
        self.metrics: WorkerMetrics | None = None  # set by run_worker when the metrics port is on

    # -------------------------------------------------------------------------------- lifecycle

    def request_stop(self, force: bool = False) -> None:
        """Begin a graceful drain (safe from signal handlers and other threads); ``force`` skips the wait."""
        if self._stop.is_set() or force:
            self._force = True
        self._stop.set()

    def run(self) -> int:
        self.startup()
        try:
            while not self.tick():
                pass
        finally:
            self.shutdown()
        return 0

    def startup(self) -> None:
        """Join the group (waiting for Redis if need be) and start the keeper thread."""
        while True:
            try:
                ensure_group(self.r, self.keys)
                self._sync_clock()
                break
            except REDIS_DOWN as exc:
                if self._stop.is_set():
                    return
                self.log.warning("redis.unavailable", error=str(exc), retry_in_s=self._backoff)
                time.sleep(self._backoff)
                self._backoff = min(self._backoff * 2, self.s.redis_backoff_max_s)
        self._backoff = 0.1
        self._update_status(force=True)
        self._keeper = _Keeper(self)
        self._keeper.start()
        self.log.info("worker.started", model=self.model_name, stream=self.keys.jobs)

    def shutdown(self) -> None:
        if self._keeper is not None:
            self._keeper.stop()
            self._keeper = None
        with contextlib.suppress(*REDIS_DOWN, redis.RedisError):
            self.r.delete(self.keys.heartbeat(self.name))
        self.r.close()
        self.log.info("worker.stopped", **{k: v for k, v in self.counts.items() if v})

    def tick(self) -> bool:
        """One iteration of the loop; True once stopped and drained. Never raises: a bug in one iteration
        is logged and counted (``errors``) and the loop goes on."""
        try:
            return self._tick()
        except Exception:
            self.errors += 1
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
        if self._redis_usable(now):
            t = time.perf_counter()
            with self._redis_phase():
                self._flush()
                if now >= self._next_cancel_poll:
                    self._poll_cancels(now)
                if not self._draining:
                    self._admit(now)
            if self._blocked:  # nothing to do: the read waited for work
                idle_s = time.perf_counter() - t
            else:
                redis_s += time.perf_counter() - t
        self._expire_deadlines()
        self._start_backlog()
        if self.engine.has_unfinished():
            t = time.perf_counter()
            self._step()
            step_s = time.perf_counter() - t
            if self._redis_usable(time.monotonic()):
                t = time.perf_counter()
                with self._redis_phase():
                    self._flush()
                redis_s += time.perf_counter() - t
        elif not self._blocked:
            t = time.perf_counter()
            time.sleep(0.01)  # nothing to step and no blocking read happened: do not spin
            idle_s += time.perf_counter() - t
        self._update_status()
        self.ticks += 1
        self.loop_s["engine_step"] += step_s
        self.loop_s["redis"] += redis_s
        self.loop_s["idle"] += idle_s
        self.loop_s["other"] += time.perf_counter() - start - step_s - redis_s - idle_s
        return False

    # ---------------------------------------------------------------------------- redis health

    def _redis_usable(self, now: float) -> bool:
        return self._redis_down_since is None or now >= self._redis_retry_at

    @contextlib.contextmanager
    def _redis_phase(self) -> Iterator[None]:
        """Run Redis work; on connection trouble back off (with jitter) instead of failing."""
        try:
            yield
        except REDIS_DOWN as exc:
            now = time.monotonic()
            if self._redis_down_since is None:
                self._redis_down_since = now
                self.log.warning("redis.connection_lost", error=str(exc))
            self._redis_retry_at = now + self._backoff * (0.5 + random.random())
            self._backoff = min(self._backoff * 2, self.s.redis_backoff_max_s)
            return
        except redis.ResponseError as exc:
            if "NOGROUP" in str(exc):  # Redis lost its data (no AOF): recreate the group
                self.log.warning("redis.group_missing", error=str(exc))
                with contextlib.suppress(*REDIS_DOWN):
                    ensure_group(self.r, self.keys)
            else:
                self.errors += 1
                self.log.exception("redis.command_failed")
            return
        if self._redis_down_since is not None:
            self.log.info("redis.reconnected", down_s=round(time.monotonic() - self._redis_down_since, 3))
            self.counts["reconnects"] += 1
            self._redis_down_since = None
            self._backoff = 0.1
            with contextlib.suppress(*REDIS_DOWN):
                self._sync_clock()

    def _sync_clock(self) -> None:
        """Offset of the Redis server clock, which stamps entry ids (queue times and deadlines use it)."""
        t0 = time.time()
        secs, micros = self.r.time()
        t1 = time.time()
        self._clock_offset = secs + micros / 1e6 - (t0 + t1) / 2

    def redis_now(self) -> float:
        return time.time() + self._clock_offset

    # ----------------------------------------------------------------------------- admission

    def unstarted(self) -> int:
        """Jobs held but not running: the engine's waiting queue plus the backlog."""
        return self.engine.num_waiting() + len(self.backlog) + len(self.inbox)

    def capacity(self) -> int:
        """How many more jobs to take now: free engine slots plus ``prefetch``, minus jobs not started.

        This is the backpressure: a worker never holds more than ``max_num_seqs + prefetch`` unstarted
        jobs (only ``prefetch`` while the engine is full), leaving the rest of the backlog to others.
        """
        if any(j.suspect for j in self.jobs.values()):
            return 0  # a suspect runs alone
        free = max(0, self.s.max_num_seqs - self.engine.num_running())
        return free + self.s.prefetch - self.unstarted()

    def _admit(self, now: float) -> None:
        self._blocked = False
        if self.inbox:
            self.accept([])
        want = self.capacity()
        if want <= 0:
            return
        busy = self.engine.has_unfinished() or bool(self.backlog) or bool(self.outbox)
        if busy and now < self._next_poll:
            return
        self._next_poll = now + self.s.poll_interval_s
        # Every read lands in the inbox at once, so a Redis error later in this tick loses nothing.
        if self._history is not None:
            got, self._history = self.reclaimer.read_own_pending(self._history, want)
            self.inbox += got
            if got:
                self.log.info("reclaim.own_pending", count=len(got))
        elif now >= self._next_reclaim:
            self._next_reclaim = now + min(self.s.reclaim_idle_s / 2, 5.0)
            got = self.reclaimer.autoclaim(want)
            self.inbox += got
            if got:
                self.log.info("reclaim.claimed", count=len(got), entries=[d.entry_id for d in got])
            if now >= self._next_tidy:
                self._next_tidy = now + 60.0
                self._forget_dead_consumers()
        left = self.capacity()
        if left > 0 and self._history is None:
            idle = not busy and not self.inbox and self.s.block_s > 0
            block = max(1, int(self.s.block_s * 1000)) if idle else None
            self._blocked = block is not None
            self.inbox += self.reclaimer.read_new(left, block)
        if self.inbox:
            self.accept([])

    def _forget_dead_consumers(self) -> None:
        live = {k.rsplit(":", 1)[-1] for k in self.r.scan_iter(self.keys.heartbeat_pattern, count=1000)}
        removed = self.reclaimer.forget_dead_consumers(live)
        if removed:
            self.log.info("group.consumers_removed", consumers=removed)

    def accept(self, deliveries: list[Delivery]) -> None:
        """Validate deliveries and start them, or answer them at once (invalid, duplicate, cancelled...).

        Deliveries stay in ``inbox`` until handled, so a Redis error half-way loses none of them.
        """
        self.inbox.extend(deliveries)
        batch, self.inbox = self.inbox, []
        parsed: list[tuple[Delivery, str, JobRequest]] = []
        for d in batch:
            self._hold(d.entry_id)
            if d.fields is None:
                self.outbox.acks.append(d.entry_id)
                continue
            raw = d.fields.get(JOB_FIELD)
            if raw is None:
                self._reject(d, json.dumps(d.fields), InvalidJob(f"stream entry has no {JOB_FIELD!r} field"))
                continue
            try:
                req = parse_job(raw, self.s.max_payload_bytes)
            except InvalidJob as exc:
                self._reject(d, raw, exc)
                continue
            parsed.append((d, raw, req))
        if not parsed:
            return
        pipe = self.r.pipeline(transaction=False)
        for _, _, req in parsed:
            pipe.exists(self.keys.result(req.id))
            pipe.exists(self.keys.cancel(req.id))
        try:
            flags = pipe.execute()
        except BaseException:
            self.inbox = [d for d, _, _ in parsed] + self.inbox
            raise
        for i, (d, raw, req) in enumerate(parsed):
            has_result, cancelled = flags[2 * i], flags[2 * i + 1]
            job = self._new_job(d, raw, req)
            if has_result:  # a redelivery of a job that already ended (or a reused id): do not rerun
                job.log.info("job.duplicate")
                self.counts["duplicate"] += 1
                self.outbox.acks.append(d.entry_id)
            elif d.attempt > self.s.max_attempts:
                msg = f"delivered {d.attempt} times, more than max_attempts={self.s.max_attempts}"
                self._end_error(job, "dead_lettered", msg, dead=True)
            elif cancelled:
                self._end_error(job, "cancelled", "cancelled before it started")
            elif job.deadline is not None and self.redis_now() >= job.deadline:
                self._end_error(job, "deadline_exceeded", f"deadline of {req.timeout_s}s passed before start")
            elif not self.keys.reply_allowed(job.reply_to):
                job.reply_to = self.keys.reply(req.id)
                self._end_error(job, "invalid_request", "reply_to must not name a pagedq key", dead=True)
            elif self._busy_id(req.id):
                self.backlog.append(job)  # same id already running here: wait, then it is a duplicate
            else:
                self._start(job)

    def _new_job(self, d: Delivery, raw: str, req: JobRequest) -> Job:
        if self.metrics is not None:
            self.metrics.delivery(d.attempt)
        return Job(
            entry_id=d.entry_id,
            raw=raw,
            req=req,
            attempt=d.attempt,
            reply_to=req.reply_to or self.keys.reply(req.id),
            enqueued_at=_entry_time(d.entry_id),
            log=self.log.bind(job_id=req.id, attempt=d.attempt, entry_id=d.entry_id),
        )

    def _busy_id(self, job_id: str) -> bool:
        return any(j.id == job_id for j in self.jobs.values())

    def _reject(self, d: Delivery, raw: str, exc: InvalidJob, job: Job | None = None) -> None:
        """Answer an unusable job: error event (when a reply target is known), dead letter, ack."""
        dead = DeadLetter(
            job=raw,
            reason=exc.message,
            code=exc.code,
            attempts=d.attempt,
            worker=self.name,
            job_id=job.id if job else "",
            entry_id=d.entry_id,
        )
        target = (job.id, job.reply_to) if job else salvage_reply_target(raw, self.s.max_payload_bytes)
        if target is None:
            self.log.warning("job.rejected", entry_id=d.entry_id, reason=exc.message, reply=False)
            self.outbox.dead_only.append((d.entry_id, dead))
            self.counts["error"] += 1
            return
        job_id, reply_to = target
        if reply_to is None or not self.keys.reply_allowed(reply_to):
            reply_to = self.keys.reply(job_id)
        dead.job_id = job_id
        event = ErrorEvent(id=job_id, attempt=d.attempt, code=exc.code, message=exc.message, worker=self.name)
        self.log.warning("job.rejected", job_id=job_id, entry_id=d.entry_id, code=exc.code, reason=exc.message)
        self.outbox.terminals.append(Terminal(d.entry_id, job_id, reply_to, event, dead=dead))
        self.counts["error"] += 1

    def _prompt(self, req: JobRequest) -> str | list[int]:
        """The engine's prompt: text, token ids, or chat messages through the model's chat template."""
        if req.prompt is not None:
            return req.prompt
        if req.prompt_token_ids is not None:
            return list(req.prompt_token_ids)  # the engine checks them against the vocabulary
        assert req.messages is not None
        messages = [m.model_dump() for m in req.messages]
        try:
            chat = getattr(self.engine, "chat_prompt_ids", None)
            if chat is not None:
                return list(chat(messages))
            ids = self.engine.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True, return_dict=False
            )
        except Exception as exc:  # jinja errors (e.g. roles that must alternate), no template...
            raise InvalidJob(f"messages: {exc}") from exc
        return list(ids)

    def _start(self, job: Job) -> None:
        """Hand a job to the engine; bad input is answered, any other failure costs one attempt."""
        try:
            prompt = self._prompt(job.req)
            params = job.req.sampling_params()
            n = job.req.n or 1
            if n > self.s.max_num_seqs:
                raise InvalidJob(f"n={n} is larger than this worker's max_num_seqs={self.s.max_num_seqs}")
            request_id = f"{job.entry_id}/{job.attempt}"
            self.engine.add_request(request_id, prompt, params, priority=job.req.priority)
        except InvalidJob as exc:
            self._reject(Delivery(job.entry_id, None, job.attempt), job.raw, exc, job)
            return
        except Exception as exc:
            if _too_long(exc):
                self._reject(
                    Delivery(job.entry_id, None, job.attempt),
                    job.raw,
                    InvalidJob(str(exc), "prompt_too_long"),
                    job,
                )
            elif isinstance(exc, (ValueError, TypeError)):
                self._reject(Delivery(job.entry_id, None, job.attempt), job.raw, InvalidJob(str(exc)), job)
            else:
                job.log.exception("job.start_failed")
                self._fail_attempt(job, exc)
            return
        job.request_id = request_id
        job.started_at = self.redis_now()
        self.jobs[job.entry_id] = job
        self.by_request[request_id] = job

    def _start_backlog(self) -> None:
        """Start held jobs when allowed: a suspect only into an empty engine, and then alone."""
        if not self.backlog or any(j.suspect for j in self.jobs.values()):
            return
        self.backlog.sort(key=lambda j: (-j.req.priority, j.entry_id))
        for job in list(self.backlog):
            if job.suspect:
                if self.jobs or self.engine.has_unfinished():
                    continue
                self.backlog.remove(job)
                job.log.info("job.rerun_alone")
                self._start(job)
                return
            if not self._busy_id(job.id):
                self.backlog.remove(job)
                self.accept_again(job)

    def accept_again(self, job: Job) -> None:
        """A job that waited for its id to be free: it is most likely a duplicate by now."""
        try:
            exists = self.r.exists(self.keys.result(job.id))
        except REDIS_DOWN:
            self.backlog.append(job)
            return
        if exists:
            self.counts["duplicate"] += 1
            self.outbox.acks.append(job.entry_id)
        else:
            self._start(job)

    # ------------------------------------------------------------------------------- stepping

    def _step(self) -> None:
        try:
            deltas = self.engine.step()
        except Exception as exc:
            self._step_failed(exc)
            return
        now = self.redis_now()
        for delta in deltas:
            job = self.by_request.get(delta.request_id)
            if job is None:
                continue
            job.prompt_tokens = len(delta.prompt_token_ids)
            job.cached_tokens = delta.num_cached_tokens
            for out in delta.outputs:
                if (out.text or out.token_ids) and job.first_token_at is None:
                    job.first_token_at = now
                job.choices.setdefault(out.index, ChoiceState()).add(out)
            if delta.finished:
                self._end_final(job)
            elif job.req.stream and time.monotonic() - job.last_publish >= self.s.stream_interval_s:
                self._emit_tokens(job)

    def _step_failed(self, exc: Exception) -> None:
        culprit = self.by_request.get(str(getattr(exc, "request_id", "")))
        running = list(self.jobs.values())
        if culprit is None and len(running) == 1:
            culprit = running[0]
        if culprit is not None:
            culprit.log.error("job.step_failed", error=repr(exc))
            self._fail_attempt(culprit, exc)
            return
        self.log.error("engine.step_failed", error=repr(exc), suspects=[j.id for j in running])
        for job in running:  # unknown culprit: rerun each alone to find it
            self._abort(job)
            self._retry(job)

    def _fail_attempt(self, job: Job, exc: BaseException) -> None:
        self._abort(job)
        if job.attempt >= self.s.max_attempts:
            msg = f"failed {job.attempt} times; last error: {exc!r}"
            self._end_error(job, "dead_lettered", msg, dead=True)
        else:
            self._retry(job)

    def _retry(self, job: Job) -> None:
        """Run the job again as a new attempt (the PEL counts the delivery), alone in the engine."""
        self._claims.append(job.entry_id)
        job.reset(job.attempt + 1)
        if self.metrics is not None:
            self.metrics.delivery(job.attempt)
        job.suspect = True
        self.backlog.append(job)
        job.log.warning("job.retry")

    def _abort(self, job: Job) -> None:
        if job.request_id:
            try:
                self.engine.abort(job.request_id)
            except Exception:
                self.log.exception("engine.abort_failed", request_id=job.request_id)
            self.by_request.pop(job.request_id, None)
        self.jobs.pop(job.entry_id, None)
        flush_pending = [c for c in job.choices.values() if c.pending_text or c.pending_ids]
        if flush_pending and job.req.stream and job.produced:
            self._emit_tokens(job)

    def _emit_tokens(self, job: Job) -> None:
        for index, ch in sorted(job.choices.items()):
            if not ch.pending_text and not ch.pending_ids:
                continue
            event = TokenEvent(
                id=job.id,
                attempt=job.attempt,
                index=index,
                text="".join(ch.pending_text),
                token_ids=ch.pending_ids,
            )
            self.outbox.tokens.append((job.reply_to, event.to_json()))
            ch.pending_text = []
            ch.pending_ids = []
        job.last_publish = time.monotonic()

    # -------------------------------------------------------------------------------- endings

    def _end_final(self, job: Job) -> None:
        self._abort_quietly(job)
        if job.req.stream:
            self._emit_tokens(job)
        choices = final_choices(job.choices, job.req.n or 1, job.stop_reason, job.req.logprobs is not None)
        now = self.redis_now()
        completion = sum(len(c.token_ids) for c in choices)
        event = FinalEvent(
            id=job.id,
            attempt=job.attempt,
            choices=choices,
            usage=Usage(prompt_tokens=job.prompt_tokens, completion_tokens=completion, cached_tokens=job.cached_tokens),
            timings=self._timings(job, now),
            metadata=job.req.metadata,
            worker=self.name,
        )
        self.outbox.terminals.append(Terminal(job.entry_id, job.id, job.reply_to, event))
        self.counts["final"] += 1
        gen_s = now - (job.first_token_at or now)
        job.log.info(
            "job.finished",
            outcome="final",
            finish_reason=choices[0].finish_reason if choices else None,
            prompt_tokens=job.prompt_tokens,
            completion_tokens=completion,
            cached_tokens=job.cached_tokens,
            tok_s=round(completion / gen_s, 2) if gen_s > 0 else None,
            **event.timings.model_dump(),
            **self._user_text(job, choices),
        )
        if self.metrics is not None:
            self.metrics.job_finished(
                outcome="final",
                reason=choices[0].finish_reason if choices else None,
                prompt_tokens=job.prompt_tokens,
                completion_tokens=completion,
                **event.timings.model_dump(),
            )

    def _timings(self, job: Job, now: float) -> Timings:
        start = job.started_at if job.started_at is not None else now
        ttft = None if job.first_token_at is None else job.first_token_at - job.enqueued_at
        return Timings(
            queued_s=finite_or_none(max(0.0, start - job.enqueued_at)) or 0.0,
            ttft_s=finite_or_none(ttft),
            total_s=finite_or_none(max(0.0, now - job.enqueued_at)) or 0.0,
        )

    def _abort_quietly(self, job: Job) -> None:
        if job.request_id:
            self.by_request.pop(job.request_id, None)
        self.jobs.pop(job.entry_id, None)

    def _end_error(self, job: Job, code: ErrorCode, message: str, *, dead: bool = False) -> None:
        self._abort_quietly(job)
        event = ErrorEvent(
            id=job.id,
            attempt=job.attempt,
            code=code,
            message=message,
            metadata=job.req.metadata,
            worker=self.name,
        )
        letter = None
        if dead:
            letter = DeadLetter(
                job=job.raw,
                reason=message,
                code=code,
                attempts=job.attempt,
                worker=self.name,
                job_id=job.id,
                entry_id=job.entry_id,
            )
        self.outbox.terminals.append(Terminal(job.entry_id, job.id, job.reply_to, event, dead=letter))
        self.counts["error"] += 1
        job.log.info("job.finished", outcome="error", code=code, message=message, dead_lettered=dead)
        if self.metrics is not None:
            self.metrics.job_finished(outcome="error", reason=code, dead_lettered=dead)

    def _user_text(self, job: Job, choices: list[Any]) -> dict[str, Any]:
        """Prompt and outputs for the canonical log line, only where ``log_prompts`` asks for them."""
        if not self.s.log_prompts:
            return {}
        req = job.req
        prompt = req.prompt if req.prompt is not None else (req.messages or req.prompt_token_ids)
        return {"prompt": prompt, "outputs": [c.text for c in choices]}

    def _stop_job(self, job: Job, reason: FinishReason) -> None:
        """Cancel or time out a job: a final with its partial text if it produced any, else an error."""
        if job in self.backlog:
            self.backlog.remove(job)
        self._abort(job)
        if job.produced:
            job.stop_reason = reason
            self._end_final(job)
        elif reason == "cancelled":
            self._end_error(job, "cancelled", "cancelled before it started")
        else:
            self._end_error(job, "deadline_exceeded", f"deadline of {job.req.timeout_s}s passed before start")

    def _all_jobs(self) -> list[Job]:
        return [*self.jobs.values(), *self.backlog]

    def _expire_deadlines(self) -> None:
        now = self.redis_now()
        for job in self._all_jobs():
            deadline = job.deadline
            if deadline is not None and now >= deadline:
                job.log.info("job.deadline")
                self._stop_job(job, "deadline")

    def cancel(self, job_id: str) -> bool:
        """Cancel a job held by this worker (from a notice or the cancel key); False if not held."""
        found = False
        for job in self._all_jobs():
            if job.id == job_id:
                job.log.info("job.cancel")
                self._stop_job(job, "cancelled")
                found = True
        return found

    def _poll_cancels(self, now: float) -> None:
        """Fallback for missed pub/sub notices (e.g. across a reconnect): look at the cancel keys."""
        self._next_cancel_poll = now + self.s.cancel_poll_s
        held = self._all_jobs()
        if not held:
            return
        pipe = self.r.pipeline(transaction=False)
        for job in held:
            pipe.exists(self.keys.cancel(job.id))
        for job, flagged in zip(held, pipe.execute(), strict=True):
            if flagged and (job in self.backlog or job.entry_id in self.jobs):
                job.log.info("job.cancel", via="poll")
                self._stop_job(job, "cancelled")

    def _drain_keeper_queues(self) -> None:
        while self._notices:
            self.cancel(self._notices.popleft())
        while self._lost:
            entry_id = self._lost.popleft()
            job = self.jobs.get(entry_id) or next((j for j in self.backlog if j.entry_id == entry_id), None)
            if job is None:
                continue
            # Another delivery of the job finished it, or we were presumed dead and it was taken over.
            job.log.warning("job.lost", reason="entry no longer owned by this worker")
            if job in self.backlog:
                self.backlog.remove(job)
            self._abort(job)
            self._unhold([entry_id])
            self.counts["lost"] += 1

    # ---------------------------------------------------------------------------------- flush

    def _hold(self, entry_id: str) -> None:
        with self._held_lock:
            self._held.add(entry_id)

    def _unhold(self, entry_ids: list[str]) -> None:
        with self._held_lock:
            self._held.difference_update(entry_ids)

    def held_ids(self) -> list[str]:
        with self._held_lock:
            return list(self._held)

    def _flush(self) -> None:
        """Send the outbox, count retried deliveries, hand back released entries."""
        if self._claims:
            claims, self._claims = self._claims, []
            try:
                pipe = self.r.pipeline(transaction=False)
                for entry_id in claims:
                    pipe.xclaim(self.keys.jobs, GROUP, self.name, 0, [entry_id])
                pipe.execute()
            except BaseException:
                self._claims = claims + self._claims
                raise
        if self.outbox:
            done = [t.entry_id for t in self.outbox.terminals]
            done += [e for e, _ in self.outbox.dead_only] + list(self.outbox.acks)
            terminals = list(self.outbox.terminals)
            errors = self.publisher.flush(self.outbox)
            for err in errors:
                self.log.warning("publish.command_failed", error=str(err))
            for t in terminals:
                if t.written is False:
                    self.log.info("job.duplicate_result_suppressed", job_id=t.job_id, entry_id=t.entry_id)
            self._unhold(done)
        if self._releases:
            releases, self._releases = self._releases, {}
            try:
                self.reclaimer.release(releases)
            except BaseException:
                self._releases.update(releases)
                raise
            self._unhold(list(releases))

    # ------------------------------------------------------------------------------- shutdown

    def _begin_drain(self, now: float) -> None:
        self._draining = True
        self._drain_deadline = now + self.s.shutdown_grace_s
        handed_back = len(self.inbox)
        for d in self.inbox:
            self._releases[d.entry_id] = d.attempt - 1
        self.inbox = []
        for job in self._all_jobs():
            if not job.produced:
                # Nothing was streamed for this attempt: hand it back without using up an attempt.
                if job in self.backlog:
                    self.backlog.remove(job)
                self._abort(job)
                self._releases[job.entry_id] = job.attempt - 1
                handed_back += 1
        self.log.info(
            "worker.draining",
            grace_s=self.s.shutdown_grace_s,
            running=len(self.jobs),
            handed_back=handed_back,
        )

    def _abandon_all(self) -> None:
        for job in self._all_jobs():
            job.log.warning("job.abandoned", reason="shutdown grace period over")
            if job in self.backlog:
                self.backlog.remove(job)
            self._abort(job)
            self._releases[job.entry_id] = None

    def _final_flush(self) -> bool:
        """Last writes before exiting; gives up (entries stay pending for others) if Redis stays away."""
        give_up_at = time.monotonic() + max(5.0, self.s.redis_backoff_max_s * 2)
        while self.outbox or self._releases or self._claims:
            with self._redis_phase():
                self._flush()
            if time.monotonic() > give_up_at:
                self.log.warning("worker.unflushed_at_exit", terminals=len(self.outbox.terminals))
                break
            if self.outbox or self._releases:
                time.sleep(0.1)
        self.log.info("worker.drained")
        return True

    # --------------------------------------------------------------------------------- status

    def _update_status(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now < self._next_status:
            return
        self._next_status = now + 0.2
        try:
            st = self.engine.stats()
            kv = {
                "kv_cache_usage": round(st.kv_cache_usage, 4),
                "num_free_blocks": st.num_free_blocks,
                "num_total_blocks": st.num_total_blocks,
                "prefix_cache_hit_rate": round(st.prefix_cache_hit_rate, 4),
                "num_preemptions": st.num_preemptions,
                "prefix_cache_queries": st.prefix_cache_queries,
                "prefix_cache_hits": st.prefix_cache_hits,
                "spec_draft_tokens": st.spec_draft_tokens,
                "spec_accepted_tokens": st.spec_accepted_tokens,
            }
        except Exception:
            kv = {}
        self.status = {
            "name": self.name,
            "queue": self.s.queue,
            "model": self.model_name,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "state": "draining" if self._draining else "ready",
            "running": self.engine.num_running(),
            "waiting": self.engine.num_waiting(),
            "unstarted": self.unstarted(),
            "in_flight": len(self.jobs) + len(self.backlog),
            "idle": not self.jobs and not self.backlog and not self.outbox and not self.engine.has_unfinished(),
            "started_at": round(self.started, 3),
            "ts": round(time.time(), 3),
            **kv,
            **{f"jobs_{k}": v for k, v in self.counts.items()},
            "loop": {"ticks": self.ticks, **{f"{k}_s": round(v, 4) for k, v in self.loop_s.items()}},
        }


class _Keeper(threading.Thread):
    """Heartbeat, keep-fresh of held entries, and cancel notices; never touches the engine."""

    def __init__(self, worker: Worker) -> None:
        super().__init__(name=f"pagedq-keeper-{worker.name}", daemon=True)
        self.w = worker
        self._halt = threading.Event()
        self.period = min(worker.s.heartbeat_interval_s, worker.s.reclaim_idle_s / 3)

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=5)

    def run(self) -> None:
        w = self.w
        pubsub: Any = None
        next_beat = 0.0
        backoff = 0.1
        while not self._halt.is_set():
            try:
                if pubsub is None:
                    pubsub = w.r.pubsub(ignore_subscribe_messages=True)
                    pubsub.subscribe(w.keys.cancel_channel)
                now = time.monotonic()
                if now >= next_beat:
                    lost = w.reclaimer.keep_fresh(w.held_ids())
                    w._lost.extend(lost)
                    w.r.set(w.keys.heartbeat(w.name), json.dumps(w.status), px=int(w.s.heartbeat_ttl_s * 1000))
                    next_beat = now + self.period
                msg = pubsub.get_message(timeout=max(0.0, min(0.2, next_beat - time.monotonic())))
                while msg is not None:
                    if msg.get("type") == "message":
                        w._notices.append(str(msg["data"]))
                    msg = pubsub.get_message(timeout=0)
                backoff = 0.1
            except Exception as exc:
                if not isinstance(exc, REDIS_DOWN):
                    w.log.exception("keeper.failed")
                if pubsub is not None:
                    with contextlib.suppress(Exception):
                        pubsub.close()
                    pubsub = None
                self._halt.wait(backoff)
                backoff = min(backoff * 2, w.s.redis_backoff_max_s)
        if pubsub is not None:
            with contextlib.suppress(Exception):
                pubsub.close()
