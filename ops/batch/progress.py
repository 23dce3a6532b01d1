"""Progress of a batch run: done / total, errors, tokens/s and ETA.

A bar when stderr is a terminal, and a log line every ``--log-interval-s`` otherwise (CI logs, nohup, where a
redrawn bar would be noise), ending with a summary either way.
"""

from __future__ import annotations

import sys
import time
from typing import IO, Any


class Progress:
    """A tqdm bar on a terminal, periodic log lines otherwise; counts requests and completion tokens."""

    def __init__(self, total: int, initial: int, mode: str, interval_s: float, stream: IO[str] | None = None) -> None:
        self.stream = stream or sys.stderr
        if mode == "auto":
            mode = "bar" if self.stream.isatty() else "log"
        self.mode = mode
        self.total, self.initial = total, initial
        self.done = initial
        self.errors = 0
        self.tokens = 0
        self.interval_s = interval_s
        self.started = time.monotonic()
        self._next_log = self.started + interval_s
        self._next_postfix = 0.0
        self.bar: Any = None
        if mode == "bar":
            from tqdm import tqdm

            self.bar = tqdm(
                total=total,
                initial=initial,
                unit="req",
                desc="batch",
                file=self.stream,
                dynamic_ncols=True,
                smoothing=0.1,
            )

    def tok_s(self) -> float:
        elapsed = time.monotonic() - self.started
        return self.tokens / elapsed if elapsed > 0 else 0.0

    def eta_s(self) -> float | None:
        elapsed = time.monotonic() - self.started
        made = self.done - self.initial
        if made <= 0 or elapsed <= 0:
            return None
        return (self.total - self.done) * elapsed / made

    def update(self, ok: bool, tokens: int = 0) -> None:
        self.done += 1
        self.errors += not ok
        self.tokens += tokens
        if self.bar is not None:
            self.bar.update(1)
            now = time.monotonic()
            if now >= self._next_postfix:
                self._next_postfix = now + 0.5
                self.bar.set_postfix(tok_s=f"{self.tok_s():.1f}", errors=self.errors, refresh=False)
        self.tick()

    def note(self, message: str) -> None:
        if self.bar is not None:
            self.bar.write(message, file=self.stream)
        elif self.mode != "none":
            self.stream.write(f"{_now()} batch: {message}\n")
            self.stream.flush()

    def tick(self) -> None:
        if self.mode != "log":
            return
        now = time.monotonic()
        if now >= self._next_log:
            self._next_log = now + self.interval_s
            self._log_line()

    def _log_line(self, prefix: str = "") -> None:
        pct = 100.0 * self.done / self.total if self.total else 100.0
        eta = self.eta_s()
        eta_txt = "-" if eta is None else _duration(eta)
        self.stream.write(
            f"{_now()} batch: {prefix}{self.done}/{self.total} done ({pct:.1f}%), {self.errors} errors, "
            f"{self.tok_s():.1f} tok/s, ETA {eta_txt}\n"
        )
        self.stream.flush()

    def close(self, summary: str) -> None:
        if self.bar is not None:
            self.bar.set_postfix(tok_s=f"{self.tok_s():.1f}", errors=self.errors, refresh=True)
            self.bar.close()
        if self.mode == "log":
            self._log_line("finished: ")
        if self.mode != "none":
            self.stream.write(summary + "\n")
            self.stream.flush()


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S")


def _duration(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"
