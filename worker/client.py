"""Producer client for pagedq, sync (:class:`PagedqClient`) and asyncio (:class:`AsyncPagedqClient`).

It only speaks wire protocol v1 (see ``README.md``, "Wire protocol v1") over plain Redis commands, so anything it does
can be done from any language. Both clients share the pure parts (building jobs, following a reply stream
across redeliveries) and differ only in how they wait on Redis.

Redelivery: when a worker dies mid-job another one reruns it with a higher ``attempt``. :meth:`stream`
never yields text twice: while the new attempt repeats what was already yielded it stays silent and then
continues where the old attempt stopped; if the new attempt diverges (sampling) it yields a
:class:`Restart` first, after which the deltas start again from the beginning of the text.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeAlias

import redis
import redis.asyncio as aioredis

from schemas.jobs import ErrorEvent, FinalEvent, JobRequest, TokenEvent, parse_event
from schemas.keys import EVENT_FIELD, JOB_FIELD, Keys

CANCEL_TTL_S = 86_400

PromptInput: TypeAlias = str | Sequence[Mapping[str, Any]] | Sequence[int]
Event: TypeAlias = TokenEvent | FinalEvent | ErrorEvent


class JobFailed(Exception):
    """The job ended with an ``error`` event (``code``: invalid_request, cancelled, dead_lettered...)."""

    def __init__(self, event: ErrorEvent) -> None:
        super().__init__(f"job {event.id} failed ({event.code}): {event.message}")
        self.event = event
        self.code = event.code


@dataclass(frozen=True)
class Restart:
    """Yielded by :meth:`PagedqClient.stream` when a redelivered job's new attempt diverges from the text
    already yielded: discard it; deltas of ``attempt`` follow from the beginning."""

    attempt: int


StreamItem: TypeAlias = str | Restart | FinalEvent


def new_job_id() -> str:
    return uuid.uuid4().hex


def build_job(prompt: PromptInput | None = None, /, **params: Any) -> JobRequest:
    """A validated :class:`JobRequest` from a prompt (str), chat messages or token ids, and job fields.

    ``id`` defaults to a fresh UUID. Raises ``pydantic.ValidationError`` on bad fields, before anything
    reaches Redis.
    """
    fields = dict(params)
    if prompt is not None:
        if isinstance(prompt, str):
            fields["prompt"] = prompt
        elif prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            fields["prompt_token_ids"] = list(prompt)
        else:
            fields["messages"] = [dict(m) for m in prompt]  # type: ignore[arg-type]
    fields.setdefault("id", new_job_id())
    return JobRequest.model_validate(fields)


def _as_job(item: PromptInput | Mapping[str, Any] | JobRequest, common: Mapping[str, Any]) -> JobRequest:
    if isinstance(item, JobRequest):
        return item
    if isinstance(item, Mapping):
        return build_job(**{**common, **item})
    return build_job(item, **common)


@dataclass
class StreamState:
    """Turns the events of a reply stream into what :meth:`stream` yields, across redeliveries.

    Pure (no I/O) so both clients share it, and tests can feed it any sequence of events.
    """

    index: int = 0
    attempt: int = 0
    yielded: str = ""  # text yielded since the start (or since the last Restart)
    replay: str = ""  # text of the current attempt so far
    done: bool = False
    result: FinalEvent | None = None

    def feed(self, event: Event) -> list[StreamItem]:
        if self.done:
            return []
        if isinstance(event, ErrorEvent):
            self.done = True
            raise JobFailed(event)
        if isinstance(event, FinalEvent):
            self.done = True
            self.result = event
            text = next((c.text for c in event.choices if c.index == self.index), "")
            out: list[StreamItem] = [*self._advance(text, event.attempt, final=True), event]
            return out
        if event.index != self.index:
            return []
        if event.attempt < self.attempt:
            return []  # a stale delivery that was taken over still talking: ignore it
        if event.attempt > self.attempt:
            self.attempt = event.attempt
            self.replay = ""
        self.replay += event.text
        return self._advance(self.replay, event.attempt, final=False)

    def _advance(self, text: str, attempt: int, *, final: bool) -> list[StreamItem]:
        """Yield what ``text`` (the current attempt's text so far) adds beyond what was already yielded."""
        if text.startswith(self.yielded):
            delta = text[len(self.yielded) :]
            self.yielded = text
            return [delta] if delta else []
        if not final and self.yielded.startswith(text):
            return []  # the new attempt is still repeating known text
        self.yielded = text
        return [Restart(attempt), text] if text else [Restart(attempt)]


def _events(reply: Any) -> tuple[list[Event], str | None]:
    """Events and last entry id from an ``XREAD`` reply on one stream."""
    events: list[Event] = []
    last = None
    for _stream, entries in reply or []:
        for entry_id, fields in entries:
            last = entry_id
            raw = (fields or {}).get(EVENT_FIELD)
            if raw is not None:
                events.append(parse_event(raw))
    return events, last


def _terminal(event: Event) -> FinalEvent:
    if isinstance(event, ErrorEvent):
        raise JobFailed(event)
    assert isinstance(event, FinalEvent)
    return event


@dataclass
class _Base:
    namespace: str = "pagedq"
    queue: str = "default"
    block_ms: int = 1000
    _reply_to: dict[str, str] = field(default_factory=dict)

    @property
    def keys(self) -> Keys:
        return Keys(self.namespace, self.queue)

    def reply_key(self, job_id: str, reply_to: str | None = None) -> str:
        return reply_to or self._reply_to.get(job_id) or self.keys.reply(job_id)

    def _remember(self, job: JobRequest) -> None:
        if job.reply_to:
            if len(self._reply_to) > 100_000:
                self._reply_to.clear()
            self._reply_to[job.id] = job.reply_to


class PagedqClient(_Base):
    """Blocking producer client. ``redis`` is a URL or a ``redis.Redis`` created with
    ``decode_responses=True``."""

    def __init__(
        self, redis_url: str | redis.Redis = "redis://localhost:6379/0", *, namespace: str = "pagedq",
        queue: str = "default", block_ms: int = 1000,
    ) -> None:  # fmt: skip
        super().__init__(namespace=namespace, queue=queue, block_ms=block_ms)
        self.redis = redis.Redis.from_url(redis_url, decode_responses=True) if isinstance(redis_url, str) else redis_url

    def close(self) -> None:
        self.redis.close()

    def __enter__(self) -> PagedqClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def submit(self, prompt: PromptInput | None = None, /, **params: Any) -> str:
        """Queue one job: a prompt string, a list of chat messages or a list of token ids, plus any job
        field (``max_tokens``, ``temperature``, ``priority``, ``timeout_s``, ``id``...). Returns its id."""
        job = build_job(prompt, **params)
        self.redis.xadd(self.keys.jobs, {JOB_FIELD: job.to_json()})
        self._remember(job)
        return job.id

    def submit_many(self, items: Iterable[PromptInput | Mapping[str, Any] | JobRequest], /, **common: Any) -> list[str]:
        """Queue many jobs in one round trip; ``items`` are prompts or dicts of job fields, ``common``
        applies to all. Returns their ids in order."""
        jobs = [_as_job(item, common) for item in items]
        pipe = self.redis.pipeline(transaction=False)
        for job in jobs:
            pipe.xadd(self.keys.jobs, {JOB_FIELD: job.to_json()})
            self._remember(job)
        pipe.execute()
        return [job.id for job in jobs]

    def cancel(self, job_id: str) -> None:
        """Ask workers to stop the job: a running one ends with finish_reason "cancelled" and its partial
        text, one not yet started with error ``cancelled``."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.set(self.keys.cancel(job_id), "1", ex=CANCEL_TTL_S)
        pipe.publish(self.keys.cancel_channel, job_id)
        pipe.execute()

    def events(self, job_id: str, *, timeout: float | None = None, reply_to: str | None = None) -> Iterator[Event]:
        """Raw events of the job's reply stream, up to and including its terminal event."""
        key = self.reply_key(job_id, reply_to)
        deadline = None if timeout is None else time.monotonic() + timeout
        last = "0"
        while True:
            block = _block_ms(self.block_ms, deadline)
            if block is None:
                raise TimeoutError(f"job {job_id}: no terminal event within {timeout}s")
            events, new_last = _events(self.redis.xread({key: last}, count=1000, block=block))
            last = new_last or last
            for event in events:
                yield event
                if not isinstance(event, TokenEvent):
                    return
            if new_last is None and (stored := self.redis.get(self.keys.result(job_id))) is not None:
                # The job ended after the empty read (its last token events and terminal land together):
                # read the stream once more, so those tokens are not skipped; only a reply stream that
                # expired or was never written (a foreign reply_to) leaves the result key alone.
                events, _ = _events(self.redis.xread({key: last}, count=1000))
                for event in events:
                    yield event
                    if not isinstance(event, TokenEvent):
                        return
                yield parse_event(stored)
                return

    def stream(
        self, job_id: str, *, timeout: float | None = None, index: int = 0, reply_to: str | None = None
    ) -> Iterator[StreamItem]:
        """Text deltas of choice ``index`` (``str``), then the :class:`FinalEvent`.

        May yield a :class:`Restart` after a redelivery (see module doc); raises :class:`JobFailed` on an
        ``error`` event and ``TimeoutError`` after ``timeout`` seconds.
        """
        state = StreamState(index=index)
        for event in self.events(job_id, timeout=timeout, reply_to=reply_to):
            yield from state.feed(event)

    def result(self, job_id: str, timeout: float | None = None, *, reply_to: str | None = None) -> FinalEvent:
        """Wait for the job's terminal event; raises :class:`JobFailed` or ``TimeoutError``."""
        stored = self.redis.get(self.keys.result(job_id))
        if stored is not None:
            return _terminal(parse_event(stored))
        for event in self.events(job_id, timeout=timeout, reply_to=reply_to):
            if not isinstance(event, TokenEvent):
                return _terminal(event)
        raise AssertionError("unreachable")  # pragma: no cover


class AsyncPagedqClient(_Base):
    """asyncio producer client, same API as :class:`PagedqClient` with ``await`` / ``async for``."""

    def __init__(
        self, redis_url: str | aioredis.Redis = "redis://localhost:6379/0", *, namespace: str = "pagedq",
        queue: str = "default", block_ms: int = 1000,
    ) -> None:  # fmt: skip
        super().__init__(namespace=namespace, queue=queue, block_ms=block_ms)
        self.redis = (
            aioredis.Redis.from_url(redis_url, decode_responses=True) if isinstance(redis_url, str) else redis_url
        )

    async def close(self) -> None:
        await self.redis.aclose()

    async def __aenter__(self) -> AsyncPagedqClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def submit(self, prompt: PromptInput | None = None, /, **params: Any) -> str:
        job = build_job(prompt, **params)
        await self.redis.xadd(self.keys.jobs, {JOB_FIELD: job.to_json()})
        self._remember(job)
        return job.id

    async def submit_many(
        self, items: Iterable[PromptInput | Mapping[str, Any] | JobRequest], /, **common: Any
    ) -> list[str]:
        jobs = [_as_job(item, common) for item in items]
        pipe = self.redis.pipeline(transaction=False)
        for job in jobs:
            pipe.xadd(self.keys.jobs, {JOB_FIELD: job.to_json()})
            self._remember(job)
        await pipe.execute()
        return [job.id for job in jobs]

    async def cancel(self, job_id: str) -> None:
        pipe = self.redis.pipeline(transaction=False)
        pipe.set(self.keys.cancel(job_id), "1", ex=CANCEL_TTL_S)
        pipe.publish(self.keys.cancel_channel, job_id)
        await pipe.execute()

    async def events(
        self, job_id: str, *, timeout: float | None = None, reply_to: str | None = None
    ) -> AsyncIterator[Event]:
        key = self.reply_key(job_id, reply_to)
        deadline = None if timeout is None else time.monotonic() + timeout
        last = "0"
        while True:
            block = _block_ms(self.block_ms, deadline)
            if block is None:
                raise TimeoutError(f"job {job_id}: no terminal event within {timeout}s")
            events, new_last = _events(await self.redis.xread({key: last}, count=1000, block=block))
            last = new_last or last
            for event in events:
                yield event
                if not isinstance(event, TokenEvent):
                    return
            if new_last is None and (stored := await self.redis.get(self.keys.result(job_id))) is not None:
                events, _ = _events(await self.redis.xread({key: last}, count=1000))  # see PagedqClient.events
                for event in events:
                    yield event
                    if not isinstance(event, TokenEvent):
                        return
                yield parse_event(stored)
                return

    async def stream(
        self, job_id: str, *, timeout: float | None = None, index: int = 0, reply_to: str | None = None
    ) -> AsyncIterator[StreamItem]:
        state = StreamState(index=index)
        async for event in self.events(job_id, timeout=timeout, reply_to=reply_to):
            for item in state.feed(event):
                yield item

    async def result(self, job_id: str, timeout: float | None = None, *, reply_to: str | None = None) -> FinalEvent:
        stored = await self.redis.get(self.keys.result(job_id))
        if stored is not None:
            return _terminal(parse_event(stored))
        async for event in self.events(job_id, timeout=timeout, reply_to=reply_to):
            if not isinstance(event, TokenEvent):
                return _terminal(event)
        raise AssertionError("unreachable")  # pragma: no cover


def _block_ms(block_ms: int, deadline: float | None) -> int | None:
    """How long the next blocking read may wait; None once ``deadline`` has passed."""
    if deadline is None:
        return block_ms
    left = deadline - time.monotonic()
    if left <= 0:
        return None
    return max(1, min(block_ms, int(left * 1000)))
