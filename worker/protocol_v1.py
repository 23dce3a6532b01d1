"""Answers jobs a wire protocol v1 producer queues, so it gets a clear error instead of waiting forever.

A v1 producer adds jobs to ``<ns>:jobs:<queue>`` and follows ``<ns>:reply:<id>`` / ``<ns>:result:<id>``;
v2 workers read ``<ns>:jobs:{<queue>:<k>}`` only. Every few seconds a worker looks at the v1 stream and
answers each entry there, under the v1 names, with an ``invalid_request`` error naming protocol v2 (a code
v1 readers know), dead-letters it on shard 0 and deletes it. Several workers may look at once:

* the error event goes out once per job id (``SET NX`` of the v1 result key decides who writes it);
* the dead letter goes out once per entry (whoever's ``XDEL`` removed the entry writes it).

Each step is a command of its own (the v1 keys do not share a slot), so a worker that dies between two
steps leaves the rest to the next look: the answer is never lost, the dead letter at worst.

Every entry read is deleted and dead-lettered, whatever its payload: the stream is read from its head, so an
entry left behind would be found again on every look, and every v1 producer queued after it would wait for
ever. The id is read as the v2 path reads an unusable job's (:func:`schemas.jobs.salvage_reply_target`:
lenient, bounded in size and nesting); a payload that defeats even that is answered with no error event.
"""

from __future__ import annotations

import hashlib
from typing import Any

from schemas.jobs import DeadLetter, ErrorEvent, salvage_reply_target
from schemas.keys import JOB_FIELD, PROTOCOL_VERSION, Keys

V1_BATCH = 100
"""Entries answered per look (a v1 producer flooding the old stream cannot stall a worker's loop)."""
DEFAULT_MAX_PAYLOAD_BYTES = 1 << 20
"""``max_payload_bytes``'s default (worker/settings.py), for callers that do not pass the setting."""


def v1_message(keys: Keys) -> str:
    return (
        f"this queue's workers speak pagedq wire protocol v{PROTOCOL_VERSION}: jobs go to "
        f"{keys.jobs_shard(0)} (one of {keys.shards} shard stream(s) {keys.namespace}:jobs:{{{keys.queue}:<k>}}), "
        f"events to {keys.namespace}:{{<id>}}:reply; {keys.jobs_v1} is protocol v1's stream and is not read. "
        "Upgrade the producer (README, 'Wire protocol v2')"
    )


def answer_v1_entries(
    client: Any,
    keys: Keys,
    worker: str,
    *,
    result_ttl_s: int,
    reply_ttl_s: int,
    max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
) -> int:
    """Answer up to :data:`V1_BATCH` entries of the v1 stream; returns how many this call removed.

    ``max_payload_bytes`` (the worker's setting) only scales how large a payload's id is still read from,
    as on the v2 path; the default is the setting's."""
    entries: Any = client.xrange(keys.jobs_v1, count=V1_BATCH)
    message = v1_message(keys)
    removed = 0
    for entry_id, fields in entries or []:
        raw = str((fields or {}).get(JOB_FIELD, ""))
        job_id = _job_id(raw, max_payload_bytes)
        if job_id:
            event = ErrorEvent(id=job_id, attempt=1, code="invalid_request", message=message, worker=worker)
            payload = event.to_json()
            if client.set(keys.v1_result(job_id), payload, ex=result_ttl_s, nx=True):
                client.xadd(keys.v1_reply(job_id), {"event": payload, "entry": str(entry_id)})
                client.expire(keys.v1_reply(job_id), reply_ttl_s)
        if int(client.xdel(keys.jobs_v1, entry_id)) == 1:
            removed += 1
            data = raw.encode("utf-8", "surrogateescape")
            letter = DeadLetter(
                job=raw[:65_536],
                job_bytes=len(data),
                job_sha256=hashlib.sha256(data).hexdigest(),
                reason=message,
                code="protocol_v1",
                attempts=0,
                worker=worker,
                job_id=job_id or "",
                entry_id=f"v1:{entry_id}",
            )
            client.xadd(keys.dead_shard(0), letter.to_fields(), maxlen=10_000, approximate=True)
    return removed


def _job_id(raw: str, max_payload_bytes: int) -> str | None:
    """The job's id when it is a usable one (v1 and v2 ids are the same), else None."""
    try:
        target = salvage_reply_target(raw, max_payload_bytes)
    except Exception:
        # The salvage already copes with every payload we know of (deep nesting, huge numbers, bad UTF-8);
        # this is for the one we do not. Reading a hostile payload runs no Redis command, so nothing caught
        # here is an outage: the entry goes on to be deleted and dead-lettered, only without an answer.
        return None
    return target[0] if target else None
