"""The producer client as a web backend uses it: wrong arguments, odd timeouts, closing while a wait is open.

* A bad ``submit`` / ``submit_many`` raises an exception naming the argument before anything reaches Redis
  (nothing queued), instead of failing deep inside ``dict()``, or worse, queueing something else: ``bytes``
  as token ids, a string as one job a character, a keyword prompt dropped for the positional one.
* ``timeout=0`` reads once without blocking (a finished job is returned, not a ``TimeoutError``), NaN is
  refused by name, ``inf`` waits like ``None``.
* ``close()`` ends a wait still open in another thread or task with :class:`ClientClosed`, instead of it
  reconnecting behind the closed client and staying blocked until the job ends.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from schemas.keys import EVENT_FIELD
from tests.redis_servers import RedisServer, redis_server  # noqa: F401
from tests.test_client_hardening import _final, _token
from tests.worker_harness import Ctx, wait_for
from worker.client import AsyncPagedqClient, ClientClosed, PagedqClient, build_job


@pytest.fixture
def ctx(redis_server: RedisServer) -> Iterator[Ctx]:  # noqa: F811
    c = Ctx(redis_server)
    yield c
    c.close()


def _finish(ctx: Ctx, job_id: str, text: str) -> None:
    """The job's run as a worker writes it: a token event, then the terminal event and the result key."""
    ctx.redis.xadd(ctx.keys.reply(job_id), {EVENT_FIELD: _token(job_id, text)})
    final = _final(job_id, text).to_json()
    pipe = ctx.redis.pipeline(transaction=True)
    pipe.xadd(ctx.keys.reply(job_id), {EVENT_FIELD: final})
    pipe.set(ctx.keys.result(job_id), final)
    pipe.execute()


@pytest.mark.parametrize(
    ("prompt", "params", "exc", "named"),
    [
        (5, {}, TypeError, "prompt must be"),
        ({"role": "user", "content": "hi"}, {}, TypeError, "got dict"),
        (b"hello", {}, TypeError, "got bytes"),  # was queued as token ids [104, 101, ...]
        (["a", "b"], {}, TypeError, "prompt: a list"),
        ([1, "b"], {}, TypeError, "prompt: a list"),
        ("hi", {"prompt": "other"}, ValueError, "positional prompt and prompt"),  # one was dropped silently
        ([1, 2], {"prompt_token_ids": [3]}, ValueError, "positional prompt and prompt_token_ids"),
    ],
)
def test_a_bad_prompt_is_refused_by_name_before_anything_is_sent(
    ctx: Ctx, prompt: Any, params: dict[str, Any], exc: type[Exception], named: str
) -> None:
    with pytest.raises(exc, match=named):
        ctx.client.submit(prompt, **params)
    assert ctx.redis.xlen(ctx.keys.jobs_shard(0)) == 0


@pytest.mark.parametrize("items", ["abc", b"ab", {"prompt": "a"}])
def test_submit_many_refuses_a_single_prompt(ctx: Ctx, items: Any) -> None:
    """A str, bytes or dict is iterable: it was queued as one job a character, a byte or a key."""
    with pytest.raises(TypeError, match="items must be a list"):
        ctx.client.submit_many(items)
    assert ctx.redis.xlen(ctx.keys.jobs_shard(0)) == 0


def test_submit_many_refuses_common_fields_it_cannot_apply_to_a_job_request(ctx: Ctx) -> None:
    with pytest.raises(TypeError, match="max_tokens"):
        ctx.client.submit_many([build_job("a")], max_tokens=8)  # max_tokens was dropped silently
    assert ctx.redis.xlen(ctx.keys.jobs_shard(0)) == 0


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_timeout_zero_reads_once_and_nan_is_refused(ctx: Ctx, kind: str) -> None:
    done = ctx.client.submit("hi")
    _finish(ctx, done, "Hi")
    pending = ctx.client.submit("hi")

    def run(job_id: str, timeout: float) -> list[Any]:
        if kind == "sync":
            return list(ctx.client.stream(job_id, timeout=timeout))

        async def read() -> list[Any]:
            async with AsyncPagedqClient(ctx.server.url, namespace=ctx.ns) as client:
                return [item async for item in client.stream(job_id, timeout=timeout)]

        return asyncio.run(read())

    items = run(done, 0)  # raised TimeoutError without reading
    assert items[0] == "Hi" and items[-1].id == done
    assert run(done, -1)[0] == "Hi"
    with pytest.raises(TimeoutError):
        run(pending, 0)
    with pytest.raises(ValueError, match="timeout must be"):  # was "cannot convert float NaN to integer"
        run(pending, float("nan"))
    with pytest.raises(ValueError, match="timeout must be"):
        ctx.client.result(pending, timeout=float("nan"))


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_close_ends_a_wait_still_open(ctx: Ctx, kind: str) -> None:
    """Before, the wait reconnected behind the closed client and stayed blocked until its own timeout."""
    job_id = ctx.client.submit("hi")
    name = f"closer-{ctx.ns}-{kind}"

    def blocked() -> bool:
        return any(c["name"] == name and "b" in c["flags"] for c in ctx.redis.client_list())

    if kind == "sync":
        conn = redis.Redis.from_url(ctx.server.url, decode_responses=True, client_name=name)
        client = PagedqClient(conn, namespace=ctx.ns)
        out: dict[str, Any] = {}

        def reader() -> None:
            try:
                out["items"] = list(client.stream(job_id, timeout=30))
            except BaseException as exc:  # reported by the main thread
                out["error"] = exc

        thread = threading.Thread(target=reader, daemon=True)
        thread.start()
        wait_for(lambda: blocked() or not thread.is_alive(), 10, what="the reader blocked on the reply stream")
        client.close()
        thread.join(10)
        assert not thread.is_alive() and isinstance(out.get("error"), ClientClosed), out
        with pytest.raises(ClientClosed):  # nor does a closed client send anything (it reconnected silently)
            client.submit("after close")
    else:

        async def main() -> None:
            conn = redis.asyncio.Redis.from_url(ctx.server.url, decode_responses=True, client_name=name)
            client = AsyncPagedqClient(conn, namespace=ctx.ns)

            async def read() -> list[Any]:
                return [item async for item in client.stream(job_id, timeout=30)]

            task = asyncio.create_task(read())
            await asyncio.to_thread(wait_for, lambda: blocked() or task.done(), 10, what="the reader blocked")
            await client.close()
            with pytest.raises(ClientClosed):
                await asyncio.wait_for(task, 10)

        asyncio.run(main())
    # The server drops the closed socket on its next event-loop turn, so wait for it to see it; a
    # wait that reconnected behind the closed client stays blocked for its 30 s and fails this.
    wait_for(lambda: not blocked(), 10, what="the server dropped the closed client's blocked read")
