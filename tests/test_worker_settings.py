"""Settings at start: a bad value exits non-zero with one line naming the setting; ``--print-config`` masks
secrets. Runs the real ``python -m worker`` entry point (no model is loaded: validation comes first)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.worker_harness import REPO
from worker.settings import load_settings, mask_url


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
