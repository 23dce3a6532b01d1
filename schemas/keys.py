"""Redis key names of wire protocol v1, in one place so producers, workers and tests agree.

Every key lives under a namespace (default ``pagedq``) so several deployments can share one Redis.
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

_NAME_RE = re.compile(r"^[A-Za-z0-9._-]{1,64}$")


def check_name(kind: str, value: str) -> str:
    """Reject namespaces and queue names that would make key names ambiguous (``:``, spaces)."""
    if not _NAME_RE.match(value):
        raise ValueError(f"{kind} must be 1-64 characters of [A-Za-z0-9._-], got {value!r}")
    return value


@dataclass(frozen=True)
class Keys:
    """Key names for one queue of one namespace."""

    namespace: str = "pagedq"
    queue: str = "default"

    def __post_init__(self) -> None:
        check_name("namespace", self.namespace)
        check_name("queue", self.queue)

    @property
    def jobs(self) -> str:
        """Stream producers XADD jobs to; read by the ``workers`` group."""
        return f"{self.namespace}:jobs:{self.queue}"

    @property
    def dead(self) -> str:
        """Stream of dead letters: invalid jobs and jobs out of attempts."""
        return f"{self.namespace}:dead:{self.queue}"

    @property
    def cancel_channel(self) -> str:
        """Pub/sub channel announcing cancellations so workers react without polling."""
        return f"{self.namespace}:cancel"

    def reply(self, job_id: str) -> str:
        """Default reply stream of a job (a job may name another with ``reply_to``)."""
        return f"{self.namespace}:reply:{job_id}"

    def result(self, job_id: str) -> str:
        """String key holding the job's terminal event (JSON) for ``result_ttl_s``."""
        return f"{self.namespace}:result:{job_id}"

    def cancel(self, job_id: str) -> str:
        """Flag key: when present, the job is to be cancelled."""
        return f"{self.namespace}:cancel:{job_id}"

    def heartbeat(self, worker: str) -> str:
        """Per-worker status key with a TTL; it vanishes shortly after the worker dies."""
        return f"{self.namespace}:worker:{self.queue}:{worker}"

    @property
    def heartbeat_pattern(self) -> str:
        """SCAN pattern matching the heartbeat keys of this queue's workers."""
        return f"{self.namespace}:worker:{self.queue}:*"

    def reply_target(self, job_id: str, reply_to: str | None, granted: Sequence[str] = ()) -> str | None:
        """The reply stream a job may write to, or None when its ``reply_to`` reaches outside its own keys.

        A job's writable keys are derived from its id: its own reply stream ``<ns>:reply:<id>`` (the
        default) and its result key. ``reply_to`` may name another stream only under a prefix the operator
        granted (setting ``reply_prefixes``), and never a key pagedq uses for something else: a jobs stream,
        a result, a heartbeat, a dead-letter stream, a cancel flag, or another job's reply stream.
        """
        own = self.reply(job_id)
        if reply_to is None or reply_to == own:
            return own
        if not any(reply_to.startswith(prefix) for prefix in granted):
            return None
        if reply_to.startswith(self.namespace + ":"):
            kind = reply_to[len(self.namespace) + 1 :].split(":", 1)[0]
            if kind in RESERVED_KINDS:
                return None
        return reply_to


RESERVED_KINDS = frozenset({"jobs", "reply", "result", "cancel", "dead", "worker"})
"""The second segment of the namespace's own keys (``<ns>:<kind>:...``): no ``reply_to`` may name one."""
