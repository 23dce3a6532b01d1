"""Redis key names of wire protocol v2, in one place so producers, workers and tests agree.

Every key lives under a namespace (default ``pagedq``) so several deployments can share one Redis.

Protocol v2 differs from v1 in key names only, so that it runs on Redis Cluster:

* every key of one job (reply stream, result, cancel flag) carries the job id as its hash tag
  (``<ns>:{<id>}:reply``), so the script that writes a job's terminal event and result touches one slot;
* a queue is ``queue_shards`` streams ``<ns>:jobs:{<queue>:<k>}``, each with its own dead-letter stream
  ``<ns>:dead:{<queue>:<k>}`` in the same slot (the tag), so an entry's ack and its one dead letter stay one
  script; the shards of a queue spread over the cluster's nodes;
* the live workers of a namespace are listed in one sorted set ``<ns>:workers`` (:func:`workers_index`), so
  readers find them without a SCAN of the keyspace; each member's heartbeat key stays the truth.

Inside a worker, a job entry is named by an *entry ref*: the stream entry id on shard 0 (so a one-shard queue
reads exactly as before) and ``<entry id>@<k>`` on shard ``k`` (entry ids of different streams can collide).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

GROUP = "workers"
"""The one consumer group every worker of a queue joins."""

JOB_FIELD = "job"
"""Field of a job stream entry holding the job's JSON."""

EVENT_FIELD = "event"
"""Field of a reply stream entry holding one event's JSON."""

OWNER_FIELD = "entry"
"""Field of a reply stream entry naming the job stream entry whose events the stream holds. A worker writes
to a reply stream only when it does not exist yet or its first entry names the same job entry, so one job
can never write into another job's (or another copy's) stream, nor into a key pagedq did not create."""

PROTOCOL_VERSION = 2
"""The wire protocol these key names are (README, "Wire protocol v2")."""

_NAME_RE = re.compile(r"^[A-Za-z0-9._-]{1,64}$")


def check_name(kind: str, value: str) -> str:
    """Reject namespaces and queue names that would make key names ambiguous (``:``, spaces)."""
    if not _NAME_RE.match(value):
        raise ValueError(f"{kind} must be 1-64 characters of [A-Za-z0-9._-], got {value!r}")
    return value


def entry_ref(shard: int, entry_id: str) -> str:
    """A job entry's name inside a worker: the entry id on shard 0, ``<entry id>@<shard>`` elsewhere."""
    return entry_id if shard == 0 else f"{entry_id}@{shard}"


def split_entry_ref(ref: str) -> tuple[int, str]:
    """``(shard, entry id)`` of an entry ref made by :func:`entry_ref`."""
    entry_id, _, shard = ref.partition("@")
    return (int(shard) if shard else 0), entry_id


def workers_index(namespace: str) -> str:
    """The sorted set listing the namespace's workers: member ``<queue>:<name>``, score the expiry (Unix time,
    the worker's clock) of the heartbeat it wrote with it. No hash tag: nothing touches it together with
    another key in one script (the heartbeat beside it is a pipeline, and heartbeat keys are untagged), as
    with the namespace's other shared name, the cancel channel. Not under ``<ns>:worker:``: readers of the
    previous version SCAN that prefix and GET every key found there, and a sorted set would fail their GET."""
    return f"{check_name('namespace', namespace)}:workers"


MAX_QUEUE_SHARDS = 1024
"""Upper bound of ``queue_shards`` (a worker reads every shard; more would be a misconfiguration)."""


@dataclass(frozen=True)
class Keys:
    """Key names for one queue of one namespace, split into ``shards`` job streams."""

    namespace: str = "pagedq"
    queue: str = "default"
    shards: int = 1

    def __post_init__(self) -> None:
        check_name("namespace", self.namespace)
        check_name("queue", self.queue)
        if not 1 <= self.shards <= MAX_QUEUE_SHARDS:
            raise ValueError(f"queue_shards must be 1-{MAX_QUEUE_SHARDS}, got {self.shards}")

    def jobs_shard(self, shard: int) -> str:
        """Job stream ``shard`` of the queue: producers XADD there, the ``workers`` group reads it. The hash
        tag keeps it in one slot with its dead-letter stream."""
        return f"{self.namespace}:jobs:{{{self.queue}:{shard}}}"

    def dead_shard(self, shard: int) -> str:
        """Dead letters of job stream ``shard``: invalid jobs and jobs out of attempts."""
        return f"{self.namespace}:dead:{{{self.queue}:{shard}}}"

    @property
    def job_streams(self) -> list[str]:
        """Every job stream of the queue, shard 0 first."""
        return [self.jobs_shard(k) for k in range(self.shards)]

    @property
    def dead_streams(self) -> list[str]:
        """Every dead-letter stream of the queue, shard 0 first."""
        return [self.dead_shard(k) for k in range(self.shards)]

    @property
    def jobs(self) -> str:
        """Job stream of shard 0 (the only one of a one-shard queue)."""
        return self.jobs_shard(0)

    @property
    def dead(self) -> str:
        """Dead letters of shard 0 (the only dead-letter stream of a one-shard queue)."""
        return self.dead_shard(0)

    @property
    def jobs_v1(self) -> str:
        """Where a protocol v1 producer adds jobs: workers answer entries there with a protocol error."""
        return f"{self.namespace}:jobs:{self.queue}"

    def v1_reply(self, job_id: str) -> str:
        """The reply stream a protocol v1 reader follows (workers answer v1 entries there, once)."""
        return f"{self.namespace}:reply:{job_id}"

    def v1_result(self, job_id: str) -> str:
        """The result key a protocol v1 reader looks at."""
        return f"{self.namespace}:result:{job_id}"

    def shard_of_stream(self, stream: str) -> int:
        """The shard number of one of this queue's job streams."""
        prefix = f"{self.namespace}:jobs:{{{self.queue}:"
        if not (stream.startswith(prefix) and stream.endswith("}")):
            raise ValueError(f"{stream!r} is not a job stream of queue {self.queue!r}")
        return int(stream[len(prefix) : -1])

    @property
    def cancel_channel(self) -> str:
        """Pub/sub channel announcing cancellations so workers react without polling."""
        return f"{self.namespace}:cancel"

    def reply(self, job_id: str) -> str:
        """Default reply stream of a job (a job may name another with ``reply_to``)."""
        return f"{self.namespace}:{{{job_id}}}:reply"

    def result(self, job_id: str) -> str:
        """String key holding the job's terminal event (JSON) for ``result_ttl_s``."""
        return f"{self.namespace}:{{{job_id}}}:result"

    def cancel(self, job_id: str) -> str:
        """Flag key: when present, the job is to be cancelled."""
        return f"{self.namespace}:{{{job_id}}}:cancel"

    def heartbeat(self, worker: str) -> str:
        """Per-worker status key with a TTL; it vanishes shortly after the worker dies."""
        return f"{self.namespace}:worker:{self.queue}:{worker}"

    @property
    def heartbeat_pattern(self) -> str:
        """SCAN pattern matching the heartbeat keys of this queue's workers (what readers before the index
        walked the keyspace with; tests and benchmarks still may)."""
        return f"{self.namespace}:worker:{self.queue}:*"

    @property
    def workers(self) -> str:
        """The namespace's index of workers (:func:`workers_index`), shared by all its queues."""
        return workers_index(self.namespace)

    def worker_member(self, worker: str) -> str:
        """A worker's member in :attr:`workers`: ``<queue>:<name>``, its heartbeat key without ``<ns>:worker:``."""
        return f"{self.queue}:{worker}"

    def reply_target(self, job_id: str, reply_to: str | None, granted: Sequence[str] = ()) -> str | None:
        """The reply stream a job may write to, or None when its ``reply_to`` reaches outside its own keys.

        A job's writable keys are derived from its id: its own reply stream ``<ns>:{<id>}:reply`` (the
        default) and its result key. ``reply_to`` may name another stream only under a prefix the operator
        granted (setting ``reply_prefixes``), and never a key pagedq uses for something else: a jobs stream,
        a result, a heartbeat, the workers index, a dead-letter stream, a cancel flag, or another job's reply
        stream (any ``<ns>:{...}`` key: the per-job keys of v2).
        """
        own = self.reply(job_id)
        if reply_to is None or reply_to == own:
            return own
        if not any(reply_to.startswith(prefix) for prefix in granted):
            return None
        if reply_to.startswith(self.namespace + ":"):
            kind = reply_to[len(self.namespace) + 1 :].split(":", 1)[0]
            if kind in RESERVED_KINDS or kind.startswith("{"):
                return None
        return reply_to


RESERVED_KINDS = frozenset({"jobs", "reply", "result", "cancel", "dead", "worker", "workers"})
"""The second segment of the namespace's own keys (``<ns>:<kind>:...``): no ``reply_to`` may name one."""
