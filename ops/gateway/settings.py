"""The gateway's settings: one pydantic-settings model, ``PAGEDQ_*`` variables overridden by flags.

Kept apart from the worker's :class:`worker.settings.Settings` because the two processes share only the
Redis connection fields: a gateway has no model, no engine and no KV cache to configure, and a worker has no
HTTP port or API keys. The shared fields carry the same names and variables, so one environment (for
instance a compose file's) serves both.
"""

from __future__ import annotations

import hmac
from typing import Annotated, Any, Literal

from pydantic import Field, SecretStr, ValidationError, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from schemas.keys import MAX_QUEUE_SHARDS, check_name
from worker.settings import ENV_PREFIX, MASK, Settings, SettingsError, _describe, mask_url


class GatewaySettings(BaseSettings):
    """``pagedq serve`` configuration. Every field is also the env var ``PAGEDQ_<FIELD>``."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="ignore", validate_default=True)

    redis_url: str | None = Field(
        None,
        description="redis://, rediss://, unix:// or redis+cluster://host:port[,host:port...] URL; unset: the "
        "embedded Redis a local `pagedq worker` runs",
    )
    namespace: str = Field("pagedq", description="prefix of every Redis key")
    queue: str = Field(
        "default", description="queue jobs go to when several queues serve the requested model (else: theirs)"
    )
    queue_shards: int = Field(
        1, ge=1, le=MAX_QUEUE_SHARDS, description="job streams each queue is split into (as the workers' setting)"
    )
    host: str = Field("127.0.0.1", description="address to bind; 0.0.0.0 in containers")
    port: int = Field(8000, ge=0, le=65535, description="HTTP port")
    # NoDecode: a comma-separated variable, not JSON (a JSON list is accepted by the validator below).
    api_keys: Annotated[list[SecretStr], NoDecode] = Field(
        default_factory=list,
        description="accepted bearer keys (comma-separated; prefer the variable: flags show in `ps`); "
        "empty: no authentication",
    )
    queue_timeout_s: float = Field(
        60.0, gt=0, description="a job no worker has picked up within this long is cancelled: 503"
    )
    request_timeout_s: float = Field(
        600.0, gt=0, description="longest a request may take in all; the job's deadline (timeout_s) too"
    )
    default_max_tokens: int = Field(256, ge=1, description="max_tokens of a request that sets none")
    # Every request in flight holds a Redis connection while it waits on its reply stream (a blocking XREAD of
    # up to 250 ms at a time), so the pool bounds how many requests a gateway follows at once without waiting.
    # Beyond it requests queue for a connection instead of failing; one that waits past the timeout is 503.
    redis_max_connections: int = Field(
        100, ge=1, le=100_000, description="Redis connections of the gateway's pool (per node on a cluster)"
    )
    redis_pool_timeout_s: float = Field(
        10.0, gt=0, le=3_600, description="longest a request waits for a free Redis connection before a 503"
    )
    dashboard_refresh_s: float = Field(2.0, gt=0, description="how often the dashboard page refreshes itself")
    log_level: Literal["debug", "info", "warning", "error"] = "info"

    @field_validator("api_keys", mode="before")
    @classmethod
    def _split_keys(cls, value: Any) -> Any:
        if isinstance(value, str):  # a flag or an env var: comma-separated, or a JSON list
            text = value.strip()
            if text.startswith("["):
                import json

                return json.loads(text)
            return [k.strip() for k in text.split(",") if k.strip()]
        return value

    @field_validator("namespace", "queue")
    @classmethod
    def _simple_name(cls, value: str) -> str:
        return check_name("name", value)

    @field_validator("redis_url")
    @classmethod
    def _redis_url(cls, value: str | None) -> str | None:
        # The worker's rules, so both reject the same URLs with the same words.
        validated: str | None = Settings._redis_url(value)
        return validated

    @field_validator("log_level", mode="before")
    @classmethod
    def _lower(cls, value: Any) -> Any:
        return value.lower() if isinstance(value, str) else value

    def key_ok(self, given: str) -> bool:
        """Whether ``given`` is one of the keys, compared in constant time against every key (no early
        exit), so response times tell an attacker nothing about how much of a key was right."""
        ok = False
        for key in self.api_keys:
            ok |= hmac.compare_digest(key.get_secret_value().encode(), given.encode())
        return ok

    def redacted(self) -> dict[str, Any]:
        """Effective values with secrets masked (Redis password, every API key), for ``--print-config``."""
        data = self.model_dump(mode="json")
        data["api_keys"] = [MASK for _ in self.api_keys]
        if self.redis_url:
            data["redis_url"] = mask_url(self.redis_url)
        return data


def load_gateway_settings(**overrides: Any) -> GatewaySettings:
    """Defaults < ``PAGEDQ_*`` < ``overrides`` (flags; None means unset). A bad value raises
    :class:`SettingsError` with one line naming the setting and its variable."""
    given = {k: v for k, v in overrides.items() if v is not None}
    try:
        return GatewaySettings(**given)
    except ValidationError as exc:
        message = _describe(exc)
        if "api_keys" in message:  # never echo a key back, not even a malformed one
            message = f"invalid setting api_keys ({ENV_PREFIX}API_KEYS)"
        raise SettingsError(message) from None
