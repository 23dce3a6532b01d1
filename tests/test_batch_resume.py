"""``pagedq batch`` resumes by content and refuses up front what would fail every line (a bug hunt's five
faults): runs as a script runs them, through a real Redis server and an in-process worker where lines are
answered.

* Errors of lines without a usable custom_id were keyed by line number, and a resume skipped whatever line
  had that number: a user who deleted the bad lines lost the valid lines that moved up, and progress said
  "40/39 done". They are keyed by the SHA-256 of the line's bytes now.
* A list or object custom_id ended every resume in ``TypeError: unhashable type``.
* ``--default-max-tokens 0`` and ``--timeout-s inf`` failed every line, after the model loaded.
* A pipe as OUTPUT hung forever (the run reads OUTPUT back to resume); a pipe as INPUT was "cannot read".
* A full disk ended the run in a chained ``OSError`` traceback and exit 1, which says Redis failed.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from ops import batch
from ops.batch.command import LINES_FAILED, WRITE_FAILED
from tests.test_batch import (  # noqa: F401  (engine, lone_queue, model_dir: fixtures)
    batch_process,
    chat,
    completion,
    engine,
    finish,
    lone_queue,
    model_dir,
    queued,
    records,
    subprocess_env,
)
from tests.worker_harness import REPO, Ctx, inprocess_worker

GOOD = [completion(f"c{i}", f"the sea {i}", max_tokens=2, temperature=0) for i in range(3)]


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


def run_to_end(ctx: Ctx, inp: Path, out: Path, *extra: str) -> tuple[int, str]:
    """A batch run on ``ctx``'s queue as a script runs it: (exit code, stderr)."""
    proc = batch_process(ctx, inp, out, "--progress", "log", *extra)
    stderr = finish(proc)
    assert "Traceback" not in stderr, stderr
    return proc.returncode, stderr


def test_a_resume_after_deleting_the_bad_lines_runs_the_lines_that_moved_up(
    lone_queue: Ctx,  # noqa: F811
    engine: Any,  # noqa: F811
    tmp_path: Path,
) -> None:
    """The usual workflow: errors show up at once (the feeder writes them as it reads), the user stops the
    run, deletes the bad lines the errors file points at, and reruns. The valid lines then sit at the bad
    lines' old numbers: they must run, not be skipped as those lines' errors (nothing was answered, and the
    rerun said "all 3 lines ... already in", exit 3, with an empty OUTPUT)."""
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_lines(inp, ["{oops", "not json at all", *GOOD])
    with queued(lone_queue, inp, out, "--progress", "none") as first:  # the good jobs wait for a worker
        first.terminate()  # the user stops the run
        stderr = finish(first)
    assert first.returncode == 130, stderr
    errors = records(tmp_path / "out.errors.jsonl")
    assert [(e["custom_id"], e["error"]["line"]) for e in errors] == [(None, 1), (None, 2)]
    assert not records(out)

    write_lines(inp, GOOD)  # the user deletes the bad lines
    with inprocess_worker(lone_queue, engine):
        code, stderr = run_to_end(lone_queue, inp, out)
    assert code == 0, stderr
    assert sorted(r["custom_id"] for r in records(out)) == ["c0", "c1", "c2"]
    assert "3/3 lines done" in stderr, stderr


def test_stale_errors_count_for_no_line_and_bad_lines_are_known_by_their_content(
    lone_queue: Ctx,  # noqa: F811
    engine: Any,  # noqa: F811
    tmp_path: Path,
) -> None:
    """A resume counts only the lines of this input that are done. A bad line's error kept for a line that
    is gone made the count "3/2 done" and the exit 3 (a line failed) although every line had its answer;
    a bad line that moved is still known, and a second copy of it is a line of its own."""
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_lines(inp, ["nope", *GOOD[:2]])
    with inprocess_worker(lone_queue, engine):
        code, stderr = run_to_end(lone_queue, inp, out)
    assert code == LINES_FAILED, stderr

    write_lines(inp, GOOD[:2])  # the bad line deleted: both lines answered, nothing failed
    code, stderr = run_to_end(lone_queue, inp, out)
    assert code == 0, stderr
    assert "all 2 lines" in stderr, stderr

    write_lines(inp, [GOOD[1], GOOD[0], "nope"])  # the bad line back, elsewhere: the same line, done
    code, stderr = run_to_end(lone_queue, inp, out)
    assert code == LINES_FAILED, stderr
    assert "all 3 lines" in stderr, stderr

    write_lines(inp, ["nope", *GOOD[:2], "nope"])  # a second copy: one record stands for one line only
    code, stderr = run_to_end(lone_queue, inp, out)
    assert code == LINES_FAILED, stderr
    assert "4/4 lines done" in stderr and "2 line(s) failed" in stderr, stderr
    assert [e["error"]["line"] for e in records(tmp_path / "out.errors.jsonl")] == [1, 4]
    assert sorted(r["custom_id"] for r in records(out)) == ["c0", "c1"]


def test_a_list_or_object_custom_id_is_that_lines_error_on_every_run(
    lone_queue: Ctx,  # noqa: F811
    engine: Any,  # noqa: F811
    tmp_path: Path,
) -> None:
    """Such a line is invalid (custom_id must be a non-empty string) on the first run, and on a resume, where
    the skip looked its custom_id up in a set and ended the run in ``TypeError: unhashable type: 'list'``
    as soon as OUTPUT held one answer: lines appended to an answered file, and ``--retry-errors``."""
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_lines(inp, GOOD[:1])
    listed = json.loads(GOOD[1]) | {"custom_id": ["c1"]}
    keyed = json.loads(GOOD[2]) | {"custom_id": {"id": "c2"}}
    with inprocess_worker(lone_queue, engine):
        code, stderr = run_to_end(lone_queue, inp, out)
        assert code == 0, stderr
        write_lines(inp, [GOOD[0], json.dumps(listed), json.dumps(keyed)])  # appended: a resume
        for extra in ((), ("--retry-errors",)):
            code, stderr = run_to_end(lone_queue, inp, out, *extra)
            assert code == LINES_FAILED, stderr
            errors = records(tmp_path / "out.errors.jsonl")
            assert [(e["custom_id"], e["error"]["line"]) for e in errors] == [(None, 2), (None, 3)], extra
            assert all("custom_id must be a non-empty string" in e["error"]["message"] for e in errors)
        code, stderr = run_to_end(lone_queue, inp, out)  # nothing left: both known by their content
        assert code == LINES_FAILED and "all 3 lines" in stderr, stderr
    assert [r["custom_id"] for r in records(out)] == ["c0"]


@pytest.mark.parametrize(
    ("flag", "value", "needle"),
    [
        ("--default-max-tokens", "0", "must be at least 1"),
        ("--default-max-tokens", "-5", "must be at least 1"),
        ("--default-max-tokens", str(2**31), "must be at most"),
        ("--timeout-s", "inf", "finite number of seconds above 0"),
        ("--timeout-s", "nan", "finite number of seconds above 0"),
        ("--timeout-s", "0", "finite number of seconds above 0"),
        ("--log-interval-s", "0", "finite number of seconds above 0"),
        ("--max-in-flight", "0", "must be at least 1"),
    ],
)
def test_flag_values_that_would_fail_every_line_are_usage_errors(
    flag: str, value: str, needle: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """argparse's exit 2 naming the flag, before a model loads or a file is made: such a value failed every
    line, each stored in the errors file, so the rerun with a good value found them all done."""
    inp, out = write_lines(tmp_path / "in.jsonl", GOOD), tmp_path / "out.jsonl"
    with pytest.raises(SystemExit) as exited:
        batch.main([str(inp), str(out), "--local", "--model", "/nonexistent", f"{flag}={value}"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert flag in err and needle in err, err
    assert not out.exists() and not (tmp_path / "out.errors.jsonl").exists()


def test_pipes_and_devices_are_refused_as_files_the_run_reads_back(tmp_path: Path) -> None:
    """OUTPUT and the errors file are read back to resume: a pipe there (``/dev/stdout | jq``) hung forever,
    saying nothing. INPUT is read twice: a pipe there is refused as a pipe, not as "cannot read". Each run is
    a subprocess under a timeout, since the hang is the fault."""
    inp, out = write_lines(tmp_path / "in.jsonl", GOOD), tmp_path / "out.jsonl"
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    cases = [
        ([str(inp), str(fifo)], f"{fifo} must be a regular file"),
        ([str(inp), str(out), "--errors", str(fifo)], f"{fifo} must be a regular file"),
        ([str(inp), "/dev/null"], "/dev/null must be a regular file"),
        ([str(fifo), str(out)], f"INPUT {fifo} must be a regular file"),
    ]
    for args, needle in cases:
        argv = [sys.executable, "-m", "ops.batch", *args, "--local", "--model", "/nonexistent", "--progress", "none"]
        done = subprocess.run(argv, cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=60)
        assert done.returncode == 2, (args, done.stderr)
        assert needle in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert not out.exists()


def _file_size_limit(limit: int) -> None:
    """In the child: writes past ``limit`` bytes fail with EFBIG (Python ignores SIGXFSZ), as on a full disk."""
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))


def test_a_failed_write_stops_the_run_with_one_line_and_a_rerun_resumes(
    lone_queue: Ctx,  # noqa: F811
    tmp_path: Path,
) -> None:
    """A file that cannot grow (a real write failure: the child's file size limit, which the kernel enforces
    as a full disk would) stops the run with one line and exit ``WRITE_FAILED``, not a chained ``OSError``
    traceback and exit 1 ("Redis failed"); the rerun, with room, cuts the torn last line and writes every
    line's error exactly once. Bad lines only: the feeder writes them, no worker needed."""
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    lines = [chat(f"bad-{i}", "hi", temperature="hot") if i % 4 else f"not json {i}" for i in range(80)]
    write_lines(inp, lines)
    argv = [sys.executable, "-m", "ops.batch", str(inp), str(out), "--redis-url", lone_queue.server.url,
            "--namespace", lone_queue.ns, "--progress", "none"]  # fmt: skip
    full = subprocess.run(
        argv,
        cwd=REPO,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=lambda: _file_size_limit(4096),
    )
    errors = tmp_path / "out.errors.jsonl"
    assert full.returncode == WRITE_FAILED == 74, full.stderr
    assert len(full.stderr.strip().splitlines()) == 1 and "Traceback" not in full.stderr, full.stderr
    assert f"cannot write {errors}: File too large" in full.stderr and "rerun" in full.stderr, full.stderr
    assert errors.stat().st_size == 4096 and not errors.read_bytes().endswith(b"\n")  # a torn last line

    again = subprocess.run(argv, cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=120)
    assert again.returncode == LINES_FAILED, again.stderr
    written = records(errors)
    keys = Counter(e["custom_id"] or e["error"]["line_sha256"] for e in written)
    assert len(written) == len(lines) == len(keys) and set(keys.values()) == {1}
    assert sorted(e["error"]["line"] for e in written) == list(range(1, len(lines) + 1))
