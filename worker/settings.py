"""All of pagedq's worker settings in one validated model: env vars ``PAGEDQ_*``, overridden by CLI flags.

Validation happens once, at start, so a typo in a deployment fails loudly before a model is loaded, with a
one-line message that names the setting (and its environment variable).
"""

from __future__ import annotations

import os
import re
import socket
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit, urlunsplit

from pydantic import Field, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from schemas.keys import check_name

ENV_PREFIX = "PAGEDQ_"


def default_worker_name() -> str:
    """``<host>-<pid>``: unique per process, readable in ``XINFO CONSUMERS`` and heartbeat keys."""
    host = re.sub(r"[^A-Za-z0-9._-]", "-", socket.gethostname())[:48] or "worker"
    return f"{host}-{os.getpid()}"


def default_data_dir() -> Path:
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "pagedq"


class SettingsError(ValueError):
    """A setting has a bad value; ``str()`` is a single line naming it."""


class Settings(BaseSettings):
    """Worker configuration. Every field is also the env var ``PAGEDQ_<FIELD>`` (case-insensitive)."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="forbid", validate_default=True)

    # --- Redis and wire protocol
    redis_url: str | None = Field(
        None, description="redis://, rediss:// or unix:// URL; unset starts an embedded Redis in data_dir"
    )
    data_dir: Path = Field(default_factory=default_data_dir, description="embedded Redis data (AOF) folder")
    namespace: str = Field("pagedq", description="prefix of every Redis key")
    queue: str = Field("default", description="queue name: jobs are read from <namespace>:jobs:<queue>")
    name: str = Field(default_factory=default_worker_name, description="consumer name of this worker")

    # --- model and engine
    model: str | None = Field(None, description="model folder (Hugging Face layout) or hub id")
    dtype: str = Field("auto", description="auto (float32 on CPU, bfloat16 on CUDA), float32, bfloat16...")
    device: str = Field("auto", description="auto, cpu, cuda, cuda:N")
    max_num_seqs: int = Field(16, gt=0, le=4096, description="sequences the engine runs at once")
    max_num_batched_tokens: int = Field(2048, gt=0, description="token budget of one engine step")
    kv_cache_bytes: int | None = Field(None, gt=0, description="KV cache size; unset lets the engine size it")
    block_size: int = Field(16, gt=0, le=1024, description="tokens per KV cache block")
    enable_prefix_caching: bool = True
    num_speculative_tokens: int = Field(
        8, ge=0, le=64, description="greedy jobs: draft tokens per decode step from prompt lookup; 0 = off"
    )
    prompt_lookup_min: int = Field(2, ge=1, le=16, description="shortest context suffix matched for drafts")
    prompt_lookup_max: int = Field(4, ge=1, le=16, description="longest context suffix matched for drafts")
    speculative_disable_by_batch_size: int = Field(
        32, ge=1, description="no drafts while more sequences than this run (the step is compute-bound)"
    )
    max_model_len: int | None = Field(None, gt=0, description="context cap; unset: the model's own")
    gpu_memory_utilization: float = Field(0.85, gt=0, le=1, description="CUDA: share of free memory for KV")

    # --- admission and reliability
    prefetch: int = Field(2, ge=0, le=1024, description="unstarted jobs held beyond free engine slots")
    reclaim_idle_s: float = Field(30.0, gt=0, description="idle time after which others' jobs are taken over")
    max_attempts: int = Field(3, ge=1, le=100, description="deliveries of a job before it is dead-lettered")
    shutdown_grace_s: float = Field(30.0, ge=0, description="time to finish running jobs on SIGTERM")
    result_ttl_s: int = Field(86_400, gt=0, description="lifetime of <namespace>:result:<id>")
    reply_ttl_s: int = Field(3_600, gt=0, description="lifetime of a reply stream after its terminal event")
    reply_maxlen: int = Field(10_000, gt=0, description="approximate cap (MAXLEN ~) of a reply stream")
    max_payload_bytes: int = Field(1 << 20, gt=0, le=512 << 20, description="largest accepted job JSON")
    stream_interval_s: float = Field(0.0, ge=0, description="minimum time between token events of a job")
    heartbeat_interval_s: float = Field(2.0, gt=0, description="heartbeat period (its TTL is 3x)")
    poll_interval_s: float = Field(0.05, gt=0, description="how often a busy worker looks for new jobs")
    block_s: float = Field(1.0, ge=0, le=30, description="longest blocking read of an idle worker; 0 polls")
    cancel_poll_s: float = Field(0.5, gt=0, description="cancel-key poll period, behind the pub/sub notice")
    redis_backoff_max_s: float = Field(5.0, gt=0, description="cap of the reconnect backoff")

    # --- logging
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    log_format: Literal["auto", "json", "console"] = "auto"
    log_prompts: bool = Field(
        False, description="also log each job's prompt and output text (off: logs never hold user text)"
    )

    # --- metrics and health (worker/health.py): /metrics, /healthz, /readyz
    metrics_port: int = Field(
        0, ge=0, le=65535, description="HTTP port of /metrics, /healthz, /readyz; 0 = off (the image uses 9400)"
    )
    metrics_host: str = Field("127.0.0.1", description="address the metrics port binds; 0.0.0.0 in containers")

    # --- extension
    engine_factory: str | None = Field(
        None, description="'module:callable' taking Settings and returning an engine; unset: pagedq's Engine"
    )

    @field_validator("log_level", "log_format", mode="before")
    @classmethod
    def _lower(cls, value: Any) -> Any:
        return value.lower() if isinstance(value, str) else value

    @field_validator("namespace", "queue", "name")
    @classmethod
    def _simple_name(cls, value: str) -> str:
        return check_name("name", value)

    @field_validator("redis_url")
    @classmethod
    def _redis_url(cls, value: str | None) -> str | None:
        if value is None or value == "":
            return None
        parts = urlsplit(value)
        if parts.scheme not in ("redis", "rediss", "unix"):
            raise ValueError("must start with redis://, rediss:// or unix://")
        if parts.scheme == "unix" and not parts.path:
            raise ValueError("a unix:// URL needs a socket path")
        if parts.scheme != "unix":
            try:
                port = parts.port
            except ValueError as exc:
                raise ValueError(f"bad port: {exc}") from None
            if not parts.hostname or (port is not None and port == 0):
                raise ValueError("needs a host (and a non-zero port, if any)")
            db = parts.path.lstrip("/")
            if db and not db.isdigit():
                raise ValueError(f"database must be a number, got {db!r}")
        return value

    @field_validator("dtype")
    @classmethod
    def _dtype(cls, value: str) -> str:
        allowed = ("auto", "float32", "float16", "bfloat16")
        if value not in allowed:
            raise ValueError(f"must be one of {', '.join(allowed)}")
        return value

    @field_validator("device")
    @classmethod
    def _device(cls, value: str) -> str:
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", value):
            raise ValueError("must be auto, cpu, cuda or cuda:N")
        return value

    @field_validator("engine_factory")
    @classmethod
    def _factory(cls, value: str | None) -> str | None:
        if value is not None and not re.fullmatch(r"[\w.]+:[\w.]+", value):
            raise ValueError("must look like 'package.module:callable'")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> Settings:
        if self.max_num_batched_tokens < self.block_size:
            raise ValueError("max_num_batched_tokens must be at least block_size")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError("prompt_lookup_min must be at most prompt_lookup_max")
        return self

    @property
    def heartbeat_ttl_s(self) -> float:
        return 3 * self.heartbeat_interval_s

    def redacted(self) -> dict[str, Any]:
        """Effective values with secrets (the Redis password) masked, for ``--print-config`` and logs."""
        data = self.model_dump(mode="json")
        if self.redis_url:
            data["redis_url"] = mask_url(self.redis_url)
        return data


def mask_url(url: str) -> str:
    """Replace the password of a URL by ``***``."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    netloc = f"{user}:***@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


CONFIG_ENV = f"{ENV_PREFIX}CONFIG"


def read_config_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A TOML or JSON file of settings (``max_num_seqs = 64``...); a ``[pagedq]`` table is honoured."""
    import json
    import tomllib

    p = Path(path)
    try:
        text = p.read_text()
        data = tomllib.loads(text) if p.suffix != ".json" else json.loads(text)
    except (OSError, ValueError) as exc:
        raise SettingsError(f"invalid setting config ({CONFIG_ENV}): cannot read {p}: {exc}") from None
    data = data.get("pagedq", data)
    if not isinstance(data, dict):
        raise SettingsError(f"invalid setting config ({CONFIG_ENV}): {p} must hold a table of settings")
    return data


def load_settings(config: str | None = None, **overrides: Any) -> Settings:
    """Build :class:`Settings` from defaults < a config file (``config`` or ``PAGEDQ_CONFIG``) < the
    environment < ``overrides`` (CLI flags; None means unset).

    Raises :class:`SettingsError` whose message names the first bad setting and its env var, e.g.
    ``invalid setting max_num_seqs (PAGEDQ_MAX_NUM_SEQS): Input should be greater than 0, got -1``.
    """
    given = {k: v for k, v in overrides.items() if v is not None}
    path = config or os.environ.get(CONFIG_ENV)
    if path:
        from_file = read_config_file(path)
        env = {k.upper() for k in os.environ}
        for key, value in from_file.items():
            if f"{ENV_PREFIX}{key}".upper() not in env:
                given.setdefault(key, value)
    try:
        return Settings(**given)
    except ValidationError as exc:
        raise SettingsError(_describe(exc)) from None


def _describe(exc: ValidationError) -> str:
    err = exc.errors()[0]
    field = str(err["loc"][0]) if err.get("loc") else ""
    msg = str(err.get("msg", "invalid")).removeprefix("Value error, ")
    if not field:
        return f"invalid settings: {msg}"
    if err.get("type") == "extra_forbidden":
        return f"unknown setting {field}"
    got = err.get("input")
    if isinstance(got, str) and "://" in got:  # never echo a password, even of a malformed URL
        got = re.sub(r"(://[^:/@]*:)[^@]*@", r"\1***@", got)
    shown = "" if isinstance(got, dict) or got is None or ", got " in msg else f", got {got!r}"
    return f"invalid setting {field} ({ENV_PREFIX}{field.upper()}): {msg}{shown}"
