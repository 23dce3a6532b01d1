"""The one reading of a pagedq Redis URL, shared by the worker, the client, the commands and the gateway.

Besides redis-py's own schemes (``redis://``, ``rediss://``, ``unix://``), a URL may name a Redis Cluster:
``redis+cluster://[user:password@]host:port[,host:port...][?options]`` (``rediss+cluster://`` for TLS). The
nodes listed are only where to start: redis-py's ``RedisCluster`` learns the others (and every failover)
from ``CLUSTER SHARDS``. Imports redis-py only, so producers stay light.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import redis
import redis.asyncio
from redis.asyncio.cluster import ClusterNode as AsyncClusterNode
from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster
from redis.cluster import ClusterNode, RedisCluster

CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}
PLAIN_SCHEMES = ("redis", "rediss", "unix")


@dataclass(frozen=True)
class RedisTarget:
    """What a URL names: one server (``url`` as redis-py reads it) or a cluster (``nodes`` to start from,
    ``url`` the first of them with the credentials and options, as redis-py's cluster client reads it)."""

    url: str
    cluster: bool
    nodes: tuple[tuple[str, int], ...] = ()


def parse_redis_url(url: str) -> RedisTarget:
    """Check a URL and say what it names; ``ValueError`` with a message that never shows the password."""
    parts = urlsplit(url)
    scheme = parts.scheme
    if scheme in CLUSTER_SCHEMES:
        userinfo, _, hosts = parts.netloc.rpartition("@")
        nodes: list[tuple[str, int]] = []
        for node in hosts.split(","):
            host, sep, port = node.rpartition(":")
            if not sep or not host or not port.isdigit() or int(port) == 0:
                raise ValueError(f"each cluster node must be host:port, got {node!r}")
            nodes.append((host.strip("[]"), int(port)))
        if parts.path.strip("/") not in ("", "0"):
            raise ValueError("a cluster has database 0 only")
        netloc = (userinfo + "@" if userinfo else "") + hosts.split(",")[0]
        first = urlunsplit((CLUSTER_SCHEMES[scheme], netloc, "", parts.query, ""))
        return RedisTarget(first, True, tuple(nodes))
    if scheme not in PLAIN_SCHEMES:
        raise ValueError("must start with redis://, rediss://, unix://, redis+cluster:// or rediss+cluster://")
    if scheme == "unix" and not parts.path:
        raise ValueError("a unix:// URL needs a socket path")
    if scheme != "unix":
        try:
            plain_port = parts.port
        except ValueError as exc:
            raise ValueError(f"bad port: {exc}") from None
        if not parts.hostname or (plain_port is not None and plain_port == 0):
            raise ValueError("needs a host (and a non-zero port, if any)")
        db = parts.path.lstrip("/")
        if db and not db.isdigit():
            raise ValueError(f"database must be a number, got {db!r}")
    return RedisTarget(url, False)


def is_cluster_url(url: str | None) -> bool:
    return bool(url) and urlsplit(url or "").scheme in CLUSTER_SCHEMES


def connect(url: str, **options: Any) -> Any:
    """A client for ``url``: ``redis.Redis`` for one server, ``redis.cluster.RedisCluster`` for a cluster.

    ``options`` are redis-py connection arguments (``decode_responses``, timeouts...); ``retry`` is kept
    for a single server only: a cluster client must follow MOVED/ASK and failovers, so it keeps its own
    retries of those (a connection error still reaches the caller, whose loop backs off)."""
    target = parse_redis_url(url)
    if not target.cluster:
        return redis.Redis.from_url(target.url, **options)
    options.pop("retry", None)
    options.pop("health_check_interval", None)
    startup = [ClusterNode(host, port) for host, port in target.nodes]
    return RedisCluster.from_url(target.url, startup_nodes=startup, **options)


def connect_async(url: str, **options: Any) -> Any:
    """The asyncio twin of :func:`connect`."""
    target = parse_redis_url(url)
    if not target.cluster:
        return redis.asyncio.Redis.from_url(target.url, **options)
    options.pop("retry", None)
    options.pop("health_check_interval", None)
    startup = [AsyncClusterNode(host, port) for host, port in target.nodes]
    return AsyncRedisCluster.from_url(target.url, startup_nodes=startup, **options)


def is_cluster_client(client: Any) -> bool:
    """Whether ``client`` talks to a cluster (scripts must then keep their keys in one slot, and a
    transaction too)."""
    return isinstance(client, RedisCluster | AsyncRedisCluster)
