"""The serving side of ``pagedq-redis``: an embedded Redis and one real ``python -m worker`` process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from ops.bench.system import WARMUP_PROMPT, BenchContext
from ops.bench.workloads import BenchRequest


class RedisWorker:
    """An embedded Redis plus one ``python -m worker`` process serving the benchmark's model.

    Started once and shared by the Redis workloads (loading a model in a fresh process takes seconds).
    The worker logs to ``worker.log`` in the work folder; its tail is quoted when it fails to start.
    """

    def __init__(self, ctx: BenchContext, caching: bool = True) -> None:
        from worker.embedded_redis import EmbeddedRedis

        self.ctx = ctx
        self.namespace = f"bench{uuid.uuid4().hex[:8]}"
        self.dir = ctx.work_dir / f"redis-{self.namespace}"
        self.redis = EmbeddedRedis(self.dir, appendfsync="no")
        self.caching = caching
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = ""
        self.log_path = self.dir / "worker.log"
        self.load_s = 0.0

    def start(self) -> None:
        t0 = time.perf_counter()
        self.url = self.redis.start()
        ctx = self.ctx
        import worker

        root = Path(worker.__file__).resolve().parents[1]
        cmd = [
            sys.executable, "-m", "worker",
            "--redis-url", self.url,
            "--namespace", self.namespace,
            "--name", "bench-worker",
            "--model", str(ctx.model_path),
            "--dtype", ctx.dtype,
            "--device", ctx.device,
            "--max-num-seqs", str(ctx.max_num_seqs),
            "--max-num-batched-tokens", str(ctx.max_num_batched_tokens),
            "--block-size", str(ctx.block_size),
            "--enable-prefix-caching" if self.caching else "--no-enable-prefix-caching",
            "--log-level", "warning",
            "--log-format", "json",
        ]  # fmt: skip
        if ctx.kv_cache_bytes is not None:
            cmd += ["--kv-cache-bytes", str(ctx.kv_cache_bytes)]
        if ctx.num_speculative_tokens is not None:
            cmd += ["--num-speculative-tokens", str(ctx.num_speculative_tokens)]
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        env["OMP_NUM_THREADS"] = str(ctx.threads)
        self.dir.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT)
        client = self._redis()
        key = f"{self.namespace}:worker:default:bench-worker"
        deadline = time.monotonic() + 300
        try:
            while not client.exists(key):
                if self.proc.poll() is not None:
                    raise RuntimeError(f"worker exited with {self.proc.returncode}: {self.log_tail()}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"worker not ready after 300 s: {self.log_tail()}")
                time.sleep(0.1)
        finally:
            client.close()
        self.offline([BenchRequest(WARMUP_PROMPT, 4)] * 2, stream=False)
        self.load_s = time.perf_counter() - t0

    def _redis(self) -> Any:
        import redis

        return redis.Redis.from_url(self.url, decode_responses=True)

    def log_tail(self, n: int = 1500) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return "(no worker log)"

    def cpu_seconds(self) -> float:
        """CPU time used so far by the worker process (all threads) and this client process."""
        own = time.process_time()
        if self.proc is None:
            return own
        try:
            fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
            return own + (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, ValueError, IndexError):
            return own

    def heartbeat(self) -> dict[str, Any]:
        client = self._redis()
        try:
            raw = client.get(f"{self.namespace}:worker:default:bench-worker")
        finally:
            client.close()
        return json.loads(raw) if raw else {}

    def heartbeat_since(self, t: float, timeout_s: float = 10.0) -> dict[str, Any]:
        """The worker's first heartbeat whose status was taken at or after wall-clock time ``t``."""
        deadline = time.monotonic() + timeout_s
        hb = self.heartbeat()
        while float(hb.get("ts", 0.0)) < t and time.monotonic() < deadline:
            time.sleep(0.1)
            hb = self.heartbeat()
        return hb

    def offline(self, reqs: list[BenchRequest], stream: bool) -> list[Any]:
        """Submit every request in one pipeline and wait for every terminal event (FinalEvent)."""
        from worker.client import PagedqClient

        with PagedqClient(self.url, namespace=self.namespace) as client:
            ids = client.submit_many(
                [{"prompt_token_ids": r.prompt_ids, "max_tokens": r.max_tokens} for r in reqs],
                temperature=0.0,
                ignore_eos=True,
                stream=stream,
            )
            return [client.result(job_id, timeout=self.ctx.request_timeout_s) for job_id in ids]

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.redis.stop(force=True)
