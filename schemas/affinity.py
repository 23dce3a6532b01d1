"""Prefix affinity without a router: which shard a job goes to, and which shards a worker calls home.

A producer routes each job to shard ``hash(affinity key) % K``, so jobs that share a prompt prefix queue on
the same shard. Each worker takes the shards it wins by rendezvous (highest-random-weight) hashing over the
live workers' names as its *homes* and reads them first, so one worker sees a prefix again and again and
its prefix cache stays warm. When a worker joins or leaves, only the shards it wins or held change owner
(about 1/N of them), so the other workers' caches stay warm too. Pure functions, no I/O: producers, workers
and tests compute the same answers.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

from schemas.jobs import JobRequest

AFFINITY_CHARS = 256
"""Characters of a prompt (or of a conversation's first message) that make its affinity key: enough to
cover an instruction prefix, short enough that jobs differing only in their documents share it."""

AFFINITY_TOKENS = 64
"""Leading token ids of a ``prompt_token_ids`` job that make its affinity key."""


def affinity_key(job: JobRequest) -> str:
    """The job's affinity key: its ``affinity`` field, else its system message, else the first message's
    (or the prompt's) first :data:`AFFINITY_CHARS` characters, else its first :data:`AFFINITY_TOKENS` token
    ids. The client has no tokenizer, so characters stand in for the chat-templated prompt's tokens: the
    template only adds the same text before every conversation."""
    if job.affinity is not None:
        return job.affinity
    if job.messages:
        first = job.messages[0]
        if first.role == "system":
            return "system:" + first.content
        return "messages:" + first.content[:AFFINITY_CHARS]
    if job.prompt is not None:
        return "prompt:" + job.prompt[:AFFINITY_CHARS]
    return "tokens:" + ",".join(str(t) for t in (job.prompt_token_ids or [])[:AFFINITY_TOKENS])


def _digest(text: str) -> int:
    """A stable 64-bit hash (Python's ``hash`` differs between processes)."""
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "big")


def shard_for_key(key: str, shards: int) -> int:
    """The shard (of ``shards``) an affinity key routes to."""
    return 0 if shards <= 1 else _digest(key) % shards


def shard_for_job(job: JobRequest, shards: int) -> int:
    """The shard a job routes to by its affinity key."""
    return shard_for_key(affinity_key(job), shards)


def shard_owner(shard: int, workers: Iterable[str]) -> str | None:
    """The worker that wins ``shard`` by rendezvous hashing (None when there is none)."""
    return max(workers, key=lambda worker: (_digest(f"{worker}/{shard}"), worker), default=None)


def home_shards(worker: str, live_workers: Iterable[str], shards: int) -> list[int]:
    """The shards ``worker`` wins among ``live_workers`` (itself included whatever the list says)."""
    fleet = set(live_workers) | {worker}
    return [shard for shard in range(shards) if shard_owner(shard, fleet) == worker]
