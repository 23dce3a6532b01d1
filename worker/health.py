"""The worker's HTTP port: ``/metrics`` (Prometheus), ``/healthz`` (liveness) and ``/readyz`` (readiness).

It runs on a daemon thread with the standard library's threading HTTP server, so a slow scrape never
stalls the worker loop, and it is started *before* the model loads: orchestrators can then tell "alive,
still loading" (``/healthz`` 200, ``/readyz`` 503) from "dead".

* ``/healthz``: the process answers, Redis answers a PING within a short timeout, AND the worker loop is
  live (``Worker.liveness``: it completed a tick, and Redis accepted its writes, within ``stall_timeout_s``).
  The probe result is cached for :data:`PROBE_CACHE_S` so a burst of probes does not hammer Redis; it
  uses its own client (the loop's client must never be shared across threads mid-command).
* ``/readyz``: the model is loaded and the consumer group is joined (the worker published its first
  status snapshot), the loop is live, and the worker is not draining for shutdown.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import redis
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from redis.exceptions import RedisClusterException

from schemas.keys import GROUP, Keys
from worker.metrics import WorkerMetrics
from worker.redis_url import connect
from worker.settings import mask_url

PROBE_CACHE_S = 0.5  # at most this old (the spec allows 1 s): a dead Redis shows within a second
PROBE_TIMEOUT_S = 0.5
PROBE_ERRORS = (redis.RedisError, OSError, RedisClusterException)
"""What an unreachable Redis raises at the probe. A cluster client's "no node answers" is a
``RedisClusterException``, not a ``RedisError``: uncaught, it ended the request's thread with no answer
(and a traceback on stderr) instead of a 503."""


class RedisProbe:
    """PING (and the stream's length and pending count) on a private client, cached for a short while."""

    def __init__(self, url: str, keys: Keys | None = None) -> None:
        self.url = url
        self.keys = keys
        # Made at the first probe, not here: a cluster client connects as it is made, so a cluster down
        # while the worker starts would end the start (before the model loads) instead of reading as 503.
        self._client: Any = None
        self._client_lock = threading.Lock()
        self._lock = threading.Lock()
        self._checked_at = -1e9
        self._ok = False
        self._error = ""

    @property
    def client(self) -> Any:
        """The probe's own client, made on first use (a cluster client's making can raise PROBE_ERRORS)."""
        with self._client_lock:
            if self._client is None:
                self._client = connect(
                    self.url,
                    decode_responses=True,
                    socket_timeout=PROBE_TIMEOUT_S,
                    socket_connect_timeout=PROBE_TIMEOUT_S,
                    retry_on_timeout=False,
                )
            return self._client

    def healthy(self) -> tuple[bool, str]:
        """(reachable, error) — from the cache when the last PING is younger than PROBE_CACHE_S."""
        with self._lock:
            now = time.monotonic()
            if now - self._checked_at >= PROBE_CACHE_S:
                try:
                    self._ok, self._error = bool(self.client.ping()), ""
                except PROBE_ERRORS as exc:
                    self._ok, self._error = False, f"{type(exc).__name__}: {exc}"
                    pool = getattr(self._client, "connection_pool", None)  # a cluster client has one per node
                    if pool is not None:
                        pool.disconnect()
                self._checked_at = time.monotonic()
            return self._ok, self._error

    def stream(self) -> tuple[int, int] | None:
        """(entries in the job streams, entries pending in the group; summed over the shards), or None when
        Redis does not answer."""
        if self.keys is None:
            return None
        try:
            pipe = self.client.pipeline(transaction=False)
            for stream in self.keys.job_streams:
                pipe.xlen(stream)
                pipe.xpending(stream, GROUP)
            replies = pipe.execute(raise_on_error=False)
            lengths, pendings = replies[0::2], replies[1::2]
            if any(isinstance(length, Exception) for length in lengths):
                return None
            count = sum(0 if isinstance(p, Exception) else int(p["pending"]) for p in pendings)
            return sum(int(length) for length in lengths), count
        except PROBE_ERRORS:
            return None

    def close(self) -> None:
        if self._client is not None:
            self._client.close()


class HealthServer:
    """Serves the three endpoints for one worker; ``attach`` the worker once it exists."""

    def __init__(self, host: str, port: int, metrics: WorkerMetrics, probe: RedisProbe) -> None:
        self.metrics = metrics
        self.probe = probe
        self.started = time.time()
        self._status: Callable[[], Mapping[str, Any]] | None = None
        self._liveness: Callable[[], tuple[bool, str]] = lambda: (True, "live")
        metrics.bind(status=self.status, stream=probe.stream)
        self.httpd = ThreadingHTTPServer((host, port), self._handler())
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="pagedq-health", daemon=True)

    @property
    def port(self) -> int:
        return int(self.httpd.server_address[1])

    def start(self) -> HealthServer:
        self.thread.start()
        return self

    def attach(
        self, status: Callable[[], Mapping[str, Any]], liveness: Callable[[], tuple[bool, str]] | None = None
    ) -> None:
        """Give the server the worker's status snapshot (``lambda: worker.status``) and liveness check."""
        self._status = status
        if liveness is not None:
            self._liveness = liveness

    def live(self) -> tuple[bool, str]:
        """(healthy, why not): Redis answers and the worker loop is live."""
        ok, error = self.probe.healthy()
        if not ok:
            return False, f"redis unreachable ({mask_url(self.probe.url)}): {error}"
        return self._liveness()

    def status(self) -> Mapping[str, Any]:
        return self._status() if self._status is not None else {}

    def ready(self) -> tuple[bool, str]:
        st = self.status()
        if self._status is None:
            return False, "model loading"
        if not st:
            return False, "joining the consumer group"
        if st.get("state") == "draining":
            return False, "draining"
        live, why = self._liveness()
        if not live:
            return False, why
        return True, "ready"

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.probe.close()

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                path = self.path.split("?", 1)[0]
                if path == "/metrics":
                    self._send(200, generate_latest(server.metrics.registry), CONTENT_TYPE_LATEST)
                elif path == "/healthz":
                    ok, why = server.live()
                    self._send(200 if ok else 503, ("ok\n" if ok else f"{why}\n").encode())
                elif path == "/readyz":
                    ok, why = server.ready()
                    self._send(200 if ok else 503, f"{why}\n".encode())
                else:
                    self._send(404, b"not found\n")

            def _send(self, code: int, body: bytes, ctype: str = "text/plain; charset=utf-8") -> None:
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                pass  # probes every few seconds would drown the JSON job log

        return Handler


def start_health_server(host: str, port: int, redis_url: str, keys: Keys) -> HealthServer:
    """Metrics registry, Redis probe and HTTP server for one worker, started."""
    return HealthServer(host, port, WorkerMetrics(), RedisProbe(redis_url, keys)).start()
