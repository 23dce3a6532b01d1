"""Everything a worker owes Redis, and the one place it is sent from.

The loop never writes to Redis in the middle of its bookkeeping: events, terminal writes, acks, retry
claims and hand-backs are queued here and sent together (once per step), so a Redis outage only delays
them. Nothing is dropped until Redis confirmed it, and then the entries are no longer owned (the keeper
stops keeping them fresh).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from schemas.keys import GROUP, Keys
from worker.keeper import OwnedEntries
from worker.publisher import Outbox, Publisher
from worker.reclaimer import Reclaimer


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

    def __bool__(self) -> bool:
        return bool(self.outbox or self.claims or self.releases)

    def send(self) -> None:
        """Send everything queued, in order: retry claims, the outbox, hand-backs. A Redis error leaves
        what was not confirmed queued for the next call."""
        if self.claims:
            claims, self.claims = self.claims, []
            try:
                pipe = self.redis.pipeline(transaction=False)
                for entry_id in claims:
                    pipe.xclaim(self.keys.jobs, GROUP, self.name, 0, [entry_id])
                pipe.execute()
            except BaseException:
                self.claims = claims + self.claims
                raise
        if self.outbox:
            done = [t.entry_id for t in self.outbox.terminals]
            done += [e for e, _ in self.outbox.dead_only] + list(self.outbox.acks)
            terminals = list(self.outbox.terminals)
            for err in self.publisher.flush(self.outbox):
                self.log.warning("publish.command_failed", error=str(err))
            for t in terminals:
                if t.written is False:
                    self.log.info("job.duplicate_result_suppressed", job_id=t.job_id, entry_id=t.entry_id)
            self.owned.discard(done)
        if self.releases:
            releases, self.releases = self.releases, {}
            try:
                self.reclaimer.release(releases)
            except BaseException:
                self.releases.update(releases)
                raise
            self.owned.discard(list(releases))
