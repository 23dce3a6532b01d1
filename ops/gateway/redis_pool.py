"""The gateway's asyncio Redis client: a pool that makes requests wait for a connection instead of failing.

redis-py's default pool raises ``MaxConnectionsError`` as soon as ``max_connections`` connections are in use,
and every request the gateway follows holds one during its blocking read of the reply stream: past that many
requests in flight, new ones failed at once. A blocking pool queues them instead (each read holds its
connection for at most the gateway's poll interval, so connections keep changing hands), and one that gets
no connection within ``timeout_s`` raises :class:`PoolExhausted`, which the app answers with a 503.

Built here rather than in :func:`worker.redis_url.connect_async`, which producers share: they keep redis-py's
defaults.
"""

from __future__ import annotations

from typing import Any

import redis
import redis.asyncio
from redis.asyncio.connection import AbstractConnection

from worker.redis_url import connect_async, parse_redis_url


class PoolExhausted(redis.ConnectionError):
    """No connection of the pool came free within its timeout: the gateway is at its limit, Redis is fine."""


class BlockingPool(redis.asyncio.BlockingConnectionPool):
    """:class:`redis.asyncio.BlockingConnectionPool` whose wait running out raises :class:`PoolExhausted`.

    redis-py raises a plain ``ConnectionError("No connection available.")`` there, the class it also raises
    when Redis cannot be reached; the two need different answers (overloaded gateway, Redis down), and
    only the wait's error is raised ``from`` the ``TimeoutError`` of the wait (a failed connect is not).
    """

    async def get_connection(self, *args: Any, **kwargs: Any) -> AbstractConnection:
        try:
            connection: AbstractConnection = await super().get_connection(*args, **kwargs)
        except redis.ConnectionError as exc:
            if isinstance(exc.__cause__, TimeoutError):
                raise PoolExhausted(
                    f"no Redis connection came free within {self.timeout:g} s "
                    f"(all {self.max_connections} of the gateway's pool in use)"
                ) from exc
            raise
        return connection


def connect_gateway(url: str, *, max_connections: int, timeout_s: float, **options: Any) -> Any:
    """An asyncio client for ``url`` over a :class:`BlockingPool` of ``max_connections``.

    On a cluster redis-py's asyncio client keeps a pool per node and has no blocking variant: there
    ``max_connections`` bounds each node's pool and a full one raises ``MaxConnectionsError`` at once, which
    the app answers with the same 503."""
    target = parse_redis_url(url)
    if target.cluster:
        return connect_async(url, max_connections=max_connections, **options)
    pool = BlockingPool.from_url(target.url, max_connections=max_connections, timeout=timeout_s, **options)
    return redis.asyncio.Redis.from_pool(pool)
