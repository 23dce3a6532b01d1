"""The watchdog: ends a worker process that stopped making progress, so its supervisor restarts it.

A worker whose loop is wedged (a step that never returns, every tick raising, Redis refusing every write)
holds its jobs without finishing them; other workers take them over only once it is gone. In-process
remedies cannot help when the loop itself is stuck, so this thread, which shares nothing with the loop but
two clocks, exits the process with :data:`EXIT_UNHEALTHY`:

* when :meth:`Worker.liveness` has said the loop is not live (no progress for ``stall_timeout_s``) for
  half as long again: time for ``/healthz``, ``/readyz`` and the heartbeat to show it first;
* when a stop was requested (SIGTERM) and the process is still here ``shutdown_grace_s`` later, plus
  :data:`EXIT_MARGIN_S`: the grace period is honoured whatever state the loop is in.

Before it exits it writes every thread's Python stack to stderr (:func:`dump_stacks`), so the log says where
the loop was stuck.

Entries the process held stay pending in the consumer group and are taken over by other workers.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import sys
import threading
import time
from typing import Any, Protocol

EXIT_UNHEALTHY = 70  # EX_SOFTWARE: an internal error; supervisors restart on any non-zero code
EXIT_MARGIN_S = 1.0
CHECK_EVERY_S = 0.5


class Watched(Protocol):
    stop_requested_at: float | None

    def liveness(self) -> tuple[bool, str]: ...


class Watchdog(threading.Thread):
    """Checks ``worker`` every :data:`CHECK_EVERY_S` and exits the process when it must (see module doc)."""

    def __init__(
        self, worker: Watched, *, shutdown_grace_s: float, stall_timeout_s: float, log: Any, exit: Any = os._exit
    ) -> None:
        super().__init__(name="pagedq-watchdog", daemon=True)
        self.worker = worker
        self.shutdown_grace_s = shutdown_grace_s
        self.unhealthy_grace_s = stall_timeout_s / 2
        self._unhealthy_since: float | None = None
        self.log = log
        self._exit = exit  # os._exit: the loop may hold locks or be inside C code, so no clean-up can be trusted
        self._halt = threading.Event()

    def stop(self) -> None:
        self._halt.set()

    def verdict(self) -> str | None:
        """Why the process must end now, or None."""
        live, why = self.worker.liveness()
        now = time.monotonic()
        if live:
            self._unhealthy_since = None
        elif self._unhealthy_since is None:
            self._unhealthy_since = now
        elif now - self._unhealthy_since > self.unhealthy_grace_s:
            return why
        asked = self.worker.stop_requested_at
        if asked is not None and now - asked > self.shutdown_grace_s + EXIT_MARGIN_S:
            return f"still running {self.shutdown_grace_s:g} s (shutdown_grace_s) after the stop request"
        return None

    def run(self) -> None:
        while not self._halt.wait(CHECK_EVERY_S):
            why = self.verdict()
            if why is not None:
                self.log.error("worker.watchdog_exit", reason=why, exit_code=EXIT_UNHEALTHY)
                dump_stacks()
                self._exit(EXIT_UNHEALTHY)
                return


NO_STDERR_DESCRIPTOR = (OSError, ValueError, RuntimeError, AttributeError)
"""What faulthandler raises for a stderr it cannot write to from C: none (AttributeError, RuntimeError) or one
without a file descriptor (io.UnsupportedOperation: a host that embeds the worker and replaced it, a test's capture)."""


def dump_stacks() -> None:
    """Every thread's Python stack to stderr (faulthandler's format, after the log line): where the loop was
    stuck when the process ends, for whoever reads the log of a worker its supervisor restarted."""
    with contextlib.suppress(*NO_STDERR_DESCRIPTOR):
        sys.stderr.flush()
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
