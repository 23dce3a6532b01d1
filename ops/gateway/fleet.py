"""What the gateway knows about the fleet: live workers and their models (for routing and ``/v1/models``),
and the dashboard's numbers with their recent history (tokens/s per worker, jobs per minute).

Everything comes from Redis: the workers' heartbeats (``<ns>:worker:<queue>:<name>``, which expire three
beats after a worker dies), found through the namespace's index of workers (:mod:`worker.registry`), and
the streams of each queue, read exactly as ``pagedq status`` reads them (:func:`ops.queue_commands.queue_status`),
so the terminal and the browser never disagree. Rates are not in any heartbeat, only counters
(``tokens_generated``, ``jobs_final``, ``jobs_error``): each gateway keeps a few minutes of samples in memory
and derives the rates itself, so no worker does extra work for a dashboard.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Any

import redis
import redis.asyncio as aioredis

from ops.queue_commands import MalformedDeadLetter, queue_names, queue_status, read_dead_letter
from schemas.jobs import DeadLetter
from schemas.keys import Keys, entry_ref
from worker.registry import gets, heartbeat_keys, index_members, queue_index_read

ROUTE_CACHE_S = 1.0
"""How long one read of the live workers serves requests: it costs two round trips and a GET per worker, and
a request per millisecond must not cost one each. A worker that just started is routable at most this much
later."""

HISTORY_S = 300.0
"""How much history of the counters a gateway keeps (the sparklines' width)."""


def model_id(model: str) -> str:
    """The name clients use for a worker's model: the last part of its checkpoint path (``/models/SmolLM2``
    -> ``SmolLM2``); a model name that is no path stays as it is."""
    return PurePosixPath(model.rstrip("/")).name or model


@dataclass(frozen=True)
class LiveWorker:
    name: str
    queue: str
    model: str
    state: str
    started_at: float


def _heartbeats(prefix: str, keys: list[str], raws: list[Any]) -> dict[str, dict[str, Any]]:
    """``<queue>:<name>`` -> the heartbeat of each key under ``prefix`` whose value is a JSON object; a key
    that expired since the index listed it, or holds anything else, is left out."""
    out: dict[str, dict[str, Any]] = {}
    for key, raw in zip(keys, raws, strict=True):
        try:
            beat = json.loads(raw) if raw else None
        except ValueError:
            continue
        if isinstance(beat, dict):
            out[key[len(prefix) :]] = beat
    return out


async def live_workers(r: aioredis.Redis, namespace: str) -> list[LiveWorker]:
    """Every worker of the namespace whose heartbeat has not expired, on any queue: the index's members whose
    heartbeat key is there (:mod:`worker.registry`; no SCAN, which walked every key of a shared Redis for
    each request the router's cache let through)."""
    prefix = f"{namespace}:worker:"
    index = r.pipeline(transaction=False)
    queue_index_read(index, namespace)
    keys = heartbeat_keys(namespace, list((await index.execute())[-1]))
    raws = await gets(r, keys).execute() if keys else []
    out = []
    for where, beat in _heartbeats(prefix, keys, raws).items():
        if not isinstance(beat.get("model"), str):
            continue
        queue, _, name = where.partition(":")
        started = beat.get("started_at")
        out.append(
            LiveWorker(
                name=name,
                queue=queue,
                model=beat["model"],
                state=str(beat.get("state", "ready")),
                started_at=float(started) if isinstance(started, (int, float)) else time.time(),
            )
        )
    return out


@dataclass
class Router:
    """Which queue serves a model, from the live workers' heartbeats (cached for :data:`ROUTE_CACHE_S`).

    A model is known by its id (:func:`model_id`) and by the full name its workers announce. Models seen
    since this gateway started are remembered, so that a model whose every worker is gone is told apart
    from a model that never existed: 503 (come back later) instead of 404 (wrong name).
    """

    redis: aioredis.Redis
    namespace: str
    preferred_queue: str
    _workers: list[LiveWorker] = field(default_factory=list)
    _at: float = -1e9
    _seen: set[str] = field(default_factory=set)
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    async def workers(self) -> list[LiveWorker]:
        async with self._lock:
            if time.monotonic() - self._at > ROUTE_CACHE_S:
                self._workers = await live_workers(self.redis, self.namespace)
                self._at = time.monotonic()
                for w in self._workers:
                    self._seen |= {w.model, model_id(w.model)}
            return self._workers

    async def models(self) -> dict[str, float]:
        """Model id -> the earliest start of a live worker serving it (``created`` in ``/v1/models``)."""
        out: dict[str, float] = {}
        for w in await self.workers():
            mid = model_id(w.model)
            out[mid] = min(out.get(mid, w.started_at), w.started_at)
        return out

    async def route(self, model: str) -> str | None:
        """The queue to send a job for ``model`` to; None when no live, non-draining worker serves it.

        Raises ``LookupError`` for a model that no live worker serves and none announced since this gateway
        started, while other workers are live: with no live worker at all the gateway cannot tell a wrong
        name from a fleet that is down (or restarting with it), and says the latter (None: 503).
        """
        workers = await self.workers()
        serving = [w for w in workers if model in (w.model, model_id(w.model))]
        if not serving and workers and model not in self._seen:
            raise LookupError(model)
        queues = sorted({w.queue for w in serving if w.state == "ready"})
        if not queues:
            return None
        return self.preferred_queue if self.preferred_queue in queues else queues[0]


@dataclass
class _Series:
    """(time, tokens_generated, jobs ended) samples of one worker, newest last."""

    samples: deque[tuple[float, int, int]] = field(default_factory=deque)

    def add(self, ts: float, tokens: int, jobs: int) -> None:
        if self.samples and ts <= self.samples[-1][0]:
            return  # the same heartbeat read twice
        if self.samples and (tokens < self.samples[-1][1] or jobs < self.samples[-1][2]):
            self.samples.clear()  # the worker restarted under the same name: its counters began again
        self.samples.append((ts, tokens, jobs))
        while self.samples and ts - self.samples[0][0] > HISTORY_S:
            self.samples.popleft()

    def rates(self) -> list[float]:
        """Tokens/s between consecutive samples (the sparkline)."""
        s = list(self.samples)
        return [round((b[1] - a[1]) / (b[0] - a[0]), 2) for a, b in itertools.pairwise(s) if b[0] > a[0]]

    def jobs_in(self, window_s: float, now: float) -> int:
        inside = [x for x in self.samples if now - x[0] <= window_s]
        return inside[-1][2] - inside[0][2] if len(inside) > 1 else 0


@dataclass
class Dashboard:
    """The dashboard's data: :func:`queue_status` of every queue, the last dead letters, and rates derived
    from the heartbeats' counters over the samples this gateway has taken (one per page refresh)."""

    redis: redis.Redis
    namespace: str
    queue_shards: int = 1
    dead_shown: int = 20
    _series: dict[str, _Series] = field(default_factory=dict)
    _backlogs: dict[str, deque[tuple[float, int]]] = field(default_factory=dict)  # queue -> (time, backlog)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def snapshot(self) -> dict[str, Any]:
        """Blocking (sync Redis): the app runs it in a thread, one at a time (several open pages share the
        history, which each refresh updates)."""
        with self._lock:
            return self._snapshot()

    def _snapshot(self) -> dict[str, Any]:
        now = time.time()
        queues = []
        for q in queue_names(self.redis, self.namespace):
            keys = Keys(self.namespace, q, self.queue_shards)
            status = queue_status(self.redis, keys)
            status["dead"] = self._dead(keys)
            history = self._backlogs.setdefault(q, deque())
            history.append((now, int(status["backlog"])))
            while history and now - history[0][0] > HISTORY_S:
                history.popleft()
            status["backlog_history"] = [b for _, b in history][-60:]
            queues.append(status)
        beats = self._beats()
        live = set()
        jobs_per_min = 0.0
        for queue in queues:
            for w in queue["workers"]:
                key = f"{queue['queue']}:{w['name']}"
                live.add(key)
                beat = beats.get(key, {})
                series = self._series.setdefault(key, _Series())
                ts = beat.get("ts")
                if isinstance(ts, (int, float)):
                    ended = int(beat.get("jobs_final", 0)) + int(beat.get("jobs_error", 0))
                    series.add(float(ts), int(beat.get("tokens_generated", 0)), ended)
                rates = series.rates()
                w["tokens_per_s_history"] = rates[-60:]
                w["tokens_per_s"] = rates[-1] if rates else 0.0
                w["prefix_cache_hit_rate"] = beat.get("prefix_cache_hit_rate")
                w["tokens_generated"] = beat.get("tokens_generated")
                jobs_per_min += series.jobs_in(60.0, now)
        for gone in set(self._series) - live:
            del self._series[gone]
        return {"namespace": self.namespace, "ts": now, "jobs_per_minute": jobs_per_min, "queues": queues}

    def _beats(self) -> dict[str, dict[str, Any]]:
        prefix = f"{self.namespace}:worker:"
        keys = heartbeat_keys(self.namespace, index_members(self.redis, self.namespace))
        return _heartbeats(prefix, keys, gets(self.redis, keys).execute() if keys else [])

    def _dead(self, keys: Keys) -> list[dict[str, Any]]:
        """The newest dead letters, without their payloads: a job's prompt is user text, and the page is
        readable without a key.

        An entry that is no dead letter (anyone who may ``XADD`` can write the stream) is a row of its own,
        ``malformed`` saying what is wrong and never replayable, as ``pagedq dead list`` shows it: reading it
        as a letter failed the whole snapshot, so one such entry made the page show nothing at all."""
        letters: list[tuple[str, int, DeadLetter | MalformedDeadLetter]] = []
        for shard, dead in enumerate(keys.dead_streams):
            shard_entries: Any = self.redis.xrevrange(dead, count=self.dead_shown)
            for entry_id, fields in shard_entries:
                ref = entry_ref(shard, entry_id)
                try:
                    letter: DeadLetter | MalformedDeadLetter = read_dead_letter(ref, fields)
                except MalformedDeadLetter as exc:
                    letter = exc
                # A malformed entry has no trustworthy ts_ms: it sorts by when it was added (its id's ms).
                ts_ms = letter.ts_ms if isinstance(letter, DeadLetter) else int(entry_id.split("-", 1)[0])
                letters.append((ref, ts_ms, letter))
        letters.sort(key=lambda item: item[1], reverse=True)
        return [_dead_row(ref, ts_ms, letter) for ref, ts_ms, letter in letters[: self.dead_shown]]


def _dead_row(ref: str, ts_ms: int, letter: DeadLetter | MalformedDeadLetter) -> dict[str, Any]:
    """One row of the dashboard's dead letters; ``malformed`` is null for a dead letter, else what is wrong."""
    if isinstance(letter, MalformedDeadLetter):
        return {
            "entry": ref,
            "job_id": letter.fields.get("job_id") or None,
            "code": "malformed",
            "reason": letter.problem[:200],
            "attempts": None,
            "ts_ms": ts_ms,
            "replayable": False,
            "malformed": letter.problem,
        }
    return {
        "entry": ref,
        "job_id": letter.job_id,
        "code": letter.code,
        "reason": letter.reason[:200],
        "attempts": letter.attempts,
        "ts_ms": ts_ms,
        "replayable": not letter.truncated,
        "malformed": None,
    }
