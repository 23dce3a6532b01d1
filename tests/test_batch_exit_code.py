"""``pagedq batch`` exits non-zero when lines failed (issue #24, point 7): a script that checks ``$?`` must not
take a run with error lines for a clean one. Run as a real subprocess (``--local``, a tiny model), as a
script would run it.

3 (``LINES_FAILED``): every line was answered, some in the errors file, whether in this run or (a rerun
with nothing left to do) in an earlier one. Exit 0 for a clean file is ``test_batch.py``'s.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ops.batch.command import LINES_FAILED
from tests.worker_harness import REPO

GOOD = {"custom_id": "ok-1", "method": "POST", "url": "/v1/chat/completions",
        "body": {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}}  # fmt: skip
BAD = {"custom_id": "bad-1", "method": "POST", "url": "/v1/chat/completions",
       "body": {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "temperature": -3}}  # fmt: skip


def run_batch(inp: Path, out: Path, model: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PAGEDQ_")}
    env.update({"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"})
    argv = [sys.executable, "-m", "ops.batch", str(inp), str(out), "--local", "--model", str(model),
            "--max-num-seqs", "4", "--kv-cache-bytes", str(8 << 20), "--progress", "log"]  # fmt: skip
    return subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow  # the CLI in a subprocess (torch import, model load: ~11 s)
def test_failed_lines_give_a_distinct_exit_code(tiny_model: Any, tmp_path: Path) -> None:
    model = Path(tiny_model("llama_gqa"))
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text(json.dumps(GOOD) + "\n" + json.dumps(BAD) + "\n")
    first = run_batch(inp, out, model)
    assert first.returncode == LINES_FAILED == 3, first.stderr
    assert "1 line(s) failed" in first.stderr and f"exit {LINES_FAILED}" in first.stderr
    errors = [json.loads(x) for x in (tmp_path / "out.errors.jsonl").read_text().splitlines()]
    assert [e["custom_id"] for e in errors] == ["bad-1"]
    assert [json.loads(x)["custom_id"] for x in out.read_text().splitlines()] == ["ok-1"]

    again = run_batch(inp, out, model)  # nothing left to run: the answer is still "some lines failed"
    assert again.returncode == LINES_FAILED, again.stderr
    assert "already in" in again.stderr
