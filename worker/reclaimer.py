"""At-least-once delivery on top of the consumer group's pending entries list (PEL).

* A worker first re-reads its own pending entries (``XREADGROUP ... 0``): jobs a previous process with the
  same name had taken.
* Entries idle for ``reclaim_idle_s`` belong to dead consumers and are taken over with ``XAUTOCLAIM``.
* A live worker keeps the entries it works on fresh (``XCLAIM ... JUSTID`` to itself, which resets their
  idle time without counting a delivery), and only while it still owns them (checked inside a Lua script),
  so a live worker is never robbed and never steals back a job someone else took over.
* The PEL's delivery counter is the job's ``attempt``; past ``max_attempts`` the job is dead-lettered.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import redis
from redis.commands.core import Script

from schemas.keys import GROUP, Keys

KEEP_FRESH_LUA = """
-- KEYS[1] jobs stream; ARGV[1] group, ARGV[2] consumer, ARGV[3..] entry ids held by the consumer.
-- Resets the idle time of the entries the consumer still owns; returns the ids it no longer owns
-- (acked by another delivery, or taken over after this worker looked dead).
local lost = {}
for i = 3, #ARGV do
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1)
  if #p == 1 and p[1][2] == ARGV[2] then
    redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[i], 'JUSTID')
  else
    lost[#lost + 1] = ARGV[i]
  end
end
return lost
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
-- (they were dead-lettered), move the stream's last id, and each group's last-delivered id that is past
-- it, back to the newest entry (or now): automatic ids follow the clock again. Returns 1 if it rewound.
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
    return 0  -- an entry from the future is still there: not yet
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


@dataclass
class Delivery:
    """One delivery of a stream entry to this worker; ``fields`` is None when the entry was deleted."""

    entry_id: str
    fields: dict[str, str] | None
    attempt: int


def ensure_group(client: redis.Redis, keys: Keys) -> None:
    """Create the stream and the ``workers`` group (reading from the start) unless they exist."""
    try:
        client.xgroup_create(keys.jobs, GROUP, id="0", mkstream=True)
    except redis.ResponseError as exc:
        if "BUSYGROUP" not in str(exc):
            raise


class Reclaimer:
    """Pending-entry bookkeeping for one consumer (a worker) of one queue."""

    def __init__(self, client: redis.Redis, keys: Keys, consumer: str, *, reclaim_idle_s: float) -> None:
        self.client = client
        self.keys = keys
        self.consumer = consumer
        self.min_idle_ms = int(reclaim_idle_s * 1000)
        self._cursor = "0-0"
        self._keep_fresh: Script = client.register_script(KEEP_FRESH_LUA)
        self._release: Script = client.register_script(RELEASE_LUA)
        self._autoclaim_ids: Script = client.register_script(AUTOCLAIM_IDS_LUA)
        self._rewind: Script = client.register_script(REWIND_LUA)

    def _counts(self, ids: list[str]) -> dict[str, int]:
        """Delivery counts of entries (one round trip)."""
        if not ids:
            return {}
        pipe = self.client.pipeline(transaction=False)
        for entry_id in ids:
            pipe.xpending_range(self.keys.jobs, GROUP, min=entry_id, max=entry_id, count=1)
        counts: dict[str, int] = {}
        for entry_id, rows in zip(ids, pipe.execute(), strict=True):
            counts[entry_id] = int(rows[0]["times_delivered"]) if rows else 1
        return counts

    def _deliveries(self, entries: list[Any]) -> list[Delivery]:
        parsed = [(_s(e[0]), _fields(e[1])) for e in entries if e and e[0] is not None]
        counts = self._counts([entry_id for entry_id, _ in parsed])
        return [Delivery(entry_id, fields, counts.get(entry_id, 1)) for entry_id, fields in parsed]

    def read_new(self, count: int, block_ms: int | None) -> list[Delivery]:
        """Entries never delivered to anyone (``>``); attempt 1."""
        reply: Any = self.client.xreadgroup(GROUP, self.consumer, {self.keys.jobs: ">"}, count=count, block=block_ms)
        out: list[Delivery] = []
        for _stream, entries in reply or []:
            out.extend(Delivery(_s(e[0]), _fields(e[1]), 1) for e in entries)
        return out

    def read_own_pending(self, after: str, count: int) -> tuple[list[Delivery], str | None]:
        """The next ``count`` entries of this consumer's own PEL after id ``after``.

        Returns the deliveries and the cursor to continue from, or None once the PEL has been walked.
        Reading history counts as a delivery (the attempt goes up): the previous process may have died
        because of the job.
        """
        reply: Any = self.client.xreadgroup(GROUP, self.consumer, {self.keys.jobs: after}, count=count)
        entries = reply[0][1] if reply else []
        if not entries:
            return [], None
        deliveries = self._deliveries(entries)
        return deliveries, _s(entries[-1][0])

    def autoclaim(self, count: int) -> list[Delivery]:
        """Take over up to ``count`` entries idle for ``reclaim_idle_s`` (their consumer is presumed dead).

        ``XAUTOCLAIM ... JUSTID`` picks them (without counting a delivery), then ``XCLAIM`` counts the
        delivery and fetches each body. Entries deleted meanwhile (their job already ended) are acked:
        Redis 6.2 would otherwise leave them in the PEL with no id to act on.
        """
        reply: Any = self._autoclaim_ids(
            keys=[self.keys.jobs], args=[GROUP, self.consumer, self.min_idle_ms, self._cursor, count]
        )
        self._cursor = _s(reply[0]) if reply and reply[0] else "0-0"
        ids = [_s(x) for x in reply[1]]
        if not ids:
            return []
        pipe = self.client.pipeline(transaction=False)
        for entry_id in ids:
            pipe.xclaim(self.keys.jobs, GROUP, self.consumer, 0, [entry_id])
        entries, gone = [], []
        for entry_id, claimed in zip(ids, pipe.execute(), strict=True):
            if claimed and claimed[0] and claimed[0][0] is not None and _fields(claimed[0][1]) is not None:
                entries.append(claimed[0])
            else:
                gone.append(entry_id)
        if gone:
            self.client.xack(self.keys.jobs, GROUP, *gone)
        return self._deliveries(entries)

    def keep_fresh(self, entry_ids: list[str]) -> list[str]:
        """Reset the idle time of entries still owned; return those no longer owned by this worker."""
        if not entry_ids:
            return []
        lost = self._keep_fresh(keys=[self.keys.jobs], args=[GROUP, self.consumer, *entry_ids])
        return [_s(x) for x in lost or []]

    def retry(self, entry_id: str) -> Delivery | None:
        """Count a new delivery of an entry this worker holds (after a failed attempt); None if gone."""
        entries: Any = self.client.xclaim(self.keys.jobs, GROUP, self.consumer, 0, [entry_id])
        if not entries or entries[0] is None or entries[0][0] is None or _fields(entries[0][1]) is None:
            return None
        deliveries = self._deliveries(entries)
        return deliveries[0] if deliveries else None

    def release(self, entries: dict[str, int | None]) -> int:
        """Hand entries back to the group, claimable by any worker at once.

        ``entries`` maps entry id to the delivery count to set (so a job released before it produced
        anything does not use up an attempt) or None to keep the count.
        """
        if not entries:
            return 0
        args: list[Any] = [GROUP, self.consumer, 10 * self.min_idle_ms + 3_600_000]
        for entry_id, count in entries.items():
            args += [entry_id, "" if count is None else max(count, 0)]
        return int(self._release(keys=[self.keys.jobs], args=args))

    def rewind_future_ids(self, tolerance_s: float) -> bool:
        """Bring the stream's automatic ids back to the clock after entries with future ids were answered
        (see :data:`REWIND_LUA`); True if it did."""
        return bool(self._rewind(keys=[self.keys.jobs], args=[int(tolerance_s * 1000)]))

    def forget_dead_consumers(self, live: set[str]) -> list[str]:
        """Delete consumers with no pending entries and no heartbeat (``live``), keeping the group tidy."""
        removed = []
        for info in self.client.xinfo_consumers(self.keys.jobs, GROUP):
            name = _s(info["name"])
            if name == self.consumer or name in live or int(info["pending"]) > 0:
                continue
            if int(info.get("idle", 0)) < self.min_idle_ms:
                continue
            self.client.xgroup_delconsumer(self.keys.jobs, GROUP, name)
            removed.append(name)
        return removed


def _s(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _fields(raw: Any) -> dict[str, str] | None:
    """Entry fields, or None for a deleted entry (nil on Redis 6.2 claims, empty in history reads)."""
    if not raw:
        return None
    return {_s(k): _s(v) for k, v in dict(raw).items()}
