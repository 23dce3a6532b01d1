"""What a worker reports about itself: the heartbeat snapshot, its engine's load, and where its loop's time goes.

The snapshot is built on the loop thread (the only one that may touch the engine) and published as a whole by
the keeper thread, which sends it as the heartbeat, and read by ``/metrics`` at scrape time.
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass, field
from typing import Any

from engine.outputs import EngineStats

LOOP_PARTS = ("engine_step", "redis", "idle", "other")


def engine_load(stats: EngineStats) -> dict[str, Any]:
    """The engine's KV cache, prefix cache and speculation counters, JSON-ready (shared by both front doors)."""
    return {
        "kv_cache_usage": round(stats.kv_cache_usage, 4),
        "num_free_blocks": stats.num_free_blocks,
        "num_total_blocks": stats.num_total_blocks,
        "prefix_cache_hit_rate": round(stats.prefix_cache_hit_rate, 4),
        "num_preemptions": stats.num_preemptions,
        "prefix_cache_queries": stats.prefix_cache_queries,
        "prefix_cache_hits": stats.prefix_cache_hits,
        "spec_draft_tokens": stats.spec_draft_tokens,
        "spec_accepted_tokens": stats.spec_accepted_tokens,
        # Memory per tensor-parallel rank (one entry on one rank): weights as held, and the KV cache.
        "tensor_parallel_size": stats.tensor_parallel_size,
        "rank_weight_bytes": list(stats.rank_weight_bytes),
        "rank_kv_bytes": list(stats.rank_kv_bytes),
        # Memory honesty: the model's weights as held (quantised weights count their int8 bytes) and the KV cache
        "weight_bytes": stats.weight_bytes,
        "kv_cache_bytes": stats.kv_cache_bytes,
        "quantization": stats.quantization,
    }


@dataclass
class LoopTimes:
    """Cumulative seconds of the worker loop by part: engine steps (with their outputs' bookkeeping), Redis
    round trips, blocking reads of an idle worker, and the rest of each tick. ``pagedq bench`` reads them."""

    ticks: int = 0
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(LOOP_PARTS, 0.0))

    def add_tick(self, *, total_s: float, engine_step_s: float, redis_s: float, idle_s: float) -> None:
        self.ticks += 1
        self.seconds["engine_step"] += engine_step_s
        self.seconds["redis"] += redis_s
        self.seconds["idle"] += idle_s
        self.seconds["other"] += total_s - engine_step_s - redis_s - idle_s

    def snapshot(self) -> dict[str, Any]:
        return {"ticks": self.ticks, **{f"{part}_s": round(s, 4) for part, s in self.seconds.items()}}


@dataclass
class WorkerIdentity:
    """The fixed part of a heartbeat: who this worker is and what it serves."""

    name: str
    queue: str
    model: str
    started_at: float = field(default_factory=time.time)
    host: str = field(default_factory=socket.gethostname)
    pid: int = field(default_factory=os.getpid)


def heartbeat_snapshot(
    identity: WorkerIdentity,
    *,
    draining: bool,
    running: int,
    waiting: int,
    unstarted: int,
    in_flight: int,
    idle: bool,
    load: dict[str, Any],
    counts: dict[str, int],
    loop: LoopTimes,
    tokens_generated: int = 0,
) -> dict[str, Any]:
    """The heartbeat JSON (README, "Workers"): identity, state, load, job counters and the loop's times."""
    return {
        "name": identity.name,
        "queue": identity.queue,
        "model": identity.model,
        "host": identity.host,
        "pid": identity.pid,
        "state": "draining" if draining else "ready",
        "running": running,
        "waiting": waiting,
        "unstarted": unstarted,
        "in_flight": in_flight,
        "idle": idle,
        "started_at": round(identity.started_at, 3),
        "ts": round(time.time(), 3),
        **load,
        **{f"jobs_{k}": v for k, v in counts.items()},
        "tokens_generated": tokens_generated,  # a counter: readers take its rate (tokens/s)
        "loop": loop.snapshot(),
    }
