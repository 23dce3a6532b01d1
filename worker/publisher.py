"""Writes what a worker has to say about jobs: token events, and exactly one terminal event per job.

A job reaches exactly its own keys: its result key, and its reply stream, which a worker writes only if the
stream does not exist yet or was created for the same job stream entry (each reply entry names its job entry
in field ``entry``). So a job can never write into another job's stream, nor into another copy's of the same
id, nor trim or expire a key pagedq did not create for it (:data:`OWNED_LUA`).

Token events go through one small script per reply stream (the ownership check, the appends, then a
safety TTL of ``result_ttl_s`` on a stream that has none: the stream is bounded even if no terminal event
ever reaches it), all of one engine step in one MULTI/EXEC round trip. Terminal events go through one Lua
script that, atomically,

1. acks (and deletes) the job's stream entry,
2. stops if ``<ns>:{<id>}:result`` already exists (another delivery of the job already ended it), after
   the dead letter of an unusable payload that reused the id, and after expiring the reply stream
   ``reply_ttl_s`` later if this delivery owns it (a copy of the id that streamed tokens but lost the race
   to end the job: nothing else would ever end its stream's life sooner than the safety TTL),
3. stores the event at ``<ns>:{<id>}:result`` with a TTL,
4. appends it to the reply stream if the job owns it, which then expires ``reply_ttl_s`` later,
5. appends a dead-letter entry when asked (the dead-letter stream is capped with ``MAXLEN ~``).

So a crash can never leave a job acked without its result, nor produce two results: whichever delivery of a
job finishes first wins, later ones are acked silently. The script is idempotent, which makes it safe to
retry after a lost reply. Every reply stream a job owns thus ends with a TTL: ``reply_ttl_s`` after the
job's (or its copy's) terminal write, at most ``result_ttl_s`` after its first token event otherwise (a
terminal degraded to skip the reply stream, a worker gone for good, a cluster whose reply stream lies in
another slot than the result key).

One refused command never holds the others back: a transaction that Redis aborts as a whole (a command
refused when queued, e.g. by an ACL) is resent one unit at a time (nothing of it was applied), and the units
that fail alone are reported back to the caller, which decides their fate (:mod:`worker.sender`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import redis
from redis.commands.core import Script
from redis.crc import key_slot

from schemas.jobs import DeadLetter
from schemas.keys import EVENT_FIELD, GROUP, OWNER_FIELD, Keys, split_entry_ref
from worker.redis_url import is_cluster_client

OWNED_LUA = f"""
-- Whether the reply stream KEYS[n] may be written for job entry `entry`: it does not exist, or it is a
-- stream whose first entry names that job entry. An empty stream someone else made is not ours either.
local function owned(key, entry)
  local kind = redis.call('TYPE', key)['ok']
  if kind == 'none' then
    return true
  end
  if kind ~= 'stream' then
    return false
  end
  local first = redis.call('XRANGE', key, '-', '+', 'COUNT', 1)
  if #first == 0 then
    return false
  end
  local fields = first[1][2]
  for i = 1, #fields, 2 do
    if fields[i] == '{OWNER_FIELD}' then
      return fields[i + 1] == entry
    end
  end
  return false
end
"""

TOKENS_LUA = (
    OWNED_LUA
    + f"""
-- KEYS[1] reply stream; ARGV[1] job entry id, ARGV[2] reply MAXLEN, ARGV[3] safety TTL (s), ARGV[4..] event
-- JSONs. Returns the number of events appended, or -1 when the stream is not this job entry's.
if not owned(KEYS[1], ARGV[1]) then
  return -1
end
for i = 4, #ARGV do
  redis.call('XADD', KEYS[1], 'MAXLEN', '~', ARGV[2], '*', '{EVENT_FIELD}', ARGV[i], '{OWNER_FIELD}', ARGV[1])
end
-- A stream this entry owns either was just created here or already got its TTL from here (or from the
-- terminal write, whose shorter reply TTL must not be lengthened again): only one without a TTL gets one.
if redis.call('TTL', KEYS[1]) == -1 then
  redis.call('EXPIRE', KEYS[1], ARGV[3])
end
return #ARGV - 3
"""
)

TERMINAL_LUA = (
    OWNED_LUA
    + f"""
-- KEYS[1] jobs stream, KEYS[2] result key, KEYS[3] reply stream, KEYS[4] dead-letter stream
-- ARGV[1] group, ARGV[2] entry id, ARGV[3] entry ref (the reply stream's owner), ARGV[4] event JSON,
-- ARGV[5] result TTL (s), ARGV[6] reply TTL (s), ARGV[7] reply MAXLEN, ARGV[8] '1' to append to the reply
-- stream, ARGV[9] dead-letter MAXLEN, ARGV[10] number of dead-letter field/value strings that follow
local acked = 0
if ARGV[2] ~= '' then
  acked = redis.call('XACK', KEYS[1], ARGV[1], ARGV[2])
  redis.call('XDEL', KEYS[1], ARGV[2])
end
local n = tonumber(ARGV[10])
if redis.call('EXISTS', KEYS[2]) == 1 then
  -- The job already ended. An unusable payload reusing its id still leaves its one dead letter, written
  -- by whichever write acked its entry (a retried write finds it acked, and adds none).
  if n > 0 and acked == 1 then
    redis.call('XADD', KEYS[4], 'MAXLEN', '~', ARGV[9], '*', unpack(ARGV, 11, 10 + n))
  end
  -- Another copy of the id ended the job, but the reply stream may hold this copy's token events: it
  -- expires as if this copy had ended the job (never a stream this entry does not own, and never when
  -- the write was degraded to leave the reply stream alone).
  if ARGV[8] == '1' and owned(KEYS[3], ARGV[3]) then
    redis.call('EXPIRE', KEYS[3], ARGV[6])
  end
  return 0
end
redis.call('SET', KEYS[2], ARGV[4], 'EX', ARGV[5])
if ARGV[8] == '1' and owned(KEYS[3], ARGV[3]) then
  redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[7], '*', '{EVENT_FIELD}', ARGV[4], '{OWNER_FIELD}', ARGV[3])
  redis.call('EXPIRE', KEYS[3], ARGV[6])
end
if n > 0 then
  redis.call('XADD', KEYS[4], 'MAXLEN', '~', ARGV[9], '*', unpack(ARGV, 11, 10 + n))
end
return 1
"""
)

TERMINAL_RESULT_LUA = (
    OWNED_LUA
    + f"""
-- On a cluster, the job-slot half of a terminal write (the entry half is ENTRY_DONE_LUA, sent after it).
-- KEYS[1] result key, KEYS[2] (when in the same slot) reply stream; ARGV[1] entry ref (the reply stream's
-- owner), ARGV[2] event JSON, ARGV[3] result TTL (s), ARGV[4] reply TTL (s), ARGV[5] reply MAXLEN,
-- ARGV[6] '1' to append to the reply stream. Returns 1 if it ended the job, 0 if a result existed.
if redis.call('EXISTS', KEYS[1]) == 1 then
  -- As in TERMINAL_LUA: this copy's own reply stream expires as if it had ended the job. (A reply stream in
  -- another slot is left to the safety TTL its token events gave it.)
  if #KEYS > 1 and ARGV[6] == '1' and owned(KEYS[2], ARGV[1]) then
    redis.call('EXPIRE', KEYS[2], ARGV[4])
  end
  return 0
end
redis.call('SET', KEYS[1], ARGV[2], 'EX', ARGV[3])
if #KEYS > 1 and ARGV[6] == '1' and owned(KEYS[2], ARGV[1]) then
  redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[5], '*', '{EVENT_FIELD}', ARGV[2], '{OWNER_FIELD}', ARGV[1])
  redis.call('EXPIRE', KEYS[2], ARGV[4])
end
return 1
"""
)

REPLY_EVENT_LUA = (
    OWNED_LUA
    + f"""
-- On a cluster, a terminal event for a granted reply_to in another slot than the job's keys, sent once
-- TERMINAL_RESULT_LUA ended the job. KEYS[1] reply stream; ARGV[1] entry ref, ARGV[2] event JSON,
-- ARGV[3] reply TTL (s), ARGV[4] reply MAXLEN.
if not owned(KEYS[1], ARGV[1]) then
  return 0
end
redis.call('XADD', KEYS[1], 'MAXLEN', '~', ARGV[4], '*', '{EVENT_FIELD}', ARGV[2], '{OWNER_FIELD}', ARGV[1])
redis.call('EXPIRE', KEYS[1], ARGV[3])
return 1
"""
)

ENTRY_DONE_LUA = """
-- On a cluster, the entry half of a terminal write, sent only after its result half was confirmed (so an
-- entry is never acked without its result). KEYS[1] jobs stream, KEYS[2] its dead-letter stream (same
-- slot); ARGV[1] group, ARGV[2] entry id, ARGV[3] '1' if the result half ended the job, ARGV[4] dead-letter
-- MAXLEN, ARGV[5] number of dead-letter field/value strings that follow. The dead letter goes out with the
-- ack that removed the entry from the group, so a retried write adds none.
local acked = 0
if ARGV[2] ~= '' then
  acked = redis.call('XACK', KEYS[1], ARGV[1], ARGV[2])
  redis.call('XDEL', KEYS[1], ARGV[2])
end
local n = tonumber(ARGV[5])
if n > 0 and (acked == 1 or (ARGV[2] == '' and ARGV[3] == '1')) then
  redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[4], '*', unpack(ARGV, 6, 5 + n))
end
return 1
"""

DEAD_ONLY_LUA = """
-- A job without a usable id: no result key, no reply; only a dead letter and the ack.
-- KEYS[1] jobs stream, KEYS[2] dead-letter stream; ARGV[1] group, ARGV[2] entry id, ARGV[3] dead-letter
-- MAXLEN, ARGV[4..] fields. Exactly one dead letter per entry: none once the entry is no longer pending.
if redis.call('XACK', KEYS[1], ARGV[1], ARGV[2]) == 0 then
  return 0
end
redis.call('XDEL', KEYS[1], ARGV[2])
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[3], '*', unpack(ARGV, 4))
return 1
"""

ACK_LUA = """
-- A delivery that needs no answer (its job already has a result, or its entry is gone).
redis.call('XACK', KEYS[1], ARGV[1], ARGV[2])
redis.call('XDEL', KEYS[1], ARGV[2])
return 1
"""


@dataclass
class TokenWrite:
    """Token events of one job for one reply stream (one step's worth), written together or not at all."""

    reply_to: str
    entry_id: str  # the job stream entry they belong to: the reply stream's owner
    job_id: str
    payloads: list[str]
    written: bool | None = None  # after flush: False if the stream belongs to another job entry


@dataclass
class Terminal:
    """A terminal write waiting to go out (kept until Redis confirmed it, across reconnects).

    ``payload`` is the event's JSON, made when the terminal is queued so that an event that cannot be
    serialised fails its own job there and then, never a flush (see ``HeldJobs.end``)."""

    entry_id: str
    job_id: str
    reply_to: str
    payload: str
    write_reply: bool = True
    dead: DeadLetter | None = None
    written: bool | None = None  # after flush: True if it ended the job, False if a result already existed
    failures: int = 0  # flushes that Redis refused (the sender retries, then degrades)
    result_written: bool | None = None  # on a cluster: the result half's answer, once Redis confirmed it


@dataclass
class DeadOnly:
    """The dead letter of an entry with no usable job id (nothing else is written for it)."""

    entry_id: str
    dead: DeadLetter
    failures: int = 0


Unit = TokenWrite | Terminal | DeadOnly | str  # str: an entry id to ack


@dataclass
class Outbox:
    """Everything not yet confirmed by Redis, in order: token events first, then terminal writes."""

    tokens: list[TokenWrite] = field(default_factory=list)
    terminals: list[Terminal] = field(default_factory=list)
    dead_only: list[DeadOnly] = field(default_factory=list)
    acks: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.tokens or self.terminals or self.dead_only or self.acks)

    def add_tokens(self, reply_to: str, entry_id: str, job_id: str, payloads: list[str]) -> None:
        """Queue token events, merged with the job's previous batch if that has not gone out yet."""
        if not payloads:
            return
        last = self.tokens[-1] if self.tokens else None
        if last is not None and last.reply_to == reply_to and last.entry_id == entry_id:
            last.payloads.extend(payloads)
        else:
            self.tokens.append(TokenWrite(reply_to, entry_id, job_id, list(payloads)))

    def units(self) -> list[Unit]:
        return [*self.tokens, *self.terminals, *self.dead_only, *self.acks]

    def clear(self) -> None:
        self.tokens.clear()
        self.terminals.clear()
        self.dead_only.clear()
        self.acks.clear()


class Publisher:
    """Flushes an :class:`Outbox` to Redis in one MULTI/EXEC round trip; on a cluster, where a script's
    keys must share a slot and a transaction cannot span slots, in two pipelined round trips (see
    :meth:`_flush_cluster`)."""

    def __init__(
        self,
        client: redis.Redis,
        keys: Keys,
        *,
        result_ttl_s: int,
        reply_ttl_s: int,
        reply_maxlen: int,
        dead_maxlen: int = 10_000,
    ) -> None:
        self.client = client
        self.keys = keys
        self.result_ttl_s = result_ttl_s
        self.reply_ttl_s = reply_ttl_s
        self.reply_maxlen = reply_maxlen
        self.dead_maxlen = dead_maxlen
        self._tokens: Script = client.register_script(TOKENS_LUA)
        self._terminal: Script = client.register_script(TERMINAL_LUA)
        self._dead_only: Script = client.register_script(DEAD_ONLY_LUA)
        self._ack: Script = client.register_script(ACK_LUA)
        self.cluster = is_cluster_client(client)
        if self.cluster:
            self._terminal_result: Script = client.register_script(TERMINAL_RESULT_LUA)
            self._reply_event: Script = client.register_script(REPLY_EVENT_LUA)
            self._entry_done: Script = client.register_script(ENTRY_DONE_LUA)

    def flush(self, outbox: Outbox) -> list[tuple[Unit, BaseException]]:
        """Write and clear ``outbox``; returns the units Redis refused, each with its error.

        Raises ``redis.ConnectionError``/``TimeoutError`` with the outbox left intact, so the caller can
        retry after reconnecting (terminal writes are idempotent; the token events of a flush are
        all-or-nothing thanks to MULTI/EXEC).
        """
        units = outbox.units()
        if not units:
            return []
        if self.cluster:
            return self._flush_cluster(outbox)
        try:
            results = self._execute(units)
        except redis.ResponseError:
            # Redis refused a command as it was queued (EXECABORT: an ACL, a wrong arity...), so nothing
            # was applied: send each unit alone, and only the guilty ones fail.
            results = self._one_by_one(outbox)
        outbox.clear()
        failed: list[tuple[Unit, BaseException]] = []
        for unit, result in zip(units, results, strict=True):
            if isinstance(result, BaseException):
                failed.append((unit, result))
            elif isinstance(unit, TokenWrite):
                unit.written = not (isinstance(result, int) and result < 0)
            elif isinstance(unit, Terminal):
                unit.written = bool(result)
        return failed

    def _run(self, script: Script, *, keys: list[Any], args: list[Any], client: Any) -> None:
        """Queue a script on a pipeline. On a cluster by its text (EVAL), not its SHA: a replica promoted by
        a failover has never loaded it, and a cluster pipeline does not load a missing script itself."""
        if self.cluster:
            client.execute_command("EVAL", script.script, len(keys), *keys, *args)
        else:
            script(keys=keys, args=args, client=client)

    def _flush_cluster(self, outbox: Outbox) -> list[tuple[Unit, BaseException]]:
        """Two pipelined round trips, each script in one slot: first the token events and each terminal's
        result half (result key + own reply stream: the job's hash tag), then, for terminals whose result
        is confirmed, the entry half (ack + delete + dead letter: the shard's hash tag), dead-only letters
        and acks. So an entry is never acked before its result exists, and the result key still decides
        which delivery ends a job. A connection error leaves in ``outbox`` what was not confirmed; token
        events of the first trip may then go out twice (readers see each event's text once per attempt
        only through the client, which follows the result key: README, "Scaling out")."""
        failed: list[tuple[Unit, BaseException]] = []
        first: list[TokenWrite | Terminal] = [
            *outbox.tokens,
            *(t for t in outbox.terminals if t.result_written is None),
        ]
        if first:
            pipe = self.client.pipeline(transaction=False)
            for unit in first:
                self._queue_first(pipe, unit)
            results = list(pipe.execute(raise_on_error=False))
            for unit, result in zip(first, results, strict=True):
                if isinstance(result, redis.ConnectionError | redis.TimeoutError):
                    raise result
                if isinstance(result, BaseException):
                    failed.append((unit, result))
                    _remove(outbox, unit)
                elif isinstance(unit, TokenWrite):
                    unit.written = not (isinstance(result, int) and result < 0)
                    outbox.tokens.remove(unit)
                else:
                    unit.result_written = bool(result)
        second: list[Unit] = [*outbox.terminals, *outbox.dead_only, *outbox.acks]
        if second:
            pipe = self.client.pipeline(transaction=False)
            for queued in second:
                self._queue_second(pipe, queued)
            results = list(pipe.execute(raise_on_error=False))
            for later, reply in zip(second, _per_unit(second, results), strict=True):
                if isinstance(reply, redis.ConnectionError | redis.TimeoutError):
                    raise reply
                if isinstance(reply, BaseException):
                    failed.append((later, reply))
                elif isinstance(later, Terminal):
                    later.written = bool(later.result_written)
        outbox.clear()
        return failed

    def _queue_first(self, pipe: Any, unit: TokenWrite | Terminal) -> None:
        if isinstance(unit, TokenWrite):
            self._run(self._tokens, keys=[unit.reply_to], args=self._token_args(unit), client=pipe)
            return
        result_key = self.keys.result(unit.job_id)
        same_slot = key_slot(unit.reply_to.encode()) == key_slot(result_key.encode())
        self._run(
            self._terminal_result,
            keys=[result_key, unit.reply_to] if same_slot else [result_key],
            args=[
                unit.entry_id,
                unit.payload,
                self.result_ttl_s,
                self.reply_ttl_s,
                self.reply_maxlen,
                "1" if unit.write_reply else "0",
            ],
            client=pipe,
        )

    def _queue_second(self, pipe: Any, unit: Unit) -> None:
        if not isinstance(unit, Terminal):
            self._queue(pipe, unit)  # dead-only letters and acks: one shard's keys already
            return
        shard, entry_id = split_entry_ref(unit.entry_id)
        result_key = self.keys.result(unit.job_id)
        foreign = key_slot(unit.reply_to.encode()) != key_slot(result_key.encode())
        if unit.result_written and unit.write_reply and foreign:
            args: list[Any] = [unit.entry_id, unit.payload, self.reply_ttl_s, self.reply_maxlen]
            self._run(self._reply_event, keys=[unit.reply_to], args=args, client=pipe)
        dead_fields = _flatten(unit.dead.to_fields()) if unit.dead is not None else []
        self._run(
            self._entry_done,
            keys=[self.keys.jobs_shard(shard), self.keys.dead_shard(shard)],
            args=[
                GROUP,
                entry_id,
                "1" if unit.result_written else "0",
                self.dead_maxlen,
                len(dead_fields),
                *dead_fields,
            ],
            client=pipe,
        )

    def _execute(self, units: Sequence[Unit]) -> list[object]:
        pipe = self.client.pipeline(transaction=True)
        for unit in units:
            self._queue(pipe, unit)
        return list(pipe.execute(raise_on_error=False))

    def _one_by_one(self, outbox: Outbox) -> list[object]:
        """Each unit in its own transaction. A connection error part-way leaves in ``outbox`` exactly the
        units not confirmed yet (the ones confirmed are removed as they are), so nothing is sent twice."""
        results: list[object] = []
        for unit in outbox.units():
            try:
                (result,) = self._execute([unit])
            except redis.ResponseError as exc:
                result = exc
            results.append(result)
            _remove(outbox, unit)
        return results

    def _queue(self, pipe: redis.client.Pipeline, unit: Unit) -> None:
        keys = self.keys
        if isinstance(unit, TokenWrite):
            self._run(self._tokens, keys=[unit.reply_to], args=self._token_args(unit), client=pipe)
        elif isinstance(unit, Terminal):
            shard, entry_id = split_entry_ref(unit.entry_id)
            dead_fields = _flatten(unit.dead.to_fields()) if unit.dead is not None else []
            self._run(
                self._terminal,
                keys=[keys.jobs_shard(shard), keys.result(unit.job_id), unit.reply_to, keys.dead_shard(shard)],
                args=[
                    GROUP,
                    entry_id,
                    unit.entry_id,
                    unit.payload,
                    self.result_ttl_s,
                    self.reply_ttl_s,
                    self.reply_maxlen,
                    "1" if unit.write_reply else "0",
                    self.dead_maxlen,
                    len(dead_fields),
                    *dead_fields,
                ],
                client=pipe,
            )
        elif isinstance(unit, DeadOnly):
            shard, entry_id = split_entry_ref(unit.entry_id)
            self._run(
                self._dead_only,
                keys=[keys.jobs_shard(shard), keys.dead_shard(shard)],
                args=[GROUP, entry_id, self.dead_maxlen, *_flatten(unit.dead.to_fields())],
                client=pipe,
            )
        else:
            shard, entry_id = split_entry_ref(unit)
            self._run(self._ack, keys=[keys.jobs_shard(shard)], args=[GROUP, entry_id], client=pipe)

    def _token_args(self, unit: TokenWrite) -> list[Any]:
        """TOKENS_LUA's arguments. The safety TTL is ``result_ttl_s``, not ``reply_ttl_s``: it runs from the
        stream's first event, and a job may well stream for longer than ``reply_ttl_s`` (an hour by
        default) before its terminal write shortens it to ``reply_ttl_s``; ``result_ttl_s`` (at least
        ``reply_ttl_s``, a day by default) still bounds a stream no terminal write ever reaches."""
        return [unit.entry_id, self.reply_maxlen, self.result_ttl_s, *unit.payloads]

    def terminal(self, t: Terminal) -> bool:
        """Write one terminal event now; True if it ended the job, False if a result already existed."""
        failed = self.flush(Outbox(terminals=[t]))
        if failed:
            raise failed[0][1]
        return bool(t.written)


def _per_unit(units: Sequence[Unit], results: list[Any]) -> list[Any]:
    """The second cluster trip's replies, one per unit: a terminal whose reply event went to a foreign
    slot sent two scripts, and answers with the entry half's reply (or the first error of the two)."""
    out: list[Any] = []
    replies = iter(results)
    for unit in units:
        reply = next(replies)
        # Mirrors _queue_second: the reply event was queued first when its stream is in another slot.
        if isinstance(unit, Terminal) and unit.result_written and unit.write_reply and _foreign_slot(unit):
            entry_reply = next(replies)
            reply = reply if isinstance(reply, BaseException) else entry_reply
        out.append(reply)
    return out


def _foreign_slot(unit: Terminal) -> bool:
    return key_slot(unit.reply_to.encode()) != key_slot(f"{{{unit.job_id}}}".encode())


def _remove(outbox: Outbox, unit: Unit) -> None:
    if isinstance(unit, TokenWrite):
        outbox.tokens.remove(unit)
    elif isinstance(unit, Terminal):
        outbox.terminals.remove(unit)
    elif isinstance(unit, DeadOnly):
        outbox.dead_only.remove(unit)
    else:
        outbox.acks.remove(unit)


def _flatten(fields: dict[str, str]) -> Sequence[bytes]:
    """Field/value pairs as bytes: a raw job that was not valid UTF-8 (kept by ``surrogateescape``
    decoding) goes back out byte for byte (hiredis would refuse to encode it as str)."""
    return [x.encode("utf-8", "surrogateescape") for kv in fields.items() for x in kv]
