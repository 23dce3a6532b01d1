"""``pagedq-redis``: the engine behind a real worker process and Redis, driven by the client library.

Measures what the queue costs end to end: offline (every request in one pipeline) against ``pagedq``'s
offline API, and online (Poisson arrivals, streaming) for latency. The worker's heartbeat supplies its
loop's own account of the run and its KV usage.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from ops.bench.online_client import latency_stats, run_online_client
from ops.bench.pagedq_system import speculative_record
from ops.bench.redis_worker import RedisWorker
from ops.bench.system import BenchContext, System, SystemResult
from ops.bench.workloads import Workload


def _loop_breakdown(before: dict[str, Any], after: dict[str, Any], wall: float) -> dict[str, Any]:
    """Where the worker's loop spent the run (deltas of its cumulative ``loop`` status), as seconds and
    shares of the client's wall time; ``outside_loop`` is the rest (results reaching the client)."""
    keys = ("engine_step_s", "redis_s", "idle_s", "other_s")
    if not all(k in before and k in after for k in keys):
        return {}
    secs = {k[:-2]: max(0.0, float(after[k]) - float(before[k])) for k in keys}
    # Idle reads before the first job and after the last one fall outside the client's wall time.
    secs["idle"] = min(secs["idle"], max(0.0, wall - secs["engine_step"] - secs["redis"] - secs["other"]))
    secs["outside_loop"] = max(0.0, wall - sum(secs.values()))
    return {
        "ticks": int(after.get("ticks", 0)) - int(before.get("ticks", 0)),
        "seconds": {k: round(v, 3) for k, v in secs.items()},
        "shares": {k: round(v / wall, 4) if wall > 0 else 0.0 for k, v in secs.items()},
    }


@contextlib.contextmanager
def _sampling(fn: Callable[[], None], period_s: float) -> Iterator[None]:
    """Call ``fn`` every ``period_s`` on a daemon thread while the block runs (heartbeat sampling)."""
    stop = threading.Event()

    def loop() -> None:
        while not stop.wait(period_s):
            with contextlib.suppress(Exception):
                fn()

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(5)


class PagedqRedisSystem(System):
    """End to end through Redis: client -> embedded Redis -> one worker process -> pagedq engine."""

    name = "pagedq-redis"

    def __init__(self) -> None:
        self.worker: RedisWorker | None = None
        self._served: set[str] = set()  # workloads the current worker has run

    def unavailable(self, ctx: BenchContext) -> str | None:
        try:
            import worker.client
            import worker.embedded_redis
            import worker.run  # noqa: F401
        except Exception as exc:  # a half-built worker package can fail in any way on import
            return f"worker package not importable: {type(exc).__name__}: {exc}"
        return None

    def ensure_worker(self, ctx: BenchContext) -> RedisWorker:
        if self.worker is None:
            w = RedisWorker(ctx)
            try:
                w.start()
            except BaseException:
                w.stop()
                raise
            self.worker = w
        return self.worker

    def run(self, workload: Workload, ctx: BenchContext) -> SystemResult:
        if workload.name in self._served:
            # A repeat (--repeat): the worker's prefix cache still holds these prompts, which would turn
            # the rerun into cache hits. Start a cold one, as every offline pagedq run is.
            self.close()
        self._served.add(workload.name)
        fresh = self.worker is None
        w = self.ensure_worker(ctx)
        peak: dict[str, float] = {"kv_cache_usage": 0.0}

        def sample() -> None:
            hb = w.heartbeat()
            peak["kv_cache_usage"] = max(peak["kv_cache_usage"], float(hb.get("kv_cache_usage", 0.0)))

        hb0 = w.heartbeat_since(time.time())
        loop0 = hb0.get("loop", {})
        with _sampling(sample, 0.25):
            t1, cpu1 = time.perf_counter(), w.cpu_seconds()
            finals = w.offline(workload.requests, stream=ctx.redis_stream)
            wall = time.perf_counter() - t1
            cpu_s = w.cpu_seconds() - cpu1
        hb1 = w.heartbeat_since(time.time())
        loop1 = hb1.get("loop", {})
        res = SystemResult(self.name, "ok", wall_s=wall, load_s=w.load_s if fresh else 0.0, cpu_s=cpu_s)
        res.outputs = [list(f.choices[0].token_ids) for f in finals]
        res.check(workload)
        spec = {k: int(hb1.get(k, 0)) - int(hb0.get(k, 0)) for k in ("spec_draft_tokens", "spec_accepted_tokens")}
        from worker.settings import Settings

        # What the worker runs: its own setting's default unless the bench passed one.
        default = Settings.model_fields["num_speculative_tokens"].default
        k = default if ctx.num_speculative_tokens is None else ctx.num_speculative_tokens
        res.cached_tokens = sum(f.usage.cached_tokens for f in finals)
        queued = [f.timings.queued_s for f in finals]
        res.extra = {
            "stream": ctx.redis_stream,
            "worker_loop": _loop_breakdown(loop0, loop1, wall),
            "kv": {"peak_usage_sampled": round(peak["kv_cache_usage"], 4)},
            "speculative": speculative_record(
                k, spec["spec_draft_tokens"], spec["spec_accepted_tokens"], sum(len(o) for o in res.outputs)
            ),
            "worker_timings": {
                "queued_s_mean": round(sum(queued) / len(queued), 4) if queued else 0.0,
                "total_s_max": round(max((f.timings.total_s for f in finals), default=0.0), 4),
            },
        }
        return res

    def run_online(self, workload: Workload, ctx: BenchContext) -> SystemResult:
        """Poisson arrivals with streaming; client-side TTFT / inter-token latency and throughput."""
        fresh = self.worker is None
        w = self.ensure_worker(ctx)
        t0, cpu0 = time.perf_counter(), w.cpu_seconds()
        records = asyncio.run(run_online_client(w.url, w.namespace, workload.requests, ctx.request_timeout_s))
        wall = time.perf_counter() - t0
        cpu_s = w.cpu_seconds() - cpu0
        res = SystemResult(self.name, "ok", wall_s=wall, load_s=w.load_s if fresh else 0.0, cpu_s=cpu_s)
        res.outputs = [rec["tokens"] for rec in records]
        res.check(workload)
        res.cached_tokens = sum(rec["cached"] for rec in records)
        res.extra = {"online": latency_stats(records, wall)}
        return res

    def close(self) -> None:
        if self.worker is not None:
            self.worker.stop()
            self.worker = None
        self._served.clear()
