"""docker-compose.yml and the Dockerfile: ``docker compose config`` where the client has the compose plugin
(no engine is needed for that), plus static checks of what the deployment promises, which run everywhere."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.worker_harness import REPO

COMPOSE = REPO / "docker-compose.yml"


def _compose_plugin() -> str | None:
    """None when ``docker compose`` works, else why it cannot run."""
    if shutil.which("docker") is None:
        return "docker CLI not installed"
    proc = subprocess.run(["docker", "compose", "version"], capture_output=True, text=True, timeout=30)
    if proc.returncode != 0:
        return f"docker compose plugin not available: {(proc.stderr or proc.stdout).strip().splitlines()[0][:200]}"
    return None


def _load() -> dict[str, Any]:
    data = yaml.safe_load(COMPOSE.read_text())
    assert isinstance(data, dict)
    return data


def test_docker_compose_config_validates(tmp_path: Path) -> None:
    why = _compose_plugin()
    if why:
        pytest.skip(why)
    env = {**os.environ, "REDIS_PASSWORD": "test-password"}
    for profile in ([], ["--profile", "gpu", "--profile", "tools"]):
        proc = subprocess.run(
            ["docker", "compose", "-f", str(COMPOSE), *profile, "config", "--quiet"],
            cwd=REPO, env=env, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr


def test_compose_requires_the_redis_password() -> None:
    why = _compose_plugin()
    if why:
        pytest.skip(why)
    env = {k: v for k, v in os.environ.items() if k != "REDIS_PASSWORD"}
    proc = subprocess.run(["docker", "compose", "-f", str(COMPOSE), "config", "--quiet"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert proc.returncode != 0 and "REDIS_PASSWORD" in proc.stderr


def test_compose_shape() -> None:
    services = _load()["services"]
    redis = services["redis"]
    assert "--appendonly yes" in " ".join(redis["command"])
    assert "REDIS_PASSWORD" in " ".join(redis["command"]) and "healthcheck" in redis
    worker = services["worker"]
    # scalable: no fixed container name, no host port (replicas would collide)
    assert "container_name" not in worker and "ports" not in worker
    assert "profiles" not in worker and "deploy" not in worker  # CPU by default
    assert worker["environment"]["PAGEDQ_METRICS_PORT"] == "9400"
    assert "${REDIS_PASSWORD" in worker["environment"]["PAGEDQ_REDIS_URL"]
    assert worker["depends_on"]["redis"]["condition"] == "service_healthy"
    gpu = services["worker-gpu"]
    assert gpu["profiles"] == ["gpu"]
    assert gpu["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]
    assert "producer" in services


def test_dockerfile_installs_cpu_torch_first() -> None:
    text = (REPO / "Dockerfile").read_text()
    assert text.startswith("#") and "FROM python:3.11-slim" in text
    torch_at = text.index('"torch==${TORCH_VERSION}"')
    assert torch_at < text.index("COPY engine") and "whl/cpu" in text and "ARG TORCH_INDEX" in text
    assert "PAGEDQ_METRICS_PORT=9400" in text and "pickle" not in text
