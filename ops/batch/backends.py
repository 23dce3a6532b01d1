"""Where a batch's jobs run; the run loop sees only :class:`Backend`, so both ways give the same output.

* :class:`QueueBackend` (default): jobs go to ``<ns>:jobs:<queue>`` and however many workers serve that queue
  share them; this process only submits and collects results.
* :class:`LocalBackend` (``--local``): an engine in this process (on an
  :class:`~worker.engine_thread.EngineThread`), no Redis.
"""

from __future__ import annotations

import queue
import sys
from collections.abc import Collection
from pathlib import Path
from typing import Any, Protocol

import redis

from ops.batch.responses import TerminalEvent, TokenText, load_token_text, token_id_text
from schemas.jobs import JobRequest, TokenEvent, parse_event
from schemas.keys import EVENT_FIELD, JOB_FIELD, Keys
from worker.settings import Settings


class Backend(Protocol):
    """Where jobs run: the queue (workers) or an engine in this process."""

    served_model: str

    def submit(self, jobs: list[JobRequest]) -> None: ...
    def wait(self, ids: Collection[str], timeout_s: float) -> list[TerminalEvent]: ...
    def token_text(self) -> TokenText: ...
    def close(self) -> None: ...


class QueueBackend:
    """Jobs through ``<ns>:jobs:<queue>``; results from ``<ns>:result:<id>`` (MGET), woken by a blocking
    XREAD on the jobs' reply streams (jobs are sent with ``stream: false``, so these hold only the
    terminal event)."""

    def __init__(self, url: str, settings: Settings, tokenizer: str | None) -> None:
        self.client = redis.Redis.from_url(url, decode_responses=True, socket_connect_timeout=5, socket_timeout=30)
        self.keys = Keys(settings.namespace, settings.queue)
        self.served_model = settings.model or "pagedq"
        self._tokenizer_source = tokenizer or settings.model
        self._text: TokenText | None = None

    def live_workers(self) -> int:
        return sum(1 for _ in self.client.scan_iter(match=self.keys.heartbeat_pattern, count=1000))

    def submit(self, jobs: list[JobRequest]) -> None:
        if not jobs:
            return
        pipe = self.client.pipeline(transaction=True)  # all or nothing: a retry after an error adds no duplicates
        for job in jobs:
            pipe.xadd(self.keys.jobs, {JOB_FIELD: job.to_json()})
        pipe.execute()

    def _results(self, ids: list[str]) -> list[TerminalEvent]:
        out: list[TerminalEvent] = []
        for start in range(0, len(ids), 500):
            chunk = ids[start : start + 500]
            for raw in self.client.mget([self.keys.result(i) for i in chunk]):
                if raw is not None:
                    event = parse_event(raw)
                    if not isinstance(event, TokenEvent):
                        out.append(event)
        return out

    def wait(self, ids: Collection[str], timeout_s: float) -> list[TerminalEvent]:
        wanted = list(ids)
        found = self._results(wanted)
        if found or not wanted:
            return found
        streams: dict[Any, Any] = {self.keys.reply(i): "0" for i in wanted[:1000]}
        reply: Any = self.client.xread(streams, count=1, block=max(1, int(timeout_s * 1000)))
        events: list[TerminalEvent] = []
        for _stream, entries in reply or []:
            for _entry_id, fields in entries:
                raw = (fields or {}).get(EVENT_FIELD)
                event = parse_event(raw) if raw is not None else None
                if event is not None and not isinstance(event, TokenEvent):
                    events.append(event)
        return events or self._results(wanted)

    def token_text(self) -> TokenText:
        if self._text is None:
            self._text = token_id_text
            if self._tokenizer_source:
                try:
                    self._text = load_token_text(self._tokenizer_source)
                except Exception as exc:  # logprobs still usable as token ids
                    print(
                        f"pagedq batch: cannot load tokenizer {self._tokenizer_source!r} ({exc}); "
                        "logprob tokens are written as token_id:<id>",
                        file=sys.stderr,
                    )
        return self._text

    def close(self) -> None:
        self.client.close()


class LocalBackend:
    """An engine in this process, stepped by an :class:`~worker.engine_thread.EngineThread`."""

    def __init__(self, settings: Settings) -> None:
        from worker.engine_thread import EngineThread
        from worker.run import build_engine

        engine: Any = build_engine(settings)
        self.engine = engine
        self.thread = EngineThread(engine, worker_name="local", max_num_seqs=settings.max_num_seqs).start()
        self.done: queue.SimpleQueue[TerminalEvent] = queue.SimpleQueue()
        self.served_model = settings.model or Path(str(getattr(engine, "model_path", "pagedq"))).name

    def submit(self, jobs: list[JobRequest]) -> None:
        for job in jobs:
            handle = self.thread.submit(job)
            handle.future.add_done_callback(lambda f: self.done.put(f.result()))

    def wait(self, ids: Collection[str], timeout_s: float) -> list[TerminalEvent]:
        try:
            events = [self.done.get(timeout=timeout_s)]
        except queue.Empty:
            return []
        while True:
            try:
                events.append(self.done.get_nowait())
            except queue.Empty:
                return events

    def token_text(self) -> TokenText:
        tok = self.engine.tokenizer
        return lambda t: str(tok.decode([t]))

    def close(self) -> None:
        self.thread.stop()
