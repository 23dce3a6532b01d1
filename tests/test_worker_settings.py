"""Settings at start: a bad value exits non-zero with one line naming the setting; ``--print-config`` masks
secrets. Runs the real ``python -m worker`` entry point (no model is loaded: validation comes first)."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from schemas.keys import Keys
from tests.redis_servers import RedisServer, redis_server, unique_namespace  # noqa: F401
from tests.worker_harness import REPO, wait_for
from worker.keeper import Keeper, OwnedEntries
from worker.reclaimer import Reclaimer
from worker.settings import Settings, load_settings, mask_url


def _worker(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("PAGEDQ_")}
    base.update({"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **env})
    return subprocess.run(
        [sys.executable, "-m", "worker", *args], cwd=REPO, env=base, capture_output=True, text=True, timeout=60
    )


@pytest.mark.parametrize(
    ("env", "setting"),
    [
        ({"PAGEDQ_MAX_NUM_SEQS": "-1"}, "max_num_seqs"),
        ({"PAGEDQ_REDIS_URL": "http://localhost:6379"}, "redis_url"),
        ({"PAGEDQ_REDIS_URL": "redis://localhost:notaport/0"}, "redis_url"),
        ({"PAGEDQ_REDIS_URL": "redis://:pw@/0"}, "redis_url"),
        ({"PAGEDQ_METRICS_PORT": "70000"}, "metrics_port"),
    ],
)
def test_bad_setting_exits_with_one_line(env: dict[str, str], setting: str) -> None:
    proc = _worker(**env)
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert setting in lines[0] and f"PAGEDQ_{setting.upper()}" in lines[0], lines[0]
    assert ":pw@" not in lines[0], "a password was echoed"


def test_flag_overrides_env_and_errors_name_the_flag_setting() -> None:
    proc = _worker("--max-num-seqs", "0", PAGEDQ_MAX_NUM_SEQS="8")
    assert proc.returncode != 0 and "max_num_seqs" in proc.stderr


@pytest.mark.slow  # the CLI in a subprocess (~5 s); test_secrets covers the query form by default
def test_print_config_masks_the_redis_password() -> None:
    proc = _worker(
        "--print-config",
        "--max-num-seqs",
        "7",
        PAGEDQ_REDIS_URL="rediss://pagedq:s3cr3t-pw@redis.example:6380/2",
        PAGEDQ_METRICS_PORT="9400",
    )
    assert proc.returncode == 0, proc.stderr
    assert "s3cr3t-pw" not in proc.stdout + proc.stderr
    config = json.loads(proc.stdout)
    assert config["redis_url"] == "rediss://pagedq:***@redis.example:6380/2"
    assert config["max_num_seqs"] == 7 and config["metrics_port"] == 9400
    assert config["metrics_host"] == "127.0.0.1"


def test_tls_and_acl_urls_pass_through_unchanged() -> None:
    for url in ("rediss://user:pw@h:6380/0?ssl_cert_reqs=required", "redis://default:pw@h/1", "unix:///tmp/r.sock"):
        assert load_settings(redis_url=url).redis_url == url
    assert mask_url("redis://h:6379/0") == "redis://h:6379/0"


def test_metrics_port_is_off_by_default() -> None:
    """Several local workers on one host would fight over a fixed port; the container image turns it on."""
    assert load_settings().metrics_port == 0


def test_config_file_sits_below_env_and_flags(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from worker.settings import SettingsError, load_settings

    cfg = tmp_path / "pagedq.toml"
    cfg.write_text('[pagedq]\nmax_num_seqs = 7\nqueue = "from-file"\nprefetch = 3\n')
    monkeypatch.setenv("PAGEDQ_QUEUE", "from-env")
    s = load_settings(str(cfg), prefetch=5)
    assert (s.max_num_seqs, s.queue, s.prefetch) == (7, "from-env", 5)
    monkeypatch.setenv("PAGEDQ_CONFIG", str(cfg))
    assert load_settings().max_num_seqs == 7
    bad = tmp_path / "bad.toml"
    bad.write_text("max_num_seqs = -1\n")
    with pytest.raises(SettingsError, match="max_num_seqs"):
        load_settings(str(bad))
    with pytest.raises(SettingsError, match="config"):
        load_settings(str(tmp_path / "missing.toml"))
    with pytest.raises(SettingsError, match="prompt_lookup_min"):  # caught here, not at engine start
        load_settings(prompt_lookup_min=5, prompt_lookup_max=3)


# -------------------------------------------------------------------------- list settings from the env


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("app:,b:", ["app:", "b:"]),  # the form --help documents
        ("app:", ["app:"]),
        (" app: , b: ,", ["app:", "b:"]),
        ('["app:", "b:"]', ["app:", "b:"]),  # a JSON list is still accepted
        ("", []),
    ],
)
def test_reply_prefixes_env_var_takes_the_documented_comma_separated_form(
    value: str, expected: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """pydantic-settings JSON-decoded a list setting's variable before the splitting validator ran, so
    ``PAGEDQ_REPLY_PREFIXES=app:,b:`` died with a SettingsError traceback while the flag worked."""
    monkeypatch.setenv("PAGEDQ_REPLY_PREFIXES", value)
    assert load_settings().reply_prefixes == expected
    assert load_settings(reply_prefixes=value).reply_prefixes == expected  # the flag, same form


def test_every_list_setting_is_split_by_its_validator_not_json_decoded() -> None:
    """Any list (or other container) setting added later must carry NoDecode too, or its env var breaks."""
    import typing

    from pydantic_settings import NoDecode

    for name, info in Settings.model_fields.items():
        args = typing.get_args(info.annotation) or (info.annotation,)
        if any(typing.get_origin(a) in (list, dict, set, tuple) or a in (list, dict, set, tuple) for a in args):
            assert NoDecode in info.metadata, f"{name} is JSON-decoded from its env var"


def test_an_undecodable_env_var_is_one_settings_error_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """pydantic-settings' own SettingsError (no ValueError) is turned into the package's, which every
    entry point catches; it names the variable, never its value."""
    from pydantic import Field
    from pydantic_settings import SettingsConfigDict

    import worker.settings as ws

    class Decoded(ws.Settings):  # a list setting without NoDecode: the env source decodes it as JSON
        model_config = SettingsConfigDict(env_prefix="PAGEDQ_", extra="forbid")
        decoded_list: list[str] = Field(default_factory=list)

    monkeypatch.setattr(ws, "Settings", Decoded)
    monkeypatch.setenv("PAGEDQ_DECODED_LIST", "s3cr3t,b")
    with pytest.raises(ws.SettingsError) as err:
        ws.load_settings()
    message = str(err.value)
    assert "decoded_list (PAGEDQ_DECODED_LIST)" in message and "s3cr3t" not in message and "\n" not in message


# ------------------------------------------------------------- non-finite, huge and inconsistent values

FLOAT_SETTINGS = [name for name, info in Settings.model_fields.items() if info.annotation is float]


@pytest.mark.parametrize("name", FLOAT_SETTINGS)
@pytest.mark.parametrize("value", ["inf", "-inf", "nan", "Infinity", "1e308"])
def test_float_settings_refuse_non_finite_and_huge_values(name: str, value: str) -> None:
    """``inf`` printed as ``Infinity`` in --print-config (not JSON), and a heartbeat interval of inf or
    1e308 crash-looped the keeper (``int(inf * 1000)``): the worker had no heartbeat."""
    from worker.settings import SettingsError

    with pytest.raises(SettingsError, match=rf"invalid setting {name} \(--{name.replace('_', '-')}\)"):
        load_settings(**{name: value})


def test_durations_up_to_the_bound_are_accepted() -> None:
    from worker.settings import MAX_DURATION_S, MAX_TTL_S

    s = load_settings(heartbeat_interval_s=MAX_DURATION_S, shutdown_grace_s=MAX_DURATION_S, result_ttl_s=MAX_TTL_S)
    assert s.heartbeat_interval_s == MAX_DURATION_S and s.result_ttl_s == MAX_TTL_S


def test_result_ttl_shorter_than_reply_ttl_is_refused_or_followed() -> None:
    """The client believes a reply stream's terminal event only once the result key confirms it (anyone
    can write a reply stream), so a result key expiring first left readers waiting on a stream that still
    held the answer ("no terminal event within 5s")."""
    from worker.settings import SettingsError

    with pytest.raises(SettingsError, match=r"result_ttl_s \(5\) must be at least reply_ttl_s \(3600\)") as err:
        load_settings(result_ttl_s=5, reply_ttl_s=3600)
    assert "result_ttl_s from --result-ttl-s" in str(err.value)
    assert load_settings(result_ttl_s=60, reply_ttl_s=60).result_ttl_s == 60
    alone = load_settings(result_ttl_s=5)  # the reply streams' default lifetime follows it down
    assert (alone.result_ttl_s, alone.reply_ttl_s) == (5, 5)


# ------------------------------------------------------------------- errors name where a value came from


def test_errors_name_the_source_of_the_value(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A bad value in a --config file was blamed on its (unset) environment variable."""
    from worker.settings import SettingsError

    cfg = tmp_path / "pagedq.toml"
    cfg.write_text("max_num_seqs = -1\nbogus = 1\n")
    with pytest.raises(SettingsError) as err:
        load_settings(str(cfg), bogus=None)
    assert f"max_num_seqs (config file {cfg})" in str(err.value), err.value
    assert "PAGEDQ_MAX_NUM_SEQS" not in str(err.value)
    cfg.write_text("bogus = 1\n")
    with pytest.raises(SettingsError, match=rf"unknown setting bogus \(config file {cfg}\)"):
        load_settings(str(cfg))
    cfg.write_text("result_ttl_s = 10\n")
    monkeypatch.setenv("PAGEDQ_REPLY_TTL_S", "20")
    with pytest.raises(SettingsError) as err:
        load_settings(str(cfg))
    assert f"result_ttl_s from config file {cfg}; reply_ttl_s from PAGEDQ_REPLY_TTL_S" in str(err.value)
    monkeypatch.delenv("PAGEDQ_REPLY_TTL_S")
    cfg.write_text("max_num_seqs = 8\n")
    monkeypatch.setenv("PAGEDQ_MAX_NUM_SEQS", "-1")  # the env var beats the file, and is the one named
    with pytest.raises(SettingsError, match=r"max_num_seqs \(PAGEDQ_MAX_NUM_SEQS\)"):
        load_settings(str(cfg))
    with pytest.raises(SettingsError, match=r"max_num_seqs \(--max-num-seqs\)"):
        load_settings(str(cfg), max_num_seqs="0")


@pytest.mark.parametrize(
    ("args", "env", "expected"),
    [
        ((), {"PAGEDQ_REPLY_PREFIXES": "app:,b:"}, None),
        ((), {"PAGEDQ_REPLY_PREFIXES": '["a b:"]'}, "reply_prefixes (PAGEDQ_REPLY_PREFIXES)"),
        ((), {"PAGEDQ_REPLY_PREFIXES": "[app:"}, "reply_prefixes (PAGEDQ_REPLY_PREFIXES)"),
        ((), {"PAGEDQ_SHUTDOWN_GRACE_S": "inf"}, "shutdown_grace_s (PAGEDQ_SHUTDOWN_GRACE_S)"),
        (("--heartbeat-interval-s", "1e308"), {}, "heartbeat_interval_s (--heartbeat-interval-s)"),
        (("--heartbeat-interval-s", "nan"), {}, "heartbeat_interval_s (--heartbeat-interval-s)"),
        (("--result-ttl-s", "5", "--reply-ttl-s", "3600"), {}, "result_ttl_s (5) must be at least reply_ttl_s (3600)"),
        (("--config", "{cfg}"), {}, "max_num_seqs (config file {cfg})"),
    ],
    ids=["prefixes-ok", "prefixes-bad", "prefixes-bad-json", "inf", "huge", "nan", "ttls", "config"],
)
def test_the_cli_exits_2_with_one_line(
    args: tuple[str, ...], env: dict[str, str], expected: str | None, tmp_path: Path
) -> None:
    """The real entry point: a bad value anywhere is one line on stderr and exit code 2, never a traceback;
    --print-config is strict JSON (no Infinity)."""
    cfg = tmp_path / "bad.toml"
    cfg.write_text("max_num_seqs = -1\n")
    proc = _worker("--print-config", *(a.format(cfg=cfg) for a in args), PAGEDQ_MODEL=str(tmp_path), **env)
    if expected is None:
        assert proc.returncode == 0, proc.stderr
        config = json.loads(proc.stdout, parse_constant=lambda c: pytest.fail(f"{c} in --print-config"))
        assert config["reply_prefixes"] == ["app:", "b:"]
        return
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and expected.format(cfg=cfg) in lines[0], proc.stderr


# ---------------------------------------------------------------------------------- the keeper's TTL


class _Log:
    def __init__(self) -> None:
        self.failures: list[str] = []

    def exception(self, event: str, **_kw: object) -> None:
        self.failures.append(event)


def _keeper(redis_server: RedisServer, heartbeat_ttl_s: float, beats: list[int]) -> tuple[Keeper, Keys, Any]:  # noqa: F811
    keys = Keys(unique_namespace())
    client = redis_server.client()

    def status() -> dict[str, Any]:
        beats.append(1)  # a beat calls it once, just before it writes the heartbeat
        return {"beats": len(beats)}

    reclaimer = Reclaimer(client, keys, "w", reclaim_idle_s=30)
    keeper = Keeper(
        client, keys, "w", reclaimer, OwnedEntries(), status,
        period_s=0.01, heartbeat_ttl_s=heartbeat_ttl_s, backoff_max_s=0.1, log=_Log(),
    )  # fmt: skip
    return keeper, keys, client


def test_keeper_beats_with_a_sub_millisecond_or_a_week_long_ttl(redis_server: RedisServer) -> None:  # noqa: F811
    """A TTL under a millisecond made ``PX 0``, which Redis refuses: every beat failed (keeper.failed)."""
    from worker.settings import MAX_DURATION_S

    for ttl_s in (3e-4, 3 * MAX_DURATION_S):
        beats: list[int] = []
        keeper, keys, client = _keeper(redis_server, ttl_s, beats)
        keeper.start()
        try:
            wait_for(lambda: len(beats) >= 3, what="three beats")  # noqa: B023
        finally:
            keeper.stop()
        assert keeper.log.failures == [], ttl_s
        if ttl_s > 1:
            assert 0.99 * ttl_s * 1000 < client.pttl(keys.heartbeat("w")) <= ttl_s * 1000
        client.close()


@pytest.mark.parametrize("ttl_s", [math.inf, math.nan, 1e308])
def test_keeper_refuses_a_ttl_redis_cannot_take_before_it_starts(ttl_s: float, redis_server: RedisServer) -> None:  # noqa: F811
    """Settings bound the interval; a Keeper given such a TTL anyway fails at once instead of crash-looping
    in its thread with no heartbeat."""
    with pytest.raises((OverflowError, ValueError)):
        _keeper(redis_server, ttl_s, [])


# ----------------------------------------------------------------- unknown variables, engine rules, the URL


def test_a_misspelt_pagedq_variable_stops_the_worker_with_one_line() -> None:
    """pydantic-settings ignores an environment variable that names no field, so ``PAGEDQ_MAX_NUM_SEQ=64``
    ran a worker with the default 16 sequences, and nothing said so."""
    proc = _worker("--print-config", PAGEDQ_MAX_NUM_SEQ="64")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert lines == [
        "pagedq worker: unknown setting PAGEDQ_MAX_NUM_SEQ (environment variable): did you mean PAGEDQ_MAX_NUM_SEQS?"
    ], proc.stderr


def test_pagedq_variables_read_outside_the_settings_are_not_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from worker.settings import SettingsError, unknown_env_vars

    # the gateway's, the default model's folder, a kernel switch, a test hook, compose's own, lower case
    for var in ("PAGEDQ_API_KEYS", "PAGEDQ_MODEL_DIR", "PAGEDQ_DISABLE_C_KERNELS", "PAGEDQ_TEST_FAULTS", "PAGEDQ_GPU"):
        monkeypatch.setenv(var, "1")
    monkeypatch.setenv("pagedq_max_num_seqs", "5")  # pydantic-settings reads names case-insensitively
    assert load_settings().max_num_seqs == 5
    monkeypatch.setenv("PAGEDQ_WHATEVER", "1")
    with pytest.raises(SettingsError, match=r"^unknown setting PAGEDQ_WHATEVER \(environment variable\): no setting"):
        load_settings()
    assert unknown_env_vars({"PAGEDQ_BLOCKSIZE": "8", "PAGEDQ_QUEUE": "q", "OTHER": "x"}) == ["PAGEDQ_BLOCKSIZE"]


def test_every_pagedq_variable_the_code_reads_is_known() -> None:
    """A variable added to the code (a kernel switch, a gateway setting, a compose variable) must be added
    to ``OTHER_ENV`` too, or setting it would stop every worker at start."""
    import re

    from ops.gateway.settings import GatewaySettings
    from worker.settings import ENV_PREFIX, unknown_env_vars

    files = [REPO / "Dockerfile", REPO / "docker-compose.yml", REPO / "Makefile"]
    for folder in ("engine", "pagedq_kernels", "worker", "ops", "schemas"):
        files += [*(REPO / folder).rglob("*.py"), *(REPO / folder).rglob("*.sh")]
    names = {m for f in files for m in re.findall(r"\bPAGEDQ_[A-Z0-9_]*[A-Z0-9]\b", f.read_text(errors="replace"))}
    names |= {f"{ENV_PREFIX}{field.upper()}" for field in GatewaySettings.model_fields}
    assert len(names) > 30
    assert unknown_env_vars(dict.fromkeys(names, "")) == []


def test_an_empty_optional_setting_means_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    """``PAGEDQ_MODEL=`` (an env file's way to say "none") made the model the current folder, and
    compose's ``${PAGEDQ_MAX_MODEL_LEN:-}`` an invalid integer; ``redis_url`` and ``quantization`` already
    read an empty value as unset."""
    names = ("model", "kv_cache_bytes", "speculative_disable_by_batch_size", "max_model_len", "engine_factory")
    for name in (*names, "celery_result_backend", "redis_url", "quantization"):
        monkeypatch.setenv(f"PAGEDQ_{name.upper()}", "")
    settings = load_settings()
    assert [getattr(settings, name) for name in names] == [None] * len(names)
    assert (settings.celery_result_backend, settings.redis_url, settings.quantization) == (None, None, None)
    assert load_settings(model=" ").model is None


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ({"block_size": "24"}, r"block_size \(--block-size\): must be a power of two"),
        (
            {"tensor_parallel_size": "2", "quantization": "int8"},
            r"quantization cannot be combined with tensor_parallel_size above 1 .*tensor_parallel_size from "
            r"--tensor-parallel-size",
        ),
    ],
    ids=["block-size", "tp-quantization"],
)
def test_engine_rules_are_settings_errors(overrides: dict[str, str], expected: str) -> None:
    """EngineConfig refuses these, but only once the worker had built its kernels and checked its model:
    ``worker.failed`` with a traceback and exit 1, where every other bad value is one line and exit 2."""
    from worker.settings import SettingsError

    with pytest.raises(SettingsError, match=expected):
        load_settings(**overrides)
    assert load_settings(block_size="32", tensor_parallel_size="2").block_size == 32


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("redis://:pa/ss@h:6379/0", "a password holding /, ? or # must be percent-encoded"),
        ("redis://:pa?ss@h:6379/0", "a password holding /, ? or # must be percent-encoded"),
        ("redis://:pw@h:6379/0?ssl_password=pw", "redis-py takes no option ssl_password in a redis:// URL"),
        ("unix:///tmp/r.sock?sockettimeout=1", "redis-py takes no option sockettimeout in a unix:// URL"),
        ("redis://h:6379/0?socket_timeout=soon", "redis-py refuses its options: Invalid value for 'socket_timeout'"),
    ],
)
def test_a_redis_url_redis_py_would_refuse_at_first_connect_is_refused_at_start(url: str, expected: str) -> None:
    """redis-py reads a URL's options only when it first connects, after the model has loaded: the worker
    died then with a TypeError traceback. A password with an unencoded / or ? read as a bad port, with no
    word of the fix. Neither message may show the password."""
    from worker.settings import SettingsError

    with pytest.raises(SettingsError) as err:
        load_settings(redis_url=url)
    assert expected in str(err.value) and "pa/ss" not in str(err.value) and "=pw" not in str(err.value), err.value
    assert load_settings(redis_url="rediss://:p%2Fw@h:6380/0?ssl_cert_reqs=required").redis_url


# ------------------------------------------------------------- start-up problems only an operator can fix


@pytest.fixture
def logged(capsys: pytest.CaptureFixture[str]) -> Iterator[Callable[[], list[dict[str, Any]]]]:
    """run_worker's JSON log lines (it configures structlog for this process: put back afterwards)."""
    import structlog

    saved = structlog.get_config()
    try:
        yield lambda: [json.loads(line) for line in capsys.readouterr().err.splitlines() if line.startswith("{")]
    finally:
        structlog.configure(**saved)


def test_a_data_dir_the_embedded_redis_cannot_use_is_one_line_and_exit_78(
    tmp_path: Path, logged: Callable[[], list[dict[str, Any]]]
) -> None:
    """The embedded Redis's mkdir raised out of run_worker: a bare traceback on stderr and exit 1."""
    from worker.run import run_worker

    (tmp_path / "file").write_text("")
    settings = load_settings(
        data_dir=str(tmp_path / "file" / "data"), engine_factory="nowhere:engine", log_format="json"
    )
    assert run_worker(settings) == 78
    lines = [line for line in logged() if line["level"] == "error"]
    assert [line["event"] for line in lines] == ["worker.embedded_redis_failed"], lines
    assert lines[0]["data_dir"] == str(tmp_path / "file" / "data") and "PAGEDQ_DATA_DIR" in lines[0]["hint"]


def test_a_cuda_device_on_a_host_without_one_is_one_line_and_exit_78(
    model_dir: Path, logged: Callable[[], list[dict[str, Any]]]
) -> None:
    """``--device cuda`` where torch sees no GPU (the CPU image, a container not given one) ended in a
    torch traceback from inside the engine, exit 1, after the model checks."""
    import torch

    from worker.run import run_worker

    if torch.cuda.is_available():
        pytest.skip("this host has a CUDA device")
    settings = load_settings(redis_url="redis://127.0.0.1:1/0", model=str(model_dir), device="cuda", log_format="json")
    assert run_worker(settings) == 78
    lines = [line for line in logged() if line["level"] == "error"]
    assert [line["event"] for line in lines] == ["worker.device_unavailable"], lines
    assert "no CUDA device is visible" in lines[0]["error"] and "--device cpu" in lines[0]["error"]


@pytest.mark.slow  # a worker process's start and exit (~4 s each): the default tier stays under 5 minutes
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_stop_while_the_model_loads_ends_the_worker_cleanly(sig: signal.Signals, tmp_path: Path) -> None:
    """Before the loop had its handler, SIGTERM killed the worker without a word and left its embedded
    Redis running (the server has a session of its own), and Ctrl-C printed a KeyboardInterrupt traceback.
    Now either ends the start: one ``worker.stopped`` line, exit 0, the embedded Redis stopped."""
    from tests.redis_servers import free_port

    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PAGEDQ_")}
    env.update({"PYTHONPATH": str(REPO), "PAGEDQ_TEST_LOAD_DELAY_S": "600", "PAGEDQ_LOG_FORMAT": "json"})
    log = tmp_path / "worker.log"
    data_dir = tmp_path / "data"
    argv = [sys.executable, "-m", "worker", "--data-dir", str(data_dir), "--metrics-port", str(port),
            "--engine-factory", "tests.ops_helpers:slow_engine"]  # fmt: skip
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        # worker.metrics is logged once the start's handler is in place (and the model "loads" for 600 s)
        wait_for(lambda: proc.poll() is not None or '"worker.metrics"' in log.read_text(), what="worker.metrics")
        redis_pid = int((data_dir / "redis.pid").read_text())
        proc.send_signal(sig)
        assert proc.wait(30) == 0, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = log.read_text()
    assert "Traceback" not in text and '"worker.stopped"' in text and '"phase": "starting"' in text, text
    try:  # the embedded Redis went with it (it stops before exit returns)
        os.kill(redis_pid, 0)
    except ProcessLookupError:
        return
    os.kill(redis_pid, signal.SIGTERM)
    pytest.fail(f"the embedded Redis (pid {redis_pid}) outlived the worker:\n{text}")
