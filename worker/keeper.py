"""The keeper thread: heartbeat, keep-fresh of this worker's entries, and cancel notices.

It runs beside the worker loop so that a long engine step never delays a heartbeat or lets another worker
take over entries that are still being worked on. It never touches the engine: what it learns goes to the
loop through two queues (cancel notices, entries lost to another consumer), which the loop drains each tick.
"""

from __future__ import annotations

import contextlib
import json
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import redis

from schemas.keys import Keys
from worker.backoff import Backoff
from worker.reclaimer import Reclaimer
from worker.redis_link import REDIS_DOWN
from worker.registry import queue_beat


class OwnedEntries:
    """The stream entries this worker owns, shared by the loop (adds, removes) and the keeper (keeps fresh)."""

    def __init__(self) -> None:
        self._ids: set[str] = set()
        self._lock = threading.Lock()

    def add(self, entry_id: str) -> None:
        with self._lock:
            self._ids.add(entry_id)

    def discard(self, entry_ids: list[str]) -> None:
        with self._lock:
            self._ids.difference_update(entry_ids)

    def snapshot(self) -> list[str]:
        with self._lock:
            return list(self._ids)


class Keeper(threading.Thread):
    """Every ``period_s``: claim the owned entries afresh (``XCLAIM ... JUSTID``, only those still ours) and
    write the heartbeat; in between, listen for cancel notices on the pub/sub channel."""

    def __init__(
        self,
        client: redis.Redis,
        keys: Keys,
        name: str,
        reclaimer: Reclaimer,
        owned: OwnedEntries,
        status: Callable[[], dict[str, Any]],
        *,
        period_s: float,
        heartbeat_ttl_s: float,
        backoff_max_s: float,
        log: Any,
    ) -> None:
        super().__init__(name=f"pagedq-keeper-{name}", daemon=True)
        self.client = client
        self.keys = keys
        self.worker_name = name
        self.reclaimer = reclaimer
        self.owned = owned
        self.status = status
        self.period_s = period_s
        self.heartbeat_ttl_s = heartbeat_ttl_s
        # PX in whole milliseconds, computed here so that a TTL Redis cannot take fails the worker's start
        # (inf raises OverflowError, NaN ValueError, 1e308 is refused below) instead of every beat in the
        # thread, which only logs and retries: a worker without a heartbeat. Redis refuses PX 0, and a PX
        # that overflows 64 bits once added to its clock; 2^53 ms (285,000 years) is far from either.
        self.heartbeat_ttl_ms = max(1, math.ceil(heartbeat_ttl_s * 1000))
        if self.heartbeat_ttl_ms >= 2**53:
            raise ValueError(f"heartbeat TTL of {heartbeat_ttl_s} s is too long")
        self.backoff = Backoff(0.1, backoff_max_s, jitter=False)
        self.log = log
        self.cancel_notices: deque[str] = deque()  # job ids (keeper -> loop)
        self.lost_entries: deque[str] = deque()  # entry ids another consumer holds now (keeper -> loop)
        self.vanished_entries: deque[str] = deque()  # entry ids no consumer holds (keeper -> loop)
        self._halt = threading.Event()

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=5)

    def run(self) -> None:
        pubsub: Any = None
        next_beat = 0.0
        while not self._halt.is_set():
            try:
                if pubsub is None:
                    pubsub = self.client.pubsub(ignore_subscribe_messages=True)
                    pubsub.subscribe(self.keys.cancel_channel)
                now = time.monotonic()
                if now >= next_beat:
                    taken, vanished = self.reclaimer.keep_fresh(self.owned.snapshot())
                    self.lost_entries.extend(taken)
                    self.vanished_entries.extend(vanished)
                    heartbeat = json.dumps(self.status())
                    pipe = self.client.pipeline(transaction=False)  # one round trip; a cluster's keys span slots
                    queue_beat(pipe, self.keys, self.worker_name, heartbeat, self.heartbeat_ttl_ms)
                    pipe.execute()
                    next_beat = now + self.period_s
                msg = pubsub.get_message(timeout=max(0.0, min(0.2, next_beat - time.monotonic())))
                while msg is not None:
                    if msg.get("type") == "message":
                        self.cancel_notices.append(str(msg["data"]))
                    msg = pubsub.get_message(timeout=0)
                self.backoff.reset()
            except Exception as exc:
                if not isinstance(exc, REDIS_DOWN):
                    self.log.exception("keeper.failed")
                if pubsub is not None:
                    with contextlib.suppress(Exception):
                        pubsub.close()
                    pubsub = None
                self._halt.wait(self.backoff.next_delay())
        if pubsub is not None:
            with contextlib.suppress(Exception):
                pubsub.close()
