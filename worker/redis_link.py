"""The worker's connection to Redis: its client, its outage handling, and the Redis server's clock.

An outage must never stop generation: the loop runs its Redis work inside :meth:`RedisLink.phase`, which turns
a connection error into a retry time (with jittered exponential backoff) instead of an exception, and the
loop keeps stepping the engine and buffering events until :meth:`RedisLink.usable` says to try again.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from schemas.keys import Keys
from worker.backoff import Backoff
from worker.reclaimer import ensure_group
from worker.redis_url import connect, parse_redis_url

T = TypeVar("T")

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


def wait_for_redis(
    attempt: Callable[[], T], *, backoff_max_s: float, log: Any, should_stop: Callable[[], bool] = lambda: False
) -> T | None:
    """``attempt()``'s result, retried while Redis is down (:data:`REDIS_DOWN`) for as long as it takes, each
    wait logged as ``redis.unavailable``; None if ``should_stop()`` became true first. For the worker's
    start, where nothing is held yet (no job, no stream entry), so a stop simply ends it."""
    waits = Backoff(0.1, backoff_max_s, jitter=False)
    while True:
        try:
            return attempt()
        except REDIS_DOWN as exc:
            if should_stop():
                return None
            delay = waits.next_delay()
            log.warning("redis.unavailable", error=str(exc), retry_in_s=delay)
            time.sleep(delay)


def redis_client_when_up(url: str, block_s: float, *, backoff_max_s: float, log: Any) -> Any:
    """:func:`redis_client`, waiting for Redis as long as it takes. A single server's client connects on
    its first command, so this returns at once and the loop's :meth:`RedisLink.join` waits; a cluster
    client reads the slot map from the startup nodes as it is made, so with the cluster down (the worker and
    Redis restarted together, a whole cluster rebooting) making it raised, and the worker exited with a
    traceback where a single server's worker waits. Here it waits the same way."""

    def attempt() -> Any:
        try:
            return redis_client(url, block_s)
        except redis.exceptions.RedisClusterException:
            if (problem := plain_server_named_as_cluster(url)) is not None:
                raise NotAClusterError(problem) from None
            raise

    return wait_for_redis(attempt, backoff_max_s=backoff_max_s, log=log)


class NotAClusterError(ValueError):
    """A ``redis+cluster://`` URL whose node answers as a plain server: a setting at fault, which no wait fixes."""


def plain_server_named_as_cluster(url: str) -> str | None:
    """What is wrong if ``url`` is a ``redis+cluster://`` URL whose first node answers and says it is no cluster
    node (``INFO cluster``: ``cluster_enabled:0``); None otherwise, a node that does not answer included (that
    is an outage, left to the wait). Asked of the server rather than read from redis-py's message, whose
    wording is not an interface."""
    target = parse_redis_url(url)
    if not target.cluster:
        return None
    try:
        probe = connect(target.url, socket_connect_timeout=2, socket_timeout=2, retry=Retry(NoBackoff(), 0))
    except (ValueError, TypeError):  # an option only the cluster client takes: the cluster client reports it
        return None
    try:
        enabled = probe.info("cluster").get("cluster_enabled")
    except (*REDIS_DOWN, redis.ResponseError):
        return None
    finally:
        probe.close()
    if enabled:
        return None
    host, port = target.nodes[0]
    return (
        f"{host}:{port} is a Redis server without cluster mode (INFO cluster: cluster_enabled:0): name it "
        "with redis:// (or rediss://), or enable cluster mode on it"
    )


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

        def attempt() -> bool:
            ensure_group(self.client, self.keys)
            self.sync_clock()
            return True

        return bool(wait_for_redis(attempt, backoff_max_s=self.backoff.max_s, log=self.log, should_stop=should_stop))

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
