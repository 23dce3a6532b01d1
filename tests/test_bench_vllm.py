"""vLLM's CPU build as a bench system (``vllm-cpu``, issue 18), tested where vLLM is not installed (as in CI).

What runs here: the ``compass`` workload, the greedy-agreement measure, the settings vLLM is given (cores,
KV budget, speculation matched to pagedq's), the one-line skip when vLLM's venv is absent, and the runner's
JSON protocol end to end on the tiny model, with the runner's transformers stand-in in place of vLLM and the
main interpreter in place of the venv's. Nothing here needs the vLLM venv; runs against real vLLM are the
bench's job (``pagedq bench --systems pagedq,vllm-cpu --workloads compass``), with their figures in the
README.
"""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

import pytest

from ops.bench import report as rep
from ops.bench import runner
from ops.bench import vllm_cpu_runner as vr
from ops.bench import workloads as wl
from ops.bench.system import BenchContext, System, SystemResult
from ops.bench.vllm_system import RUNNER, VLLMCPUSystem, bind_cpus, cpu_list, pagedq_speculation


def _ctx(tmp_path: Path, model: Path | None = None, **kw: object) -> tuple[BenchContext, list[str]]:
    lines: list[str] = []
    ctx = BenchContext(
        model_path=model or tmp_path / "model",
        device="cpu",
        dtype="float32",
        threads=1,
        seed=0,
        max_num_seqs=16,
        max_num_batched_tokens=256,
        kv_cache_bytes=16 << 20,
        block_size=16,
        hf_batch_size=4,
        work_dir=tmp_path,
        log=lines.append,
        **kw,  # type: ignore[arg-type]
    )
    return ctx, lines


def test_compass_is_the_issues_workload() -> None:
    """64 requests, random ids, prompts 32-512 and outputs 32-256, deterministic for a seed."""
    a = wl.compass(0, 49152)
    assert len(a.requests) == 64 and a.name == "compass"
    assert [r.prompt_ids for r in a.requests] == [r.prompt_ids for r in wl.compass(0, 49152).requests]
    assert wl.compass(1, 49152).requests != a.requests
    for r in a.requests:
        assert 32 <= len(r.prompt_ids) <= 512 and 32 <= r.max_tokens <= 256
        assert all(wl.RANDOM_ID_LOW <= t < 49152 for t in r.prompt_ids)
    assert max(len(r.prompt_ids) for r in a.requests) > 400 and min(r.max_tokens for r in a.requests) < 80
    tiny = wl.compass(0, 512, wl.QUICK_COMPASS)
    assert all(4 <= t < 512 for r in tiny.requests for t in r.prompt_ids)
    assert all(r.max_tokens >= rep.AGREEMENT_PREFIX for r in tiny.requests)


def test_agreement_counts_requests_whose_first_32_tokens_match() -> None:
    workload = wl.Workload("compass", [wl.BenchRequest([1], 40)] * 4)
    base = [list(range(40)) for _ in range(4)]
    other = [list(b) for b in base]
    other[1][35] = 999  # differs after the first 32: still agrees
    other[2][31] = 999  # differs within the first 32
    other[3][0] = 999
    ref, res = SystemResult("pagedq", "ok"), SystemResult("vllm-cpu", "ok")
    ref.outputs, res.outputs = base, other
    ref.check(workload)
    res.check(workload)
    agree = rep.agreement(ref, res)
    assert agree["first_32"] == 0.5 and agree["identical"] == 0.25


def test_vllm_gets_pagedqs_cores_kv_budget_and_speculation(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert cpu_list([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8" and cpu_list([3]) == "3"
    assert bind_cpus(1) == cpu_list([min(__import__("os").sched_getaffinity(0))])
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    monkeypatch.setenv("PYTHONPATH", "/somewhere")
    ctx, _ = _ctx(tmp_path)
    env = VLLMCPUSystem().environment(ctx)
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == bind_cpus(1) and env["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert "PYTHONPATH" not in env

    from engine.config import EngineConfig

    spec = pagedq_speculation(ctx)  # pagedq's default: prompt-lookup drafts on
    assert spec is not None and spec["method"] == "ngram"
    assert spec["num_speculative_tokens"] == EngineConfig().num_speculative_tokens
    assert (spec["prompt_lookup_min"], spec["prompt_lookup_max"]) == (2, 4)
    ctx.num_speculative_tokens = 3
    assert pagedq_speculation(ctx) == {**spec, "num_speculative_tokens": 3}
    ctx.num_speculative_tokens = 0  # pagedq without drafts: vLLM without speculation
    assert pagedq_speculation(ctx) is None
    req = VLLMCPUSystem().request(wl.compass(0, 512, wl.QUICK_COMPASS), ctx)
    assert req["speculative"] is None and req["dtype"] == "float32" and len(req["requests"]) == 8
    json.dumps(req)  # the protocol is JSON


class _Stub(System):
    """A system that always runs: stands in for pagedq, to see the others go on."""

    name = "pagedq"

    def run(self, workload: wl.Workload, ctx: BenchContext) -> SystemResult:
        res = SystemResult(self.name, "ok", wall_s=1.0)
        res.outputs = [[7] * r.max_tokens for r in workload.requests]
        res.check(workload)
        return res


def test_absent_venv_is_one_line_and_the_others_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGEDQ_VLLM_VENV", str(tmp_path / "no-venv"))
    ctx, lines = _ctx(tmp_path)
    systems: list[System] = [_Stub(), VLLMCPUSystem()]
    unavailable = {s.name: s.unavailable(ctx) for s in systems}
    assert "vllm_env.sh" in (unavailable["vllm-cpu"] or "")
    announced: set[tuple[str, str]] = set()
    for workload in (wl.compass(0, 512, wl.QUICK_COMPASS), wl.mixed(4, 0, wl.TextSource(None, 512))):
        results, _ = runner._run_workload(workload, systems, unavailable, ctx, announced)
        assert results["pagedq"].status == "ok" and results["pagedq"].tokens_ok
        assert results["vllm-cpu"].status == "skipped"
    skipped = [line for line in lines if "vllm-cpu" in line]
    assert len(skipped) == 1 and "no-venv" in skipped[0], lines


def test_runner_imports_nothing_from_pagedq() -> None:
    """The runner runs in vLLM's venv: pagedq's packages (and their torch) are not there."""
    tree = ast.parse(RUNNER.read_text(encoding="utf-8"))
    modules = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    modules |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert not {m.split(".")[0] for m in modules} & {"engine", "pagedq_kernels", "ops", "schemas", "worker", "tests"}


def test_runner_reports_a_failure_as_a_result(tmp_path: Path) -> None:
    """A run that fails (here: an unknown backend) still writes a JSON result that says how."""
    req, res = tmp_path / "req.json", tmp_path / "res.json"
    req.write_text(json.dumps({"backend": "nope"}), encoding="utf-8")
    assert vr.main(["runner", str(req), str(res)]) == 1
    out = json.loads(res.read_text(encoding="utf-8"))
    assert out["status"] == "failed" and "nope" in out["reason"] and out["traceback"]


@pytest.mark.slow  # two model loads and two generations on the tiny model (~20 s on 2 shared cores)
def test_runner_protocol_end_to_end_agrees_with_pagedq(tmp_path: Path) -> None:
    """The vllm-cpu system through its runner subprocess and JSON files, with the transformers stand-in:
    exact greedy lengths come back, and at fp32 they agree with pagedq's on the first 32 tokens."""
    from ops.bench.pagedq_system import PagedqSystem
    from ops.bench.tiny import make_quick_model

    model = make_quick_model(tmp_path / "quick-model")
    ctx, _ = _ctx(tmp_path, model)
    workload = wl.compass(0, 512, wl.QUICK_COMPASS)
    system = VLLMCPUSystem(python=Path(sys.executable), backend="transformers")
    assert system.unavailable(ctx) is None
    theirs = system.run(workload, ctx)
    assert theirs.tokens_ok and theirs.output_tokens == workload.output_tokens
    assert theirs.extra["speculative_config"]["method"] == "ngram"
    ours = PagedqSystem().run(workload, ctx)
    assert ours.tokens_ok
    agree = rep.agreement(ours, theirs)
    assert agree["first_32"] >= 0.875, agree  # fp32, exact-parity engine: a near-tie may flip one request
