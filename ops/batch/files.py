"""The batch's files: the input (streamed, never held whole), OUTPUT and the errors file.

* **Resumable by content, not by position.** Rerunning with the same OUTPUT skips every custom_id already
  in OUTPUT or in the errors file (:func:`read_done`), so a run killed at any point and rerun ends with each
  custom_id exactly once (a torn last line from a kill is cut off first). Every output line is written with
  one ``write`` and flushed (:class:`Writer`), so what is in the file is complete. A line with no usable
  custom_id has its error keyed by the SHA-256 of its bytes (``error.line_sha256``), never by its number
  alone: a user who deletes the bad lines the errors file points at shifts every later line up, and a
  number-keyed resume then skipped the valid, unanswered lines that moved into those numbers.
* **Duplicate custom_ids are found up front** (:func:`scan_input`), so that the run can refuse them before
  writing anything: resumption keys on them, and an OpenAI Batch with duplicates is invalid anyway.
* **Bounded.** The input is streamed twice (:func:`scan_input` counts lines and checks custom_ids keeping
  only the ids; :func:`iter_lines` then feeds the jobs), so memory is O(number of custom_ids), not O(file
  size).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any


def errors_path_for(output: Path) -> Path:
    """The default errors file beside OUTPUT: ``out.jsonl`` -> ``out.errors.jsonl``."""
    name = output.name
    stem = name[: -len(".jsonl")] if name.endswith(".jsonl") else name
    return output.with_name(stem + ".errors.jsonl")


def _raw_lines(path: Path) -> Iterator[tuple[int, bytes]]:
    """(1-based line number, bytes) of each non-blank line, its end of line still on. A UTF-8 byte order
    mark opening the file (what Windows editors save) is not part of the first line."""
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, 1):
            if line_no == 1:
                raw = raw.removeprefix(b"\xef\xbb\xbf")
            if raw.strip():
                yield line_no, raw


def _decode(raw: bytes) -> str | None:
    try:
        return raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        return None


def iter_lines(path: Path) -> Iterator[tuple[int, str | None]]:
    """(1-based line number, text) of each non-blank line; text None when it is not valid UTF-8."""
    for line_no, raw in _raw_lines(path):
        yield line_no, _decode(raw)


def line_sha256(raw: bytes) -> str:
    """The key of a line that has no usable custom_id: the SHA-256 of its bytes without the surrounding
    whitespace, so a line saved again with CRLF endings, or moved, is still the same line."""
    return hashlib.sha256(raw.strip()).hexdigest()


def lenient_custom_id(text: str | None) -> str | None:
    """The line's custom_id as resumption keys on it: a non-empty string that can be written as UTF-8, read
    with plain ``json.loads`` (a NaN elsewhere in the line does not hide it), else None.

    The one reading of a custom_id for :func:`scan_input`, the resume's skip and the errors file, so that a
    line is keyed the same way in all three: a list or object custom_id ended every resume in ``TypeError:
    unhashable type`` where the skip read it by itself, and a lone surrogate escape would fail the write."""
    if text is None:
        return None
    try:
        data = json.loads(text)
    except (ValueError, RecursionError):
        return None
    cid = data.get("custom_id") if isinstance(data, dict) else None
    if not isinstance(cid, str) or not cid:
        return None
    try:
        cid.encode("utf-8")
    except UnicodeEncodeError:
        return None
    return cid


@dataclass(frozen=True)
class InputLine:
    """One non-blank input line as the run feeds it: ``text`` None when it is not valid UTF-8; ``sha256``
    (:func:`line_sha256`) only when it has no usable custom_id, the one case its error is keyed by it."""

    line_no: int
    text: str | None
    custom_id: str | None
    sha256: str | None


def iter_input(path: Path) -> Iterator[InputLine]:
    """Every non-blank line of ``path`` with its resumption key (its custom_id, else its SHA-256)."""
    for line_no, raw in _raw_lines(path):
        text = _decode(raw)
        cid = lenient_custom_id(text)
        yield InputLine(line_no, text, cid, None if cid is not None else line_sha256(raw))


@dataclass
class Scan:
    """What the first pass learns: non-blank lines, distinct custom_ids, each duplicate's line numbers, and
    how many lines with no usable custom_id have each content (by :func:`line_sha256`), so that a resume can
    count the lines it will skip before it reads them again."""

    total: int
    ids: set[str]
    duplicates: dict[str, list[int]]
    unnamed: Counter[str]


def scan_input(path: Path) -> Scan:
    """First pass: count lines and find duplicate custom_ids (only ids, and the hashes of lines without one,
    are kept in memory)."""
    first: dict[str, int] = {}
    duplicates: dict[str, list[int]] = {}
    unnamed: Counter[str] = Counter()
    total = 0
    for line in iter_input(path):
        total += 1
        cid = line.custom_id
        if cid is None:
            assert line.sha256 is not None
            unnamed[line.sha256] += 1
        elif cid in first:
            duplicates.setdefault(cid, [first[cid]]).append(line.line_no)
        else:
            first[cid] = line.line_no
    return Scan(total, set(first), duplicates, unnamed)


def read_done(path: Path) -> tuple[set[str], Counter[str]]:
    """custom_ids already recorded in ``path``, and for lines that had none, how many records each line
    content (``error.line_sha256``) has. A record with neither (written before lines were keyed by content)
    counts for no line: that line runs again, which is safe, where skipping by its number was not.

    A last line without its newline is what a kill during a write leaves: it is cut off, so the rerun
    writes that answer again, whole.
    """
    ids: set[str] = set()
    lines: Counter[str] = Counter()
    if not path.exists():
        return ids, lines
    good_end = 0
    with open(path, "rb") as f:
        for raw in f:
            if not raw.endswith(b"\n"):
                break
            good_end += len(raw)
            try:
                rec = json.loads(raw)
            except ValueError:
                continue
            if not isinstance(rec, dict):
                continue
            cid = rec.get("custom_id")
            if isinstance(cid, str):
                ids.add(cid)
            elif isinstance(rec.get("error"), dict) and isinstance(rec["error"].get("line_sha256"), str):
                lines[rec["error"]["line_sha256"]] += 1
    if good_end < path.stat().st_size:
        with open(path, "rb+") as f:
            f.truncate(good_end)
    return ids, lines


def failed_request_ids(path: Path) -> set[str]:
    """The job ids of the errors file's lines that a worker answered (``error.request_id``)."""
    ids: set[str] = set()
    with contextlib.suppress(FileNotFoundError), open(path, "rb") as f:
        for raw in f:
            with contextlib.suppress(ValueError):
                rec = json.loads(raw)
                error = rec.get("error") if isinstance(rec, dict) else None
                if isinstance(error, dict) and isinstance(error.get("request_id"), str):
                    ids.add(error["request_id"])
    return ids


class WriteFailed(Exception):
    """OUTPUT or the errors file could not be written (a full disk, a quota, an I/O error): the run stops at
    the first such failure, so that a torn line can only be a file's last one (cut off by the rerun's
    :func:`read_done`), and ends with one line and its own exit code rather than an ``OSError`` traceback."""

    def __init__(self, path: Path, error: OSError) -> None:
        super().__init__(f"cannot write {path}: {error.strerror or error}")
        self.path = path
        self.error = error


class Writer:
    """Appends whole lines, flushed one by one, to OUTPUT and (created on first use) the errors file."""

    def __init__(self, output: Path, errors: Path) -> None:
        self.output_path, self.errors_path = output, errors
        self.out: IO[str] = open(output, "a", encoding="utf-8", newline="\n")  # noqa: SIM115
        self.err: IO[str] | None = None
        self.ok = 0
        self.failed = 0

    def write(self, ok: bool, record: dict[str, Any]) -> None:
        """Append ``record`` to OUTPUT (``ok``) or the errors file; :class:`WriteFailed` when it cannot be."""
        line = json.dumps(record, ensure_ascii=False) + "\n"
        path = self.output_path if ok else self.errors_path
        try:
            if ok:
                f = self.out
            else:
                if self.err is None:
                    self.err = open(self.errors_path, "a", encoding="utf-8", newline="\n")  # noqa: SIM115
                f = self.err
            f.write(line)
            f.flush()
        except OSError as exc:
            raise WriteFailed(path, exc) from exc
        if ok:  # counted once written: the summary says what is in the files
            self.ok += 1
        else:
            self.failed += 1

    def close(self) -> None:
        """Flush and sync both files. Errors are swallowed: every line was flushed by :meth:`write`, so what
        is left is at most the torn end of the line whose write failed (a rerun cuts it off), and closing a
        file on a full disk flushes that end again and raised a second ``OSError`` over the first."""
        for f in (self.out, self.err):
            if f is not None:
                with contextlib.suppress(OSError):
                    f.flush()
                    os.fsync(f.fileno())
                with contextlib.suppress(OSError):
                    f.close()
