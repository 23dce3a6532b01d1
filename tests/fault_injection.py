"""Fault injection for the worker tests: an engine wrapper that slows or breaks steps. Test code only.

Production settings carry no test hooks. An in-process worker gets a :class:`FaultyEngine` directly; a
worker *process* gets one through the ordinary ``engine_factory`` setting (``tests.fault_injection:build_engine``)
with the faults in the ``PAGEDQ_TEST_FAULTS`` environment variable (JSON), which the worker's settings
never read.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from engine.outputs import RequestDelta
from schemas.sampling import SamplingParams
from worker.job_run import EngineLike
from worker.settings import Settings

FAULTS_ENV = "PAGEDQ_TEST_FAULTS"
FACTORY = "tests.fault_injection:build_engine"


class FaultyEngine:
    """An engine whose ``step()`` sleeps ``step_delay_s`` first, and raises a plain RuntimeError (naming no
    request) while a request whose prompt contains ``fault_marker`` is in the engine: the worst case, which
    the worker must isolate on its own. While a request whose prompt contains ``wedge_marker`` is in the
    engine, a step hangs for ``wedge_s`` (a step that never comes back, as far as the worker can tell)."""

    def __init__(
        self,
        engine: EngineLike,
        *,
        fault_marker: str | None = None,
        step_delay_s: float = 0.0,
        wedge_marker: str | None = None,
        wedge_s: float = 3600.0,
    ) -> None:
        self.inner = engine
        self.fault_marker = fault_marker
        self.step_delay_s = step_delay_s
        self.wedge_marker = wedge_marker
        self.wedge_s = wedge_s
        self._faulty: set[str] = set()
        self._wedged: set[str] = set()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        priority: int = 0,
        *,
        strict_max_tokens: bool = False,
    ) -> None:
        self.inner.add_request(request_id, prompt, params, priority, strict_max_tokens=strict_max_tokens)
        text = prompt if isinstance(prompt, str) else self.inner.tokenizer.decode(prompt)
        if self.fault_marker and self.fault_marker in text:
            self._faulty.add(request_id)
        if self.wedge_marker and self.wedge_marker in text:
            self._wedged.add(request_id)

    def abort(self, request_id: str) -> bool:
        self._faulty.discard(request_id)
        self._wedged.discard(request_id)
        return self.inner.abort(request_id)

    def step(self) -> list[RequestDelta]:
        if self.step_delay_s:
            time.sleep(self.step_delay_s)
        if self._wedged:
            time.sleep(self.wedge_s)
        if self._faulty:
            raise RuntimeError("injected fault (fault_marker)")
        return self.inner.step()


def process_environment(**faults: Any) -> dict[str, str]:
    """Environment additions that make a worker process build a :class:`FaultyEngine` with ``faults`` (its
    keyword arguments)."""
    return {FAULTS_ENV: json.dumps(faults)}


def build_engine(settings: Settings) -> FaultyEngine:
    """``engine_factory`` for worker processes: pagedq's engine from ``settings``, wrapped with the faults
    named in ``PAGEDQ_TEST_FAULTS``."""
    from worker.run import build_engine as build_real_engine

    faults = json.loads(os.environ.get(FAULTS_ENV, "{}"))
    engine = build_real_engine(settings.model_copy(update={"engine_factory": None}))
    return FaultyEngine(engine, **faults)
