"""The batch's files: the input (streamed, never held whole), OUTPUT and the errors file.

* **Resumable by content, not by position.** Rerunning with the same OUTPUT skips every custom_id already
  in OUTPUT or in the errors file (:func:`read_done`), so a run killed at any point and rerun ends with each
  custom_id exactly once (a torn last line from a kill is cut off first). Every output line is written with
  one ``write`` and flushed (:class:`Writer`), so what is in the file is complete.
* **Duplicate custom_ids are found up front** (:func:`scan_input`), so that the run can refuse them before
  writing anything: resumption keys on them, and an OpenAI Batch with duplicates is invalid anyway.
* **Bounded.** The input is streamed twice (:func:`scan_input` counts lines and checks custom_ids keeping
  only the ids; :func:`iter_lines` then feeds the jobs), so memory is O(number of custom_ids), not O(file
  size).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any


def errors_path_for(output: Path) -> Path:
    """The default errors file beside OUTPUT: ``out.jsonl`` -> ``out.errors.jsonl``."""
    name = output.name
    stem = name[: -len(".jsonl")] if name.endswith(".jsonl") else name
    return output.with_name(stem + ".errors.jsonl")


def iter_lines(path: Path) -> Iterator[tuple[int, str | None]]:
    """(1-based line number, text) of each non-blank line; text None when it is not valid UTF-8. A UTF-8 byte
    order mark opening the file (what Windows editors save) is not part of the first line."""
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, 1):
            if line_no == 1:
                raw = raw.removeprefix(b"\xef\xbb\xbf")
            if not raw.strip():
                continue
            try:
                yield line_no, raw.decode("utf-8").strip()
            except UnicodeDecodeError:
                yield line_no, None


@dataclass
class Scan:
    """What the first pass learns: non-blank lines, distinct custom_ids, and each duplicate's line numbers."""

    total: int
    ids: set[str]
    duplicates: dict[str, list[int]]


def scan_input(path: Path) -> Scan:
    """First pass: count lines and find duplicate custom_ids (only ids are kept in memory)."""
    first: dict[str, int] = {}
    duplicates: dict[str, list[int]] = {}
    total = 0
    for line_no, text in iter_lines(path):
        total += 1
        if text is None:
            continue
        try:
            data = json.loads(text)
        except (ValueError, RecursionError):
            continue
        cid = data.get("custom_id") if isinstance(data, dict) else None
        if not isinstance(cid, str) or not cid:
            continue
        if cid in first:
            duplicates.setdefault(cid, [first[cid]]).append(line_no)
        else:
            first[cid] = line_no
    return Scan(total, set(first), duplicates)


def read_done(path: Path) -> tuple[set[str], set[int]]:
    """custom_ids (and, for lines that had none, line numbers) already recorded in ``path``.

    A last line without its newline is what a kill during a write leaves: it is cut off, so the rerun
    writes that answer again, whole.
    """
    ids: set[str] = set()
    lines: set[int] = set()
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
            elif isinstance(rec.get("error"), dict) and isinstance(rec["error"].get("line"), int):
                lines.add(rec["error"]["line"])
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


class Writer:
    """Appends whole lines, flushed one by one, to OUTPUT and (created on first use) the errors file."""

    def __init__(self, output: Path, errors: Path) -> None:
        self.output_path, self.errors_path = output, errors
        self.out: IO[str] = open(output, "a", encoding="utf-8", newline="\n")  # noqa: SIM115
        self.err: IO[str] | None = None
        self.ok = 0
        self.failed = 0

    def write(self, ok: bool, record: dict[str, Any]) -> None:
        line = json.dumps(record, ensure_ascii=False) + "\n"
        if ok:
            f = self.out
            self.ok += 1
        else:
            if self.err is None:
                self.err = open(self.errors_path, "a", encoding="utf-8", newline="\n")  # noqa: SIM115
            f = self.err
            self.failed += 1
        f.write(line)
        f.flush()

    def close(self) -> None:
        for f in (self.out, self.err):
            if f is not None:
                with contextlib.suppress(OSError):
                    f.flush()
                    os.fsync(f.fileno())
                f.close()
