"""Intake: which stream entries a worker reads, when, and how a delivery becomes a job or an answer.

Reading is the backpressure: the loop asks for at most its capacity, so a worker never holds more than
``max_num_seqs + prefetch`` unstarted jobs and a backlog is shared between replicas. On a sharded queue it
reads its home shards first (:mod:`schemas.affinity`), and other shards only with capacity left and only
those whose oldest unread job has waited ``steal_after_s``. Order of reads: this
consumer's own pending entries first (a restarted worker with the same name), then entries idle for
``reclaim_idle_s`` (their worker died), then new ones; a worker with nothing to do blocks on the read.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from schemas.affinity import home_shards
from schemas.jobs import InvalidJob, JobRequest, parse_job, salvage_reply_target
from schemas.keys import JOB_FIELD, Keys
from worker.protocol_v1 import answer_v1_entries
from worker.reclaimer import MULTI_SHARD_BLOCK_MS, Delivery, Reclaimer
from worker.registry import live_heartbeats
from worker.settings import Settings


@dataclass
class Parsed:
    """A delivery whose payload is a valid job."""

    delivery: Delivery
    raw: str
    request: JobRequest


@dataclass
class Unusable:
    """A delivery whose payload cannot be run: answered with an error and dead-lettered.

    ``raw`` is what the dead letter keeps; the error goes to the id and ``reply_to`` read from ``answer``
    (default: ``raw``). ``dead`` False: answer only, another :class:`Unusable` of the same entry carries its
    one dead letter (an entry with several ``job`` fields, :meth:`Intake.take`)."""

    delivery: Delivery
    raw: str
    error: InvalidJob
    answer: str | None = None
    dead: bool = True


FUTURE_ENTRY_TOLERANCE_S = 60.0
"""How far ahead of the Redis clock an entry id may be: Redis' own ids are never ahead (up to clock steps
between a primary and its promoted replica, well under a minute) unless a producer chose an id further
ahead, and Redis then numbers every later automatic id after it (``Intake.take``)."""

V1_LOOK_S = 1.0
"""How often a worker looks for jobs a protocol v1 producer queued (one EXISTS when there are none)."""

MAX_SUBMITTED_AGE_S = 30 * 86_400.0
"""A ``submitted_at`` older than this is not believed (a producer's clock off by more than a month)."""


def entry_sequence(entry_id: str) -> int:
    """The sequence part of a stream entry id (``<ms>-<seq>``); 0 when it is not one."""
    try:
        return int(entry_id.split("-", 1)[1])
    except (IndexError, ValueError):
        return 0


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
    * else the entry id's time when it is not ahead of ``now`` either: then Redis chose it (a producer can
      only pick ids above every existing one, i.e. in the future), so it survives redeliveries;
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
        self.future_entries = 0  # entries refused for an id a producer chose ahead of the clock
        self.ahead_of_clock = False  # an entry read was ahead of the clock: the loop moves the stream's ids back
        self.blocked = False  # the last read waited for work (the loop counts that time as idle)
        self._history: str | None = "0"  # cursor in our own PEL; None once walked
        self._next_poll = 0.0
        self._next_reclaim = 0.0
        self._next_tidy = time.monotonic() + 60.0
        self._next_v1_look = 0.0
        self._next_homes = 0.0
        self.homes: list[int] = list(range(keys.shards))  # until the first look at the fleet
        self.stolen = 0  # entries read from shards that are not this worker's homes
        self.v1_answered = 0  # protocol v1 entries answered with an error
        self._no_home_waits = threading.Event()  # never set: a timed wait that is not a busy loop

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
        if now >= self._next_v1_look:
            self._next_v1_look = now + V1_LOOK_S
            self._answer_v1()
        if self.keys.shards > 1 and now >= self._next_homes:
            self._next_homes = now + settings.heartbeat_interval_s
            self._update_homes()
        left = capacity()
        if left > 0 and self._history is None:
            idle = not busy and not self.inbox and settings.block_s > 0
            block = max(1, int(settings.block_s * 1000)) if idle else None
            self.blocked = block is not None
            homes = self.homes
            got = self.reclaimer.read_new(left, None if len(homes) < self.keys.shards else block, homes)
            self.inbox += got
            left -= len(got)
            if left > 0 and len(homes) < self.keys.shards:
                got = self._steal(left)
                if not got and block is not None:
                    if homes:
                        got = self.reclaimer.read_new(left, block, homes)
                    else:  # no home shard (more workers than shards): nothing to wait on but the clock
                        self._no_home_waits.wait(MULTI_SHARD_BLOCK_MS / 1000)
                self.inbox += got

    def _update_homes(self) -> None:
        """This worker's home shards: those it wins by rendezvous hashing over the live workers."""
        homes = home_shards(self.reclaimer.consumer, self._live_workers(), self.keys.shards)
        if homes != self.homes:
            self.log.info("shards.homes", homes=homes)
        self.homes = homes

    def _steal(self, want: int) -> list[Delivery]:
        """Entries of shards that are not home, only from those whose oldest unread entry has waited more
        than ``steal_after_s`` (their home worker is busy, or gone): stealing sooner would warm a second
        prefix cache for nothing."""
        now = self.reclaimer.server_time()
        others = [k for k in range(self.keys.shards) if k not in self.homes]
        late = [k for k in others if self.reclaimer.oldest_unread_age_s(k, now) > self.settings.steal_after_s]
        got = self.reclaimer.read_new(want, None, late) if late else []
        self.stolen += len(got)
        return got

    def _live_workers(self) -> set[str]:
        """Names of this queue's live workers, from the namespace's index (:mod:`worker.registry`): it runs on
        the main loop, where a SCAN of a shared keyspace stalled every running job's tokens."""
        members = live_heartbeats(self.client, self.keys.namespace, self.keys.queue)
        return {member.partition(":")[2] for member in members}

    def _answer_v1(self) -> None:
        if not self.client.exists(self.keys.jobs_v1):
            return
        answered = answer_v1_entries(
            self.client,
            self.keys,
            self.reclaimer.consumer,
            result_ttl_s=self.settings.result_ttl_s,
            reply_ttl_s=self.settings.reply_ttl_s,
            max_payload_bytes=self.settings.max_payload_bytes,
        )
        if answered:
            self.v1_answered += answered
            self.log.warning("protocol.v1_entries_answered", count=answered, stream=self.keys.jobs_v1)

    def _forget_dead_consumers(self) -> None:
        live = self._live_workers()
        removed = self.reclaimer.forget_dead_consumers(live)
        if removed:
            self.log.info("group.consumers_removed", consumers=removed)

    def take(self, now: float) -> tuple[list[Parsed], list[Unusable], list[Delivery]]:
        """Empty the inbox into valid jobs, unusable payloads, and deliveries whose entry is gone (only an
        ack is owed for those). ``now`` is the Redis server's time.

        An entry id further ahead of it than :data:`FUTURE_ENTRY_TOLERANCE_S` is either one a producer chose
        or one Redis gave after it: while a stream's last id lies in the future, Redis numbers every
        ``XADD *`` in that same millisecond, counting up the sequence. So an id ahead of the clock with
        sequence 0 (a millisecond's first: what ``<ms>-0`` or ``<ms>-*`` gives) is the producer's choice and
        unusable, and one with a later sequence is served: it is most likely an honest producer's job queued
        behind the bad one, and a producer who picked it gains nothing, since a job's clock never comes
        from an id ahead of the clock (:func:`job_clock`). The one automatic id this refuses is the next
        millisecond's first after a chosen ``<ms>-18446744073709551615``. Either way the loop moves the
        stream's ids back to the clock once every such entry has gone (``ahead_of_clock``).

        An entry's fields are all read, in order (:class:`worker.reclaimer.Delivery`). Other field names
        than ``job`` are not read (a repeated one changes nothing); an entry with more than one ``job``
        field is unusable as a whole: see :meth:`_several_jobs`."""
        batch, self.inbox = self.inbox, []
        parsed: list[Parsed] = []
        unusable: list[Unusable] = []
        gone: list[Delivery] = []
        for d in batch:
            if d.fields is None:
                gone.append(d)
                continue
            jobs = [value for name, value in d.fields if name == JOB_FIELD]
            if not jobs:
                error = InvalidJob(f"stream entry has no {JOB_FIELD!r} field")
                unusable.append(Unusable(d, json.dumps(dict(d.fields), ensure_ascii=False), error))
                continue
            if len(jobs) > 1:
                self.ahead_of_clock |= entry_time(d.entry_id) - now > FUTURE_ENTRY_TOLERANCE_S
                unusable += self._several_jobs(d, jobs)
                continue
            raw = jobs[0]
            ahead_s = entry_time(d.entry_id) - now
            if ahead_s > FUTURE_ENTRY_TOLERANCE_S:
                self.ahead_of_clock = True
                if entry_sequence(d.entry_id) == 0:
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

    def _several_jobs(self, d: Delivery, jobs: list[str]) -> list[Unusable]:
        """The rule for an entry with more than one ``job`` field (``XADD ... job A job B``, legal in Redis):
        none of its jobs runs (which one was meant cannot be told, and running one would leave the others'
        producers waiting), every job whose payload names a readable id gets an ``invalid_request`` error
        event (in its own reply stream, or its ``reply_to`` where that is allowed), and the entry gets one
        dead letter keeping every field in order (a JSON list of ``[name, value]`` pairs), ridden by the
        first answered job's terminal write so that it goes out with the entry's ack. With no readable id
        in any of them, the dead letter alone."""
        message = (
            f"stream entry has {len(jobs)} {JOB_FIELD!r} fields; none of them was run: send one job per entry "
            f"(XADD <queue> * {JOB_FIELD} <payload>)"
        )
        whole = json.dumps([list(pair) for pair in d.fields or []], ensure_ascii=False)
        limit = self.settings.max_payload_bytes
        answered = [job for job in jobs if salvage_reply_target(job, limit) is not None]
        if not answered:
            return [Unusable(d, whole, InvalidJob(message))]
        return [Unusable(d, whole, InvalidJob(message), job, dead=k == 0) for k, job in enumerate(answered)]

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
