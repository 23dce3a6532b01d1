"""The index of live workers: one sorted set per namespace (:func:`schemas.keys.workers_index`), so that finding
the workers costs a read of that set and one GET per worker, not a SCAN of every key in Redis.

A SCAN walks the whole keyspace: with a million other keys on a shared Redis one took half a second on
loopback, on a cluster it walks every node, and the worker ran one on its main loop (no engine step
meanwhile) every ``heartbeat_interval_s`` on a sharded queue. Rules, which every reader here follows:

* a worker writes its member (score: its heartbeat's expiry, its own clock) in the same round trip as its
  heartbeat (:func:`queue_beat`), and removes both on a clean stop (:func:`queue_leave`);
* the heartbeat key stays the truth: a member whose heartbeat key is gone (expired, or the worker died
  between the two writes of a stop) is not live, so readers GET the members' heartbeats
  (:func:`heartbeat_keys`), one GET each in a non-transactional pipeline (heartbeat keys carry no hash tag:
  on a cluster they span slots, and MGET across slots is refused);
* readers prune members expired more than :data:`PRUNE_AFTER_S` ago (:func:`queue_index_read`), so a worker
  that died without stopping leaves nothing behind for long; the margin keeps clock skew between the
  worker's host and the reader's from pruning a live worker.

Workers of a version before the index write no member: readers do not see them (README, "Wire protocol v2").
"""

from __future__ import annotations

import time
from typing import Any

from schemas.keys import Keys, workers_index

PRUNE_AFTER_S = 60.0
"""How long after its heartbeat's expiry (by the worker's clock) a member is pruned: far more than the clock
skew of hosts kept by NTP, and a member left a minute too long costs a reader only one GET of a missing key."""


def queue_beat(pipe: Any, keys: Keys, name: str, heartbeat: str, ttl_ms: int) -> None:
    """Queue a worker's heartbeat on ``pipe`` (one round trip once executed): the heartbeat key, as every
    earlier version wrote it (readers of those versions keep working), then its member in the index."""
    pipe.set(keys.heartbeat(name), heartbeat, px=ttl_ms)
    pipe.zadd(keys.workers, {keys.worker_member(name): time.time() + ttl_ms / 1000})


def queue_leave(pipe: Any, keys: Keys, name: str) -> None:
    """Queue a clean stop on ``pipe``: the heartbeat key and the member go together."""
    pipe.delete(keys.heartbeat(name))
    pipe.zrem(keys.workers, keys.worker_member(name))


def queue_index_read(pipe: Any, namespace: str) -> None:
    """Queue the pruning of long-expired members and the read of the rest on ``pipe``; its result's last item
    is the members (``<queue>:<name>``). Works on sync and asyncio pipelines alike: it only queues."""
    index = workers_index(namespace)
    pipe.zremrangebyscore(index, "-inf", f"({time.time() - PRUNE_AFTER_S}")
    pipe.zrange(index, 0, -1)


def heartbeat_keys(namespace: str, members: list[str], queue: str | None = None) -> list[str]:
    """The heartbeat keys of ``members`` (those of ``queue`` only, when given), sorted."""
    wanted = [m for m in members if queue is None or m.partition(":")[0] == queue]
    return [f"{namespace}:worker:{m}" for m in sorted(wanted)]


def gets(r: Any, keys: list[str]) -> Any:
    """A non-transactional pipeline holding one GET per key, for the caller to execute (awaited on an asyncio
    client). Not MGET: heartbeat keys carry no hash tag, and each job's keys have a slot of their own, so on a
    cluster they span slots, and redis-py's cluster client refuses an MGET across slots with
    ``RedisClusterException`` (no ``RedisError``): the gateway answered every request 500 from its second live
    worker on, and ``pagedq batch`` ended in a traceback at its first answers."""
    pipe = r.pipeline(transaction=False)
    for key in keys:
        pipe.get(key)
    return pipe


def index_members(r: Any, namespace: str) -> list[str]:
    """The members of the namespace's index after pruning (sync client): candidates, not yet live workers."""
    pipe = r.pipeline(transaction=False)
    queue_index_read(pipe, namespace)
    return list(pipe.execute()[-1])


def live_heartbeats(r: Any, namespace: str, queue: str | None = None) -> dict[str, str]:
    """``<queue>:<name>`` -> the raw heartbeat of every indexed worker (of ``queue`` only, when given) whose
    heartbeat key exists (sync client). A key holding another type than a string is no worker's heartbeat
    (no worker writes anything else there) and is left out, not raised: one such key must not hide the rest."""
    keys = heartbeat_keys(namespace, index_members(r, namespace), queue)
    if not keys:
        return {}
    raws = gets(r, keys).execute(raise_on_error=False)
    prefix = f"{namespace}:worker:"
    return {key[len(prefix) :]: raw for key, raw in zip(keys, raws, strict=True) if isinstance(raw, str)}
