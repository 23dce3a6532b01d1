"""``pagedq serve`` end to end: the official ``openai`` SDK against the gateway as a subprocess, a real
Redis (Debian's ``redis-server``) and real worker processes on the tiny model.

One Redis, one worker and the gateways are shared by the module (each costs seconds of start-up on two
cores); every test uses its own job ids, so they do not disturb each other. The worker runs with a small
step delay so that a long job is still running when a test acts on it (a disconnect, a SIGKILL, a full
worker that reads no new job).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import openai
import pytest
from redis.crc import key_slot
from redis.exceptions import RedisClusterException

from schemas.jobs import Choice, DeadLetter, ErrorEvent, FinalEvent, Timings, Usage
from tests.redis_servers import ClusterServers, RedisServer, free_port, make_server, redis_cluster  # noqa: F401
from tests.worker_harness import REPO, Ctx, WorkerProcess, wait_for

API_KEY = "sk-test-" + "k" * 24


class GatewayProcess:
    """``python -m ops.cli serve`` as a child process on a free port, its log in a file."""

    def __init__(
        self, server: RedisServer | ClusterServers, namespace: str, log_dir: Path, name: str, **settings: Any
    ) -> None:
        self.port = free_port()
        self.log_path = log_dir / f"gateway-{name}.log"
        env = {k: v for k, v in os.environ.items() if not k.startswith("PAGEDQ_")}
        env["PYTHONPATH"] = str(REPO)
        args = {"redis_url": server.url, "namespace": namespace, "port": self.port, **settings}
        cmd = [sys.executable, "-m", "ops.cli", "serve"]
        for key, value in args.items():
            cmd += ["--" + key.replace("_", "-"), str(value)]
        self._log = open(self.log_path, "wb")  # noqa: SIM115
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=self._log, stderr=subprocess.STDOUT)
        self.url = f"http://127.0.0.1:{self.port}"

        def healthy() -> bool:
            if self.proc.poll() is not None:
                raise AssertionError(f"gateway {name} exited:\n{self.log()}")
            try:
                with urllib.request.urlopen(self.url + "/healthz", timeout=2) as response:
                    return bool(response.status == 200)
            except (urllib.error.URLError, OSError):
                return False

        wait_for(healthy, 30, 0.05, f"gateway {name} /healthz")

    def client(self, api_key: str = API_KEY) -> openai.OpenAI:
        # No retries: a 503 must reach the test as it was sent, not be retried by the SDK.
        return openai.OpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0, timeout=60)

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-6000:]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


@dataclass
class Fleet:
    ctx: Ctx
    worker: WorkerProcess
    gateway: GatewayProcess
    model: str

    @property
    def client(self) -> openai.OpenAI:
        return self.gateway.client()


@pytest.fixture(scope="module")
def redis_srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = make_server("debian", tmp_path_factory.mktemp("gw-redis"))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def fleet(redis_srv: RedisServer, model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    logs = tmp_path_factory.mktemp("gw-logs")
    ctx = Ctx(redis_srv)
    worker = WorkerProcess(ctx, model_dir, logs, "gw-w1", step_delay_s=0.01, heartbeat_interval_s=1)
    gateway: GatewayProcess | None = None
    try:
        worker.wait_ready()
        gateway = GatewayProcess(redis_srv, ctx.ns, logs, "main", api_keys=API_KEY, dashboard_refresh_s=0.5)
        yield Fleet(ctx, worker, gateway, model_dir.name)
    except BaseException:
        print(worker.log())
        if gateway is not None:
            print(gateway.log())
        raise
    finally:
        if gateway is not None:
            gateway.close()
        worker.close()
        ctx.close()


def chat(text: str) -> list[Any]:
    return [{"role": "user", "content": text}]


def test_models_lists_what_live_workers_serve(fleet: Fleet) -> None:
    models = fleet.client.models.list()
    assert [m.id for m in models.data] == [fleet.model]
    assert models.data[0].owned_by == "pagedq"


def test_chat_streamed_deltas_concatenate_to_the_non_streamed_greedy_text(fleet: Fleet) -> None:
    kw: dict[str, Any] = {"model": fleet.model, "messages": chat("Tell me about queues."), "max_tokens": 12}
    whole = fleet.client.chat.completions.create(temperature=0, **kw)
    assert whole.object == "chat.completion"
    assert whole.id.startswith("chatcmpl-")
    (choice,) = whole.choices
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert whole.usage is not None and whole.usage.completion_tokens > 0 and whole.usage.prompt_tokens > 0
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens
    # The id is the job id: its result is in Redis under that name.
    stored = fleet.ctx.result(whole.id)
    assert isinstance(stored, FinalEvent) and stored.text == choice.message.content

    chunks = list(
        fleet.client.chat.completions.create(temperature=0, stream=True, stream_options={"include_usage": True}, **kw)
    )
    assert len({c.id for c in chunks}) == 1
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [choice.finish_reason]
    last = chunks[-1]  # include_usage: a last chunk without choices carries the usage
    assert last.choices == [] and last.usage is not None
    assert last.usage.completion_tokens == whole.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_completions_n2_streamed_and_not(fleet: Fleet) -> None:
    kw: dict[str, Any] = {"model": fleet.model, "prompt": "The capital of France is", "max_tokens": 8, "n": 2}
    whole = fleet.client.completions.create(temperature=0.8, seed=7, **kw)
    assert whole.object == "text_completion" and whole.id.startswith("cmpl-")
    assert sorted(c.index for c in whole.choices) == [0, 1]
    assert whole.usage is not None
    assert whole.usage.completion_tokens == sum(len(fleet.ctx.result(whole.id).choices[i].token_ids) for i in (0, 1))

    texts = ["", ""]
    reasons: dict[int, str] = {}
    usage = None
    for c in fleet.client.completions.create(
        temperature=0.8, seed=7, stream=True, stream_options={"include_usage": True}, **kw
    ):
        for choice in c.choices:
            texts[choice.index] += choice.text
            if choice.finish_reason:
                reasons[choice.index] = choice.finish_reason
        usage = c.usage or usage
    # Same seed, same job: the same two samples, streamed or not.
    assert texts == [whole.choices[0].text, whole.choices[1].text]
    assert reasons == {c.index: c.finish_reason for c in whole.choices}
    assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens


def test_stop_strings_cut_the_text(fleet: Fleet) -> None:
    kw: dict[str, Any] = {"model": fleet.model, "prompt": "Once upon a time", "max_tokens": 16, "temperature": 0}
    full = fleet.client.completions.create(**kw).choices[0].text
    assert len(full) > 6, full
    stop = full[3:6]  # a piece from the middle of the greedy text: the text ends just before its first occurrence
    cut = full[: full.index(stop)]
    for stream in (False, True):
        if stream:
            chunks = list(fleet.client.completions.create(stop=[stop], stream=True, **kw))
            text = "".join(c.choices[0].text for c in chunks if c.choices)
            reason = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        else:
            choice = fleet.client.completions.create(stop=[stop], **kw).choices[0]
            text, reason = choice.text, [choice.finish_reason]
        assert text == cut and reason == ["stop"], (stream, stop, full)


def test_sdk_error_types(fleet: Fleet) -> None:
    client = fleet.client
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(
            model=fleet.model,
            messages=chat("hi"),
            tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}],
        )
    assert bad.value.status_code == 400 and "tools" in bad.value.message
    assert bad.value.body is not None and bad.value.body["param"] == "tools"  # type: ignore[index]

    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=fleet.model, messages=chat("hi"), temperature=-1)
    assert bad.value.body["param"] == "temperature"  # type: ignore[index]

    with pytest.raises(openai.BadRequestError) as too_long:  # the worker knows the model's context (1024)
        client.completions.create(model=fleet.model, prompt=[5] * 1200, max_tokens=4)
    assert too_long.value.code == "context_length_exceeded"
    # The client's own max_tokens must fit beside the prompt (OpenAI's 400, with its numbers), where the
    # default (16 for completions) only caps: the choice stops at the context.
    with pytest.raises(openai.BadRequestError) as overflow:
        client.completions.create(model=fleet.model, prompt=[5] * 1020, max_tokens=5)
    assert overflow.value.code == "context_length_exceeded"
    assert "requested 1025 tokens (1020 in the messages, 5 in the completion)" in overflow.value.message
    capped = client.completions.create(model=fleet.model, prompt=[5] * 1020, temperature=0)
    assert capped.choices[0].finish_reason == "length" and capped.usage is not None
    assert capped.usage.completion_tokens == 4
    # A refusal only the worker can make (its grammar compiler judges the schema) names the request's field.
    bad_schema: Any = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=fleet.model, messages=chat("hi"), max_tokens=4, response_format=bad_schema)
    assert refused.value.body["param"] == "response_format", refused.value.body  # type: ignore[index]

    with pytest.raises(openai.AuthenticationError):
        fleet.gateway.client(api_key="sk-wrong").models.list()
    with pytest.raises(openai.AuthenticationError):
        fleet.gateway.client(api_key=API_KEY + "x").chat.completions.create(model=fleet.model, messages=chat("hi"))

    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="no-such-model", messages=chat("hi"))
    assert missing.value.code == "model_not_found"


OPENAI_CONTEXT_LENGTH = re.compile(
    r"This model's maximum context length is (\d+) tokens\. However, you requested (\d+) tokens "
    r"\((\d+) in the messages, (\d+) in the completion\)\. Please reduce the length of the messages or completion\."
)


def context_length_numbers(exc: openai.BadRequestError, param: str) -> tuple[int, int, int, int]:
    """(context, requested, prompt, completion) of OpenAI's 400 for a prompt too long, after checking that the
    SDK sees it as OpenAI sends it: its code, type and param, and the message in OpenAI's words, nothing else."""
    assert exc.status_code == 400
    assert (exc.code, exc.type, exc.param) == ("context_length_exceeded", "invalid_request_error", param), exc.body
    body: Any = exc.body
    assert set(body) == {"message", "type", "param", "code"}, body
    match = OPENAI_CONTEXT_LENGTH.fullmatch(body["message"])
    assert match is not None, body["message"]
    context, requested, prompt, completion = (int(g) for g in match.groups())
    assert requested == prompt + completion, body["message"]
    return context, requested, prompt, completion


def test_a_prompt_too_long_for_the_model_gets_openais_error(fleet: Fleet) -> None:
    """A prompt the model's context (1024 tokens) cannot hold: the 400 carried the worker's own words ("prompt
    is 1200 tokens; the model's context is ..."), where OpenAI's SDK users and vLLM's expect OpenAI's sentence
    with its numbers. Both endpoints, streamed or not, with the client's max_tokens or the default."""
    client = fleet.client
    cases: list[tuple[str, dict[str, Any], tuple[int, int, int, int]]] = [
        # The prompt alone fills the context: C is the max_tokens the job asked for, the client's own...
        ("prompt", {"prompt": [5] * 1200, "max_tokens": 4}, (1024, 1204, 1200, 4)),
        # ... or, none given, the default of /v1/completions (16).
        ("prompt", {"prompt": [5] * 1200}, (1024, 1216, 1200, 16)),
        # The prompt fits but not with the client's max_tokens beside it.
        ("prompt", {"prompt": [5] * 1020, "max_tokens": 5}, (1024, 1025, 1020, 5)),
        ("prompt", {"prompt": [5] * 1020, "max_tokens": 5, "stream": True}, (1024, 1025, 1020, 5)),
    ]
    for param, kw, numbers in cases:
        with pytest.raises(openai.BadRequestError) as refused:
            client.completions.create(model=fleet.model, **kw)
        assert context_length_numbers(refused.value, param) == numbers, kw

    # Chat: the prompt's length is the templated messages' (the worker's tokenizer). One that fills the context:
    long_chat = chat("hello " * 1100)
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(model=fleet.model, messages=long_chat, max_tokens=7, stream=stream)
        context, _, prompt, completion = context_length_numbers(refused.value, "messages")
        assert (context, completion) == (1024, 7) and prompt >= 1024, refused.value.message
    # One that fits, with one max_completion_tokens too many beside it: its length read off a served request.
    short_chat = chat("hello " * 300)
    served = client.chat.completions.create(model=fleet.model, messages=short_chat, max_tokens=1)
    assert served.usage is not None
    prompt = served.usage.prompt_tokens
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=fleet.model, messages=short_chat, max_completion_tokens=1025 - prompt)
    assert context_length_numbers(refused.value, "messages") == (1024, 1025, prompt, 1025 - prompt)


def test_context_length_error_rewrites_each_refusal_of_the_engine() -> None:
    """The gateway rewrites the worker's words, so both of the engine's wordings are pinned here: a change
    to either in ``engine/errors.py`` fails this test rather than a client's parser."""
    from engine.errors import PromptTooLongError
    from ops.gateway.openai_api import context_length_error

    alone = context_length_error(str(PromptTooLongError(1200, 1024)), "chat", 256)
    assert (alone.status, alone.param, alone.code, alone.type) == (
        400,
        "messages",
        "context_length_exceeded",
        "invalid_request_error",
    )
    assert alone.message == (
        "This model's maximum context length is 1024 tokens. However, you requested 1456 tokens "
        "(1200 in the messages, 256 in the completion). Please reduce the length of the messages or completion."
    )
    beside = context_length_error(str(PromptTooLongError(1020, 1024, 5)), "completion", 16)
    assert beside.param == "prompt" and beside.message == (
        "This model's maximum context length is 1024 tokens. However, you requested 1025 tokens "
        "(1020 in the messages, 5 in the completion). Please reduce the length of the messages or completion."
    )
    # A wording it does not know (a worker of another version) is passed on, never given made-up numbers.
    other = context_length_error("the prompt is far too long", "completion", 16)
    assert (other.message, other.param, other.code) == (
        "the prompt is far too long",
        "prompt",
        "context_length_exceeded",
    )


def test_no_live_worker_is_503(fleet: Fleet, redis_srv: RedisServer, tmp_path: Path) -> None:
    empty = GatewayProcess(redis_srv, "tempty" + fleet.ctx.ns, tmp_path, "empty")
    try:
        with pytest.raises(openai.InternalServerError) as unavailable:
            empty.client().chat.completions.create(model=fleet.model, messages=chat("hi"))
        assert unavailable.value.status_code == 503 and unavailable.value.code == "no_live_worker"
        assert empty.client().models.list().data == []
    finally:
        empty.close()


def test_job_not_picked_up_in_time_is_503_and_cancelled(fleet: Fleet, tmp_path: Path) -> None:
    ctx = fleet.ctx
    impatient = GatewayProcess(ctx.server, ctx.ns, tmp_path, "impatient", queue_timeout_s=0.5)
    # A live worker with no room: 4 running + 2 prefetched long jobs, so it reads nothing more for seconds.
    busy = ctx.client.submit_many(["busy"] * 6, max_tokens=600, ignore_eos=True, temperature=1.0, seed=2)
    try:
        wait_for(lambda: ctx.pending() == 6, 30, what="the worker holding six jobs")
        with pytest.raises(openai.InternalServerError) as unavailable:
            impatient.client().chat.completions.create(model=fleet.model, messages=chat("hi"), max_tokens=4)
        assert unavailable.value.status_code == 503 and unavailable.value.code == "queue_timeout"
        job_id = unavailable.value.response.headers["x-request-id"]
        assert ctx.redis.exists(ctx.keys.cancel(job_id))
    finally:
        for busy_id in busy:
            ctx.client.cancel(busy_id)
        impatient.close()
    # With room again, the worker reads the job and finds it cancelled: it never runs.
    event = wait_for(lambda: ctx.result(job_id), 30, what="the cancelled job's terminal event")
    assert isinstance(event, ErrorEvent) and event.code == "cancelled"
    wait_for(lambda: all(ctx.result(busy_id) for busy_id in busy), 30, what="the busy jobs to end")


def long_stream(fleet: Fleet, **extra: Any) -> Any:
    """A streamed chat request for a job of 600 tokens (several seconds), for a test to act on while it runs."""
    return fleet.client.chat.completions.create(
        model=fleet.model,
        messages=chat("Write a very long story."),
        max_tokens=600,
        extra_body={"ignore_eos": True},
        temperature=1.0,
        seed=1,
        stream=True,
        **extra,
    )


def test_client_disconnect_mid_stream_cancels_the_job(fleet: Fleet) -> None:
    stream = long_stream(fleet)
    first = next(iter(stream))
    job_id = first.id
    stream.close()  # the HTTP connection goes away mid-stream
    event = wait_for(lambda: fleet.ctx.result(job_id), 30, what="the disconnected job's terminal event")
    assert isinstance(event, FinalEvent), event
    assert event.choices[0].finish_reason == "cancelled"
    assert len(event.choices[0].token_ids) < 600


@pytest.mark.parametrize("logprobs", [None, 1])
def test_client_gone_before_a_non_streamed_answer_cancels_the_job(fleet: Fleet, logprobs: int | None) -> None:
    # With logprobs the job streams an event per step to the gateway (it needs each token's), so its reply
    # stream never falls silent: the gateway must look at the client while events flow, not only in a lull.
    user = f"client-gone-{logprobs}"
    impatient = openai.OpenAI(base_url=fleet.gateway.url + "/v1", api_key=API_KEY, max_retries=0, timeout=1.0)
    with pytest.raises(openai.APITimeoutError):
        impatient.completions.create(
            model=fleet.model,
            prompt="A long answer, please",
            max_tokens=600,
            temperature=1.0,
            seed=5,
            extra_body={"ignore_eos": True},
            user=user,
            logprobs=logprobs,
        )

    # The client hung up after a second; the gateway noticed and cancelled the job (found by its user).
    def ended() -> list[Any]:
        keys = fleet.ctx.redis.scan_iter(fleet.ctx.keys.result("cmpl-*"))
        events = [fleet.ctx.result(k.split("{", 1)[1].rsplit("}", 1)[0]) for k in keys]  # <ns>:{<id>}:result
        return [e for e in events if e is not None and e.metadata == {"user": user}]

    (event,) = wait_for(ended, 30, what="the abandoned job's end")
    if isinstance(event, ErrorEvent):  # cancelled before its first token (a very slow start)
        assert event.code == "cancelled"
    else:
        assert event.choices[0].finish_reason == "cancelled" and len(event.choices[0].token_ids) < 600


def test_guided_choice_passes_through(fleet: Fleet) -> None:
    out = fleet.client.chat.completions.create(
        model=fleet.model, messages=chat("yes or no?"), max_tokens=8, extra_body={"guided_choice": ["yes", "no"]}
    )
    assert out.choices[0].message.content in ("yes", "no")


def test_extra_body_fields_and_user_reach_the_job(fleet: Fleet) -> None:
    out = fleet.client.chat.completions.create(
        model=fleet.model,
        messages=[{"role": "developer", "content": "Be brief."}, *chat("hi")],
        max_completion_tokens=5,
        user="alice",
        extra_body={"top_k": 5, "min_tokens": 5, "repetition_penalty": 1.1, "priority": 3},
        temperature=0.5,
        seed=3,
    )
    assert out.usage is not None and out.usage.completion_tokens == 5
    stored = fleet.ctx.result(out.id)
    assert isinstance(stored, FinalEvent) and stored.metadata == {"user": "alice"}


def test_openai_tagging_fields_and_stream_options_of_the_current_sdk(fleet: Fleet) -> None:
    """What the current SDK documents and a client copies: ``metadata``, ``safety_identifier`` (``user``'s
    successor) and ``prompt_cache_key`` are taken (each used to be a 400), the first two echoed in the job's
    metadata; ``stream_options.include_obfuscation: false`` (OpenAI's bandwidth advice) is what pagedq does
    anyway, while ``true`` is refused by name; a negative ``seed`` (OpenAI's are signed 64-bit) is a seed."""
    kw: dict[str, Any] = {
        "model": fleet.model,
        "messages": chat("Tell me about queues."),
        "max_tokens": 6,
        "temperature": 1.0,
        "seed": -1,
        "metadata": {"team": "search", "run": "7"},
        "safety_identifier": "user-hash-1",
        "prompt_cache_key": "queues-v1",
    }
    whole = fleet.client.chat.completions.create(**kw)
    stored = fleet.ctx.result(whole.id)
    assert isinstance(stored, FinalEvent)
    assert stored.metadata == {"team": "search", "run": "7", "safety_identifier": "user-hash-1"}
    streamed = fleet.client.chat.completions.create(
        stream=True, stream_options={"include_usage": True, "include_obfuscation": False}, **kw
    )
    chunks = list(streamed)
    # The same seed, -1, gives the same sample: it is one fixed seed, not "random".
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 6
    with pytest.raises(openai.BadRequestError) as refused:
        fleet.client.chat.completions.create(stream=True, stream_options={"include_obfuscation": True}, **kw)
    assert refused.value.body["param"] == "stream_options", refused.value.body  # type: ignore[index]
    assert "include_obfuscation" in refused.value.message
    with pytest.raises(openai.BadRequestError) as too_many:
        fleet.client.completions.create(
            model=fleet.model, prompt="hi", max_tokens=2, extra_body={"metadata": {str(i): "x" for i in range(17)}}
        )
    assert too_many.value.body["param"] == "metadata", too_many.value.body  # type: ignore[index]


def test_logprobs(fleet: Fleet) -> None:
    out = fleet.client.chat.completions.create(
        model=fleet.model, messages=chat("hi"), max_tokens=3, temperature=0, logprobs=True, top_logprobs=2
    )
    content = out.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 3
    assert all(entry.token.startswith("token_id:") and len(entry.top_logprobs) == 2 for entry in content)


def test_logit_bias_through_the_sdk(fleet: Fleet) -> None:
    """OpenAI's logit_bias (token ids as string keys) reaches the sampler: +100 makes token 42 every greedy
    choice. Values out of [-100, 100] and ids past the model's vocabulary are 400s naming ``logit_bias``."""
    out = fleet.client.chat.completions.create(
        model=fleet.model, messages=chat("hi"), max_tokens=3, temperature=0, logprobs=True, logit_bias={"42": 100}
    )
    content = out.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and [entry.token for entry in content] == ["token_id:42"] * 3
    for bias in ({"42": 101}, {"100000": 5}):  # the gateway's check; the worker's (the model's vocabulary)
        with pytest.raises(openai.BadRequestError) as info:
            fleet.client.completions.create(model=fleet.model, prompt="hi", max_tokens=2, logit_bias=bias)
        assert info.value.param == "logit_bias", info.value.body


def test_print_config_masks_keys_and_password() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "ops.cli", "serve", "--print-config", "--api-keys", "sk-one,sk-two"],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO), "PAGEDQ_REDIS_URL": "redis://:hunter2@localhost:6379/0"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert "sk-one" not in out.stdout and "sk-two" not in out.stdout and "hunter2" not in out.stdout
    assert '"***"' in out.stdout


def test_serve_loads_no_torch() -> None:
    code = (
        "import sys\nimport ops.gateway.app, ops.gateway.command\n"
        "print(','.join(m for m in ('torch', 'transformers', 'engine') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == ""


CHROMIUM = "/usr/bin/chromium"


@pytest.mark.skipif(not os.access(CHROMIUM, os.X_OK), reason="Debian's chromium is not installed (.ci/run installs it)")
def test_dashboard_in_a_real_browser(fleet: Fleet, tmp_path: Path) -> None:
    from playwright.sync_api import sync_playwright

    ctx = fleet.ctx
    # A dead letter, made the real way: a worker refuses an invalid job.
    ctx.redis.xadd(ctx.keys.jobs, {"job": json.dumps({"id": "gw-dead-1", "prompt": "hi", "temperature": "hot"})})
    ((dead_entry, _),) = wait_for(
        lambda: [(e, f) for e, f in ctx.redis.xrange(ctx.keys.dead) if f["job_id"] == "gw-dead-1"],
        what="the dead letter",
    )
    # Jobs running while the page is open: long ones that keep the worker busy (tokens/s), short ones that end.
    long_ids = ctx.client.submit_many(["a long story"] * 3, max_tokens=400, ignore_eos=True, temperature=1.0, seed=1)
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            page.goto(fleet.gateway.url + "/dashboard")
            # The data name jobs and their failures: with keys set, the page shows none until it has one.
            page.locator("#error", has_text="401").wait_for(timeout=30_000)
            assert page.locator("#workers tbody tr").count() == 0
            page.fill("#key", API_KEY)
            row = page.locator(f"#workers tbody tr[data-worker='{fleet.worker.name}']")
            row.wait_for(timeout=30_000)
            assert page.locator("#n-workers").inner_text() == "1"
            assert page.locator("#queues tbody tr").count() == 1
            done_before = int(row.locator("td").nth(10).inner_text())
            short_ids = ctx.client.submit_many(["hi"] * 3, max_tokens=4)
            # The page refreshes itself: the worker's finished-jobs count goes up as the short jobs end, and
            # its tokens/s sparkline gets a line once the heartbeat's token counter has moved twice.
            page.wait_for_function(
                "([name, before]) => { const r = document.querySelector(`#workers tr[data-worker='${name}']`);"
                " return r && Number(r.children[10].textContent) >= before + 3; }",
                arg=[fleet.worker.name, done_before],
                timeout=60_000,
            )
            row.locator("svg.spark polyline").wait_for(timeout=60_000)
            assert float(page.locator("#tokens-per-s").inner_text()) >= 0
            for job_id in short_ids:
                assert isinstance(ctx.result(job_id), FinalEvent)

            # Replay needs the key: without it the gateway refuses (401), with it the letter is re-queued.
            dead_row = page.locator(f"#dead tbody tr[data-entry='{dead_entry}']")
            dead_row.wait_for(timeout=30_000)
            page.fill("#key", "")  # the table stays as it was while the data is refused
            dead_row.locator("button").click()
            page.locator("#replay-status", has_text="401").wait_for(timeout=30_000)
            page.fill("#key", API_KEY)
            dead_row.locator("button").click()
            page.locator("#replay-status", has_text="re-queued as").wait_for(timeout=30_000)
            new_entry = page.locator("#replay-status").inner_text().rsplit(" ", 1)[-1]
            dead_row.wait_for(state="detached", timeout=30_000)
            # Re-queued for real: a worker read the new entry (and, the job being invalid, dead-lettered it again).
            ((again_entry, again),) = wait_for(
                lambda: [(e, f) for e, f in ctx.redis.xrange(ctx.keys.dead) if f["entry_id"] == new_entry],
                what="the replayed job read by the worker",
            )
            assert again["job_id"] == "gw-dead-1"
            page.locator(f"#dead tbody tr[data-entry='{again_entry}']").wait_for(timeout=30_000)
            page.screenshot(path=str(tmp_path / "dashboard.png"), full_page=True)
            browser.close()
        assert (tmp_path / "dashboard.png").stat().st_size > 10_000
    finally:
        for job_id in long_ids:
            ctx.client.cancel(job_id)
        wait_for(lambda: all(ctx.result(job_id) for job_id in long_ids), 30, what="the long jobs to end")


@pytest.mark.slow  # two more worker processes and a 3 s reclaim: the default tier keeps its budget
@pytest.mark.parametrize("logprobs", [None, 1])  # with logprobs: streamed as generated, redelivery and all
def test_worker_sigkilled_mid_stream_the_client_gets_one_coherent_completion(
    redis_srv: RedisServer, model_dir: Path, tmp_path: Path, logprobs: int | None
) -> None:
    ctx = Ctx(redis_srv)  # a namespace of its own: two workers, a gateway
    workers = [WorkerProcess(ctx, model_dir, tmp_path, f"k{i}", step_delay_s=0.02) for i in (1, 2)]
    gateway: GatewayProcess | None = None
    try:
        for w in workers:
            w.wait_ready()
        gateway = GatewayProcess(redis_srv, ctx.ns, tmp_path, "kill")
        client = gateway.client()
        kw: dict[str, Any] = {
            "model": model_dir.name,
            "prompt": "Tell me a story about a worker",
            "max_tokens": 160,
            "temperature": 0,
            "logprobs": logprobs,
            "extra_body": {"ignore_eos": True},
        }
        text = ""
        tokens: list[str] = []
        job_id = ""
        killed = None
        for c in client.completions.create(stream=True, **kw):
            job_id = c.id
            text += "".join(choice.text for choice in c.choices)
            tokens += [t for choice in c.choices if choice.logprobs for t in choice.logprobs.tokens or ()]
            if killed is None and text:
                # The worker holding the job dies mid-stream; the other one takes the entry over.
                (holder,) = [e["consumer"] for e in ctx.redis.xpending_range(ctx.keys.jobs, "workers", "-", "+", 10)]
                killed = next(w for w in workers if w.name == holder)
                killed.kill()
        assert killed is not None
        final = ctx.result(job_id)
        assert isinstance(final, FinalEvent) and final.attempt >= 2 and final.worker != killed.name
        assert text == final.text  # every delta once, in order: what the surviving attempt produced
        if logprobs:  # and every token's logprobs once, in order
            assert tokens == [f"token_id:{t}" for t in final.choices[0].token_ids]
    except BaseException:
        for w in workers:
            print(w.log())
        if gateway is not None:
            print(gateway.log())
        raise
    finally:
        if gateway is not None:
            gateway.close()
        for w in workers:
            w.close()
        ctx.close()


@dataclass
class Answer:
    status: int
    content_type: str
    body: Any  # the JSON, or the text when it is not JSON


def http(
    gateway: GatewayProcess, method: str, path: str, body: bytes | None = None, key: str | None = API_KEY
) -> Answer:
    """A raw request: what the SDK would never send (bad JSON, lone surrogates), or a route it has no call for."""
    headers = {"content-type": "application/json"} | ({"authorization": f"Bearer {key}"} if key else {})
    request = urllib.request.Request(gateway.url + path, data=body, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            status, ctype, raw = response.status, response.headers.get("content-type", ""), response.read()
    except urllib.error.HTTPError as err:
        status, ctype, raw = err.code, err.headers.get("content-type", ""), err.read()
    return Answer(status, ctype, json.loads(raw) if ctype.startswith("application/json") else raw.decode())


def test_bad_bodies_are_400s_in_openai_shape(fleet: Fleet) -> None:
    head = '{"model":' + json.dumps(fleet.model) + ',"max_tokens":2,'
    msgs = '"messages":[{"role":"user","content":"hi"}]'
    cases = [  # (body, param, words in the message)
        (head + '"messages":[{"role":"user","content":"\\ud800 hi"}]}', "messages[0].content", "surrogate"),
        (head + msgs + ',"stop":["\\udc00"]}', "stop[0]", "surrogate"),
        ('{"model":"\\ud800",' + msgs + "}", "model", "surrogate"),
        (head + msgs + ',"foo\\ud800":1}', "foo\\ud800", "surrogate"),  # the name, escaped: never echoed raw
        (head + msgs + ',"x":' + "[" * 100_000 + "]" * 100_000 + "}", None, "nested too deeply"),
        (head.replace('"max_tokens":2', '"max_tokens":1' + "0" * 5000) + msgs + "}", None, "5001 digits"),
    ]
    for body, param, words in cases:
        answer = http(fleet.gateway, "POST", "/v1/chat/completions", body.encode())
        assert answer.status == 400 and answer.content_type == "application/json", (body[:80], answer)
        error = answer.body["error"]
        assert error["type"] == "invalid_request_error" and error["param"] == param and words in error["message"], error


def test_unknown_routes_and_methods_answer_in_openai_shape(fleet: Fleet) -> None:
    missing = http(fleet.gateway, "GET", "/v1/no-such-endpoint")
    assert missing.status == 404 and missing.body["error"]["code"] == "not_found", missing
    wrong = http(fleet.gateway, "GET", "/v1/chat/completions")
    assert wrong.status == 405 and wrong.body["error"]["code"] == "method_not_allowed", wrong


def test_models_retrieve(fleet: Fleet) -> None:
    model = fleet.client.models.retrieve(fleet.model)
    assert model.id == fleet.model and model.owned_by == "pagedq"
    with pytest.raises(openai.NotFoundError) as missing:
        fleet.client.models.retrieve("no-such-model")
    assert missing.value.code == "model_not_found"


def test_dashboard_data_needs_the_key_when_keys_are_set(fleet: Fleet) -> None:
    refused = http(fleet.gateway, "GET", "/dashboard/data", key=None)
    assert refused.status == 401 and refused.body["error"]["code"] == "invalid_api_key"
    data = http(fleet.gateway, "GET", "/dashboard/data")
    assert data.status == 200 and data.body["namespace"] == fleet.ctx.ns
    assert http(fleet.gateway, "GET", "/dashboard", key=None).status == 200  # the page itself has no data


def test_a_malformed_dead_letter_is_listed_as_malformed_and_never_replayed(fleet: Fleet) -> None:
    """Anyone who may XADD can write a dead-letter stream: an entry that is no dead letter (fields missing, an
    attempts that is no integer) made the dashboard's data a 500, hiding every good letter, and its replay a
    500 too. It is a row marked ``malformed`` beside the good letters, and its replay a 409 that leaves it
    where it is (as ``pagedq dead list`` / ``dead replay`` treat it)."""
    ctx = fleet.ctx
    good = DeadLetter(job="{}", reason="r", code="invalid_job", attempts=1, worker="w", job_id="gw-good-dl")
    written = {
        "no-fields": ctx.redis.xadd(ctx.keys.dead, {"foo": "bar"}),
        "bad-attempts": ctx.redis.xadd(
            ctx.keys.dead, {**good.to_fields(), "job_id": "gw-malformed-dl", "attempts": "notanint"}
        ),
        "good": ctx.redis.xadd(ctx.keys.dead, good.to_fields()),
    }
    try:
        data = http(fleet.gateway, "GET", "/dashboard/data")
        assert data.status == 200, data
        (queue,) = [q for q in data.body["queues"] if q["queue"] == ctx.keys.queue]
        rows = {row["entry"]: row for row in queue["dead"]}
        no_fields, bad_attempts = rows[written["no-fields"]], rows[written["bad-attempts"]]
        assert no_fields["code"] == "malformed" and "job" in no_fields["malformed"], no_fields
        assert no_fields["replayable"] is False and no_fields["job_id"] is None and no_fields["attempts"] is None
        assert bad_attempts["code"] == "malformed" and "attempts" in bad_attempts["malformed"], bad_attempts
        assert bad_attempts["job_id"] == "gw-malformed-dl" and bad_attempts["replayable"] is False
        good_row = rows[written["good"]]  # listed beside them, as it was
        assert good_row["malformed"] is None and good_row["code"] == "invalid_job", good_row
        assert good_row["job_id"] == "gw-good-dl" and good_row["replayable"] is True

        for name in ("no-fields", "bad-attempts"):
            ref = written[name]
            refused = http(fleet.gateway, "POST", f"/dashboard/replay/{ctx.keys.queue}/{ref}")
            assert refused.status == 409 and refused.content_type == "application/json", (name, refused)
            error = refused.body["error"]
            assert error["code"] == "malformed_dead_letter" and error["type"] == "invalid_request_error", error
            assert f"dead letter {ref} is malformed" in error["message"], error
            assert ctx.redis.xrange(ctx.keys.dead, min=ref, max=ref), f"{name} was deleted"  # left in place
    finally:
        ctx.redis.xdel(ctx.keys.dead, *written.values())


def test_null_fields_are_not_given(fleet: Fleet) -> None:
    # The SDK sends an explicit None as null: max_tokens stays in charge.
    out = fleet.client.chat.completions.create(
        model=fleet.model,
        messages=chat("Tell me a story"),
        max_tokens=2,
        max_completion_tokens=None,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert out.usage is not None and out.usage.completion_tokens == 2


def test_continuous_usage_stats_is_refused_by_name(fleet: Fleet) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        fleet.client.chat.completions.create(
            model=fleet.model,
            messages=chat("hi"),
            stream=True,
            extra_body={"stream_options": {"include_usage": True, "continuous_usage_stats": True}},
        )
    assert refused.value.body["param"] == "stream_options"  # type: ignore[index]
    assert "continuous_usage_stats" in refused.value.message


def test_streamed_logprobs_come_with_their_tokens(fleet: Fleet) -> None:
    kw: dict[str, Any] = {
        "model": fleet.model,
        "messages": chat("Count to five."),
        "max_tokens": 8,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 1,
        "extra_body": {"ignore_eos": True},
    }
    whole = fleet.client.chat.completions.create(**kw)
    expected = whole.choices[0].logprobs.content
    assert expected is not None and len(expected) == 8
    streamed: list[Any] = []
    carriers = 0
    for c in fleet.client.chat.completions.create(stream=True, **kw):
        for choice in c.choices:
            entries = choice.logprobs.content if choice.logprobs and choice.logprobs.content else []
            if choice.delta.content:
                assert entries, c  # text never comes without the logprobs of the tokens it came with
            carriers += bool(entries)
            streamed += entries
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in expected]
    assert carriers > 1  # spread over the chunks, not all in the last one

    # Completions: text_offset places each token where its worker says its text starts, within the text of the
    # engine step that produced it.
    ckw: dict[str, Any] = {
        "model": fleet.model,
        "prompt": "1, 2, 3,",
        "max_tokens": 6,
        "temperature": 0,
        "logprobs": 1,
        "extra_body": {"ignore_eos": True},
    }
    out = fleet.client.completions.create(**ckw)
    lp = out.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and len(lp.tokens) == 6
    steps = [e for e in fleet.ctx.events(out.id) if e.type == "token"]
    assert "".join(e.text for e in steps) == out.choices[0].text
    offsets, at = [], 0
    for e in steps:
        assert e.text_offsets is not None and all(at <= o <= at + len(e.text) for o in e.text_offsets), e
        offsets += e.text_offsets
        at += len(e.text)
    assert lp.text_offset == offsets == sorted(offsets)

    # A stop string holds back the text that could begin it, never the tokens: the offsets stay where the
    # tokens' text starts (they were each step's released text, all 0 until the held text came out), and a
    # streamed chunk carries the logprobs of the tokens whose text starts in it, not of those still held.
    unmatched = fleet.client.completions.create(**ckw, stop="zzzzzzzzzz")
    assert unmatched.choices[0].text == out.choices[0].text
    assert unmatched.choices[0].logprobs is not None and unmatched.choices[0].logprobs.text_offset == offsets
    ckw_chat = {**kw, "stop": ["zzzzzzzzzz"], "max_tokens": 8}
    whole_stop = fleet.client.chat.completions.create(**ckw_chat)
    streamed_stop: list[Any] = []
    chunks = list(fleet.client.chat.completions.create(stream=True, **ckw_chat))
    for c in chunks[:-1]:
        for choice in c.choices:
            entries = choice.logprobs.content if choice.logprobs and choice.logprobs.content else []
            assert choice.delta.content or not entries, c  # no logprobs of tokens whose text is still held
            streamed_stop += entries
    streamed_stop += [e for ch in chunks[-1].choices if ch.logprobs for e in ch.logprobs.content or ()]
    assert whole_stop.choices[0].logprobs is not None
    expected_stop = whole_stop.choices[0].logprobs.content or []
    assert [(e.token, e.logprob) for e in streamed_stop] == [(e.token, e.logprob) for e in expected_stop]
    text = ""
    for c in fleet.client.completions.create(stream=True, **ckw):
        for choice in c.choices:
            if choice.logprobs is not None:
                assert choice.logprobs.text_offset == [len(text)] * len(choice.logprobs.tokens or [])
            text += choice.text
    assert text == out.choices[0].text


def test_streamed_logprobs_arrive_as_they_are_generated(fleet: Fleet) -> None:
    # A long job: its first chunk, with its tokens' logprobs, comes while the job still runs (no final event
    # in its reply stream, no result), not once it has ended.
    stream = long_stream(fleet, logprobs=True, top_logprobs=2)
    first = next(iter(stream))
    job_id = first.id
    running = (fleet.ctx.result(job_id), fleet.ctx.terminal_events(job_id))
    stream.close()  # and the job is cancelled
    assert running == (None, []), running
    (choice,) = first.choices
    assert choice.delta.role == "assistant" and choice.finish_reason is None
    assert choice.logprobs is not None and choice.logprobs.content
    assert all(len(e.top_logprobs) == 2 for e in choice.logprobs.content)
    event = wait_for(lambda: fleet.ctx.result(job_id), 30, what="the disconnected job's terminal event")
    assert isinstance(event, FinalEvent) and event.choices[0].finish_reason == "cancelled", event

    # Streamed as generated, the logprobs of a seeded request are the non-streamed response's, choice by choice.
    kw: dict[str, Any] = {
        "model": fleet.model,
        "messages": chat("Name three queues."),
        "max_tokens": 9,
        "n": 2,
        "temperature": 0.9,
        "seed": 21,
        "logprobs": True,
        "top_logprobs": 2,
    }
    whole = fleet.client.chat.completions.create(**kw)

    def entries(content: Any) -> list[Any]:
        return [(e.token, e.logprob, [(t.token, t.logprob) for t in e.top_logprobs]) for e in content or ()]

    streamed: dict[int, list[Any]] = {0: [], 1: []}
    texts = ["", ""]
    for c in fleet.client.chat.completions.create(stream=True, **kw):
        for ch in c.choices:
            streamed[ch.index] += entries(ch.logprobs.content if ch.logprobs else None)
            texts[ch.index] += ch.delta.content or ""
    for ch in whole.choices:
        assert ch.logprobs is not None and len(ch.logprobs.content or ()) > 0
        assert streamed[ch.index] == entries(ch.logprobs.content), ch.index
        assert texts[ch.index] == ch.message.content

    # Completions: the same, with text_offset continuing over the chunks.
    ckw: dict[str, Any] = {
        "model": fleet.model,
        "prompt": "Queues are",
        "max_tokens": 9,
        "n": 2,
        "temperature": 0.9,
        "seed": 22,
        "logprobs": 2,
    }
    out = fleet.client.completions.create(**ckw)
    got: dict[int, list[Any]] = {0: [], 1: []}
    ctexts = ["", ""]
    for c in fleet.client.completions.create(stream=True, **ckw):
        for ch in c.choices:
            lp = ch.logprobs
            if lp is not None and lp.tokens:
                assert lp.text_offset == [len(ctexts[ch.index])] * len(lp.tokens)
                got[ch.index] += zip(lp.tokens, lp.token_logprobs or (), lp.top_logprobs or (), strict=True)
            ctexts[ch.index] += ch.text
    for ch in out.choices:
        lp = ch.logprobs
        assert lp is not None and lp.tokens
        assert got[ch.index] == list(zip(lp.tokens, lp.token_logprobs or (), lp.top_logprobs or (), strict=True))
        assert ctexts[ch.index] == ch.text


def test_live_logprobs_follow_a_redelivery_and_fall_back_to_the_final_event() -> None:
    from ops.gateway.openai_api import Diverged, LiveLogprobs, Steps, logprob_chunks, parse_request
    from schemas.jobs import Logprob, TokenEvent

    def lp(token_id: int) -> Logprob:
        return Logprob(token_id=token_id, logprob=-token_id / 10)

    def token(attempt: int, text: str, ids: list[int], with_logprobs: bool = True) -> TokenEvent:
        lps = [lp(t) for t in ids] if with_logprobs else None
        return TokenEvent(id="j", attempt=attempt, index=0, text=text, token_ids=ids, logprobs=lps)

    def final(attempt: int, text: str, ids: list[int]) -> FinalEvent:
        choice = Choice(index=0, text=text, token_ids=ids, finish_reason="length", logprobs=[lp(t) for t in ids])
        usage, timings = Usage(prompt_tokens=1, completion_tokens=len(ids)), Timings(queued_s=0, total_s=1)
        return FinalEvent(id="j", attempt=attempt, choices=[choice], usage=usage, timings=timings, worker="w")

    body = {"model": "m", "prompt": "p", "logprobs": 0, "stream": True}
    req = parse_request("completion", body, default_max_tokens=8, timeout_s=60)
    state, steps = LiveLogprobs(), Steps()
    events = [token(1, "ab", [1, 2]), token(2, "a", [1]), token(1, "z", [9]), token(2, "bc", [2, 3]), token(2, "", [4])]
    pieces = []
    for event in events:
        steps.add(event)
        pieces.append(state.feed(event))
    # Attempt 2 repeats attempt 1 silently (a stale attempt-1 event is ignored), then adds what is new.
    assert pieces == [("ab", [lp(1), lp(2)], 0), None, None, ("c", [lp(3)], 2), ("", [lp(4)], 3)]
    state.started = True
    (last,) = logprob_chunks(req, final(2, "abcd", [1, 2, 3, 4, 5]), steps, {0: state})
    (choice,) = last["choices"]  # the text and tokens after the last token event, with the finish
    assert (choice["text"], choice["finish_reason"]) == ("d", "length")
    assert choice["logprobs"]["tokens"] == ["token_id:5"] and choice["logprobs"]["text_offset"] == [3]
    with pytest.raises(Diverged):  # a rerun that differs from what was sent (sampling without a seed)
        state.feed(token(3, "ax", [1, 7]))

    # An older worker's token events carry no logprobs: everything comes, cut at its steps, with the final.
    old, steps = LiveLogprobs(), Steps()
    for event in (token(1, "ab", [1, 2], False), token(1, "c", [3], False)):
        steps.add(event)
        assert old.feed(event) is None
    chunks = logprob_chunks(req, final(1, "abcd", [1, 2, 3, 4]), steps, {0: old})
    cut = [(c["choices"][0]["text"], c["choices"][0]["logprobs"]["tokens"]) for c in chunks]
    assert cut == [("ab", ["token_id:1", "token_id:2"]), ("c", ["token_id:3"]), ("d", ["token_id:4"])]
    assert [c["choices"][0]["logprobs"]["text_offset"] for c in chunks] == [[0, 0], [2], [3]]


def test_live_logprobs_wait_for_the_text_a_stop_string_holds_back() -> None:
    """Tokens "a", "b", "c" under a 3-character stop string: the worker releases "a" only with the third token.
    Each token's logprob goes out with the chunk its text starts in, the rest with the final event, one
    piece; completions' text_offset is where each token's text starts, the text's end for a stop string's."""
    from ops.gateway.openai_api import LiveLogprobs, Steps, _offsets, logprob_chunks, parse_request
    from schemas.jobs import Logprob, TokenEvent

    def lp(token_id: int) -> Logprob:
        return Logprob(token_id=token_id, logprob=-token_id / 10)

    def token(text: str, ids: list[int], offsets: list[int]) -> TokenEvent:
        logprobs = [lp(t) for t in ids]
        return TokenEvent(id="j", attempt=1, index=0, text=text, token_ids=ids, logprobs=logprobs, text_offsets=offsets)

    def final(text: str, ids: list[int]) -> FinalEvent:
        choice = Choice(index=0, text=text, token_ids=ids, finish_reason="stop", logprobs=[lp(t) for t in ids])
        usage, timings = Usage(prompt_tokens=1, completion_tokens=len(ids)), Timings(queued_s=0, total_s=1)
        return FinalEvent(id="j", attempt=1, choices=[choice], usage=usage, timings=timings, worker="w")

    body = {"model": "m", "prompt": "p", "logprobs": 0, "stream": True, "stop": "xyz"}
    req = parse_request("completion", body, default_max_tokens=8, timeout_s=60)
    state, steps = LiveLogprobs(), Steps()
    fed = []
    for event in (token("", [1], [0]), token("", [2], [1]), token("a", [3], [2]), token("b", [4], [3])):
        steps.add(event)
        fed.append(state.feed(event))
    assert fed == [None, None, ("a", [lp(1)], 0), ("b", [lp(2)], 1)]
    state.started = True
    # The job stopped at "xyz", which token 5 began: the text is "abc"; tokens 3 and 4 start in "c" and past it.
    ending = final("abc", [1, 2, 3, 4, 5])
    (last,) = logprob_chunks(req, ending, steps, {0: state})
    (choice,) = last["choices"]
    assert (choice["text"], choice["finish_reason"]) == ("c", "stop")
    assert choice["logprobs"]["tokens"] == ["token_id:3", "token_id:4", "token_id:5"]
    steps.add(TokenEvent(id="j", attempt=1, index=0, text="c", token_ids=[5], logprobs=[lp(5)], text_offsets=[4]))
    assert _offsets(steps, ending) == {0: [0, 1, 2, 3, 3]}
    # From a worker that does not place its tokens: each step's text start, as before.
    old = Steps()
    for event in (token("", [1], [0]), token("a", [2], [1])):
        old.add(event.model_copy(update={"text_offsets": None}))
    assert _offsets(old, final("ab", [1, 2, 3])) == {0: [0, 0, 1]}


def test_job_endings_without_an_openai_finish_reason_are_errors() -> None:
    from ops.gateway.openai_api import Request, error_for_event, final_error

    def final(*reasons: str) -> FinalEvent:
        choices = [Choice(index=i, text="a", token_ids=[1], finish_reason=r) for i, r in enumerate(reasons)]  # type: ignore[arg-type]
        return FinalEvent(
            id="j", attempt=1, choices=choices, usage=Usage(prompt_tokens=1, completion_tokens=len(reasons)),
            timings=Timings(queued_s=0, total_s=1), worker="w",
        )  # fmt: skip

    assert final_error(final("stop", "length"), 7) is None
    late = final_error(final("length", "deadline"), 7)  # the job's deadline: what the gateway's own timeout gives
    assert late is not None and (late.status, late.code) == (504, "timeout")
    gone = final_error(final("cancelled"), 7)
    assert gone is not None and (gone.status, gone.code) == (503, "cancelled")
    spec = Request(kind="chat", model="m", fields={"id": "j", "max_tokens": 4}, stream=False, include_usage=False)
    unstarted = error_for_event(ErrorEvent(id="j", attempt=1, code="deadline_exceeded", message="m"), spec, 7)
    assert (unstarted.status, unstarted.code) == (504, "timeout")


def test_a_request_past_its_timeout_is_a_504_streamed_or_not(fleet: Fleet, tmp_path: Path) -> None:
    ctx = fleet.ctx
    hasty = GatewayProcess(ctx.server, ctx.ns, tmp_path, "hasty", request_timeout_s=1)
    kw: dict[str, Any] = {
        "model": fleet.model,
        "prompt": "A long story",
        "max_tokens": 600,
        "temperature": 1.0,
        "seed": 9,
        "extra_body": {"ignore_eos": True},
    }
    job_ids = []
    try:
        with pytest.raises(openai.APIStatusError) as late:
            hasty.client().completions.create(**kw)
        assert late.value.status_code == 504 and late.value.code == "timeout"
        job_ids.append(late.value.response.headers["x-request-id"])
        # Streamed: an error chunk once the stream has started (the SDK raises it), the same 504 before that.
        with pytest.raises(openai.APIError) as late_stream:
            for c in hasty.client().completions.create(stream=True, **kw):
                job_ids.append(c.id)
        assert late_stream.value.code == "timeout"
        if isinstance(late_stream.value, openai.APIStatusError):
            job_ids.append(late_stream.value.response.headers["x-request-id"])
    finally:
        hasty.close()
    # Whichever deadline passed first (the worker's or the gateway's, which then cancels), the job ended early.
    for job_id in set(job_ids):
        event = wait_for(partial(ctx.result, job_id), 30, what="the late job's end")
        if isinstance(event, FinalEvent):
            assert event.choices[0].finish_reason in ("deadline", "cancelled") and event.usage.completion_tokens < 600
        else:
            assert event.code in ("deadline_exceeded", "cancelled")


def test_more_requests_in_flight_than_the_redis_pool_default(fleet: Fleet) -> None:
    from ops.gateway.settings import GatewaySettings

    ctx = fleet.ctx
    n = 110  # more than the 100 connections of the gateway's pool by default (also redis-py's default)
    # A worker with no room (as in the queue timeout test): every request stays in flight, each following its
    # silent job with a blocking read, until the busy jobs are cancelled.
    busy = ctx.client.submit_many(["busy"] * 6, max_tokens=600, ignore_eos=True, temperature=1.0, seed=2)
    client = openai.AsyncOpenAI(base_url=fleet.gateway.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)

    async def main() -> list[Any]:
        await asyncio.to_thread(wait_for, lambda: ctx.pending() == 6, 30, 0.02, "the worker holding six jobs")
        tasks = [
            asyncio.create_task(client.chat.completions.create(model=fleet.model, messages=chat(f"{i}?"), max_tokens=1))
            for i in range(n)
        ]
        queued = lambda: ctx.backlog() == 6 + n or any(t.done() for t in tasks)  # a failure ends the wait
        await asyncio.to_thread(wait_for, queued, 60, 0.05, "every request's job queued")
        assert ctx.backlog() == 6 + n
        for job_id in busy:
            await asyncio.to_thread(ctx.client.cancel, job_id)
        return await asyncio.gather(*tasks, return_exceptions=True)

    try:
        results = asyncio.run(main())
    finally:
        for job_id in busy:
            ctx.client.cancel(job_id)
    failed = [r for r in results if isinstance(r, BaseException)]
    assert not failed, failed[:3]
    assert all(r.usage.completion_tokens == 1 for r in results)
    wait_for(lambda: all(ctx.result(job_id) for job_id in busy), 30, what="the busy jobs to end")
    assert GatewaySettings.model_fields["redis_max_connections"].default < n


def test_a_request_that_gets_no_redis_connection_in_time_is_503(fleet: Fleet, tmp_path: Path) -> None:
    ctx = fleet.ctx
    narrow = GatewayProcess(ctx.server, ctx.ns, tmp_path, "narrow", redis_max_connections=1, redis_pool_timeout_s=0.2)
    client = narrow.client()

    def ask(i: int) -> Any:
        try:
            return client.chat.completions.create(model=fleet.model, messages=chat(f"hi {i}"), max_tokens=2)
        except openai.APIStatusError as exc:
            return exc

    # Redis holds every write back: the first request's XADD keeps the gateway's only connection until the
    # pause ends, and the other request waits for it in vain.
    ctx.redis.execute_command("CLIENT", "PAUSE", "30000", "WRITE")
    try:
        with ThreadPoolExecutor(2) as pool:
            futures = [pool.submit(ask, i) for i in range(2)]
            try:
                first = next(as_completed(futures, timeout=30)).result()
            finally:
                ctx.redis.execute_command("CLIENT", "UNPAUSE")
            results = [f.result(timeout=60) for f in futures]
    finally:
        narrow.close()
    assert isinstance(first, openai.InternalServerError), first
    assert first.status_code == 503 and first.code == "overloaded"
    assert "x-request-id" not in first.response.headers  # refused before its job was queued: nothing to lose
    (other,) = [r for r in results if r is not first]
    assert other.usage.completion_tokens > 0  # the other one got the connection, and its answer


def test_redis_down_is_503(tmp_path: Path) -> None:
    server = make_server("debian", tmp_path / "redis")
    gateway = GatewayProcess(server, "down", tmp_path, "down")
    try:
        server.stop()

        def refused() -> openai.APIStatusError | None:
            try:
                gateway.client().models.list()  # served from the fleet cache for up to a second
            except openai.APIStatusError as exc:
                return exc
            return None

        down = wait_for(refused, 30, 0.05, "the gateway noticing Redis is down")
        assert down.status_code == 503 and down.code == "redis_unavailable"
        with pytest.raises(openai.InternalServerError) as unavailable:
            gateway.client().chat.completions.create(model="m", messages=chat("hi"))
        assert unavailable.value.status_code == 503 and unavailable.value.code == "redis_unavailable"
    finally:
        gateway.close()
        server.stop()


@pytest.mark.slow  # a cluster of six redis-server processes
def test_a_fleet_on_a_cluster_is_seen_whole(redis_cluster: ClusterServers, tmp_path: Path) -> None:  # noqa: F811
    """Heartbeat keys carry no hash tag, so on a cluster a fleet's heartbeats sit in different slots: the one
    MGET over them was refused by the cluster client (``RedisClusterException``, which is no ``RedisError``),
    and from the second live worker on /healthz, /v1/models and every request answered 500."""
    from ops.gateway.fleet import live_workers
    from worker.redis_url import connect_async
    from worker.registry import queue_beat

    ctx = Ctx(redis_cluster)
    names = ["wa", "wb", "wc"]
    keys = [ctx.keys.heartbeat(name) for name in names]
    assert len({key_slot(key.encode()) for key in keys}) == 3
    gateway = GatewayProcess(redis_cluster, ctx.ns, tmp_path, "cluster")  # healthy: no heartbeat yet
    try:
        for name in names:  # as a worker beats: its heartbeat key and its member in the namespace's index
            beat = {"model": f"/models/tiny-{name}", "state": "ready", "started_at": time.time()}
            pipe = ctx.redis.pipeline(transaction=False)
            queue_beat(pipe, ctx.keys, name, json.dumps(beat), 300_000)
            pipe.execute()

        async def live() -> list[str]:
            r = connect_async(redis_cluster.url, decode_responses=True)
            try:
                return sorted(w.name for w in await live_workers(r, ctx.ns))
            finally:
                await r.aclose()

        assert asyncio.run(live()) == names

        def all_seen() -> Answer | None:  # the router serves its last scan (none) for up to a second
            answer = http(gateway, "GET", "/healthz")
            return answer if answer.status != 200 or answer.body["live_workers"] == 3 else None

        health = wait_for(all_seen, 30, 0.05, "the gateway's next scan of the heartbeats")
        assert health.status == 200 and health.body == {"status": "ok", "redis": "ok", "live_workers": 3}, health
        models = http(gateway, "GET", "/v1/models")
        assert models.status == 200, models
        assert [m["id"] for m in models.body["data"]] == [f"tiny-{name}" for name in names]
    except BaseException:
        print(gateway.log())
        raise
    finally:
        gateway.close()
        ctx.redis.delete(*keys, ctx.keys.workers)
        ctx.close()


def answer_to_a_raise(redis_srv: RedisServer, exc: Exception) -> Any:
    """The gateway's answer to a request whose endpoint (one added for the test) raises ``exc``."""
    from starlette.testclient import TestClient

    from ops.gateway.app import create_app
    from ops.gateway.settings import load_gateway_settings

    app = create_app(load_gateway_settings(redis_url=redis_srv.url), redis_srv.url)

    @app.get("/v1/raises")
    async def raises() -> None:
        raise exc

    with TestClient(app, raise_server_exceptions=False) as client:
        return client.get("/v1/raises")


def test_a_cluster_clients_error_is_a_503_like_any_redis_error(redis_srv: RedisServer) -> None:
    """A cluster client's own failures (no node reachable, a command it refuses) are ``RedisClusterException``,
    which is no ``RedisError``: they fell through to the generic 500 instead of the 503 (retry later) that a
    Redis failure gets."""
    answer = answer_to_a_raise(redis_srv, RedisClusterException("MGET - all keys must map to the same key slot"))
    assert answer.status_code == 503 and answer.headers["retry-after"] == "1", answer.text
    assert answer.json()["error"]["code"] == "redis_unavailable"
    assert "RedisClusterException" in answer.json()["error"]["message"]


def test_an_unexpected_error_is_a_500_in_openai_shape(redis_srv: RedisServer) -> None:
    answer = answer_to_a_raise(redis_srv, RuntimeError("a bug, with the request's text in it"))
    assert answer.status_code == 500 and answer.headers["content-type"] == "application/json"
    assert answer.json()["error"]["code"] == "internal" and "request's text" not in answer.text


# ------------------------------------------------------------------- request mapping (pure, no server)


def test_request_mapping_refuses_by_name_and_accepts_neutral_values() -> None:
    from ops.gateway.openai_api import ApiError, parse_request

    def parse(**body: Any) -> dict[str, Any]:
        base = {"model": "m", "messages": chat("hi")}
        return parse_request("chat", {**base, **body}, default_max_tokens=32, timeout_s=60).fields

    fields = parse(logit_bias={}, store=False, tool_choice="none", stop=["", "x"], user="u", max_completion_tokens=3)
    assert fields["stop"] == ["x"] and fields["metadata"] == {"user": "u"} and fields["max_tokens"] == 3
    assert 0 <= fields["seed"] < 2**63  # always seeded: a redelivered job reproduces the streamed text
    assert parse(seed=4)["seed"] == 4 and parse()["max_tokens"] == 32
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    messages = parse(messages=[{"role": "developer", "content": parts}])["messages"]
    assert messages == [{"role": "system", "content": "a\nb"}]
    for body, param in (
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, "messages[0].content"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0]"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"n": 0}, "n"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
    ):
        with pytest.raises(ApiError) as err:
            parse(**body)
        assert err.value.status == 400 and err.value.param == param, (body, err.value.body())


def test_request_mapping_of_tags_seeds_and_cache_keys() -> None:
    """``metadata``, ``user`` and ``safety_identifier`` make the job's metadata; ``prompt_cache_key`` its
    affinity key, so it picks the shard; OpenAI's signed seeds map one to one into the job's unsigned range."""
    from ops.gateway.openai_api import ApiError, parse_request
    from schemas.affinity import shard_for_job, shard_for_key
    from worker.client import build_job

    def parse(**body: Any) -> dict[str, Any]:
        base = {"model": "m", "messages": chat("hi")}
        return parse_request("chat", {**base, **body}, default_max_tokens=32, timeout_s=60).fields

    fields = parse(metadata={"a": "1"}, user="u", safety_identifier="s" * 300, prompt_cache_key="k")
    assert fields["metadata"] == {"a": "1", "user": "u", "safety_identifier": "s" * 256}
    assert fields["affinity"] == "k"
    for shards in (2, 3, 8):
        assert shard_for_job(build_job(**fields), shards) == shard_for_key("k", shards)
    assert "affinity" not in parse(prompt_cache_key="") and "metadata" not in parse(metadata={})
    assert parse(metadata={"user": "u"}, user="u")["metadata"] == {"user": "u"}
    assert parse(seed=-1)["seed"] == 2**63 - 1 and parse(seed=-(2**63))["seed"] == 0
    assert parse(seed=2**63 - 1)["seed"] == 2**63 - 1
    for body, param in (
        ({"metadata": {"user": "v"}, "user": "u"}, "metadata"),
        ({"metadata": {"k": 1}}, "metadata"),
        ({"metadata": {"k" * 65: "v"}}, "metadata"),
        ({"metadata": {"k": "v" * 513}}, "metadata"),
        ({"metadata": ["k"]}, "metadata"),
        ({"safety_identifier": 5}, "safety_identifier"),
        ({"prompt_cache_key": 5}, "prompt_cache_key"),
        ({"prompt_cache_key": "k" * 1025}, "prompt_cache_key"),
        ({"seed": -(2**63) - 1}, "seed"),
        ({"seed": 2**63}, "seed"),
        ({"stream": True, "stream_options": {"include_obfuscation": True}}, "stream_options"),
    ):
        with pytest.raises(ApiError) as err:
            parse(**body)
        assert err.value.status == 400 and err.value.param == param, (body, err.value.body())
    assert parse(stream=True, stream_options={"include_obfuscation": False})["stream"] is True


def test_request_mapping_messages_name_the_field_and_the_rule() -> None:
    from ops.gateway.openai_api import ApiError, parse_request

    def parse(**body: Any) -> dict[str, Any]:
        base = {"model": "m", "messages": chat("hi")}
        return parse_request("chat", {**base, **body}, default_max_tokens=32, timeout_s=60).fields

    def refused(**body: Any) -> tuple[str | None, str]:
        with pytest.raises(ApiError) as err:
            parse(**body)
        return err.value.param, err.value.message

    assert refused(stop=[str(i) for i in range(17)]) == ("stop", "stop: at most 16 strings, got 17")
    assert refused(stop=["a", None]) == ("stop", "stop[1]: must be a string, got null")
    assert refused(min_tokens=9, max_tokens=5) == ("min_tokens", "min_tokens: must be at most max_tokens (5), got 9")
    assert refused(min_tokens=9, max_completion_tokens=5)[1].endswith("max_completion_tokens (5), got 9")
    # Without a max_tokens of the client's, the gateway's default (32 here) is no limit a client set: it
    # makes room for min_tokens (vLLM accepts min_tokens alone too) and still caps nothing below it.
    assert parse(min_tokens=300)["max_tokens"] == 300 and parse(min_tokens=5)["max_tokens"] == 32
    # A rule over the whole job names the field its message starts with.
    big = {f"k{i}": "v" * 300 for i in range(16)}  # within OpenAI's 16 keys of 512 characters, over 4096 bytes
    assert refused(metadata=big)[0] == "metadata"
    assert refused(stream=True, stream_options={"continuous_usage_stats": True})[0] == "stream_options"
    assert refused(messages=[{"role": "user", "content": 5}])[0] == "messages[0].content"
    # null is "not given", wherever it is; an empty stop string is ignored alone as in a list
    fields = parse(stop="", max_tokens=3, max_completion_tokens=None, stream=None, no_such_field=None)
    assert "stop" not in fields and fields["max_tokens"] == 3 and fields["stream"] is False
    assert parse(messages=[{"role": "assistant", "content": "a", "tool_calls": None}])["messages"][0]["content"] == "a"
