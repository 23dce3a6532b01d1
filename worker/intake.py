"""Intake: which stream entries a worker reads, when, and how a delivery becomes a job or an answer.

Reading is the backpressure: the loop asks for at most its capacity, so a worker never holds more than
``max_num_seqs + prefetch`` unstarted jobs and a backlog is shared between replicas. Order of reads: this
consumer's own pending entries first (a restarted worker with the same name), then entries idle for
``reclaim_idle_s`` (their worker died), then new ones; a worker with nothing to do blocks on the read.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from schemas.jobs import InvalidJob, JobRequest, parse_job
from schemas.keys import JOB_FIELD, Keys
from worker.reclaimer import Delivery, Reclaimer
from worker.settings import Settings


@dataclass
class Parsed:
    """A delivery whose payload is a valid job."""

    delivery: Delivery
    raw: str
    request: JobRequest


@dataclass
class Unusable:
    """A delivery whose payload cannot be run: answered with an error and dead-lettered."""

    delivery: Delivery
    raw: str
    error: InvalidJob


FUTURE_ENTRY_TOLERANCE_S = 60.0
"""How far ahead of the Redis clock an entry id may be: Redis' own ids are never ahead (up to clock steps
between a primary and its promoted replica, well under a minute); further ahead, a producer chose it."""

MAX_SUBMITTED_AGE_S = 30 * 86_400.0
"""A ``submitted_at`` older than this is not believed (a producer's clock off by more than a month)."""


def entry_time(entry_id: str) -> float:
    """Seconds since the epoch encoded in a stream entry id (``<ms>-<seq>``); 0 when it is not one."""
    try:
        return int(entry_id.split("-", 1)[0]) / 1000.0
    except ValueError:
        return 0.0


def job_clock(submitted_at: float | None, entry_id: str, now: float) -> float:
    """When a job is deemed enqueued, for its timings and deadline: never later than ``now`` (the Redis
    server's time at read), never a producer's choice that could hurt another job.

    * ``submitted_at`` (the producer's clock) when given and sane: not ahead of ``now`` by more than
      :data:`FUTURE_ENTRY_TOLERANCE_S` (then clamped to ``now``), not older than a month;
    * else the entry id's time, which Redis chose (a producer can only pick ids above every existing one,
      i.e. in the future, and those never get here: ``take`` refuses them), so it survives redeliveries;
    * else ``now``.
    """
    if submitted_at is not None and now - MAX_SUBMITTED_AGE_S <= submitted_at <= now + FUTURE_ENTRY_TOLERANCE_S:
        return min(submitted_at, now)
    stamped = entry_time(entry_id)
    if 0.0 < stamped <= now + FUTURE_ENTRY_TOLERANCE_S:
        return min(stamped, now)
    return now


class Intake:
    """The reads of one worker and the deliveries not handled yet (``inbox``, kept across Redis errors)."""

    def __init__(self, client: Any, keys: Keys, reclaimer: Reclaimer, settings: Settings, log: Any) -> None:
        self.client = client
        self.keys = keys
        self.reclaimer = reclaimer
        self.settings = settings
        self.log = log
        self.inbox: list[Delivery] = []
        self.future_entries = 0  # entries refused for an id ahead of the clock (the loop repairs the stream)
        self.blocked = False  # the last read waited for work (the loop counts that time as idle)
        self._history: str | None = "0"  # cursor in our own PEL; None once walked
        self._next_poll = 0.0
        self._next_reclaim = 0.0
        self._next_tidy = time.monotonic() + 60.0

    def read(self, now: float, want: int, busy: bool, capacity: Callable[[], int]) -> None:
        """Read up to ``want`` entries into the inbox. ``busy`` (the engine or outbox has work) limits reads
        to every ``poll_interval_s`` and rules out blocking; ``capacity()`` is asked again before new reads.
        Every read lands in the inbox at once, so a Redis error later in the tick loses nothing."""
        settings = self.settings
        if busy and now < self._next_poll:
            return
        self._next_poll = now + settings.poll_interval_s
        if self._history is not None:
            got, self._history = self.reclaimer.read_own_pending(self._history, want)
            self.inbox += got
            if got:
                self.log.info("reclaim.own_pending", count=len(got))
        elif now >= self._next_reclaim:
            self._next_reclaim = now + min(settings.reclaim_idle_s / 2, 5.0)
            got = self.reclaimer.autoclaim(want)
            self.inbox += got
            if got:
                self.log.info("reclaim.claimed", count=len(got), entries=[d.entry_id for d in got])
            if now >= self._next_tidy:
                self._next_tidy = now + 60.0
                self._forget_dead_consumers()
        left = capacity()
        if left > 0 and self._history is None:
            idle = not busy and not self.inbox and settings.block_s > 0
            block = max(1, int(settings.block_s * 1000)) if idle else None
            self.blocked = block is not None
            self.inbox += self.reclaimer.read_new(left, block)

    def _forget_dead_consumers(self) -> None:
        live = {k.rsplit(":", 1)[-1] for k in self.client.scan_iter(self.keys.heartbeat_pattern, count=1000)}
        removed = self.reclaimer.forget_dead_consumers(live)
        if removed:
            self.log.info("group.consumers_removed", consumers=removed)

    def take(self, now: float) -> tuple[list[Parsed], list[Unusable], list[Delivery]]:
        """Empty the inbox into valid jobs, unusable payloads, and deliveries whose entry is gone (only an
        ack is owed for those). ``now`` is the Redis server's time: an entry id further ahead of it than
        :data:`FUTURE_ENTRY_TOLERANCE_S` was chosen by a producer, not by Redis, and is unusable."""
        batch, self.inbox = self.inbox, []
        parsed: list[Parsed] = []
        unusable: list[Unusable] = []
        gone: list[Delivery] = []
        for d in batch:
            if d.fields is None:
                gone.append(d)
                continue
            raw = d.fields.get(JOB_FIELD)
            if raw is None:
                error = InvalidJob(f"stream entry has no {JOB_FIELD!r} field")
                unusable.append(Unusable(d, json.dumps(d.fields, ensure_ascii=False), error))
                continue
            ahead_s = entry_time(d.entry_id) - now
            if ahead_s > FUTURE_ENTRY_TOLERANCE_S:
                self.future_entries += 1
                message = (
                    f"stream entry id {d.entry_id} is {ahead_s:.0f} s ahead of the Redis clock; add jobs with "
                    "an automatic id (XADD ... *) and resubmit"
                )
                unusable.append(Unusable(d, raw, InvalidJob(message, "entry_id_in_future")))
                continue
            try:
                parsed.append(Parsed(d, raw, parse_job(raw, self.settings.max_payload_bytes)))
            except InvalidJob as exc:
                unusable.append(Unusable(d, raw, exc))
        return parsed, unusable, gone

    def existing_keys(self, parsed: list[Parsed]) -> list[tuple[bool, bool]]:
        """Per job: whether its result key exists (a job that ended) and its cancel key (cancelled while
        queued). On a Redis error the deliveries go back to the inbox."""
        pipe = self.client.pipeline(transaction=False)
        for p in parsed:
            pipe.exists(self.keys.result(p.request.id))
            pipe.exists(self.keys.cancel(p.request.id))
        try:
            flags = pipe.execute()
        except BaseException:
            self.inbox = [p.delivery for p in parsed] + self.inbox
            raise
        return [(bool(flags[2 * i]), bool(flags[2 * i + 1])) for i in range(len(parsed))]
