"""Threads and OpenMP waiting for CPU inference on shared machines (engine/cpu_runtime.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine import LLM, cpu_runtime

REPO = Path(__file__).resolve().parent.parent


def _cgroup(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    return tmp_path


@pytest.mark.parametrize(
    ("files", "limit"),
    [
        ({"cpu.max": "max 100000\n"}, None),  # v2, unlimited
        ({"cpu.max": "150000 100000\n"}, 1.5),  # v2, --cpus 1.5
        ({"cpu.max": "50000 100000\n"}, 0.5),
        ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),  # v1, unlimited
        ({"cpu/cpu.cfs_quota_us": "300000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 3.0),  # v1, --cpus 3
        ({}, None),  # no cgroup files at all
        ({"cpu.max": "garbage\n"}, None),
    ],
)
def test_cgroup_cpu_limit(tmp_path: Path, files: dict[str, str], limit: float | None) -> None:
    assert cpu_runtime.cgroup_cpu_limit(_cgroup(tmp_path, files)) == limit


def test_usable_cpus_is_the_affinity_mask_capped_by_the_quota_rounded_down(tmp_path: Path) -> None:
    mask = len(os.sched_getaffinity(0))
    assert cpu_runtime.usable_cpus(_cgroup(tmp_path / "none", {})) == mask
    assert cpu_runtime.usable_cpus(_cgroup(tmp_path / "big", {"cpu.max": "6400000 100000"})) == mask
    assert cpu_runtime.usable_cpus(_cgroup(tmp_path / "half", {"cpu.max": "50000 100000"})) == 1  # at least 1
    quota = _cgroup(tmp_path / "1.5", {"cpu.max": "150000 100000"})
    assert cpu_runtime.usable_cpus(quota) == 1  # a second thread over quota would be frozen mid-region


def test_an_operators_thread_count_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "7")
    assert cpu_runtime.default_threads() == 7
    monkeypatch.setenv("OMP_NUM_THREADS", "nonsense")
    assert cpu_runtime.default_threads() == cpu_runtime.usable_cpus()


def _child(code: str, env: dict[str, str]) -> dict[str, object]:
    clean = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    out = subprocess.run(
        [sys.executable, "-c", code], env={**clean, **env}, cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    result: dict[str, object] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


REPORT = "import json, os; print(json.dumps({k: os.environ.get(k) for k in ('OMP_WAIT_POLICY', 'GOMP_SPINCOUNT')}))"


@pytest.mark.slow  # three fresh interpreters importing torch: ~10 s
def test_importing_the_engine_sets_passive_waiting_before_torch_loads() -> None:
    assert _child(f"import engine; {REPORT}", {}) == {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "30000"}
    # The operator's values win; a process that loaded torch first keeps libgomp's (and is told so).
    assert _child(f"import engine; {REPORT}", {"OMP_WAIT_POLICY": "ACTIVE"})["OMP_WAIT_POLICY"] == "ACTIVE"
    late = "import torch; from engine import cpu_runtime; print(cpu_runtime.configure_openmp_waiting())\n" + REPORT
    assert _child(late, {}) == {"OMP_WAIT_POLICY": None, "GOMP_SPINCOUNT": None}


def test_the_engine_caps_torch_threads_at_the_usable_cpus(model_dir: Path) -> None:
    """A process that asked for more threads than it may run (OpenMP's default under a quota) gets
    capped when the engine starts; a lower count stays."""
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(64)
        LLM(str(model_dir), num_kv_blocks=8)
        assert torch.get_num_threads() == cpu_runtime.default_threads()
        torch.set_num_threads(1)
        LLM(str(model_dir), num_kv_blocks=8)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
