"""At-least-once delivery on top of the consumer group's pending entries list (PEL).

* A worker first re-reads its own pending entries (``XREADGROUP ... 0``): jobs a previous process with the
  same name had taken.
* Entries idle for ``reclaim_idle_s`` belong to dead consumers and are taken over with ``XAUTOCLAIM``.
* A live worker keeps the entries it works on fresh (``XCLAIM ... JUSTID`` to itself, which resets their
  idle time without counting a delivery), and only while it still owns them (checked inside a Lua script),
  so a live worker is never robbed and never steals back a job someone else took over.
* The PEL's delivery counter is the job's ``attempt``; past ``max_attempts`` the job is dead-lettered.
* A delivery carries every field of its entry, in order (:data:`ENTRY_FIELDS_LUA`): a stream entry may
  repeat a field name, and redis-py's stream replies keep only the last value of each name.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import redis
from redis.commands.core import Script

from schemas.keys import GROUP, Keys, entry_ref, split_entry_ref

MULTI_SHARD_BLOCK_MS = 100
"""Longest blocking read of an idle worker of a sharded queue: it waits on one shard only (a blocking read
of several slots is refused by a cluster), so it comes back soon to look at the others."""

KEEP_FRESH_LUA = """
-- KEYS[1] jobs stream; ARGV[1] group, ARGV[2] consumer, ARGV[3..] entry ids held by the consumer.
-- Resets the idle time of the entries the consumer still owns. Returns {taken, vanished}: the ids another
-- consumer holds now (taken over after this worker looked dead), and those no consumer holds (acked by
-- another delivery, deleted, or gone with the data of a Redis that restarted empty: then the group itself
-- may be missing, and every id is vanished).
local taken, vanished = {}, {}
for i = 3, #ARGV do
  local p = redis.pcall('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1)
  if p['err'] or #p == 0 then
    vanished[#vanished + 1] = ARGV[i]
  elseif p[1][2] == ARGV[2] then
    redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[i], 'JUSTID')
  else
    taken[#taken + 1] = ARGV[i]
  end
end
return {taken, vanished}
"""

RELEASE_LUA = """
-- KEYS[1] jobs stream; ARGV[1] group, ARGV[2] consumer, ARGV[3] idle ms to set,
-- then pairs (entry id, delivery count to set, or '' to keep it).
-- Makes entries this worker gives up on immediately claimable by others (idle time set far in the past).
local n = 0
for i = 4, #ARGV, 2 do
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1)
  if #p == 1 and p[1][2] == ARGV[2] then
    if ARGV[i + 1] ~= '' then
      redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[i], 'IDLE', ARGV[3],
                 'RETRYCOUNT', ARGV[i + 1], 'JUSTID')
    else
      redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[i], 'IDLE', ARGV[3], 'JUSTID')
    end
    n = n + 1
  end
end
return n
"""

AUTOCLAIM_IDS_LUA = """
-- XAUTOCLAIM ... JUSTID with its reply shape kept the same on Redis 6.2 and 7: {next cursor, ids}.
local r = redis.call('XAUTOCLAIM', KEYS[1], ARGV[1], ARGV[2], ARGV[3], ARGV[4], 'COUNT', ARGV[5], 'JUSTID')
return {r[1], r[2]}
"""


REWIND_LUA = """
-- KEYS[1] jobs stream; ARGV[1] tolerance (ms) an entry id may be ahead of the Redis clock.
-- After a producer added an entry with an id far in the future, every later automatic id comes after it,
-- so every later job would look like it came from the future too. Once no such entry is left in the stream
-- (they were answered and deleted), move the stream's last id, and each group's last-delivered id that is
-- past it, back to the newest entry (or now): automatic ids follow the clock again. Returns 1 if it
-- rewound, 0 if the stream's ids were not ahead, -1 if an entry ahead of the clock is still there.
local function parse(id)
  local dash = string.find(id, '-', 1, true)
  return tonumber(string.sub(id, 1, dash - 1)), tonumber(string.sub(id, dash + 1))
end
local function after(a, b)
  local ams, aseq = parse(a)
  local bms, bseq = parse(b)
  return ams > bms or (ams == bms and aseq > bseq)
end
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local now_id = string.format('%d-0', now_ms)
local limit = string.format('%d-0', now_ms + tonumber(ARGV[1]))
local info = redis.call('XINFO', 'STREAM', KEYS[1])
local last = nil
for i = 1, #info, 2 do
  if info[i] == 'last-generated-id' then
    last = info[i + 1]
  end
end
if last == nil or not after(last, limit) then
  return 0
end
local target = now_id
local top = redis.call('XREVRANGE', KEYS[1], '+', '-', 'COUNT', 1)
if #top > 0 then
  if after(top[1][1], limit) then
    return -1  -- an entry from the future is still there: not yet
  end
  if after(top[1][1], target) then
    target = top[1][1]
  end
end
redis.call('XSETID', KEYS[1], target)
for _, group in ipairs(redis.call('XINFO', 'GROUPS', KEYS[1])) do
  local name, delivered = nil, nil
  for i = 1, #group, 2 do
    if group[i] == 'name' then
      name = group[i + 1]
    elseif group[i] == 'last-delivered-id' then
      delivered = group[i + 1]
    end
  end
  if name ~= nil and delivered ~= nil and after(delivered, target) then
    redis.call('XGROUP', 'SETID', KEYS[1], name, target)
  end
end
return 1
"""


ENTRY_FIELDS_LUA = """
-- KEYS[1] jobs stream; ARGV entry ids. Returns, per id, the entry's field/value strings, every one and in
-- order, or an empty list when the entry is gone. redis-py parses the entries of XREADGROUP, XCLAIM and
-- XRANGE replies into a dict (RESP2 and RESP3, with or without hiredis, on one server and on a cluster),
-- which keeps the last value of a repeated field name only: an entry with two `job` fields would run the
-- second job and silently drop the first. A script's reply is passed on as Redis sent it.
local out = {}
for i = 1, #ARGV do
  local e = redis.call('XRANGE', KEYS[1], ARGV[i], ARGV[i])
  if #e == 1 then
    out[i] = e[1][2]
  else
    out[i] = {}
  end
end
return out
"""

READ_NEW_LUA = """
-- KEYS[1] jobs stream; ARGV[1] group, ARGV[2] consumer, ARGV[3] count. XREADGROUP ... > without BLOCK, its
-- reply passed on as Redis gave it, so every field of each entry arrives in order in the one round trip of
-- the plain command (see ENTRY_FIELDS_LUA). A script cannot block: the waiting read stays a command.
return redis.call('XREADGROUP', 'GROUP', ARGV[1], ARGV[2], 'COUNT', ARGV[3], 'STREAMS', KEYS[1], '>')
"""

Fields = list[tuple[str, str]]
"""A stream entry's field/value pairs, every one and in the order the producer wrote them."""


@dataclass
class Delivery:
    """One delivery of a stream entry to this worker; ``fields`` (:data:`Fields`) is None when the entry
    was deleted.

    ``entry_id`` is the entry's ref (:func:`schemas.keys.entry_ref`): the stream entry id on shard 0,
    ``<id>@<k>`` on shard ``k``."""

    entry_id: str
    fields: Fields | None
    attempt: int


def ensure_group(client: Any, keys: Keys) -> None:
    """Create every job stream of the queue and its ``workers`` group (reading from the start) unless they
    exist."""
    for stream in keys.job_streams:
        try:
            client.xgroup_create(stream, GROUP, id="0", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise


def by_shard(refs: Iterable[str]) -> dict[int, list[str]]:
    """Entry refs grouped by shard, as plain entry ids (each shard is its own stream, often its own slot)."""
    grouped: dict[int, list[str]] = {}
    for ref in refs:
        shard, entry_id = split_entry_ref(ref)
        grouped.setdefault(shard, []).append(entry_id)
    return grouped


class Reclaimer:
    """Pending-entry bookkeeping for one consumer (a worker) of one queue, over every shard of it.

    Each shard is a stream of its own (on Redis Cluster, maybe on another node), so every command names one
    shard; entry refs say which."""

    def __init__(self, client: Any, keys: Keys, consumer: str, *, reclaim_idle_s: float) -> None:
        self.client = client
        self.keys = keys
        self.consumer = consumer
        self.min_idle_ms = int(reclaim_idle_s * 1000)
        self._cursors = ["0-0"] * keys.shards  # XAUTOCLAIM cursor per shard
        self._next_autoclaim_shard = 0
        self._keep_fresh: Script = client.register_script(KEEP_FRESH_LUA)
        self._release: Script = client.register_script(RELEASE_LUA)
        self._autoclaim_ids: Script = client.register_script(AUTOCLAIM_IDS_LUA)
        self._rewind: Script = client.register_script(REWIND_LUA)
        self._entry_fields: Script = client.register_script(ENTRY_FIELDS_LUA)
        self._read_new: Script = client.register_script(READ_NEW_LUA)

    def _counts(self, shard: int, ids: list[str]) -> dict[str, int]:
        """Delivery counts of entries of one shard (one round trip)."""
        if not ids:
            return {}
        stream = self.keys.jobs_shard(shard)
        pipe = self.client.pipeline(transaction=False)
        for entry_id in ids:
            pipe.xpending_range(stream, GROUP, min=entry_id, max=entry_id, count=1)
        counts: dict[str, int] = {}
        for entry_id, rows in zip(ids, pipe.execute(), strict=True):
            counts[entry_id] = int(rows[0]["times_delivered"]) if rows else 1
        return counts

    def _all_fields(self, shard: int, entries: list[Any]) -> list[tuple[str, Fields | None]]:
        """(entry id, every field of the entry in order, or None when it was deleted) of each entry of a
        stream reply, read again through :data:`ENTRY_FIELDS_LUA` (one round trip) since redis-py's reply
        kept one value per field name. An entry deleted between the two reads is deleted."""
        read = [(_s(e[0]), _present(e[1])) for e in entries if e and e[0] is not None]
        present = [entry_id for entry_id, here in read if here]
        fetched: dict[str, Fields | None] = {}
        if present:
            rows = self._entry_fields(keys=[self.keys.jobs_shard(shard)], args=present)
            fetched = {entry_id: _pairs(row) for entry_id, row in zip(present, rows, strict=True)}
        return [(entry_id, fetched.get(entry_id)) for entry_id, _ in read]

    def _deliveries(self, shard: int, entries: list[Any]) -> list[Delivery]:
        parsed = self._all_fields(shard, entries)
        counts = self._counts(shard, [entry_id for entry_id, _ in parsed])
        return [Delivery(entry_ref(shard, entry_id), fields, counts.get(entry_id, 1)) for entry_id, fields in parsed]

    def read_new(self, count: int, block_ms: int | None, shards: Sequence[int] | None = None) -> list[Delivery]:
        """Entries never delivered to anyone (``>``); attempt 1. ``shards`` (default: all, in order) are read
        one after the other until ``count`` entries came, so a worker never takes more than its capacity;
        only the first is waited on (``block_ms``) when none had any, since a blocking read of streams in
        different cluster slots is refused."""
        order = list(range(self.keys.shards)) if shards is None else list(shards)
        out: list[Delivery] = []
        for shard in order:
            if len(out) >= count:
                break
            reply: Any = self._read_new(
                keys=[self.keys.jobs_shard(shard)], args=[GROUP, self.consumer, count - len(out)]
            )
            entries = reply[0][1] if reply else []  # a new entry always has its fields
            out.extend(Delivery(entry_ref(shard, _s(e[0])), _pairs(e[1]), 1) for e in entries)
        if not out and block_ms is not None and order:
            if self.keys.shards > 1:
                block_ms = min(block_ms, MULTI_SHARD_BLOCK_MS)
            reply = self.client.xreadgroup(
                GROUP, self.consumer, {self.keys.jobs_shard(order[0]): ">"}, count=count, block=block_ms
            )
            out.extend(self._new(order[0], reply))  # an idle worker's wake-up: its fields are read again
        return out

    def server_time(self) -> float:
        """The Redis server's clock (entry ids are stamped with it)."""
        secs, micros = self.client.time()
        return float(secs) + float(micros) / 1e6

    def oldest_unread_age_s(self, shard: int, now: float) -> float:
        """How long the oldest entry of ``shard`` not yet delivered to the group has waited (0 when none)."""
        stream = self.keys.jobs_shard(shard)
        try:
            groups: Any = self.client.xinfo_groups(stream)
        except redis.ResponseError:
            return 0.0  # no stream or group yet: nothing waits
        delivered = next((_s(g["last-delivered-id"]) for g in groups if _s(g["name"]) == GROUP), "0-0")
        first: Any = self.client.xrange(stream, min="(" + delivered, count=1)
        if not first:
            return 0.0
        return max(0.0, now - int(_s(first[0][0]).split("-", 1)[0]) / 1000.0)

    def _new(self, shard: int, reply: Any) -> list[Delivery]:
        out: list[Delivery] = []
        for _stream, entries in reply or []:
            out.extend(Delivery(entry_ref(shard, e), fields, 1) for e, fields in self._all_fields(shard, entries))
        return out

    def read_own_pending(self, after: str, count: int) -> tuple[list[Delivery], str | None]:
        """The next ``count`` entries of this consumer's own PEL after entry ref ``after`` (start: ``"0"``).

        Returns the deliveries and the ref to continue from, or None once the PEL of every shard has been
        walked. Reading history counts as a delivery (the attempt goes up): the previous process may have
        died because of the job.
        """
        shard, entry_id = split_entry_ref(after)
        reply: Any = self.client.xreadgroup(GROUP, self.consumer, {self.keys.jobs_shard(shard): entry_id}, count=count)
        entries = reply[0][1] if reply else []
        if not entries:
            next_shard = shard + 1
            return [], (entry_ref(next_shard, "0") if next_shard < self.keys.shards else None)
        deliveries = self._deliveries(shard, entries)
        return deliveries, entry_ref(shard, _s(entries[-1][0]))

    def autoclaim(self, count: int) -> list[Delivery]:
        """Take over up to ``count`` entries idle for ``reclaim_idle_s`` (their consumer is presumed dead),
        from each shard in turn (one shard a call: reclaim runs every few seconds).

        ``XAUTOCLAIM ... JUSTID`` picks them (without counting a delivery), then ``XCLAIM`` counts the
        delivery and fetches each body. Entries deleted meanwhile (their job already ended) are acked:
        Redis 6.2 would otherwise leave them in the PEL with no id to act on.
        """
        out: list[Delivery] = []
        for _ in range(self.keys.shards):
            shard = self._next_autoclaim_shard
            self._next_autoclaim_shard = (shard + 1) % self.keys.shards
            out += self._autoclaim_shard(shard, count - len(out))
            if len(out) >= count:
                break
        return out

    def _autoclaim_shard(self, shard: int, count: int) -> list[Delivery]:
        stream = self.keys.jobs_shard(shard)
        reply: Any = self._autoclaim_ids(
            keys=[stream], args=[GROUP, self.consumer, self.min_idle_ms, self._cursors[shard], count]
        )
        self._cursors[shard] = _s(reply[0]) if reply and reply[0] else "0-0"
        ids = [_s(x) for x in reply[1]]
        if not ids:
            return []
        pipe = self.client.pipeline(transaction=False)
        for entry_id in ids:
            pipe.xclaim(stream, GROUP, self.consumer, 0, [entry_id])
        entries, gone = [], []
        for entry_id, claimed in zip(ids, pipe.execute(), strict=True):
            if claimed and claimed[0] and claimed[0][0] is not None and _present(claimed[0][1]):
                entries.append(claimed[0])
            else:
                gone.append(entry_id)
        if gone:
            self.client.xack(stream, GROUP, *gone)
        return self._deliveries(shard, entries)

    def keep_fresh(self, entry_refs: list[str]) -> tuple[list[str], list[str]]:
        """Reset the idle time of entries still owned; return the refs of those no longer owned by this
        worker, as (taken: another consumer holds them, vanished: none does; :data:`KEEP_FRESH_LUA`). One
        script per shard: a script's keys must share a slot."""
        taken: list[str] = []
        vanished: list[str] = []
        for shard, ids in by_shard(entry_refs).items():
            reply = self._keep_fresh(keys=[self.keys.jobs_shard(shard)], args=[GROUP, self.consumer, *ids])
            taken += [entry_ref(shard, _s(x)) for x in reply[0] or []]
            vanished += [entry_ref(shard, _s(x)) for x in reply[1] or []]
        return taken, vanished

    def retry(self, ref: str) -> Delivery | None:
        """Count a new delivery of an entry this worker holds (after a failed attempt); None if gone."""
        shard, entry_id = split_entry_ref(ref)
        entries: Any = self.client.xclaim(self.keys.jobs_shard(shard), GROUP, self.consumer, 0, [entry_id])
        if not entries or entries[0] is None or entries[0][0] is None or not _present(entries[0][1]):
            return None
        deliveries = self._deliveries(shard, entries)
        return deliveries[0] if deliveries else None

    def release(self, entries: dict[str, int | None]) -> int:
        """Hand entries back to the group, claimable by any worker at once.

        ``entries`` maps entry ref to the delivery count to set (so a job released before it produced
        anything does not use up an attempt) or None to keep the count.
        """
        released = 0
        grouped: dict[int, list[Any]] = {}
        for ref, count in entries.items():
            shard, entry_id = split_entry_ref(ref)
            grouped.setdefault(shard, []).extend([entry_id, "" if count is None else max(count, 0)])
        for shard, pairs in grouped.items():
            args: list[Any] = [GROUP, self.consumer, 10 * self.min_idle_ms + 3_600_000, *pairs]
            released += int(self._release(keys=[self.keys.jobs_shard(shard)], args=args))
        return released

    def rewind_future_ids(self, tolerance_s: float) -> tuple[bool, bool]:
        """Bring each shard's automatic ids back to the clock once the entries ahead of it are gone (see
        :data:`REWIND_LUA`): (rewound any, some shard still has an entry ahead of the clock)."""
        outcomes = [
            int(self._rewind(keys=[stream], args=[int(tolerance_s * 1000)])) for stream in self.keys.job_streams
        ]
        return 1 in outcomes, -1 in outcomes

    def forget_dead_consumers(self, live: set[str]) -> list[str]:
        """Delete consumers with no pending entries and no heartbeat (``live``), keeping the group tidy."""
        removed = []
        for stream in self.keys.job_streams:
            for info in self.client.xinfo_consumers(stream, GROUP):
                name = _s(info["name"])
                if name == self.consumer or name in live or int(info["pending"]) > 0:
                    continue
                if int(info.get("idle", 0)) < self.min_idle_ms:
                    continue
                self.client.xgroup_delconsumer(stream, GROUP, name)
                removed.append(name)
        return removed


def _s(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _present(parsed: Any) -> bool:
    """Whether an entry of a parsed stream reply is still there (a deleted one has nil fields on Redis 6.2
    claims, empty ones in history reads)."""
    return bool(parsed)


def _pairs(flat: Any) -> Fields | None:
    """A flat field/value list as pairs, or None for an entry that is gone (an empty list)."""
    if not flat:
        return None
    return [(_s(flat[i]), _s(flat[i + 1])) for i in range(0, len(flat) - 1, 2)]
