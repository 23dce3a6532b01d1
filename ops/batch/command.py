"""The ``pagedq batch`` command: arguments, checks before anything runs, the run loop, exit codes.

* **Bounded.** At most ``--max-in-flight`` jobs are outstanding; results are written as they arrive (so the
  output is in completion order, as with OpenAI).
* **Duplicate custom_ids are refused up front** (exit 2, nothing written), and a rerun with nothing left to
  do neither loads a model nor touches Redis.
* **Redis outages are waited out** (retried with :class:`~worker.backoff.Backoff`, no jitter: one client has
  no fleet to spread) for up to ``REDIS_GIVE_UP_S``; then exit 1, and a rerun resumes.
* SIGTERM stops the run like Ctrl-C, so files are closed cleanly either way.

Exit codes: 0 every line has an output line, 1 Redis failed or stayed unreachable for 5 minutes (rerun to
resume), 2 bad arguments or input (duplicates, unreadable file), 3 every line was answered but some failed
(``LINES_FAILED``: their error lines are in the errors file; ``--retry-errors`` runs them again), 74
OUTPUT or the errors file could not be written (``WRITE_FAILED``, sysexits' EX_IOERR: a full disk, say;
free space and rerun to resume), 130 interrupted (rerun to resume).
"""

from __future__ import annotations

import argparse
import fcntl
import math
import os
import signal
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import FrameType
from typing import IO

import redis
from redis.exceptions import RedisClusterUnreachableError

from ops.arg_types import int_at_least, positive_seconds
from ops.batch.backends import Backend, LocalBackend, QueueBackend
from ops.batch.files import (
    InputLine,
    Scan,
    WriteFailed,
    Writer,
    errors_path_for,
    failed_request_ids,
    iter_input,
    read_done,
    scan_input,
)
from ops.batch.progress import Progress
from ops.batch.requests import DEFAULT_MAX_TOKENS, BatchLine, LineError, parse_line
from ops.batch.responses import TerminalEvent, error_record, outcome_record, token_id_text
from ops.queue_commands import REDIS_ERRORS
from schemas.jobs import INT32_MAX, FinalEvent
from worker.backoff import Backoff
from worker.settings import Settings, SettingsError

LINES_FAILED = 3
"""Exit code of a run that answered every line, some with an error: a script must not take it for success."""

WRITE_FAILED = 74
"""Exit code of a run stopped because OUTPUT or the errors file could not be written (sysexits' EX_IOERR, as
the worker's 70 and 78 are sysexits' too): not 1, which says Redis failed, and a rerun resumes once there
is room."""

REDIS_GIVE_UP_S = 300.0
"""How long the run waits out an unreachable Redis before exiting 1 (a rerun resumes where it stopped)."""

REDIS_DOWN = (redis.ConnectionError, redis.TimeoutError, RedisClusterUnreachableError)
"""What an unreachable Redis raises, waited out by the run loop. A cluster client that reaches no node says
so with ``RedisClusterUnreachableError``, a ``RedisClusterException`` and no ``ConnectionError``."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from ops.queue_commands import add_connection_arguments

    parser.description = (
        "Run an OpenAI Batch JSONL file (chat, completions and responses requests) through the queue's workers, "
        "or with --local through an engine in this process. Rerun the same command to resume."
    )
    parser.add_argument("input", type=Path, help="OpenAI Batch input (JSONL)")
    parser.add_argument("output", type=Path, help="output JSONL (appended to; existing custom_ids are skipped)")
    parser.add_argument("--errors", type=Path, default=None, help="errors file (default: OUTPUT.errors.jsonl)")
    parser.add_argument("--local", action="store_true", help="run an engine in this process instead of the queue")
    parser.add_argument(
        "--max-in-flight",
        type=int_at_least(1),
        default=None,
        help="jobs outstanding at once (default: 256 in queue mode, 2 x max-num-seqs local)",
    )
    parser.add_argument(
        "--default-max-tokens",
        type=_max_tokens,
        default=DEFAULT_MAX_TOKENS,
        help=f"max_tokens of requests that give none (default {DEFAULT_MAX_TOKENS})",
    )
    parser.add_argument("--timeout-s", type=positive_seconds, default=None, help="per-request deadline (job timeout_s)")
    parser.add_argument("--overwrite", action="store_true", help="discard OUTPUT and errors file and start over")
    parser.add_argument(
        "--retry-errors",
        action="store_true",
        help="run again the lines recorded in the errors file (which is started afresh)",
    )
    parser.add_argument(
        "--progress",
        choices=("auto", "bar", "log", "none"),
        default="auto",
        help="auto: a bar on a terminal, log lines otherwise",
    )
    parser.add_argument(
        "--log-interval-s", type=positive_seconds, default=10.0, help="seconds between progress log lines"
    )
    parser.add_argument(
        "--tokenizer",
        default=None,
        help="queue mode: tokenizer folder for logprob token strings (default: $PAGEDQ_MODEL)",
    )
    add_connection_arguments(parser)
    g = parser.add_argument_group("engine (--local)")
    g.add_argument("--model", default=None, help="checkpoint folder (default: $PAGEDQ_MODEL or SmolLM2)")
    g.add_argument("--max-num-seqs", type=int, default=None)
    g.add_argument("--max-num-batched-tokens", type=int, default=None)
    g.add_argument("--kv-cache-bytes", type=int, default=None)
    g.add_argument("--dtype", default=None)
    g.add_argument("--device", default=None)


def _max_tokens(text: str) -> int:
    """``--default-max-tokens``: what a job's ``max_tokens`` accepts (1 to 2**31 - 1). A value outside failed
    every line, each in the errors file, after the model loaded, and the rerun with a good value then found
    every line done (their failures stored) unless told ``--retry-errors``."""
    value = int_at_least(1)(text)
    if value > INT32_MAX:
        raise argparse.ArgumentTypeError(f"must be at most {INT32_MAX}, got {value}")
    return value


def _cannot_write(path: Path) -> str | None:
    """Why OUTPUT or the errors file could not be written, found before a model loads or a job is queued
    (the errors file is opened only at the first error: a bad folder would surface after the work)."""
    if path.is_dir():
        return f"{path} is a folder, not a file"
    if path.exists() and not path.is_file():  # is_file follows links: a link to a regular file is one
        # A pipe (``/dev/stdout | jq``), a terminal or a device: the run reads the file back to resume, and
        # reading its own pipe hung forever, saying nothing.
        return f"{path} must be a regular file, not a pipe or a device: pagedq batch reads it back to resume"
    if not path.parent.is_dir():
        return f"cannot write {path}: the folder {path.parent} does not exist"
    if not os.access(path if path.exists() else path.parent, os.W_OK):
        return f"cannot write {path}: permission denied"
    return None


def _cannot_read(path: Path) -> str | None:
    """Why INPUT could not be used. It must be a regular file: it is read twice (:func:`scan_input` counts
    lines and finds duplicate custom_ids before anything runs, then the run feeds them), and again by every
    rerun that resumes, so a pipe (``<(zcat in.jsonl.gz)``) is refused for what it is, not as unreadable."""
    if not path.exists():
        return f"cannot read {path}: no such file"
    if path.is_dir():
        return f"{path} is a folder, not a file"
    if not path.is_file():
        return (
            f"INPUT {path} must be a regular file, not a pipe or a device: it is read twice, and again by a"
            " rerun that resumes (save it to a file first)"
        )
    if not os.access(path, os.R_OK):
        return f"cannot read {path}: permission denied"
    return None


def _fail(message: str, code: int) -> int:
    print(f"pagedq batch: {message}", file=sys.stderr)
    return code


ENGINE_FLAGS = ("model", "max_num_seqs", "max_num_batched_tokens", "kv_cache_bytes", "dtype", "device")
"""The ``pagedq batch`` flags that become worker settings (the engine's, for ``--local``)."""


def run(args: argparse.Namespace) -> int:
    """``pagedq batch`` (see :mod:`ops.batch`): check, resume, run the pending lines. Returns the exit code."""
    from ops.queue_commands import resolve_redis_url, settings_from_args

    inp: Path = args.input
    out: Path = args.output
    errors: Path = args.errors or errors_path_for(out)
    if (problem := _cannot_read(inp)) is not None:
        return _fail(problem, 2)
    if len({inp.resolve(), out.resolve(), errors.resolve()}) < 3:
        return _fail("INPUT, OUTPUT and the errors file must be three different files", 2)
    for path in (out, errors):
        if (problem := _cannot_write(path)) is not None:
            return _fail(problem, 2)
    # The parser refuses these already; checked again for a caller that builds the Namespace itself, since
    # a bad value is every line's error, found only after the model loads.
    if args.max_in_flight is not None and args.max_in_flight < 1:
        return _fail("--max-in-flight must be at least 1", 2)
    if args.timeout_s is not None and not (math.isfinite(args.timeout_s) and args.timeout_s > 0):
        return _fail(f"--timeout-s must be a finite number above 0, got {args.timeout_s}", 2)
    if not 1 <= args.default_max_tokens <= INT32_MAX:
        return _fail(f"--default-max-tokens must be 1 to {INT32_MAX}, got {args.default_max_tokens}", 2)
    try:
        settings = settings_from_args(args, **{flag: getattr(args, flag) for flag in ENGINE_FLAGS})
        url = None if args.local else resolve_redis_url(settings)
    except SettingsError as exc:
        return _fail(str(exc), 2)

    scan = scan_input(inp)
    if scan.duplicates:
        shown = "; ".join(
            f"{cid!r} (lines {', '.join(map(str, lines))})" for cid, lines in list(scan.duplicates.items())[:5]
        )
        more = len(scan.duplicates) - 5
        return _fail(
            f"{inp} has {len(scan.duplicates)} duplicate custom_id(s): {shown}"
            + (f" and {more} more" if more > 0 else "")
            + "; nothing was processed",
            2,
        )

    lock = _lock_output(out)
    if lock is None:
        return _fail(f"another pagedq batch is writing {out}: let it end (or stop it) and rerun to resume", 2)
    try:
        return _run_locked(args, settings, url, scan, lock)
    finally:
        lock.close()


def _lock_output(out: Path) -> IO[bytes] | None:
    """OUTPUT opened and locked (``flock``) for this run, or None while another run holds it: two runs on one
    OUTPUT would skip the same done lines, wait for the same job ids and each write every answer."""
    f = open(out, "ab")  # noqa: SIM115  (held for the whole run; closed by the caller)
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.close()
        return None
    return f


def _run_locked(args: argparse.Namespace, settings: Settings, url: str | None, scan: Scan, lock: IO[bytes]) -> int:
    """The run once OUTPUT is this process's (``lock``): resume, run the pending lines, sum up."""
    inp: Path = args.input
    out: Path = args.output
    errors: Path = args.errors or errors_path_for(out)
    if args.overwrite:  # OUTPUT is emptied, not removed: the lock is on this file
        lock.truncate(0)
        errors.unlink(missing_ok=True)
    done_ids, _ = read_done(out)
    err_ids, err_lines = read_done(errors)
    retried = failed_request_ids(errors) if args.retry_errors else set()
    if args.retry_errors:  # the file itself goes once their stored failures are gone (a rerun may retry again)
        err_ids, err_lines = set(), Counter()
    stray = len((done_ids | err_ids) - scan.ids)
    done_ids |= err_ids
    # Lines without a usable custom_id are done by content: as many lines with a content as the errors file
    # has records for it (never by number: lines move when the user deletes the bad ones). Counted from the
    # scan, so progress and the exit code cover the lines of this input only.
    failed_unnamed = sum(min(n, err_lines[digest]) for digest, n in scan.unnamed.items())

    def pending_lines() -> Iterator[InputLine]:
        unmatched = Counter(err_lines)
        for line in iter_input(inp):
            if line.custom_id is not None:
                if line.custom_id in done_ids:
                    continue
            elif line.sha256 is not None and unmatched[line.sha256] > 0:
                unmatched[line.sha256] -= 1
                continue
            yield line

    skipped = len(done_ids & scan.ids) + failed_unnamed
    max_in_flight = args.max_in_flight or (2 * settings.max_num_seqs if args.local else 256)
    if skipped >= scan.total:  # nothing left: do not load a model or touch Redis
        what = f"all {scan.total} lines of {inp} are already in {out} / {errors}" if scan.total else f"{inp} is empty"
        print(f"pagedq batch: {what}", file=sys.stderr)
        return LINES_FAILED if (err_ids & scan.ids) or failed_unnamed else 0
    try:
        backend: Backend = LocalBackend(settings) if args.local else QueueBackend(str(url), settings, args.tokenizer)
    except Exception as exc:
        return _fail(f"cannot start: {exc}", 1)
    progress = Progress(scan.total, min(skipped, scan.total), args.progress, args.log_interval_s)
    if skipped:
        progress.note(f"resuming: {skipped} of {scan.total} lines already in {out.name} / {errors.name}")
    if stray:
        progress.note(f"warning: {stray} custom_id(s) in the output files are not in {inp.name} (another input?)")
    interrupted = _install_sigterm()
    writer = Writer(out, errors)
    code = 0
    write_failure = ""
    try:
        backend.forget(retried)  # their failures stored under their ids would be read back, not retried
        if args.retry_errors:
            errors.unlink(missing_ok=True)  # before the first write: the Writer opens it at the first error
        if args.overwrite:  # before the new nonce: an earlier run's unfinished jobs would run for nothing
            _cancel_earlier(backend, out, progress)
        # Job ids hash OUTPUT's path and the nonce of its last --overwrite (kept by the backend), so a
        # resume reads back the results of the jobs its earlier run queued, even after --overwrite.
        nonce = backend.generation(out.resolve(), args.overwrite)
        run_key = str(out.resolve()) + (f"#{nonce}" if nonce else "")
        if isinstance(backend, QueueBackend) and backend.live_workers() == 0:
            progress.note(f"warning: no live worker on queue {settings.queue!r}; jobs wait until one starts")
        code = _process(pending_lines(), backend, writer, progress, args, run_key, max_in_flight)
    except KeyboardInterrupt:
        code = 130
    except WriteFailed as exc:  # a full disk: one line and its own code, not a chained OSError and exit 1
        write_failure = str(exc)
        code = WRITE_FAILED
    except REDIS_ERRORS as exc:  # not a lost connection (retried in _process): e.g. auth, wrong type
        # One line: a cluster client's own failures are RedisClusterException, no RedisError, and ended the
        # run in a traceback.
        progress.note(f"Redis error ({type(exc).__name__}): {exc}")
        code = 1
    finally:
        interrupted()
        backend.close()
        writer.close()
    summary = (
        f"pagedq batch: {writer.ok} written to {out}, {writer.failed} to {errors}"
        f" this run; {progress.done}/{scan.total} lines done"
    )
    if code == 130:
        summary += "; interrupted: rerun the same command to resume"
    elif code == 1:
        summary += "; Redis failed: rerun the same command to resume"
    elif code == WRITE_FAILED:
        summary += f"; {write_failure}: make room and rerun the same command to resume"
    failed = writer.failed + len(err_ids & scan.ids) + failed_unnamed  # this run's and earlier runs'
    if code == 0 and failed:
        code = LINES_FAILED
        summary += f"; {failed} line(s) failed (see {errors}): exit {LINES_FAILED}"
    progress.close(summary)
    if code == WRITE_FAILED and progress.mode == "none":  # an error is said whatever --progress asked
        print(summary, file=sys.stderr)
    return code


def _cancel_earlier(backend: Backend, out: Path, progress: Progress) -> None:
    """An ``--overwrite`` start cancels the jobs earlier runs on ``out`` left queued or running (an
    interrupted run leaves up to ``--max-in-flight``), which would otherwise run on the workers for nothing.

    A Redis error here is noted and the run goes on, not exit 1: the cancel only saves GPU time, it decides
    no answer (the new run's ids carry a fresh nonce, so an old job's answer is never read as a new line's),
    and OUTPUT is already emptied as ``--overwrite`` asked, so stopping would leave the user nothing where
    going on gives every answer. The ids to cancel are not lost either: the backend clears them only once
    every cancel is in, so the next ``--overwrite`` tries again. A Redis that is down fails the next step
    (the new nonce) and the run exits 1 as before; one that refuses the cancel for good (an ACL without
    PUBLISH, say) would otherwise make every ``--overwrite`` fail."""
    try:
        cancelled = backend.cancel_earlier(out.resolve())
    except REDIS_ERRORS as exc:
        progress.note(
            f"warning: could not cancel the jobs an earlier run on {out.name} left unfinished (Redis error: {exc});"
            " they run on the workers for nothing, and the next --overwrite tries again"
        )
        return
    if cancelled:
        progress.note(f"cancelled {cancelled} unfinished job(s) of an earlier run on {out.name}")


def _install_sigterm() -> Callable[[], None]:
    """SIGTERM stops the run like Ctrl-C (files closed cleanly); returns the restore function."""
    if threading.current_thread() is not threading.main_thread():  # signal handlers are the main thread's
        return lambda: None

    def on_term(_signum: int, _frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, on_term)

    def restore() -> None:
        signal.signal(signal.SIGTERM, previous)

    return restore


def _process(
    lines: Iterator[InputLine],
    backend: Backend,
    writer: Writer,
    progress: Progress,
    args: argparse.Namespace,
    run_key: str,
    max_in_flight: int,
) -> int:
    """The loop: keep up to ``max_in_flight`` jobs outstanding, write each answer as it arrives."""
    in_flight: dict[str, BatchLine] = {}
    unsent: list[BatchLine] = []
    renamed: set[tuple[str, str]] = set()  # (model requested, model served) pairs already noted
    exhausted = False
    redis_down_since: float | None = None
    backoff = Backoff(0.2, 5.0, jitter=False)
    while True:
        while not exhausted and len(in_flight) + len(unsent) < max_in_flight:
            item = next(lines, None)
            if item is None:
                exhausted = True
                break
            # An error's record has the custom_id as the resume reads it (also when strict parsing failed before
            # reaching it: a NaN elsewhere), else the line's content key: what the resume skips it by.
            cid, line_no, sha = item.custom_id, item.line_no, item.sha256
            if item.text is None:
                writer.write(False, error_record(None, line_no, "invalid_json", "line is not valid UTF-8", None, sha))
                progress.update(False)
                continue
            try:
                line = parse_line(
                    item.text,
                    line_no,
                    run_key=run_key,
                    default_max_tokens=args.default_max_tokens,
                    timeout_s=args.timeout_s,
                )
            except LineError as exc:
                writer.write(False, error_record(cid, line_no, exc.code, exc.message, None, sha))
                progress.update(False)
                continue
            unsent.append(line)
        if exhausted and not in_flight and not unsent:
            return 0
        try:
            if unsent:
                backend.submit([line.job for line in unsent])
                in_flight.update((line.job.id, line) for line in unsent)
                unsent = []
            events = backend.wait(in_flight.keys(), timeout_s=1.0)
            # Checked when nothing came, or once Redis is back: a Redis back without its data lost the jobs.
            lost = (not events or redis_down_since is not None) and backend.lost_jobs()
        except REDIS_DOWN as exc:
            now = time.monotonic()
            if redis_down_since is None:
                redis_down_since = now
                progress.note(f"Redis unreachable ({exc}); retrying")
            if now - redis_down_since > REDIS_GIVE_UP_S:
                return 1
            time.sleep(backoff.next_delay())
            continue
        if redis_down_since is not None:
            progress.note("Redis reachable again")
            redis_down_since = None
            backoff.reset()
        for event in events:
            answered = in_flight.pop(event.id, None)
            if answered is None:
                continue  # answered already (a result seen twice)
            served = backend.served_model(event)
            text_of = backend.token_text(event) if _wants_logprobs(event) else token_id_text
            ok, record = outcome_record(answered, event, served, text_of)
            writer.write(ok, record)
            asked = answered.model
            if ok and asked is not None and asked != served and (asked, served) not in renamed:
                renamed.add((asked, served))  # noted once: a batch names the same model on every line
                progress.note(f"requests name model {asked!r}; answered by {served!r}, the body.model written")
            progress.update(ok, event.usage.completion_tokens if isinstance(event, FinalEvent) else 0)
        if lost:  # queued again: their ids make a copy that did survive harmless (one terminal event per id)
            progress.note(f"Redis lost queued jobs (back without its data?); queueing {len(in_flight)} again")
            unsent = list(in_flight.values())
            in_flight.clear()
        progress.tick()


def _wants_logprobs(event: TerminalEvent) -> bool:
    """Only answers with logprobs need token texts (loading a tokenizer costs a second or more)."""
    return isinstance(event, FinalEvent) and any(c.logprobs is not None for c in event.choices)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pagedq batch")
    add_arguments(parser)
    try:
        return run(parser.parse_args(argv))
    except KeyboardInterrupt:  # outside the run loop (reading the input, loading the model)
        return _fail("interrupted: rerun the same command to resume", 130)


if __name__ == "__main__":
    sys.exit(main())
