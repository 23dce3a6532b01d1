"""The worker's connection to Redis: its client, its outage handling, and the Redis server's clock.

An outage must never stop generation: the loop runs its Redis work inside :meth:`RedisLink.phase`, which turns
a connection error into a retry time (with jittered exponential backoff) instead of an exception, and the
loop keeps stepping the engine and buffering events until :meth:`RedisLink.usable` says to try again.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from schemas.keys import Keys
from worker.backoff import Backoff
from worker.reclaimer import ensure_group
from worker.redis_url import connect

REDIS_DOWN = (
    redis.ConnectionError,
    redis.TimeoutError,
    ConnectionError,
    TimeoutError,
    OSError,
    # A cluster in failover: a slot without a primary yet, a node that says to try again.
    redis.exceptions.ClusterDownError,
    redis.exceptions.TryAgainError,
    redis.exceptions.ClusterError,
    redis.exceptions.RedisClusterException,
)
"""Exceptions that mean "Redis is unreachable right now" (retry later), not "the command was wrong"."""


def redis_client(url: str, block_s: float) -> Any:
    """The worker's Redis client: str values, invalid UTF-8 kept byte-exact, no hidden retries (the loop
    does its own backoff, and a silent retry could duplicate token events). ``block_s`` is the longest
    blocking read the loop makes; the socket timeout leaves room for it."""
    return connect(
        url,
        decode_responses=True,
        encoding_errors="surrogateescape",
        socket_timeout=block_s + 10,
        socket_connect_timeout=2,
        health_check_interval=30,
        retry=Retry(NoBackoff(), 0),
    )


def redis_client_when_up(url: str, block_s: float, *, backoff_max_s: float, log: Any) -> Any:
    """:func:`redis_client`, waiting for Redis as long as it takes. A single server's client connects on
    its first command, so this returns at once and the loop's :meth:`RedisLink.join` waits; a cluster
    client reads the slot map from the startup nodes as it is made, so with the cluster down (the worker and
    Redis restarted together, a whole cluster rebooting) making it raised, and the worker exited with a
    traceback where a single server's worker waits. Here it waits the same way, logging
    ``redis.unavailable``. Nothing is held yet (no job, no stream entry), so SIGTERM or Ctrl-C simply end it."""
    waits = Backoff(0.1, backoff_max_s, jitter=False)
    while True:
        try:
            return redis_client(url, block_s)
        except REDIS_DOWN as exc:
            if "Cluster mode is not enabled" in str(
                exc
            ):  # a server that answers, and is not a cluster: no wait fixes it
                raise
            delay = waits.next_delay()
            log.warning("redis.unavailable", error=str(exc), retry_in_s=delay)
            time.sleep(delay)


class RedisLink:
    """Redis health as the loop sees it: down since when, when to retry, and the server clock's offset."""

    def __init__(self, client: redis.Redis, keys: Keys, *, backoff_max_s: float, log: Any) -> None:
        self.client = client
        self.keys = keys
        self.log = log
        self.backoff = Backoff(0.1, backoff_max_s)
        self.down_since: float | None = None
        self.retry_at = 0.0
        self.clock_offset = 0.0
        self.reconnects = 0
        self.command_errors = 0  # commands Redis refused for a reason other than a missing group

    def join(self, should_stop: Callable[[], bool]) -> bool:
        """Create the consumer group and read the clock, waiting for Redis as long as it takes; False if
        ``should_stop()`` became true first."""
        waits = Backoff(0.1, self.backoff.max_s, jitter=False)
        while True:
            try:
                ensure_group(self.client, self.keys)
                self.sync_clock()
                return True
            except REDIS_DOWN as exc:
                if should_stop():
                    return False
                delay = waits.next_delay()
                self.log.warning("redis.unavailable", error=str(exc), retry_in_s=delay)
                time.sleep(delay)

    def usable(self, now: float) -> bool:
        """Whether to try Redis now (it is up, or its retry time has come)."""
        return self.down_since is None or now >= self.retry_at

    @contextlib.contextmanager
    def phase(self) -> Iterator[None]:
        """Run Redis work; on connection trouble schedule a retry instead of failing, and recreate the
        consumer group if Redis lost it (restarted without AOF)."""
        try:
            yield
        except REDIS_DOWN as exc:
            now = time.monotonic()
            if self.down_since is None:
                self.down_since = now
                self.log.warning("redis.connection_lost", error=str(exc))
            self.retry_at = now + self.backoff.next_delay()
            return
        except redis.ResponseError as exc:
            if "NOGROUP" in str(exc):
                self.log.warning("redis.group_missing", error=str(exc))
                with contextlib.suppress(*REDIS_DOWN):
                    ensure_group(self.client, self.keys)
            else:
                self.command_errors += 1
                self.log.exception("redis.command_failed")
            return
        if self.down_since is not None:
            self.log.info("redis.reconnected", down_s=round(time.monotonic() - self.down_since, 3))
            self.reconnects += 1
            self.down_since = None
            self.backoff.reset()
            with contextlib.suppress(*REDIS_DOWN):
                self.sync_clock()

    def sync_clock(self) -> None:
        """Offset of the Redis server clock, which stamps entry ids (queue times and deadlines use it)."""
        t0 = time.time()
        secs, micros = self.client.time()
        t1 = time.time()
        self.clock_offset = secs + micros / 1e6 - (t0 + t1) / 2

    def now(self) -> float:
        """The Redis server's time, from this process's clock and the last measured offset."""
        return time.time() + self.clock_offset
