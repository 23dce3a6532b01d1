"""Helpers shared by the worker tests: a tiny-model engine, in-process and subprocess workers.

In-process workers run ``Worker.run`` on a thread with a shared tiny engine (the engine is used by one
worker thread at a time); subprocess workers are real ``python -m worker`` processes that can be
SIGKILLed or SIGTERMed.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

from schemas.jobs import parse_event
from schemas.keys import EVENT_FIELD, GROUP, Keys
from tests.fault_injection import FACTORY as FAULT_FACTORY
from tests.fault_injection import FaultyEngine, process_environment
from tests.redis_servers import ClusterServers, RedisServer, unique_namespace
from worker.client import PagedqClient
from worker.consumer import Worker
from worker.job_run import EngineLike
from worker.settings import Settings

REPO = Path(__file__).resolve().parents[1]
STACK_DUMP_HEADER = "most recent call first"  # in each thread's header of faulthandler's dump (SIGUSR1, watchdog)

ENGINE_KW: dict[str, Any] = {
    "max_num_seqs": 4,
    "max_num_batched_tokens": 256,
    "kv_cache_bytes": 8 << 20,
    "block_size": 16,
}


def make_engine(model: Path, **overrides: Any) -> EngineLike:
    from engine import Engine, EngineConfig

    return Engine(EngineConfig(model=str(model), **{**ENGINE_KW, **overrides}))


def wait_for(cond: Callable[[], Any], timeout: float = 30.0, interval: float = 0.02, what: str = "") -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what or cond}")


@dataclass
class Ctx:
    """A namespace on a server, with a client and raw Redis access for counting."""

    server: RedisServer | ClusterServers
    ns: str = field(default_factory=unique_namespace)
    shards: int = 1  # the queue's job streams (queue_shards of the client and of the workers started here)

    def __post_init__(self) -> None:
        self.keys = Keys(self.ns, "default", self.shards)
        self.redis: Any = self.server.client()
        self.client = PagedqClient(self.server.client(), namespace=self.ns, queue_shards=self.shards)

    def settings(self, **overrides: Any) -> Settings:
        base: dict[str, Any] = {
            "redis_url": self.server.url,
            "namespace": self.ns,
            "queue_shards": self.shards,
            "max_num_seqs": ENGINE_KW["max_num_seqs"],
            "max_num_batched_tokens": ENGINE_KW["max_num_batched_tokens"],
            "prefetch": 2,
            "reclaim_idle_s": 3.0,
            "heartbeat_interval_s": 0.3,
            "shutdown_grace_s": 10.0,
            "redis_backoff_max_s": 0.5,
            "block_s": 0.2,
        }
        return Settings(**{**base, **overrides})

    def events(self, job_id: str) -> list[Any]:
        return [parse_event(f[EVENT_FIELD]) for _, f in self.redis.xrange(self.keys.reply(job_id))]

    def terminal_events(self, job_id: str) -> list[Any]:
        return [e for e in self.events(job_id) if e.type != "token"]

    def result(self, job_id: str) -> Any:
        raw = self.redis.get(self.keys.result(job_id))
        return None if raw is None else parse_event(raw)

    def pending(self) -> int:
        """Entries delivered and not acked, over every shard."""
        return sum(int(self.redis.xpending(stream, GROUP)["pending"]) for stream in self.keys.job_streams)

    def backlog(self) -> int:
        """Entries in the job streams (workers delete each when its job ends), over every shard."""
        return sum(int(self.redis.xlen(stream)) for stream in self.keys.job_streams)

    def heartbeats(self) -> dict[str, dict[str, Any]]:
        out = {}
        for key in self.redis.scan_iter(self.keys.heartbeat_pattern):
            raw = self.redis.get(key)
            if raw:
                out[key.rsplit(":", 1)[-1]] = json.loads(raw)
        return out

    def close(self) -> None:
        self.client.close()
        self.redis.close()


@contextlib.contextmanager
def inprocess_worker(
    ctx: Ctx, engine: EngineLike, *, fault_marker: str | None = None, step_delay_s: float = 0.0, **overrides: Any
) -> Iterator[Worker]:
    """A Worker running on a thread; stopped (gracefully) and checked for leaks on exit. ``fault_marker`` and
    ``step_delay_s`` wrap the engine in a :class:`~tests.fault_injection.FaultyEngine`."""
    driven: EngineLike = engine
    if fault_marker or step_delay_s:
        driven = FaultyEngine(engine, fault_marker=fault_marker, step_delay_s=step_delay_s)
    worker = Worker(ctx.settings(**overrides), driven)
    thread = threading.Thread(target=worker.run, name="worker", daemon=True)
    thread.start()
    try:
        # Joined (the group exists and the first status is out) before the test adds entries or reads the
        # group: an XPENDING before the worker's XGROUP CREATE would fail with NOGROUP.
        wait_for(lambda: worker.status or not thread.is_alive(), timeout=60, what="the worker to join its group")
        yield worker
    finally:
        worker.request_stop()
        thread.join(60)
        assert not thread.is_alive(), "worker did not stop"
    assert worker.errors == 0, "the worker loop swallowed unexpected exceptions (see log)"
    assert not engine.has_unfinished()
    stats = engine.stats()
    assert stats.num_free_blocks == stats.num_total_blocks, f"KV blocks leaked: {stats}"


class WorkerProcess:
    """``python -m worker`` as a child process, with its log in a file."""

    def __init__(
        self,
        ctx: Ctx,
        model: Path,
        log_dir: Path,
        name: str,
        *,
        fault_marker: str | None = None,
        step_delay_s: float = 0.0,
        wedge_marker: str | None = None,
        **settings: Any,
    ) -> None:
        """``settings`` become ``--flags``; ``fault_marker`` / ``step_delay_s`` / ``wedge_marker`` inject
        faults into the process's engine (:mod:`tests.fault_injection`)."""
        self.name = name
        self.ctx = ctx
        self.log_path = log_dir / f"worker-{name}.log"
        env = {k: v for k, v in os.environ.items() if not k.startswith("PAGEDQ_")}
        env.update(
            {
                "PYTHONPATH": str(REPO),
                "OMP_NUM_THREADS": "1",
                "MKL_NUM_THREADS": "1",
                "TOKENIZERS_PARALLELISM": "false",
                "PAGEDQ_LOG_FORMAT": "json",
            }
        )
        if fault_marker or step_delay_s or wedge_marker:
            faults = {"fault_marker": fault_marker, "step_delay_s": step_delay_s, "wedge_marker": wedge_marker}
            env.update(process_environment(**faults))
            settings.setdefault("engine_factory", FAULT_FACTORY)
        args = {
            "redis_url": ctx.server.url,
            "namespace": ctx.ns,
            "queue_shards": ctx.shards,
            "name": name,
            "model": str(model),
            "max_num_seqs": ENGINE_KW["max_num_seqs"],
            "max_num_batched_tokens": ENGINE_KW["max_num_batched_tokens"],
            "kv_cache_bytes": ENGINE_KW["kv_cache_bytes"],
            "prefetch": 2,
            "reclaim_idle_s": 3,
            "heartbeat_interval_s": 0.3,
            "redis_backoff_max_s": 0.5,
            "block_s": 0.2,
            "dtype": "float32",
            "device": "cpu",
            **settings,
        }
        cmd = [sys.executable, "-m", "worker"]
        for key, value in args.items():
            if value is None:
                continue
            cmd += ["--" + key.replace("_", "-"), str(value)]
        self._log = open(self.log_path, "wb")  # noqa: SIM115
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=self._log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float = 120.0) -> None:
        def ready() -> bool:
            if self.proc.poll() is not None:
                raise AssertionError(f"worker {self.name} exited early:\n{self.log()}")
            return self.name in self.ctx.heartbeats()

        wait_for(ready, timeout, 0.1, f"worker {self.name} heartbeat")

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")[-6000:]

    def log_lines(self) -> list[dict[str, Any]]:
        out = []
        for line in self.log_path.read_text(errors="replace").splitlines():
            with contextlib.suppress(ValueError):
                out.append(json.loads(line))
        return out

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def terminate(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(60)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)
        self._log.close()


@contextlib.contextmanager
def logs_shown_on_failure(logs: Callable[[], str], *closers: Callable[[], object]) -> Iterator[None]:
    """Run a block against worker processes: print their logs if it fails, close them whatever happens."""
    try:
        yield
    except BaseException:
        print(logs())
        raise
    finally:
        for close in closers:
            close()


def job_counts(r: redis.Redis, keys: Keys, job_ids: list[str]) -> dict[str, tuple[int, bool]]:
    """Per job: number of terminal events in its reply stream, and whether its result key exists."""
    pipe = r.pipeline(transaction=False)
    for job_id in job_ids:
        pipe.xrange(keys.reply(job_id))
        pipe.exists(keys.result(job_id))
    raw = pipe.execute()
    out = {}
    for i, job_id in enumerate(job_ids):
        events = [json.loads(f[EVENT_FIELD]) for _, f in raw[2 * i]]
        out[job_id] = (sum(e["type"] != "token" for e in events), bool(raw[2 * i + 1]))
    return out
