"""The gateway's FastAPI app: OpenAI's endpoints over the queue, ``/healthz``, and the dashboard.

One request is one job. The job is added to the jobs stream of a queue whose live workers serve the requested
model, and its reply stream is followed with the producer client (:class:`worker.client.AsyncPagedqClient`),
which already skips events of other jobs, believes a terminal event only with its result key behind it, and
lets the per-choice :class:`worker.client.StreamState` follow ``attempt`` across a redelivery without
repeating text. What the client does not know, this module checks while the reply stream is silent:

* whether a worker has picked the job up (its entry is pending in the consumer group, or already gone);
  not within ``queue_timeout_s`` means 503 and a cancelled job, so that no worker spends time on an answer
  nobody waits for;
* whether the HTTP client is still there; gone means the job is cancelled.

A streaming response starts only once the job's first event has arrived, so that errors that come before
any text (a prompt too long for the model, a queue nobody serves) get their own status code and not a 200
followed by an error chunk.

Every answer that is not a success is OpenAI's ``{"error": {...}}``, whatever failed: a bad body (400), Redis
unreachable or the gateway's connection pool exhausted (503), an unknown route (404), a bug (500).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import redis
import redis.asyncio as aioredis
from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from redis.exceptions import RedisClusterException
from starlette.exceptions import HTTPException
from starlette.types import Receive, Scope, Send

from ops.gateway.fleet import Dashboard, Router
from ops.gateway.openai_api import (
    ApiError,
    Diverged,
    Kind,
    LiveLogprobs,
    Steps,
    check_unicode,
    chunk,
    completion_body,
    delta_choice,
    error_for_event,
    final_error,
    finish_choice,
    json_problem,
    logprob_choice,
    logprob_chunks,
    parse_request,
    shown,
    timeout_error,
    usage,
)
from ops.gateway.openai_api import Request as JobSpec
from ops.gateway.redis_pool import PoolExhausted, connect_gateway
from ops.gateway.responses_api import (
    ResponseEvents,
    ResponsesRequest,
    parse_responses_request,
    renamed_error,
    response_body,
)
from ops.gateway.settings import GatewaySettings
from ops.queue_commands import (
    REDIS_ERRORS,
    MalformedDeadLetter,
    dead_streams_label,
    find_dead_letter,
    replay_dead_letter,
)
from schemas.affinity import shard_for_job
from schemas.jobs import ErrorEvent, FinalEvent, TokenEvent
from schemas.keys import GROUP, JOB_FIELD, Keys, split_entry_ref
from worker.client import AsyncPagedqClient, JobFailed, Restart, StreamState, build_job
from worker.redis_url import connect

DASHBOARD_HTML = Path(__file__).with_name("dashboard.html")
POLL_MS = 250
"""Longest blocking read of a reply stream: how often a silent job's pickup and its client are checked."""

log = logging.getLogger("uvicorn.error")  # uvicorn's own logger: its handler and format, at --log-level


class JSONBody(JSONResponse):
    """JSON written so that it always encodes: a lone surrogate in a string (text the gateway did not make,
    such as a worker's message) becomes its ``\\udXXX`` escape, still valid JSON, where Starlette's
    ``encode("utf-8")`` would raise and turn the answer into a plain-text 500."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode(
            "utf-8", "backslashreplace"
        )


def error_response(exc: ApiError, headers: dict[str, str] | None = None) -> JSONBody:
    out = dict(headers or {})
    if exc.status == 401:
        out["WWW-Authenticate"] = "Bearer"
    if exc.job_id:
        out["x-request-id"] = exc.job_id
    return JSONBody(exc.body(), status_code=exc.status, headers=out)


def redis_error(exc: redis.RedisError | RedisClusterException) -> ApiError:
    """503 for a Redis command that failed: the gateway's pool had no free connection in time (it is at its
    limit of requests in flight: ``redis_max_connections``), or Redis did not answer. A cluster client's own
    failures (no node reachable, a command it refuses) are ``RedisClusterException``, which is no
    ``RedisError``: the gateway catches both (:data:`~ops.queue_commands.REDIS_ERRORS`), so a cluster's
    failure is this 503 as well, not the generic 500."""
    if isinstance(exc, redis.MaxConnectionsError | PoolExhausted):
        return ApiError(503, f"the gateway is overloaded: {exc} (retry later)", type="server_error", code="overloaded")
    return ApiError(
        503, f"Redis is unavailable ({type(exc).__name__}): retry later", type="server_error", code="redis_unavailable"
    )


def model_not_found(model: str) -> ApiError:
    return ApiError(
        404, f"the model {shown(model)!r} does not exist (GET /v1/models)", param="model", code="model_not_found"
    )


def internal_error() -> ApiError:
    return ApiError(
        500, "internal error in the gateway (its log has the details)", type="server_error", code="internal"
    )


class QueueTimeout(Exception):
    """No worker picked the job up within ``queue_timeout_s``."""


class ClientGone(Exception):
    """The HTTP client disconnected."""


@dataclass
class Gateway:
    """What every request shares: settings, the Redis clients, the router and the dashboard's history."""

    settings: GatewaySettings
    redis_url: str
    redis: aioredis.Redis = field(init=False)
    client: AsyncPagedqClient = field(init=False)
    router: Router = field(init=False)
    dashboard: Dashboard = field(init=False)

    def __post_init__(self) -> None:
        s = self.settings
        self.redis = connect_gateway(
            self.redis_url,
            max_connections=s.redis_max_connections,
            timeout_s=s.redis_pool_timeout_s,
            decode_responses=True,
        )
        # reconnect_s=0: a Redis error ends the request with a 503 at once (the SDKs retry that), and the
        # pool's own "exhausted" error, a ConnectionError too, must not be waited out as an outage.
        self.client = AsyncPagedqClient(
            self.redis, namespace=s.namespace, queue=s.queue, block_ms=POLL_MS, reconnect_s=0
        )
        self.router = Router(self.redis, s.namespace, s.queue)
        sync = connect(self.redis_url, decode_responses=True, encoding_errors="surrogateescape")
        self.dashboard = Dashboard(sync, s.namespace, s.queue_shards)

    async def close(self) -> None:
        await self.redis.aclose()
        self.dashboard.redis.close()


@dataclass
class Job:
    """One request's job in flight: submitted, followed, cancelled when nobody waits for it any more."""

    gw: Gateway
    spec: JobSpec
    queue: str
    http: Request
    entry_id: str = ""
    stream: str = ""  # the job stream (shard) it was added to
    submitted: float = 0.0
    picked_up: bool = False
    ended: bool = False
    watch_client: bool = True  # off once a streaming response runs (Starlette then watches the client)

    @property
    def keys(self) -> Keys:
        return Keys(self.gw.settings.namespace, self.queue, self.gw.settings.queue_shards)

    async def submit(self) -> None:
        job = build_job(**self.spec.fields)
        self.stream = self.keys.jobs_shard(shard_for_job(job, self.keys.shards))  # prefix affinity
        self.entry_id = str(await self.gw.redis.xadd(self.stream, {JOB_FIELD: job.to_json()}))
        self.submitted = time.monotonic()

    async def _is_picked_up(self) -> bool:
        """Delivered to a worker (pending in the group) or already ended (workers delete ended entries)."""
        pipe = self.gw.redis.pipeline(transaction=False)
        pipe.xpending_range(self.stream, GROUP, min=self.entry_id, max=self.entry_id, count=1)
        pipe.xrange(self.stream, min=self.entry_id, max=self.entry_id)
        try:
            pending, present = await pipe.execute()
        except redis.ResponseError as exc:  # NOGROUP: no worker ever joined this queue
            if "NOGROUP" in str(exc):
                return False
            raise
        return bool(pending) or not present

    async def _on_idle(self) -> None:
        if self.watch_client and await self.http.is_disconnected():
            raise ClientGone
        if not self.picked_up:
            self.picked_up = await self._is_picked_up()
            if not self.picked_up and time.monotonic() - self.submitted > self.gw.settings.queue_timeout_s:
                raise QueueTimeout

    def events(self) -> AsyncIterator[TokenEvent | FinalEvent | ErrorEvent]:
        return self.gw.client.events(
            self.spec.job_id, timeout=self.gw.settings.request_timeout_s, on_idle=self._on_idle
        )

    async def cancel(self) -> None:
        """Cancel the job unless it ended; shielded, so it also runs while the request's task is cancelled.
        Best effort: with Redis down (or no connection free) the job still ends at its deadline (timeout_s),
        and the request's own error, not this one, is what its client must get."""
        if self.ended:
            return
        self.ended = True
        with anyio.CancelScope(shield=True):
            try:
                await self.gw.client.cancel(self.spec.job_id)
            except REDIS_ERRORS as exc:
                log.warning("could not cancel job %s: %r", self.spec.job_id, exc)

    async def first_event(self, events: AsyncIterator[Any]) -> Any:
        """The job's first event; every way of never getting one becomes its HTTP error (and a cancel)."""
        try:
            event = await anext(events)
        except QueueTimeout:
            await self.cancel()
            raise ApiError(
                503,
                f"no worker picked the job up within {self.gw.settings.queue_timeout_s:g} s; it was cancelled",
                type="server_error",
                code="queue_timeout",
            ) from None
        except TimeoutError:
            await self.cancel()
            raise timeout_error(self.gw.settings.request_timeout_s) from None
        except BaseException:
            await self.cancel()
            raise
        self.picked_up = True
        if isinstance(event, ErrorEvent):
            self.ended = True
            raise error_for_event(event, self.spec, self.gw.settings.request_timeout_s)
        if isinstance(event, FinalEvent):
            self.ended = True
            if (error := final_error(event, self.gw.settings.request_timeout_s)) is not None:
                raise error
        return event


class JobStreamingResponse(StreamingResponse):
    """A streaming response that runs ``on_close`` however it ends: finished, failed, or cut off by the
    client (Starlette then cancels the stream's task, and only a finally of the response itself still runs)."""

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], Awaitable[None]]) -> None:
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self.on_close()


def _sse(data: Any, event: str | None = None) -> bytes:
    # backslashreplace: as JSONBody, so that a chunk always encodes (a lone surrogate becomes a JSON escape).
    text = json.dumps(data, separators=(",", ":"), ensure_ascii=False)
    head = f"event: {event}\n" if event else ""  # the Responses API names each event, as OpenAI's does
    return f"{head}data: {text}\n\n".encode("utf-8", "backslashreplace")


async def _live_chunks(job: Job, first: Any, events: AsyncIterator[Any]) -> AsyncIterator[dict[str, Any]]:
    """Each choice's deltas as they come (across redeliveries, never repeated), then its finish; usage last."""
    spec = job.spec
    n = int(spec.fields.get("n") or 1)
    states = [StreamState(index=i, job_id=spec.job_id) for i in range(n)]
    started: set[int] = set()
    event = first
    while True:
        final = event if isinstance(event, FinalEvent) else None
        if final is not None:
            job.ended = True
            if (error := final_error(final, job.gw.settings.request_timeout_s)) is not None:
                raise error  # the text sent so far is all there is: the client gets the error after it
        for i, state in enumerate(states):
            items = state.feed(event)  # JobFailed on an error event
            if any(isinstance(item, Restart) for item in items):
                raise Diverged
            text = "".join(item for item in items if isinstance(item, str))
            if final is not None:
                choice = next((c for c in final.choices if c.index == i), None)
                if choice is not None:
                    yield chunk(spec, [finish_choice(spec, choice, text, first=i not in started)])
                    started.add(i)
            elif text:
                yield chunk(spec, [delta_choice(spec, i, text, first=i not in started)])
                started.add(i)
        if final is not None:
            if spec.include_usage:
                yield chunk(spec, [], usage(final.usage))
            return
        event = await anext(events)


async def _logprob_chunks(job: Job, first: Any, events: AsyncIterator[Any]) -> AsyncIterator[dict[str, Any]]:
    """With logprobs: each token event's text as it comes, with its tokens' logprobs (workers send them in
    token events), across redeliveries as :func:`_live_chunks` (:class:`LiveLogprobs`); then what the final
    event adds, with each choice's finish (:func:`logprob_chunks`: all of it for an older worker, which sends
    logprobs in the final event only)."""
    spec = job.spec
    steps = Steps()
    live: dict[int, LiveLogprobs] = {}
    event = first
    while not isinstance(event, FinalEvent):
        if isinstance(event, ErrorEvent):
            raise JobFailed(event)
        if isinstance(event, TokenEvent):
            steps.add(event)
            state = live.setdefault(event.index, LiveLogprobs())
            if (piece := state.feed(event)) is not None:
                yield chunk(spec, [logprob_choice(spec, event.index, *piece, first=not state.started)])
                state.started = True
        event = await anext(events)
    job.ended = True
    if (error := final_error(event, job.gw.settings.request_timeout_s)) is not None:
        raise error  # the chunks sent so far are all there is: the client gets the error after them
    for body in logprob_chunks(spec, event, steps, live):
        yield body
    if spec.include_usage:
        yield chunk(spec, [], usage(event.usage))


async def _response_events(
    job: Job, first: Any, events: AsyncIterator[Any], shape: ResponseEvents
) -> AsyncIterator[dict[str, Any]]:
    """The Responses API's events for a chat job: :func:`_live_chunks`' deltas (redeliveries followed, never
    repeated) each as ``response.output_text.delta``, between the events that open and close the response."""
    for opening in shape.opening():
        yield opening
    final = first if isinstance(first, FinalEvent) else None

    async def remember_final() -> AsyncIterator[Any]:
        nonlocal final
        async for event in events:
            if isinstance(event, FinalEvent):
                final = event
            yield event

    async for body in _live_chunks(job, first, remember_final()):
        for choice in body["choices"]:
            if text := (choice.get("delta") or {}).get("content"):
                yield shape.delta(text)
    assert final is not None  # _live_chunks returns only after the final event
    for closing in shape.closing(final):
        yield closing


async def _sse_stream(job: Job, first: Any, events: AsyncIterator[Any]) -> AsyncIterator[bytes]:
    """SSE chunks, then ``[DONE]``. Once the response has started its status cannot change: whatever ends
    the job badly becomes an error chunk in OpenAI's shape (the SDK raises it) before ``[DONE]``. For the
    Responses API: its named events, an ``error`` event for a failure, and no ``[DONE]`` (OpenAI sends none)."""
    spec = job.spec
    timeout_s = job.gw.settings.request_timeout_s
    shape = ResponseEvents(spec) if isinstance(spec, ResponsesRequest) else None
    if shape is not None:
        chunks = _response_events(job, first, events, shape)
    else:
        chunks = _logprob_chunks(job, first, events) if spec.logprobs else _live_chunks(job, first, events)

    def failed(error: ApiError) -> bytes:
        return _sse(error.body()) if shape is None else _sse(shape.error(renamed_error(error)), "error")

    try:
        async for body in chunks:
            yield _sse(body) if shape is None else _sse(body, body["type"])
    except JobFailed as exc:
        job.ended = True
        yield failed(error_for_event(exc.event, spec, timeout_s))
    except ApiError as exc:
        yield failed(exc)
    except Diverged:
        yield failed(
            ApiError(
                500,
                "the job's worker was lost and its rerun produced different text; retry the request",
                type="server_error",
                code="diverged",
            )
        )
    except TimeoutError:
        yield failed(timeout_error(timeout_s))
    except REDIS_ERRORS as exc:
        log.warning("job %s: Redis failed mid-stream: %r", spec.job_id, exc)
        yield failed(redis_error(exc))
    except Exception:
        log.exception("job %s: the stream failed", spec.job_id)
        yield failed(internal_error())
    if shape is None:
        yield b"data: [DONE]\n\n"


def create_app(settings: GatewaySettings, redis_url: str) -> FastAPI:
    """The app; ``redis_url`` is the resolved one (``settings.redis_url``, or the embedded Redis's socket)."""
    state: dict[str, Gateway] = {}
    timeout_s = settings.request_timeout_s

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state["gw"] = Gateway(settings, redis_url)
        try:
            yield
        finally:
            await state["gw"].close()

    app = FastAPI(
        title="pagedq gateway",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
        default_response_class=JSONBody,
    )

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(redis.RedisError)
    @app.exception_handler(RedisClusterException)
    async def redis_failed(request: Request, exc: redis.RedisError | RedisClusterException) -> JSONResponse:
        log.warning("%s %s: Redis failed: %r", request.method, request.url.path, exc)
        return error_response(redis_error(exc), {"Retry-After": "1"})

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        """Starlette's own errors (an unknown route, a method a route does not take) in OpenAI's shape."""
        if exc.status_code == 404:
            error = ApiError(404, f"no such endpoint: {request.method} {shown(request.url.path)}", code="not_found")
        elif exc.status_code == 405:
            error = ApiError(
                405, f"{request.method} is not allowed on {shown(request.url.path)}", code="method_not_allowed"
            )
        else:
            error = ApiError(exc.status_code, shown(str(exc.detail)))
        return error_response(error, dict(exc.headers or {}))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        # No log here: Starlette re-raises the exception after this answer, and uvicorn logs it with its
        # traceback. The answer says nothing of it: its text may hold the request's data.
        return error_response(internal_error())

    def check_key(request: Request) -> None:
        if not settings.api_keys:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not settings.key_ok(given.strip()):
            raise ApiError(401, "a valid API key is required (Authorization: Bearer <key>)", code="invalid_api_key")

    async def body_of(request: Request) -> Any:
        try:
            body = json.loads(await request.body())
        except RecursionError:  # json's C decoder gives up past the interpreter's recursion limit
            raise ApiError(400, "the request body is nested too deeply") from None
        except ValueError as exc:
            raise ApiError(400, f"the request body is not valid JSON: {json_problem(exc)}") from None
        check_unicode(body)
        return body

    async def complete(request: Request, kind: Kind | None) -> Response:
        """One OpenAI request as one job; ``kind`` None: the Responses API's (a chat job)."""
        check_key(request)
        gw = state["gw"]
        body = await body_of(request)
        spec: JobSpec
        if kind is None:
            spec = parse_responses_request(body, default_max_tokens=settings.default_max_tokens, timeout_s=timeout_s)
        else:
            spec = parse_request(
                kind,
                body,
                default_max_tokens=settings.default_max_tokens if kind == "chat" else 16,
                timeout_s=timeout_s,
            )
        try:
            queue = await gw.router.route(spec.model)
        except LookupError:
            raise model_not_found(spec.model) from None
        if queue is None:
            raise ApiError(
                503,
                f"no live worker serves the model {shown(spec.model)!r}",
                type="server_error",
                code="no_live_worker",
            )
        job = Job(gw, spec, queue, request)
        try:
            return await run_job(job)
        except ApiError as exc:
            exc.job_id = spec.job_id
            if isinstance(spec, ResponsesRequest):
                renamed_error(exc)  # a prompt too long names the request's input, not messages
            raise
        except REDIS_ERRORS as exc:
            error = redis_error(exc)
            error.job_id = spec.job_id if job.entry_id else None
            log.warning("job %s: Redis failed: %r", spec.job_id, exc)
            raise error from None

    async def run_job(job: Job) -> Response:
        spec = job.spec
        await job.submit()
        events = job.events()
        try:
            first = await job.first_event(events)
        except ClientGone:
            return Response(status_code=499)
        if not spec.stream:
            steps = Steps()  # completions' text_offset (openai_api.completion_body)
            try:
                event = first
                while not isinstance(event, FinalEvent):  # token events: for logprobs, or a worker's anyway
                    steps.add(event)
                    event = await anext(events)
                    if isinstance(event, ErrorEvent):
                        job.ended = True
                        raise error_for_event(event, spec, timeout_s)
            except ClientGone:
                await job.cancel()
                return Response(status_code=499)
            except (QueueTimeout, TimeoutError):
                await job.cancel()
                raise timeout_error(timeout_s) from None
            except REDIS_ERRORS:
                await job.cancel()
                raise
            job.ended = True
            if (error := final_error(event, timeout_s)) is not None:
                raise error
            body = (
                response_body(spec, event)
                if isinstance(spec, ResponsesRequest)
                else completion_body(spec, event, steps)
            )
            return JSONBody(body, headers={"x-request-id": spec.job_id})
        job.watch_client = False

        async def on_close() -> None:
            await job.cancel()
            await events.aclose()  # type: ignore[attr-defined]

        response = JobStreamingResponse(_sse_stream(job, first, events), on_close)
        response.headers["x-request-id"] = spec.job_id
        return response

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await complete(request, "chat")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await complete(request, "completion")

    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        return await complete(request, None)

    def model_object(mid: str, created: float) -> dict[str, Any]:
        return {"id": mid, "object": "model", "created": int(created), "owned_by": "pagedq"}

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        check_key(request)
        found = await state["gw"].router.models()
        return {"object": "list", "data": [model_object(mid, created) for mid, created in sorted(found.items())]}

    @app.get("/v1/models/{model:path}")
    async def model(request: Request, model: str) -> dict[str, Any]:
        check_key(request)
        found = await state["gw"].router.models()
        if model not in found:
            raise model_not_found(model)
        return model_object(model, found[model])

    @app.get("/healthz")
    async def healthz() -> JSONResponse:
        gw = state["gw"]
        try:
            await gw.redis.ping()
            workers = await gw.router.workers()
        except REDIS_ERRORS as exc:
            return JSONResponse({"status": "unhealthy", "redis": type(exc).__name__}, status_code=503)
        return JSONResponse({"status": "ok", "redis": "ok", "live_workers": len(workers)})

    @app.get("/dashboard")
    async def dashboard() -> HTMLResponse:
        html = DASHBOARD_HTML.read_text().replace("__REFRESH_MS__", str(int(settings.dashboard_refresh_s * 1000)))
        return HTMLResponse(html)

    @app.get("/dashboard/data")
    async def dashboard_data(request: Request) -> dict[str, Any]:
        # Behind the key: job ids and failure reasons are the clients' business (the page itself is not).
        check_key(request)
        return await asyncio.to_thread(state["gw"].dashboard.snapshot)

    @app.post("/dashboard/replay/{queue}/{entry_id}")
    async def replay(request: Request, queue: str, entry_id: str) -> dict[str, Any]:
        check_key(request)
        try:
            keys = Keys(settings.namespace, queue, settings.queue_shards)
        except ValueError as exc:
            raise ApiError(400, str(exc), param="queue") from None
        gw = state["gw"]

        def run() -> list[str]:
            r = gw.dashboard.redis
            try:
                letter = find_dead_letter(r, keys, entry_id)
            except MalformedDeadLetter as exc:
                # Not a letter a worker wrote (anyone who may XADD can write the stream): nothing to re-queue,
                # and the entry stays for the operator to read, fix or delete, as `pagedq dead replay` does.
                raise ApiError(
                    409, f"{exc}: it cannot be replayed and is left in place", code="malformed_dead_letter"
                ) from None
            if letter is None:
                raise ApiError(404, f"no dead letter {entry_id} in {dead_streams_label(keys)}", code="not_found")
            if letter.truncated:
                raise ApiError(409, "this dead letter keeps only the start of its job: it cannot be replayed")
            return replay_dead_letter(r, keys, entry_id, letter)

        try:
            new_ids = await asyncio.to_thread(run)
        except redis.ResponseError as exc:
            raise ApiError(400, f"bad entry id: {exc}", param="entry_id") from None
        stream = keys.jobs_shard(split_entry_ref(entry_id)[0])
        return {"replayed": entry_id, "entry": new_ids[0], "entries": new_ids, "stream": stream}

    return app
