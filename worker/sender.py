"""Everything a worker owes Redis, and the one place it is sent from.

The loop never writes to Redis in the middle of its bookkeeping: events, terminal writes, acks, retry
claims and hand-backs are queued here and sent together (once per step), so a Redis outage only delays
them. Nothing is dropped until Redis confirmed it, and then the entries are no longer owned (the keeper
stops keeping them fresh).

A write Redis *refuses* (as opposed to one it did not receive) is the fate of one job, never of the batch
(rules enforced in :meth:`Sender._refused`):

* refused token events are dropped (the job's terminal event still carries its whole text);
* a refused terminal write is retried :data:`REFUSALS_BEFORE_DEGRADING` times, then once more without the
  reply stream (the result key and the dead letter are the record that matters; the token events already
  in the stream expire with the ``result_ttl_s`` safety TTL their first write gave it, since the degraded
  write no longer touches the stream, not even to expire it), and if Redis refuses that too, the entry is
  handed back so that a later delivery (attempt + 1, dead-lettered past ``max_attempts``) answers it;
* a refused dead letter of an id-less entry is retried the same way, then the entry is handed back.

While refusals go on, :attr:`Sender.refusing_since` says since when: the worker reports itself unhealthy
when that lasts longer than ``stall_timeout_s`` (a publish that keeps failing is not progress).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from schemas.keys import GROUP, Keys, split_entry_ref
from worker.keeper import OwnedEntries
from worker.publisher import DeadOnly, Outbox, Publisher, Terminal, TokenWrite, Unit
from worker.reclaimer import Reclaimer

REFUSALS_BEFORE_DEGRADING = 3


@dataclass(eq=False)
class Sender:
    """The outbox (events, terminals, acks), retried deliveries to count, and entries to hand back."""

    redis: Any
    keys: Keys
    name: str  # this worker's consumer name
    publisher: Publisher
    reclaimer: Reclaimer
    owned: OwnedEntries
    log: Any
    outbox: Outbox = field(default_factory=Outbox)
    claims: list[str] = field(default_factory=list)  # entries whose job runs again: count a new delivery
    releases: dict[str, int | None] = field(default_factory=dict)  # entries to hand back (delivery count to set)
    refusing_since: float | None = None  # monotonic time of the first refusal of the current streak
    refused_writes: int = 0  # units Redis refused since start (tokens dropped, terminals retried...)
    foreign_streams: int = 0  # token writes skipped because the reply stream belongs to another job entry

    def __bool__(self) -> bool:
        return bool(self.outbox or self.claims or self.releases)

    def send(self) -> None:
        """Send everything queued, in order: retry claims, the outbox, hand-backs. A Redis error leaves
        what was not confirmed queued for the next call."""
        if self.claims:
            claims, self.claims = self.claims, []
            try:
                pipe = self.redis.pipeline(transaction=False)
                for ref in claims:
                    shard, entry_id = split_entry_ref(ref)
                    pipe.xclaim(self.keys.jobs_shard(shard), GROUP, self.name, 0, [entry_id])
                pipe.execute()
            except BaseException:
                self.claims = claims + self.claims
                raise
        if self.outbox:
            units = self.outbox.units()
            refused = self.publisher.flush(self.outbox)
            refused_units = {id(unit) for unit, _ in refused}
            done: list[str] = []
            for unit in units:
                if id(unit) in refused_units:
                    continue
                if isinstance(unit, TokenWrite):
                    if unit.written is False:
                        self.foreign_streams += 1
                        self.log.info("job.reply_stream_not_owned", job_id=unit.job_id, reply_to=unit.reply_to)
                elif isinstance(unit, Terminal):
                    done.append(unit.entry_id)
                    if unit.written is False:
                        self.log.info("job.duplicate_result_suppressed", job_id=unit.job_id, entry_id=unit.entry_id)
                elif isinstance(unit, DeadOnly):
                    done.append(unit.entry_id)
                else:
                    done.append(unit)
            for unit, error in refused:
                self._refused(unit, error)
            if not refused:
                self.refusing_since = None
            self.owned.discard(done)
        if self.releases:
            releases, self.releases = self.releases, {}
            try:
                self.reclaimer.release(releases)
            except BaseException:
                self.releases.update(releases)
                raise
            self.owned.discard(list(releases))

    def _refused(self, unit: Unit, error: BaseException) -> None:
        """One unit Redis refused: retry, degrade, or give it up (the rules in the module doc)."""
        self.refused_writes += 1
        if self.refusing_since is None:
            self.refusing_since = time.monotonic()
        if isinstance(unit, TokenWrite):
            self.log.warning("publish.tokens_refused", job_id=unit.job_id, reply_to=unit.reply_to, error=str(error))
            return
        if isinstance(unit, str):
            self.log.warning("publish.ack_refused", entry_id=unit, error=str(error))
            self.outbox.acks.append(unit)
            return
        unit.failures += 1
        job_id = unit.job_id if isinstance(unit, Terminal) else ""
        log = self.log.bind(entry_id=unit.entry_id, job_id=job_id, failures=unit.failures, error=str(error))
        if unit.failures < REFUSALS_BEFORE_DEGRADING:
            log.warning("publish.refused")
        elif isinstance(unit, Terminal) and unit.write_reply:
            log.error("publish.refused_without_reply_stream", reply_to=unit.reply_to)
            unit.write_reply = False
            unit.failures = 0
        else:
            log.error("publish.given_up", hint="the entry is handed back; a later delivery answers it")
            self.releases[unit.entry_id] = None
            return
        if isinstance(unit, Terminal):
            self.outbox.terminals.append(unit)
        else:
            self.outbox.dead_only.append(unit)
