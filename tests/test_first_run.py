"""A new user's first hour (issue #24, point 7), each rough edge run the way they would meet it: the real
``pagedq`` command line in subprocesses, a real Redis, the README's own snippets in bash.

``submit`` without a worker and ``status`` with exited workers are in ``test_queue_commands.py``; the batch
exit code in ``test_batch_exit_code.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from schemas.jobs import DeadLetter, FinalEvent, parse_event
from tests.redis_servers import RedisServer, redis_server  # noqa: F401
from tests.worker_harness import REPO, Ctx, inprocess_worker, make_engine

README = (REPO / "README.md").read_text()

DEBIAN = pytest.mark.parametrize("redis_server", ["debian"], indirect=True)


def section(title: str) -> str:
    found = re.search(rf"^#+ {re.escape(title)}[^\n]*\n(.*?)(?=^#+ |\Z)", README, re.S | re.M)
    assert found, f"no section {title!r} in README.md"
    return found.group(1)


def env(**extra: str) -> dict[str, str]:
    """This environment without pagedq's settings (a fresh user has none), one thread per process."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("PAGEDQ_")}
    return {**base, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", **extra}


def pagedq(*argv: str) -> list[str]:
    """The ``pagedq`` console script (``ops.cli:main``), as it runs from a fresh clone."""
    return [sys.executable, "-m", "ops.cli", *argv]


@pytest.fixture
def ctx(redis_server: RedisServer) -> Iterator[Ctx]:  # noqa: F811
    c = Ctx(redis_server)
    yield c
    c.close()


# ------------------------------------------------------------------------------------- output | head


@DEBIAN
@pytest.mark.parametrize(
    "command",
    [pytest.param("worker --print-config", marks=pytest.mark.slow), "status --json", "dead list --json"],
)  # the worker's --print-config imports the engine (~7 s a server variant): slow tier
def test_output_into_a_reader_that_left_ends_quietly(ctx: Ctx, command: str) -> None:
    """``... | head`` closes the pipe early; the command must not end in a BrokenPipeError traceback. The
    reader here has left before the first write, so the broken pipe is certain, not a race with ``head``."""
    letter = DeadLetter(job="{oops", reason="job is not valid JSON", code="invalid_request", attempts=1, worker="w")
    ctx.redis.xadd(ctx.keys.dead, letter.to_fields())
    read_end, write_end = os.pipe()
    os.close(read_end)
    argv = pagedq(*command.split())
    if not command.startswith("worker"):
        argv += ["--redis-url", ctx.server.url, "--namespace", ctx.ns]
    try:
        proc = subprocess.run(argv, cwd=REPO, env=env(), stdout=write_end, stderr=subprocess.PIPE, text=True,
                              timeout=120)  # fmt: skip
    finally:
        os.close(write_end)
    assert "Traceback" not in proc.stderr and "BrokenPipe" not in proc.stderr, proc.stderr
    assert proc.returncode == 141  # 128 + SIGPIPE, as for a C tool the signal ended


# ----------------------------------------------------------------------------------------- --help


def test_worker_help_explains_every_flag_and_promises_no_download() -> None:
    proc = subprocess.run(pagedq("worker", "--help"), cwd=REPO, env=env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    text = " ".join(proc.stdout.split())
    assert not re.search(r"\btest", text, re.I), "no test-only flag belongs in --help"
    assert "hub id" not in text and "nothing is downloaded from a hub" in text
    assert "(default: 16; env PAGEDQ_MAX_NUM_SEQS)" in text and "default: on; env PAGEDQ_ENABLE_PREFIX_CACHING" in text
    from worker.__main__ import build_parser

    for action in build_parser()._actions:
        assert action.help, f"{action.option_strings} has no help"


def test_demo_and_generate_flags_say_what_they_do_and_their_defaults() -> None:
    from ops.cli import build_parser

    (subcommands,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    assert isinstance(subcommands, argparse._SubParsersAction)
    for name in ("demo", "generate"):
        for action in subcommands.choices[name]._actions:
            assert action.help, f"pagedq {name} {action.option_strings or action.dest} has no help"
            if action.default not in (None, False, True) and action.dest != "help":
                assert "default" in action.help, f"pagedq {name} {action.option_strings} hides its default"


def test_bad_generation_values_are_usage_errors_before_the_model_loads(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Exit 2 and one line naming the value, not a pydantic traceback after the model has loaded (the
    missing model folder shows nothing was loaded first); a missing model folder is one line too."""
    from ops.cli import build_parser, main

    with pytest.raises(SystemExit) as usage:
        build_parser().parse_args(["demo", "--max-tokens", "0"])
    assert usage.value.code == 2 and "--max-tokens: must be at least 1, got 0" in capsys.readouterr().err
    missing = str(tmp_path / "no-model")
    for flags, needle in (
        (["--max-tokens", "0"], "max_tokens: "),
        (["--temperature", "-1"], "temperature: "),
        ([], f"Model {missing!r} is not a local folder"),
    ):
        assert main(["generate", "--model", missing, *flags, "hi"]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"pagedq generate: {needle}") and "Traceback" not in err, err


@pytest.mark.slow  # the CLI in a subprocess (~6 s); test_secrets runs --print-config in the default tier
def test_print_config_names_the_default_model(tmp_path: Path) -> None:
    proc = subprocess.run(pagedq("worker", "--print-config"), cwd=REPO, env=env(PAGEDQ_MODEL_DIR=str(tmp_path)),
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    from engine.default_model import DefaultModelUnavailable, find_default_gguf

    try:  # nothing prepared in tmp_path: the package's GGUF is what the worker would serve
        want = str(find_default_gguf())
    except DefaultModelUnavailable:
        from engine.default_model import DEFAULT_MODEL_NAME

        want = str(tmp_path / DEFAULT_MODEL_NAME)
    assert json.loads(proc.stdout)["model"] == want


# ---------------------------------------------------------------------------------- prepare-model


@pytest.mark.slow  # the CLI in a subprocess up to its slow imports (~6 s)
def test_prepare_model_speaks_before_its_slow_imports(tmp_path: Path) -> None:
    """The first line comes before torch is imported (``-X importtime`` logs each import as it happens, on
    the same pipe), not after the seconds those imports take. The model is already prepared here: the
    conversion's own progress is the next test's."""
    from engine.default_model import CONVERSION_FORMAT, DEFAULT_MODEL_NAME, MARKER_FILENAME, REQUIRED_FILES

    folder = tmp_path / DEFAULT_MODEL_NAME
    folder.mkdir()
    for name in REQUIRED_FILES:
        (folder / name).write_text("{}")
    files = {name: 2 for name in REQUIRED_FILES}
    (folder / MARKER_FILENAME).write_text(json.dumps({"format": CONVERSION_FORMAT, "files": files}))
    proc = subprocess.run([sys.executable, "-u", "-X", "importtime", *pagedq("prepare-model")[1:]], cwd=REPO,
                          env=env(PAGEDQ_MODEL_DIR=str(tmp_path)), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:]
    lines = proc.stdout.splitlines()
    said = [i for i, line in enumerate(lines) if not line.startswith("import time:")]
    torch_at = next(i for i, line in enumerate(lines) if re.search(r"\|\s+torch$", line))
    assert said and said[0] < torch_at, lines[said[0]] if said else proc.stdout[-2000:]
    assert "loading torch and transformers" in lines[said[0]]
    assert lines[said[-1]] == str(folder)


def test_a_long_conversion_step_reports_progress_while_it_runs() -> None:
    """Reading the GGUF takes ~25 s with no output of its own: ``still ...`` lines come while it runs. The
    step here waits for two of them (no sleeps), so the test is as fast as the ticks."""
    from engine.default_model import _progress

    lines: list[str] = []
    two_ticks = threading.Event()

    def log(line: str) -> None:
        lines.append(line)
        if sum(x.startswith("still reading") for x in lines) >= 2:
            two_ticks.set()

    with _progress(log, "reading the GGUF", "about 25 s", every_s=0.01):
        assert two_ticks.wait(30), lines
    assert lines[0] == "reading the GGUF (about 25 s)"
    assert all(re.fullmatch(r"still reading the GGUF seconds=\d+", x) for x in lines[1:]), lines
    count = len(lines)
    assert not two_ticks.wait(0.05) or len(lines) == count  # the ticker stopped with the step


# ------------------------------------------------------------------------------------------- demo


@pytest.mark.slow  # a whole demo run (~12 s): the default tier stays under 5 minutes
def test_demo_leaves_no_temp_folder_behind(tiny_model: Any, tmp_path: Path) -> None:
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    model = str(tiny_model("llama_gqa"))
    # The worker reads its namespace and queue from the environment the demo passes on: the demo's jobs
    # went to the default ones, where nobody served them (600 s of silence per job).
    demo_env = env(TMPDIR=str(tmp), PAGEDQ_NAMESPACE="demo-ns", PAGEDQ_QUEUE="demo-q")
    proc = subprocess.run(pagedq("demo", "--model", model, "--max-tokens", "2"), cwd=REPO, env=demo_env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "removed when the demo ends well" in proc.stdout
    kept = [p for p in tmp.iterdir() if p.name.startswith("pagedq-demo-")]
    # Kept only when something failed: then the demo says so, and the worker's log says what.
    assert kept == [], proc.stderr[-1000:] + "".join((p / "worker.log").read_text()[-1500:] for p in kept)


def test_demo_checks_the_workers_settings_before_it_starts_anything(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The demo's worker reads the demo's environment: a bad ``PAGEDQ_*`` value there killed it at start,
    unseen (its log is a file), while the producer waited 600 s per job for it, then exited 0."""
    import tempfile

    from ops.cli import main

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setenv("PAGEDQ_MAX_NUM_SEQS", "0")
    assert main(["demo", "--model", str(model_dir)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "pagedq demo: invalid setting max_num_seqs (PAGEDQ_MAX_NUM_SEQS): Input should be greater than 0, got '0'"
    ], err
    assert list(tmp_path.iterdir()) == []  # nothing started, nothing left behind


@pytest.mark.slow  # a worker process that gets as far as its metrics port (~4 s)
def test_demo_stops_at_once_when_its_worker_dies_at_start(tiny_model: Any, tmp_path: Path) -> None:
    """A worker that exits before it is ready (here: a metrics host that does not resolve, exit 78) ends
    the demo with exit 1 and the worker's own last line, instead of 600 s of waiting per job and exit 0."""
    model = str(tiny_model("llama_gqa"))
    bad_host = env(PAGEDQ_METRICS_PORT="1", PAGEDQ_METRICS_HOST="nohost.invalid")
    proc = subprocess.run(pagedq("demo", "--model", model, "--data-dir", str(tmp_path / "demo")), cwd=REPO,
                          env=bad_host, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "pagedq demo: the worker exited with code 78 before it was ready: " in proc.stderr, proc.stderr
    assert "worker.metrics_port_unavailable" in proc.stderr and "enqueued" not in proc.stdout


# ---------------------------------------------------------------------------------------- README


@DEBIAN
def test_the_readme_raw_protocol_snippets_run_in_bash(ctx: Ctx, tiny_model: Any, tmp_path: Path) -> None:
    """``Submitting a job``'s two bash blocks, as a user pastes them: the XADD (in a folder with files, where
    an unquoted ``*`` would be expanded), then the XREAD loop, which must end at the terminal event."""
    if shutil.which("redis-cli") is None:
        pytest.skip("redis-cli is not installed (apt-get install redis-tools)")
    blocks = re.findall(r"```bash\n(.*?)```", section("Submitting a job"), re.S)
    assert len(blocks) == 2, blocks
    script = "\n".join(blocks).replace("pagedq:", f"{ctx.ns}:")
    assert '"messages":[{"role":"user"' in script and '"prompt"' not in script  # an instruct model wants chat
    prelude = f'redis-cli() {{ command redis-cli -u "{ctx.server.url}" "$@"; }}\n'
    for name in ("a.txt", "b.txt"):
        (tmp_path / name).write_text("a file the shell would put in place of *")
    with inprocess_worker(ctx, make_engine(Path(tiny_model("llama_gqa"))), name="w-readme"):
        proc = subprocess.run(["bash", "-euc", prelude + script], cwd=tmp_path, capture_output=True, text=True,
                              timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert re.fullmatch(r"\d+-\d+", lines[0]), lines[0]  # XADD's entry id
    events = [parse_event(line) for line in lines[1:]]
    assert isinstance(events[-1], FinalEvent) and events[-1].id == "a1"
    assert [e.type for e in events[:-1]] == ["token"] * (len(events) - 1)
    assert events[-1] == ctx.result("a1")


def test_readme_tells_a_new_user_what_to_expect() -> None:
    quick = " ".join(section("Quick start").split())
    assert "135M parameters" in quick and "4-bit (Q4_1) GGUF" in quick and "That is the model, not the engine" in quick
    assert "pagedq submit --chat" in quick
    assert '"prompt":"Hello"' not in README
    tests = " ".join(section("Tests").split())
    # The tiers' sizes and times as measured, and the default tier within its 5-minute budget.
    default = re.search(r"runs the default tier: (\d+) tests in (\d+) s", tests)
    slow = re.search(r"`make test-slow` \(`pytest -m slow`: (\d+) tests in (\d+) s\)", tests)
    assert default and slow, tests
    assert int(default.group(2)) < 300
    assert "10 minutes" not in README
