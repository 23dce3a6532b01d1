"""Writes what a worker has to say about jobs: token events, and exactly one terminal event per job.

Token events are pipelined: all events of one engine step go out in one MULTI/EXEC round trip. Terminal
events go through one Lua script that, atomically,

1. acks (and deletes) the job's stream entry,
2. stops if ``<ns>:result:<id>`` already exists (another delivery of the job already ended it),
3. stores the event at ``<ns>:result:<id>`` with a TTL,
4. appends it to the reply stream, which then expires ``reply_ttl_s`` later,
5. appends a dead-letter entry when asked.

So a crash can never leave a job acked without its result, nor produce two results: whichever delivery of a
job finishes first wins, later ones are acked silently. The script is idempotent, which makes it safe to
retry after a lost reply.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import redis
from redis.commands.core import Script

from schemas.jobs import DeadLetter, ErrorEvent, FinalEvent, TokenEvent
from schemas.keys import EVENT_FIELD, GROUP, Keys

TERMINAL_LUA = """
-- KEYS[1] jobs stream, KEYS[2] result key, KEYS[3] reply stream, KEYS[4] dead-letter stream
-- ARGV[1] group, ARGV[2] entry id, ARGV[3] event JSON, ARGV[4] result TTL (s), ARGV[5] reply TTL (s),
-- ARGV[6] reply MAXLEN, ARGV[7] '1' to append to the reply stream, ARGV[8] number of dead-letter
-- field/value strings that follow (0: none)
if ARGV[2] ~= '' then
  redis.call('XACK', KEYS[1], ARGV[1], ARGV[2])
  redis.call('XDEL', KEYS[1], ARGV[2])
end
if redis.call('EXISTS', KEYS[2]) == 1 then
  return 0
end
redis.call('SET', KEYS[2], ARGV[3], 'EX', ARGV[4])
if ARGV[7] == '1' then
  local kind = redis.call('TYPE', KEYS[3])['ok']
  if kind == 'stream' or kind == 'none' then
    redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[6], '*', 'event', ARGV[3])
    redis.call('EXPIRE', KEYS[3], ARGV[5])
  end
end
local n = tonumber(ARGV[8])
if n > 0 then
  redis.call('XADD', KEYS[4], '*', unpack(ARGV, 9, 8 + n))
end
return 1
"""

DEAD_ONLY_LUA = """
-- A job without a usable id: no result key, no reply; only a dead letter and the ack.
-- KEYS[1] jobs stream, KEYS[2] dead-letter stream; ARGV[1] group, ARGV[2] entry id, ARGV[3..] fields
if redis.call('XACK', KEYS[1], ARGV[1], ARGV[2]) == 0 then
  return 0
end
redis.call('XDEL', KEYS[1], ARGV[2])
redis.call('XADD', KEYS[2], '*', unpack(ARGV, 3))
return 1
"""

ACK_LUA = """
-- A delivery that needs no answer (its job already has a result, or its entry is gone).
redis.call('XACK', KEYS[1], ARGV[1], ARGV[2])
redis.call('XDEL', KEYS[1], ARGV[2])
return 1
"""


@dataclass
class Terminal:
    """A terminal write waiting to go out (kept until Redis confirmed it, across reconnects)."""

    entry_id: str
    job_id: str
    reply_to: str
    event: FinalEvent | ErrorEvent
    write_reply: bool = True
    dead: DeadLetter | None = None
    written: bool | None = None  # after flush: True if it ended the job, False if a result already existed


@dataclass
class Outbox:
    """Everything not yet confirmed by Redis, in order: token events first, then terminal writes."""

    tokens: list[tuple[str, str]] = field(default_factory=list)  # (reply stream, event JSON)
    terminals: list[Terminal] = field(default_factory=list)
    dead_only: list[tuple[str, DeadLetter]] = field(default_factory=list)  # (entry id, dead letter)
    acks: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.tokens or self.terminals or self.dead_only or self.acks)


class Publisher:
    """Flushes an :class:`Outbox` to Redis in one MULTI/EXEC round trip."""

    def __init__(
        self,
        client: redis.Redis,
        keys: Keys,
        *,
        result_ttl_s: int,
        reply_ttl_s: int,
        reply_maxlen: int,
    ) -> None:
        self.client = client
        self.keys = keys
        self.result_ttl_s = result_ttl_s
        self.reply_ttl_s = reply_ttl_s
        self.reply_maxlen = reply_maxlen
        self._terminal: Script = client.register_script(TERMINAL_LUA)
        self._dead_only: Script = client.register_script(DEAD_ONLY_LUA)
        self._ack: Script = client.register_script(ACK_LUA)

    def token_event(self, reply_to: str, event: TokenEvent) -> tuple[str, str]:
        return reply_to, event.to_json()

    def flush(self, outbox: Outbox) -> list[BaseException]:
        """Write and clear ``outbox``; returns per-command errors (e.g. WRONGTYPE on a foreign reply key).

        Raises ``redis.ConnectionError``/``TimeoutError`` with the outbox left intact, so the caller can
        retry after reconnecting (terminal writes are idempotent; token events of a step are all-or-nothing
        thanks to MULTI/EXEC).
        """
        if not outbox:
            return []
        pipe = self.client.pipeline(transaction=True)
        for reply_to, payload in outbox.tokens:
            pipe.xadd(reply_to, {EVENT_FIELD: payload}, maxlen=self.reply_maxlen, approximate=True)
        for t in outbox.terminals:
            self._queue_terminal(pipe, t)
        for entry_id, dead in outbox.dead_only:
            self._dead_only(
                keys=[self.keys.jobs, self.keys.dead],
                args=[GROUP, entry_id, *_flatten(dead.to_fields())],
                client=pipe,
            )
        for entry_id in outbox.acks:
            self._ack(keys=[self.keys.jobs], args=[GROUP, entry_id], client=pipe)
        results = pipe.execute(raise_on_error=False)
        errors = [r for r in results if isinstance(r, BaseException)]
        offset = len(outbox.tokens)
        for i, t in enumerate(outbox.terminals):
            r = results[offset + i]
            t.written = None if isinstance(r, BaseException) else bool(r)
        outbox.tokens.clear()
        outbox.terminals.clear()
        outbox.dead_only.clear()
        outbox.acks.clear()
        return errors

    def _queue_terminal(self, pipe: redis.client.Pipeline, t: Terminal) -> None:
        dead_fields = _flatten(t.dead.to_fields()) if t.dead is not None else []
        self._terminal(
            keys=[self.keys.jobs, self.keys.result(t.job_id), t.reply_to, self.keys.dead],
            args=[
                GROUP,
                t.entry_id,
                t.event.to_json(),
                self.result_ttl_s,
                self.reply_ttl_s,
                self.reply_maxlen,
                "1" if t.write_reply else "0",
                len(dead_fields),
                *dead_fields,
            ],
            client=pipe,
        )

    def terminal(self, t: Terminal) -> bool:
        """Write one terminal event now; True if it ended the job, False if a result already existed."""
        outbox = Outbox(terminals=[t])
        errors = self.flush(outbox)
        if errors:
            raise errors[0]
        return bool(t.written)


def _flatten(fields: dict[str, str]) -> Sequence[bytes]:
    """Field/value pairs as bytes: a raw job that was not valid UTF-8 (kept by ``surrogateescape``
    decoding) goes back out byte for byte (hiredis would refuse to encode it as str)."""
    return [x.encode("utf-8", "surrogateescape") for kv in fields.items() for x in kv]
