"""Threads and OpenMP waiting for CPU inference on shared machines (engine/cpu_runtime.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
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


def test_busy_cpu_seconds_reads_proc_stat_lines_of_the_given_cpus() -> None:
    text = (
        "cpu  900 0 900 9000 0 0 0 0 0 0\n"  # the all-CPU line is not a CPU
        "cpu0 100 10 50 1000 5 1 2 7 0 0\n"
        "cpu1 200 0 100 900 0 0 0 300 0 0\n"
        "intr 12345\n"
    )
    hz = os.sysconf("SC_CLK_TCK")
    assert cpu_runtime.busy_cpu_seconds({0}, text) == pytest.approx(170 / hz)  # idle and iowait left out
    assert cpu_runtime.busy_cpu_seconds({0, 1}, text) == pytest.approx((170 + 600) / hz)  # steal counts


def test_core_share_follows_a_neighbour_after_two_agreeing_readings() -> None:
    """Readings fed in: each interval of 1 s, how busy our CPUs were and how much of that was us."""
    if len(os.sched_getaffinity(0)) < 2 or cpu_runtime.usable_cpus() != len(os.sched_getaffinity(0)):
        pytest.skip("needs two CPUs without a quota below them")
    cpus = len(os.sched_getaffinity(0))
    now, busy, own = [0.0], [0.0], [0.0]

    def interval(ours: float, others: float) -> int | None:
        now[0] += 1.0
        own[0] += ours
        busy[0] += ours + others
        return share.poll()

    share = cpu_runtime.CoreShare(cpus, read_busy=lambda: busy[0], read_own=lambda: own[0], clock=lambda: now[0])
    assert share.enabled and share.poll() is None  # no interval has passed yet
    assert interval(cpus, 0.1) is None  # quiet
    assert interval(cpus - 1, 1.0) is None  # a neighbour takes a core: one reading is not enough
    assert interval(cpus - 1, 1.0) == cpus - 1 and share.threads == cpus - 1
    assert share.others_cores == pytest.approx(1.0)
    assert interval(cpus - 1, 0.4) is None  # under half a core: the core is ours again, after one more
    assert interval(cpus - 1, 0.0) == cpus
    assert interval(cpus, 1.0) is None and interval(cpus, 0.0) is None  # a one-reading burst changes nothing
    assert share.threads == cpus


def test_core_share_measures_a_real_busy_process_on_one_of_our_cpus() -> None:
    """The real readings (/proc/stat, this process's CPU time): a busy loop pinned to our last CPU takes
    one thread away, and its end gives it back."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2 or cpu_runtime.usable_cpus() != len(cpus) or not cpu_runtime.PROC_STAT.exists():
        pytest.skip("needs two CPUs without a quota below them, and /proc/stat")
    share = cpu_runtime.CoreShare(len(cpus), interval_s=0.2)
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        os.sched_setaffinity(busy.pid, {cpus[-1]})
        deadline = time.monotonic() + 20
        while share.threads == len(cpus) and time.monotonic() < deadline:
            share.poll()
            time.sleep(0.05)  # this process idles: the readings see the neighbour, not us
        assert share.threads == len(cpus) - 1, f"others' load read as {share.others_cores:.2f} cores"
    finally:
        busy.kill()
        busy.wait()
    deadline = time.monotonic() + 20
    while share.threads < len(cpus) and time.monotonic() < deadline:
        share.poll()
        time.sleep(0.05)
    assert share.threads == len(cpus), f"others' load read as {share.others_cores:.2f} cores"


# A child that loads cpu_runtime alone (stdlib only: no torch, ~0.1 s), calls keep_freed_memory(), then frees and
# re-allocates a 48 MB block (over glibc's default mmap threshold, which rises to 32 MB at most) and counts the
# page faults of touching it the second time.
KEEP = """
import ctypes, importlib.util, json, resource
spec = importlib.util.spec_from_file_location("cpu_runtime", "engine/cpu_runtime.py")
runtime = importlib.util.module_from_spec(spec)
spec.loader.exec_module(runtime)
kept = runtime.keep_freed_memory()
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_size_t], [ctypes.c_void_p]
size = 48 << 20
def touch():
    block = libc.malloc(size)
    ctypes.memset(block, 1, size)
    libc.free(block)
touch()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
touch()
print(json.dumps({"kept": kept, "faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before}))
"""


def test_freed_memory_is_reused_instead_of_faulted_in_again() -> None:
    env = {k: v for k, v in os.environ.items() if k not in cpu_runtime.MALLOC_ENV}
    run = subprocess.run(
        [sys.executable, "-c", KEEP], env=env, cwd=REPO, capture_output=True, text=True, timeout=60, check=True
    )
    kept = json.loads(run.stdout)
    assert kept["kept"] is True
    assert kept["faults"] < 100  # reused from the heap (12288 pages if unmapped and mapped again)
    # An operator's own malloc tuning stands: nothing is changed, and the block is unmapped and faulted in again.
    run = subprocess.run(
        [sys.executable, "-c", KEEP],
        env={**env, "MALLOC_TOP_PAD_": "131072"},
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    left = json.loads(run.stdout)
    assert left["kept"] is False and left["faults"] > 10000
