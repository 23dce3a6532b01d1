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
from worker.redis_url import connect, is_cluster_url, parse_redis_url

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
    traceback where a single server's worker waits. Here it waits the same way, except for a node's
    refusal (:class:`NotAClusterError`), which no wait fixes."""

    return wait_for_redis(lambda: _client_unless_refused(url, block_s), backoff_max_s=backoff_max_s, log=log)


def _client_unless_refused(url: str, block_s: float) -> Any:
    """:func:`redis_client`, a node's refusal of a cluster client raised as :class:`NotAClusterError` (any
    other failure as it came: an outage, which the callers wait out or leave for later)."""
    try:
        return redis_client(url, block_s)
    except redis.exceptions.RedisClusterException as exc:
        if (refusal := node_refusal(exc)) is not None:
            raise NotAClusterError(url, refusal) from None
        raise


class NotAClusterError(ValueError):
    """A ``redis+cluster://`` URL whose node answered the cluster client's ``CLUSTER SLOTS`` with an error: a
    plain server (cluster mode disabled), or a user that may not run it. A setting at fault, which no wait
    fixes (worker/run.py: exit 78 in one line)."""

    def __init__(self, url: str, refusal: redis.ResponseError) -> None:
        nodes = ", ".join(f"{host}:{port}" for host, port in parse_redis_url(url).nodes)
        super().__init__(
            f"Redis at {nodes} refused the cluster client's CLUSTER SLOTS ({refusal}): a server that is not a "
            "cluster node is named with redis:// (or rediss://), and a cluster user needs CLUSTER SLOTS"
        )


def node_refusal(exc: BaseException) -> redis.ResponseError | None:
    """The error a node answered with, behind a cluster client that could not start; None when no node
    answered (a connection error: an outage, waited out). Read from the exception's chain, which is how
    redis-py links the two (its own wording is not an interface): ``CLUSTER SLOTS`` refused by a plain server
    (``ERR This instance has cluster support disabled``) or by the ACL (``NOPERM``). A slot map not yet
    covered (a cluster still starting) has no node error in its chain, and is waited out."""
    seen: set[int] = set()
    link: BaseException | None = exc
    while link is not None and id(link) not in seen:
        seen.add(id(link))
        if isinstance(link, redis.ResponseError):
            return link
        if isinstance(link, (redis.ConnectionError, redis.TimeoutError, OSError)):
            return None
        link = link.__cause__ or link.__context__
    return None


def check_cluster(url: str, block_s: float) -> None:
    """For worker/run.py, before the model loads: :class:`NotAClusterError` if ``url``'s cluster refuses the
    client (one attempt). Not a cluster URL, a client that started, or no node answering (an outage, which
    the worker waits out once its model is loaded) pass."""
    if is_cluster_url(url):
        with contextlib.suppress(*REDIS_DOWN):
            _client_unless_refused(url, block_s).close()


class RedisLink:
    """Redis health as the loop sees it: down since when, when to retry, and the server clock's offset."""

    def __init__(self, client: redis.Redis, keys: Keys, *, backoff_max_s: float, log: Any) -> None:
        self.client = client
        self.keys = keys
        self.log = log
        self.backoff = Backoff(0.1, backoff_max_s)
        self.down_since: float | None = None
        self.down_error = ""  # why the last try failed, while down: a new reason is logged, a repeat is not
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
            elif str(exc) != self.down_error:
                # Each retry failing alike stays quiet (a log line per backoff step would flood a long outage),
                # but a new reason is news: a server back up that now refuses this worker's password or ACL
                # user was silent behind the first "Connection closed by server" until it came back.
                self.log.warning("redis.still_down", error=str(exc), down_s=round(now - self.down_since, 3))
            self.down_error = str(exc)
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
