"""Producer client for pagedq, sync (:class:`PagedqClient`) and asyncio (:class:`AsyncPagedqClient`).

It only speaks wire protocol v2 (see ``README.md``, "Wire protocol v2") over plain Redis commands, so anything it does
can be done from any language. Both clients share the pure parts (building jobs, following a reply stream
across redeliveries) and differ only in how they wait on Redis.

Redelivery: when a worker dies mid-job another one reruns it with a higher ``attempt``. :meth:`stream`
never yields text twice: while the new attempt repeats what was already yielded it stays silent and then
continues where the old attempt stopped; if the new attempt diverges (sampling) it yields a
:class:`Restart` first, after which the deltas start again from the beginning of the text.

Readers trust nothing they read from a reply stream: any producer may name another job's reply stream as
its ``reply_to``, and anyone who can write to Redis can append to it. So events of another job (``id``
not the job's) and entries that are not valid events are skipped, and a terminal event read from the
stream only counts once ``<ns>:{<id>}:result`` confirms it: the worker writes the two atomically, so the
result key is the authoritative outcome and a terminal event without one is a forgery.

Durability: ``submit`` returns once the primary has the job in memory. With ``wait_replicas`` (per call
or per client) it also waits, with Redis ``WAIT``, until that many replicas have it, and raises
:class:`NotReplicated` when fewer acknowledge in time (README, "Durability").
"""

from __future__ import annotations

import asyncio
import math
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeAlias

import redis
import redis.asyncio as aioredis

from schemas.affinity import shard_for_job
from schemas.jobs import ErrorEvent, FinalEvent, JobRequest, TokenEvent, parse_event
from schemas.keys import EVENT_FIELD, JOB_FIELD, Keys
from schemas.sampling import SamplingParams
from worker.backoff import Backoff
from worker.redis_url import connect, connect_async

CANCEL_TTL_S = 86_400
RECONNECT_ERRORS = (redis.ConnectionError, redis.TimeoutError)
"""What a wait on a job rides out (:class:`_Outage`): the connection lost or refused, a server still loading."""

PromptInput: TypeAlias = str | Sequence[Mapping[str, Any]] | Sequence[int]
Event: TypeAlias = TokenEvent | FinalEvent | ErrorEvent


class NotReplicated(Exception):
    """Fewer replicas than ``wait_replicas`` acknowledged a submission within ``wait_timeout_ms``.

    The jobs ARE queued on the primary (Redis cannot take a write back): they will run unless the primary
    fails before a replica gets them. To be sure, submit again with the same ids (``job_ids``) once the
    replicas are back: however often an id is queued, it has exactly one terminal event.
    """

    def __init__(self, job_ids: list[str], acked: int, wanted: int, timeout_ms: int) -> None:
        super().__init__(
            f"{len(job_ids)} job(s) queued on the primary, but only {acked} of {wanted} replica(s) acknowledged "
            f"within {timeout_ms} ms: they are lost if the primary fails now (first id: {job_ids[0]})"
        )
        self.job_ids = job_ids
        self.acked = acked
        self.wanted = wanted


class ClientClosed(RuntimeError):
    """The client was closed: its waits stop (instead of reconnecting, which would leak connections past
    ``close`` and keep a shutting-down server's readers blocked until their jobs end) and it sends nothing."""


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

    ``id`` defaults to a fresh UUID and ``submitted_at`` to now (``time.time()``, this machine's clock):
    workers count a job's queue time and ``timeout_s`` from it (when it is neither in the future nor
    absurdly old by the worker's clock) instead of from the stream entry id, which a producer may choose.
    Pass ``submitted_at`` to keep a job's original time (re-queueing it), or ``None`` for none. Raises
    ``pydantic.ValidationError`` on bad fields, before anything reaches Redis.
    """
    fields = dict(params)
    if prompt is not None:
        # A positional prompt and a keyword one would otherwise be merged silently, one of them dropped.
        if given := [f for f in ("prompt", "messages", "prompt_token_ids") if f in params]:
            raise ValueError(f"exactly one prompt is allowed: got a positional prompt and {', '.join(given)}")
        name = _prompt_field(prompt)  # first: the value below is evaluated before the subscript
        fields[name] = prompt if isinstance(prompt, str) else [t if isinstance(t, int) else dict(t) for t in prompt]
    fields.setdefault("id", new_job_id())
    fields.setdefault("submitted_at", time.time())
    job = JobRequest.model_validate(fields)
    # The engine's own rules (no empty stop string, min_tokens <= max_tokens...), which a worker would
    # otherwise answer with an error event after the round trip; pydantic only, no torch in a producer.
    SamplingParams.model_validate(job.sampling_kwargs())
    return job


def _prompt_field(prompt: object) -> str:
    """The job field a positional prompt fills; ``TypeError`` naming ``prompt`` for anything else.

    Checked here because the shapes are told apart by their items: ``bytes`` are a sequence of ints (they
    would go out as token ids), and a dict or a list of strings would fail deep inside ``dict()`` with a
    message that names neither the argument nor what it should have been."""
    if isinstance(prompt, str):
        return "prompt"
    if isinstance(prompt, Sequence) and not isinstance(prompt, bytes | bytearray | memoryview):
        if prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return "prompt_token_ids"
        if all(isinstance(m, Mapping) for m in prompt):
            return "messages"
        kinds = sorted({type(t).__name__ for t in prompt})
        raise TypeError(
            f"prompt: a list must hold only chat messages (dicts) or only token ids (ints), got {', '.join(kinds)}"
        )
    raise TypeError(
        f"prompt must be a str, a list of chat messages (dicts) or a list of token ids (ints), "
        f"got {type(prompt).__name__}"
    )


def _as_jobs(items: object, common: Mapping[str, Any]) -> list[JobRequest]:
    """``submit_many``'s jobs. A str, bytes or a single dict is iterable too, and would be queued as one job a
    character, a byte or a key: refused, as ``submit`` is what queues one prompt."""
    if isinstance(items, str | bytes | bytearray | Mapping | JobRequest):
        raise TypeError(f"items must be a list of prompts, job dicts or JobRequests, got {type(items).__name__}")
    return [_as_job(item, common) for item in items]  # type: ignore[attr-defined]


def _as_job(item: PromptInput | Mapping[str, Any] | JobRequest, common: Mapping[str, Any]) -> JobRequest:
    if isinstance(item, JobRequest):
        if common:  # a validated job is sent as it is: the common fields would be dropped without a word
            raise TypeError(f"common fields ({', '.join(sorted(common))}) do not apply to a JobRequest: set them on it")
        if "submitted_at" in item.model_fields_set:
            return item
        return item.model_copy(update={"submitted_at": time.time()})
    if isinstance(item, Mapping):
        return build_job(**{**common, **item})
    return build_job(item, **common)


@dataclass
class StreamState:
    """Turns the events of a reply stream into what :meth:`stream` yields, across redeliveries.

    Pure (no I/O) so both clients share it, and tests can feed it any sequence of events. With ``job_id``
    set, events of other jobs (another job's ``reply_to`` naming this stream) are ignored.
    """

    index: int = 0
    job_id: str | None = None
    attempt: int = 0
    yielded: str = ""  # text yielded since the start (or since the last Restart)
    replay: str = ""  # text of the current attempt so far
    done: bool = False
    result: FinalEvent | None = None

    def feed(self, event: Event) -> list[StreamItem]:
        if self.done or (self.job_id is not None and event.id != self.job_id):
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


def _events(reply: Any, job_id: str) -> tuple[list[Event], str | None]:
    """The events of job ``job_id`` and the last entry id from an ``XREAD`` reply on one stream.

    Entries without a valid ``event``, and events of other jobs, are skipped (module doc): a reply stream
    is writable by anyone, and a reader that crashed on, or believed, whatever was written there would
    hand every producer a way to break or fool every other producer's reads.
    """
    events: list[Event] = []
    last = None
    for _stream, entries in reply or []:
        for entry_id, fields in entries:
            last = entry_id
            raw = fields.get(EVENT_FIELD) if isinstance(fields, dict) else None
            if raw is None:
                continue
            try:
                event = parse_event(raw)
            except ValueError:  # pydantic's ValidationError, also for non-JSON
                continue
            if event.id == job_id:
                events.append(event)
    return events, last


def stored_end(raw: str | bytes | None, job_id: str) -> FinalEvent | ErrorEvent | None:
    """The terminal event stored at the job's result key, or None when there is none (or none valid)."""
    if raw is None:
        return None
    try:
        event = parse_event(raw)
    except ValueError:
        return None
    return event if event.id == job_id and not isinstance(event, TokenEvent) else None


def _terminal(event: Event) -> FinalEvent:
    if isinstance(event, ErrorEvent):
        raise JobFailed(event)
    assert isinstance(event, FinalEvent)
    return event


class _Outage:
    """How a wait on a job (``events``, ``stream``, ``result``) rides out a lost Redis connection: a restart,
    a failover, a network blip. Each read is retried with backoff for up to ``reconnect_s`` of continuous
    failure and never past the wait's own deadline; then the error is raised. Nothing is read twice or
    skipped: the reply stream is read on from the last entry seen, and a job that ended meanwhile is found
    at its result key (the empty-read check in ``events``). Submissions are not retried: the caller knows
    whether sending the same ids again is what it wants (``NotReplicated`` explains why it is safe)."""

    def __init__(self, reconnect_s: float) -> None:
        self.reconnect_s = reconnect_s
        self.since: float | None = None
        self.backoff = Backoff(0.05, 2.0)

    def delay(self, exc: BaseException, deadline: float | None) -> float:
        """The wait before the next try; raises ``exc`` once the budget or the deadline would be passed."""
        now = time.monotonic()
        if self.since is None:
            self.since = now
        delay = self.backoff.next_delay()
        if now + delay - self.since > self.reconnect_s or (deadline is not None and now + delay >= deadline):
            raise exc
        return delay

    def over(self) -> None:
        self.since = None
        self.backoff.reset()


@dataclass
class _Base:
    namespace: str = "pagedq"
    queue: str = "default"
    block_ms: int = 1000
    wait_replicas: int = 0
    wait_timeout_ms: int = 1000
    queue_shards: int = 1
    affinity: bool = True
    reconnect_s: float = 30.0
    _reply_to: dict[str, str] = field(default_factory=dict)
    _next_shard: int = 0
    _closed: bool = False

    def _check_open(self) -> None:
        if self._closed:
            raise ClientClosed("the pagedq client is closed")

    @property
    def keys(self) -> Keys:
        return Keys(self.namespace, self.queue, self.queue_shards)

    def stream_for(self, job: JobRequest) -> str:
        """The job stream a job goes to: the shard of its affinity key (``affinity=True``, the default), or
        the shards in turn (``affinity=False``: spread evenly, no prefix locality)."""
        if self.affinity:
            shard = shard_for_job(job, self.queue_shards)
        else:
            shard, self._next_shard = self._next_shard, (self._next_shard + 1) % self.queue_shards
        return self.keys.jobs_shard(shard)

    def reply_key(self, job_id: str, reply_to: str | None = None) -> str:
        return reply_to or self._reply_to.get(job_id) or self.keys.reply(job_id)

    def _wait_args(self, wait_replicas: int | None, wait_timeout_ms: int | None) -> tuple[int, int]:
        """The (replicas, timeout) a submission waits for: the call's, else the client's."""
        replicas = self.wait_replicas if wait_replicas is None else wait_replicas
        timeout_ms = self.wait_timeout_ms if wait_timeout_ms is None else wait_timeout_ms
        if replicas < 0 or timeout_ms < 0:
            raise ValueError(f"wait_replicas and wait_timeout_ms must be >= 0, got {replicas}, {timeout_ms}")
        return replicas, timeout_ms

    def _remember(self, job: JobRequest) -> None:
        if job.reply_to:
            if len(self._reply_to) > 100_000:
                self._reply_to.clear()
            self._reply_to[job.id] = job.reply_to


class PagedqClient(_Base):
    """Blocking producer client. ``redis`` is a URL or a ``redis.Redis`` created with
    ``decode_responses=True``.

    ``wait_replicas`` > 0 makes every ``submit``/``submit_many`` wait (Redis ``WAIT``, at most
    ``wait_timeout_ms``; 0 waits forever) until that many replicas have the jobs, raising
    :class:`NotReplicated` otherwise; each call may override both. Waits on a job retry a lost Redis
    connection for up to ``reconnect_s`` seconds (0: raise at once; :class:`_Outage`).
    """

    def __init__(
        self, redis_url: str | redis.Redis = "redis://localhost:6379/0", *, namespace: str = "pagedq",
        queue: str = "default", block_ms: int = 1000, wait_replicas: int = 0, wait_timeout_ms: int = 1000,
        queue_shards: int = 1, affinity: bool = True, reconnect_s: float = 30.0,
    ) -> None:  # fmt: skip
        super().__init__(
            namespace=namespace, queue=queue, block_ms=block_ms, wait_replicas=wait_replicas,
            wait_timeout_ms=wait_timeout_ms, queue_shards=queue_shards, affinity=affinity, reconnect_s=reconnect_s,
        )  # fmt: skip
        Keys(namespace, queue, queue_shards)  # reject a bad queue_shards now, not at the first submit
        self._wait_args(None, None)  # reject bad values now, not at the first submit
        self.redis = connect(redis_url, decode_responses=True) if isinstance(redis_url, str) else redis_url

    def close(self) -> None:
        """Close the connections; a wait still open (another thread's ``stream``) raises
        :class:`ClientClosed` at its next read instead of reconnecting."""
        self._closed = True
        self.redis.close()

    def __enter__(self) -> PagedqClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def submit(
        self, prompt: PromptInput | None = None, /, *, wait_replicas: int | None = None,
        wait_timeout_ms: int | None = None, **params: Any,
    ) -> str:  # fmt: skip
        """Queue one job: a prompt string, a list of chat messages or a list of token ids, plus any job
        field (``max_tokens``, ``temperature``, ``priority``, ``timeout_s``, ``id``...). Returns its id.

        ``wait_replicas`` / ``wait_timeout_ms`` override the client's (class doc); :class:`NotReplicated`
        when too few replicas acknowledged."""
        return self.submit_many(
            [build_job(prompt, **params)], wait_replicas=wait_replicas, wait_timeout_ms=wait_timeout_ms
        )[0]

    def submit_many(
        self, items: Iterable[PromptInput | Mapping[str, Any] | JobRequest], /, *, wait_replicas: int | None = None,
        wait_timeout_ms: int | None = None, **common: Any,
    ) -> list[str]:  # fmt: skip
        """Queue many jobs in one round trip; ``items`` are prompts or dicts of job fields, ``common``
        applies to all. Returns their ids in order. ``wait_replicas``: as for :meth:`submit`, one
        ``WAIT`` for the whole batch."""
        self._check_open()
        replicas, timeout_ms = self._wait_args(wait_replicas, wait_timeout_ms)
        jobs = _as_jobs(items, common)
        # One pipeline, hence one connection: WAIT counts the writes of its own connection only.
        pipe = self.redis.pipeline(transaction=False)
        for job in jobs:
            pipe.xadd(self.stream_for(job), {JOB_FIELD: job.to_json()})
            self._remember(job)
        if replicas and jobs:
            pipe.wait(replicas, timeout_ms)
        replies = pipe.execute()
        _check_replicas(jobs, replies, replicas, timeout_ms)
        return [job.id for job in jobs]

    def cancel(self, job_id: str) -> None:
        """Ask workers to stop the job: a running one ends with finish_reason "cancelled" and its partial
        text, one not yet started with error ``cancelled``."""
        self._check_open()
        # The flag first, then the notice: two commands, since a cluster pipeline refuses PUBLISH.
        self.redis.set(self.keys.cancel(job_id), "1", ex=CANCEL_TTL_S)
        self.redis.publish(self.keys.cancel_channel, job_id)

    def events(self, job_id: str, *, timeout: float | None = None, reply_to: str | None = None) -> Iterator[Event]:
        """The job's events from its reply stream, up to and including its terminal event, which is the
        one stored at its result key (module doc: others' events, invalid entries and unconfirmed
        terminal events are skipped)."""
        key = self.reply_key(job_id, reply_to)
        deadline = _deadline(timeout)
        last = "0"
        outage = _Outage(self.reconnect_s)
        expired = False
        while True:
            self._check_open()
            block = _block_ms(self.block_ms, deadline)
            if block is None:
                if expired:
                    raise TimeoutError(f"job {job_id}: no terminal event within {timeout}s")
                expired = True  # one last read without BLOCK: a job already over is no timeout (timeout=0)
            try:
                events, new_last = _events(self.redis.xread({key: last}, count=1000, block=block), job_id)
                last = new_last or last
                unconfirmed = False  # a terminal event of this read had no result key behind it
                for event in events:
                    if isinstance(event, TokenEvent):
                        yield event
                    elif not unconfirmed:  # one GET per read, however many forged terminals it holds
                        if (stored := stored_end(self.redis.get(self.keys.result(job_id)), job_id)) is not None:
                            yield stored
                            return
                        unconfirmed = True
                if new_last is None and (stored := stored_end(self.redis.get(self.keys.result(job_id)), job_id)):
                    # The job ended after the empty read (its last token events and terminal land together):
                    # read the stream once more, so those tokens are not skipped; only a reply stream that
                    # expired or was never written (a foreign reply_to) leaves the result key alone.
                    events, _ = _events(self.redis.xread({key: last}, count=1000), job_id)
                    yield from (event for event in events if isinstance(event, TokenEvent))
                    yield stored
                    return
            except RECONNECT_ERRORS as exc:
                self._check_open()  # close() dropped the connection: stop, do not reconnect
                time.sleep(outage.delay(exc, deadline))
                continue
            outage.over()

    def stream(
        self, job_id: str, *, timeout: float | None = None, index: int = 0, reply_to: str | None = None
    ) -> Iterator[StreamItem]:
        """Text deltas of choice ``index`` (``str``), then the :class:`FinalEvent`.

        May yield a :class:`Restart` after a redelivery (see module doc); raises :class:`JobFailed` on an
        ``error`` event and ``TimeoutError`` after ``timeout`` seconds.
        """
        state = StreamState(index=index, job_id=job_id)
        for event in self.events(job_id, timeout=timeout, reply_to=reply_to):
            yield from state.feed(event)

    def result(self, job_id: str, timeout: float | None = None, *, reply_to: str | None = None) -> FinalEvent:
        """Wait for the job's terminal event; raises :class:`JobFailed` or ``TimeoutError``."""
        self._check_open()
        _deadline(timeout)  # a bad timeout is refused before the first round trip
        stored = stored_end(self.redis.get(self.keys.result(job_id)), job_id)
        if stored is not None:
            return _terminal(stored)
        for event in self.events(job_id, timeout=timeout, reply_to=reply_to):
            if not isinstance(event, TokenEvent):
                return _terminal(event)
        raise AssertionError("unreachable")  # pragma: no cover


class AsyncPagedqClient(_Base):
    """asyncio producer client, same API as :class:`PagedqClient` with ``await`` / ``async for``."""

    def __init__(
        self, redis_url: str | aioredis.Redis = "redis://localhost:6379/0", *, namespace: str = "pagedq",
        queue: str = "default", block_ms: int = 1000, wait_replicas: int = 0, wait_timeout_ms: int = 1000,
        queue_shards: int = 1, affinity: bool = True, reconnect_s: float = 30.0,
    ) -> None:  # fmt: skip
        super().__init__(
            namespace=namespace, queue=queue, block_ms=block_ms, wait_replicas=wait_replicas,
            wait_timeout_ms=wait_timeout_ms, queue_shards=queue_shards, affinity=affinity, reconnect_s=reconnect_s,
        )  # fmt: skip
        Keys(namespace, queue, queue_shards)  # reject a bad queue_shards now, not at the first submit
        self._wait_args(None, None)
        self.redis = connect_async(redis_url, decode_responses=True) if isinstance(redis_url, str) else redis_url

    async def close(self) -> None:
        self._closed = True  # as PagedqClient.close
        await self.redis.aclose()

    async def __aenter__(self) -> AsyncPagedqClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def submit(
        self, prompt: PromptInput | None = None, /, *, wait_replicas: int | None = None,
        wait_timeout_ms: int | None = None, **params: Any,
    ) -> str:  # fmt: skip
        ids = await self.submit_many(
            [build_job(prompt, **params)], wait_replicas=wait_replicas, wait_timeout_ms=wait_timeout_ms
        )
        return ids[0]

    async def submit_many(
        self, items: Iterable[PromptInput | Mapping[str, Any] | JobRequest], /, *, wait_replicas: int | None = None,
        wait_timeout_ms: int | None = None, **common: Any,
    ) -> list[str]:  # fmt: skip
        self._check_open()
        replicas, timeout_ms = self._wait_args(wait_replicas, wait_timeout_ms)
        jobs = _as_jobs(items, common)
        pipe = self.redis.pipeline(transaction=False)  # one connection for the XADDs and WAIT (see sync)
        for job in jobs:
            pipe.xadd(self.stream_for(job), {JOB_FIELD: job.to_json()})
            self._remember(job)
        if replicas and jobs:
            pipe.wait(replicas, timeout_ms)
        replies = await pipe.execute()
        _check_replicas(jobs, replies, replicas, timeout_ms)
        return [job.id for job in jobs]

    async def cancel(self, job_id: str) -> None:
        self._check_open()
        await self.redis.set(self.keys.cancel(job_id), "1", ex=CANCEL_TTL_S)
        await self.redis.publish(self.keys.cancel_channel, job_id)

    async def events(
        self, job_id: str, *, timeout: float | None = None, reply_to: str | None = None,
        on_idle: Callable[[], Awaitable[None]] | None = None,
    ) -> AsyncIterator[Event]:  # fmt: skip
        """As :meth:`PagedqClient.events`. ``on_idle`` is awaited after every read that found nothing new
        (at most ``block_ms`` apart while the job is silent), and at least every ``block_ms`` while events flow:
        a server following many jobs at once checks there what the reply stream cannot say (the job still not
        picked up, its HTTP client gone) and raises to stop following. Not only on silence: a job that sends
        an event every step (logprobs stream per token) would otherwise never be checked, and a client gone
        from it would leave it running to its last token."""
        key = self.reply_key(job_id, reply_to)
        deadline = _deadline(timeout)
        last = "0"
        checked = time.monotonic()  # when on_idle last ran
        outage = _Outage(self.reconnect_s)
        expired = False
        while True:  # as PagedqClient.events
            self._check_open()
            block = _block_ms(self.block_ms, deadline)
            if block is None:
                if expired:
                    raise TimeoutError(f"job {job_id}: no terminal event within {timeout}s")
                expired = True  # one last read without BLOCK: a job already over is no timeout (timeout=0)
            try:
                events, new_last = _events(await self.redis.xread({key: last}, count=1000, block=block), job_id)
                if on_idle is not None and (new_last is None or time.monotonic() - checked >= self.block_ms / 1000):
                    checked = time.monotonic()
                    await on_idle()
                last = new_last or last
                unconfirmed = False
                for event in events:
                    if isinstance(event, TokenEvent):
                        yield event
                    elif not unconfirmed:
                        if (stored := stored_end(await self.redis.get(self.keys.result(job_id)), job_id)) is not None:
                            yield stored
                            return
                        unconfirmed = True
                if new_last is None and (stored := stored_end(await self.redis.get(self.keys.result(job_id)), job_id)):
                    events, _ = _events(await self.redis.xread({key: last}, count=1000), job_id)
                    for event in events:
                        if isinstance(event, TokenEvent):
                            yield event
                    yield stored
                    return
            except RECONNECT_ERRORS as exc:
                self._check_open()
                await asyncio.sleep(outage.delay(exc, deadline))
                continue
            outage.over()

    async def stream(
        self, job_id: str, *, timeout: float | None = None, index: int = 0, reply_to: str | None = None
    ) -> AsyncIterator[StreamItem]:
        state = StreamState(index=index, job_id=job_id)
        async for event in self.events(job_id, timeout=timeout, reply_to=reply_to):
            for item in state.feed(event):
                yield item

    async def result(self, job_id: str, timeout: float | None = None, *, reply_to: str | None = None) -> FinalEvent:
        self._check_open()
        _deadline(timeout)
        stored = stored_end(await self.redis.get(self.keys.result(job_id)), job_id)
        if stored is not None:
            return _terminal(stored)
        async for event in self.events(job_id, timeout=timeout, reply_to=reply_to):
            if not isinstance(event, TokenEvent):
                return _terminal(event)
        raise AssertionError("unreachable")  # pragma: no cover


def _check_replicas(jobs: list[JobRequest], replies: list[Any], replicas: int, timeout_ms: int) -> None:
    """Raise :class:`NotReplicated` when the pipeline's closing ``WAIT`` counted fewer than ``replicas``."""
    if replicas and jobs and int(replies[-1]) < replicas:
        raise NotReplicated([job.id for job in jobs], int(replies[-1]), replicas, timeout_ms)


def _deadline(timeout: float | None) -> float | None:
    """The monotonic deadline of a wait of ``timeout`` seconds: None (or inf) waits forever, 0 or less reads
    once without blocking. NaN is refused: every comparison with it is false, so it would fail later as an
    unrelated ``cannot convert float NaN to integer``."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or math.isnan(timeout):
        raise ValueError(f"timeout must be a number of seconds or None, got {timeout!r}")
    return None if math.isinf(timeout) and timeout > 0 else time.monotonic() + timeout


def _block_ms(block_ms: int, deadline: float | None) -> int | None:
    """How long the next blocking read may wait; None once ``deadline`` has passed."""
    if deadline is None:
        return block_ms
    left = deadline - time.monotonic()
    if left <= 0:
        return None
    return max(1, min(block_ms, int(left * 1000)))
