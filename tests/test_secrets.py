"""Redis credentials never reach what pagedq prints, logs or serves.

A password can sit in the userinfo of a Redis URL or in its query (redis-py turns ``?password=`` into a
connection argument just like ``redis://:pw@host``), percent-encoded or not, and a generated one may hold
characters that make the URL parse as something else. ``mask_url`` must hide all of them while leaving
the rest readable; these tests check the function itself, then every place a URL is shown: ``--print-config``,
the ``worker.config`` log line, a settings error, the ``/healthz`` body while Redis is down, and the queue
commands' "cannot reach Redis" message.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest
from redis.connection import parse_url

from tests.ops_helpers import http_get
from tests.redis_servers import free_port
from tests.worker_harness import REPO
from worker.health import HealthServer, RedisProbe
from worker.metrics import WorkerMetrics
from worker.settings import Settings, load_settings, mask_url

SECRET = "Zq8-secret-pw"  # distinctive: must appear nowhere in what the worker shows


@pytest.mark.parametrize(
    ("url", "masked"),
    [
        ("redis://h:6379/0", "redis://h:6379/0"),
        ("redis://:Zq8-secret-pw@h", "redis://:***@h"),
        ("redis://pagedq:Zq8-secret-pw@redis.example:6380/2", "redis://pagedq:***@redis.example:6380/2"),
        ("rediss://u:Zq8-secret-pw@h:6380/0?ssl_cert_reqs=required", "rediss://u:***@h:6380/0?ssl_cert_reqs=required"),
        ("unix://:Zq8-secret-pw@/run/redis.sock", "unix://:***@/run/redis.sock"),
        ("unix:///run/redis.sock?password=Zq8-secret-pw", "unix:///run/redis.sock?password=***"),
        ("unix:///run/redis.sock?db=2&password=Zq8-secret-pw", "unix:///run/redis.sock?db=2&password=***"),
        ("redis://h?password=Zq8-secret-pw&username=u", "redis://h?password=***&username=u"),
        ("redis://h/0?username=me@corp&password=Zq8-secret-pw", "redis://h/0?username=me@corp&password=***"),
        ("redis://h/0?pass%77ord=Zq8-secret-pw", "redis://h/0?pass%77ord=***"),  # the name is decoded too
        ("rediss://h?ssl_password=Zq8-secret-pw&client_name=w1", "rediss://h?ssl_password=***&client_name=w1"),
        ("redis://:Zq8%40secret%2Fpw@h/0", "redis://:***@h/0"),  # percent-encoded
        ("redis://Zq8-secret-pw@h:6379", "redis://***@h:6379"),  # no colon: most likely a password
        ("redis://:pw-Zq8@secret@h:1/0", "redis://:***@h:1/0"),  # unencoded "@"
        ("redis://:Zq8?secret@h/0", "redis://:***@h/0"),  # unencoded "?": parses as a query
        ("redis://:Zq8#secret@h", "redis://:***@h"),  # unencoded "#": parses as a fragment
        ("redis://:Zq8/secret+pw==@h:6379", "redis://:***@h:6379"),  # base64: "/" parses as a path
        ("redis://user:12?Zq8secret@h", "redis://user:***@h"),  # a port-like password head
        ("unix://:Zq8/secret@/run/redis.sock", "unix://:***@/run/redis.sock"),
        ("unix:///run/a@b.sock", "unix:///run/a@b.sock"),  # an "@" in a socket path is no credential
        ("redis://[::1]:6379/0", "redis://[::1]:6379/0"),
        ("redis://:Zq8-secret-pw@[::1]:6379/0", "redis://:***@[::1]:6379/0"),
        ("redis://h#Zq8-secret-pw", "redis://h#***"),
        ("not a url", "not a url"),
        ("", ""),
    ],
)
def test_mask_url(url: str, masked: str) -> None:
    assert mask_url(url) == masked
    assert "secret" not in mask_url(url)
    try:
        kwargs = parse_url(url)
    except ValueError:
        return
    # whatever redis-py would authenticate with is gone
    for key in ("password", "ssl_password"):
        if kwargs.get(key):
            assert str(kwargs[key]) not in mask_url(url)


def test_mask_url_never_raises_on_garbage() -> None:
    for url in ("redis://[::1", "redis://:a@[zz", "://@", "@@@", "redis://:Zq8-secret-pw@[::1"):
        assert "Zq8-secret-pw" not in mask_url(url)


def _run(module: str, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("PAGEDQ_")}
    base.update({"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **env})
    return subprocess.run(
        [sys.executable, "-m", module, *args], cwd=REPO, env=base, capture_output=True, text=True, timeout=60
    )


def test_print_config_masks_a_query_password() -> None:
    url = f"redis://127.0.0.1:6379/0?password={SECRET}&username=pagedq"
    proc = _run("worker", "--print-config", PAGEDQ_REDIS_URL=url)
    assert proc.returncode == 0, proc.stderr
    assert SECRET not in proc.stdout + proc.stderr
    assert json.loads(proc.stdout)["redis_url"] == "redis://127.0.0.1:6379/0?password=***&username=pagedq"


def test_a_bad_url_is_reported_without_its_password() -> None:
    """The URL does not parse (an unencoded "?" cut the password): the error names the setting but neither
    echoes the URL's password nor the piece of it that urllib took for a port."""
    proc = _run("worker", "--print-config", PAGEDQ_REDIS_URL="redis://:Zq8?secret-pw@h/0")
    assert proc.returncode == 2
    assert "redis_url" in proc.stderr and "Zq8" not in proc.stderr and "secret" not in proc.stderr


def refuse_engine(settings: Settings) -> None:
    """An engine factory that fails at once: the worker has logged its config by then and exits."""
    raise RuntimeError("no engine in this test")


@pytest.mark.slow  # a worker process start (~6 s); --print-config's masking stays default
def test_the_worker_config_log_line_masks_the_password() -> None:
    # rediss://: ssl_password is an option of TLS connections (on redis:// the settings refuse it at once)
    url = f"rediss://pagedq:{SECRET}@127.0.0.1:{free_port()}/0?ssl_password={SECRET}"
    proc = _run(
        "worker", "--log-format", "json", PAGEDQ_REDIS_URL=url, PAGEDQ_ENGINE_FACTORY="tests.test_secrets:refuse_engine"
    )
    assert proc.returncode == 1, proc.stderr
    assert SECRET not in proc.stdout + proc.stderr
    lines = [json.loads(line) for line in proc.stderr.splitlines() if line.startswith("{")]
    (config,) = [line for line in lines if line.get("event") == "worker.config"]
    masked = config["redis_url"]
    assert masked.startswith("rediss://pagedq:***@127.0.0.1:") and "ssl_password=***" in masked
    assert load_settings(redis_url=url).redacted()["redis_url"] == mask_url(url)


@pytest.fixture
def dead_redis_health() -> Iterator[HealthServer]:
    """The health port of a worker whose Redis (a port nobody listens on) is down."""
    url = f"redis://pagedq:{SECRET}@127.0.0.1:{free_port()}/0?password={SECRET}"
    server = HealthServer("127.0.0.1", 0, WorkerMetrics(), RedisProbe(url)).start()
    yield server
    server.stop()


def test_healthz_body_masks_the_password_while_redis_is_down(dead_redis_health: HealthServer) -> None:
    status, body = http_get(dead_redis_health.port, "/healthz")
    assert status == 503, body
    assert "redis unreachable (redis://pagedq:***@127.0.0.1:" in body and "password=***" in body
    assert SECRET not in body


@pytest.mark.parametrize("command", ["status", "submit", "dead"])
def test_queue_commands_mask_the_password_when_redis_is_down(command: str) -> None:
    url = f"redis://:{SECRET}@127.0.0.1:{free_port()}/0?password={SECRET}"
    args = {"status": ["status"], "submit": ["submit", "hello"], "dead": ["dead", "list"]}[command]
    proc = _run("ops.queue_commands", *args, "--redis-url", url)
    assert proc.returncode == 1, proc.stderr
    assert SECRET not in proc.stdout + proc.stderr
    assert "redis://:***@127.0.0.1:" in proc.stderr
