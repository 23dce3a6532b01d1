"""``pagedq batch``: OpenAI Batch JSONL through two real worker processes, through ``--local``, and resumed
after a SIGKILL. Plus the request/response mapping, resumption bookkeeping and progress output on their own.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
import shutil
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion
from openai.types.responses import Response
from redis.crc import key_slot

from ops import batch
from ops.batch import BatchLine, LineError, Progress, QueueBackend, parse_line, read_done, response_body
from ops.batch.backends import output_key
from ops.batch.command import LINES_FAILED
from ops.batch.files import iter_lines
from ops.gateway.openai_api import parse_request
from ops.gateway.responses_api import parse_responses_request
from schemas.affinity import shard_for_job
from schemas.jobs import Choice, ErrorEvent, FinalEvent, Logprob, Timings, TopLogprob, Usage
from tests.redis_servers import ClusterServers, RedisServer, make_server, redis_cluster  # noqa: F401
from tests.worker_harness import ENGINE_KW, REPO, Ctx, WorkerProcess, inprocess_worker, make_engine, wait_for
from worker.client import CANCEL_TTL_S

ENGINE_FLAGS = [
    "--max-num-seqs", str(ENGINE_KW["max_num_seqs"]),
    "--max-num-batched-tokens", str(ENGINE_KW["max_num_batched_tokens"]),
    "--kv-cache-bytes", str(ENGINE_KW["kv_cache_bytes"]),
    "--dtype", "float32", "--device", "cpu",
]  # fmt: skip


def chat(cid: str, content: Any, **body: Any) -> str:
    return json.dumps(
        {
            "custom_id": cid,
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"model": "tiny", "messages": [{"role": "user", "content": content}], **body},
        }
    )


def completion(cid: str, prompt: Any, **body: Any) -> str:
    return json.dumps(
        {
            "custom_id": cid,
            "method": "POST",
            "url": "/v1/completions",
            "body": {"model": "tiny", "prompt": prompt, **body},
        }
    )


def responses(cid: str, input: Any, **body: Any) -> str:
    return json.dumps(
        {"custom_id": cid, "method": "POST", "url": "/v1/responses", "body": {"model": "tiny", "input": input, **body}}
    )


@dataclass
class BatchFile:
    path: Path
    greedy: set[str]  # custom_ids whose answer is deterministic
    malformed: dict[int, str | None]  # line number -> custom_id (None when the line has none)


def make_batch_file(path: Path, n: int = 200) -> BatchFile:
    """Chat and completions lines (greedy, a few sampled, some with logprobs) and some malformed ones."""
    rng = random.Random(7)
    words = ["the", "sea", "robot", "paged", "cache", "token", "model", "batch", "queue", "worker"]
    lines: list[str] = []
    greedy: set[str] = set()
    malformed: dict[int, str | None] = {}
    bad = [
        lambda cid: "{this is not json",
        lambda cid: json.dumps({"method": "POST", "url": "/v1/completions", "body": {"prompt": "no id"}}),
        lambda cid: chat(cid, "hi", temperature="hot"),
        lambda cid: json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/embeddings", "body": {"input": "x"}}),
        lambda cid: chat(cid, "hi", tools=[{"type": "function"}]),
        lambda cid: completion(cid, ["two", "prompts"]),
        lambda cid: chat(cid, [{"type": "image_url", "image_url": {"url": "http://x"}}]),
        lambda cid: completion(cid, "x", max_tokens=0),
    ]
    for i in range(n):
        cid = f"req-{i:03d}"
        text = " ".join(rng.choice(words) for _ in range(rng.randint(2, 9)))
        max_tokens = rng.randint(3, 10)
        if i % 17 == 5:
            lines.append(bad[(i // 17) % len(bad)](cid))
            raw = json.loads(lines[-1]) if lines[-1].startswith('{"') else {}
            malformed[i + 1] = raw.get("custom_id") if isinstance(raw, dict) else None
            continue
        sampled = i % 23 == 3
        extra: dict[str, Any] = {"temperature": 0.9} if sampled else {"temperature": 0}
        if i % 11 == 0:
            extra |= {"logprobs": True, "top_logprobs": 2} if i % 2 else {"logprobs": 2}
        if i % 2:
            line = chat(cid, text, max_completion_tokens=max_tokens, **extra)
        elif i % 13 == 4:
            line = completion(cid, [rng.randrange(3, 500) for _ in range(5)], max_tokens=max_tokens, **extra)
        else:
            line = completion(cid, text, max_tokens=max_tokens, **extra)
        lines.append(line)
        if not sampled:
            greedy.add(cid)
    path.write_text("\n".join(lines) + "\n\n")  # a trailing blank line is ignored
    return BatchFile(path, greedy, malformed)


def records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def answers(path: Path) -> dict[str, Any]:
    """custom_id -> what must not depend on where a greedy request ran (texts, reasons, token counts)."""
    out = {}
    for rec in records(path):
        body = rec["response"]["body"]
        choices = []
        for c in body["choices"]:
            text = c["text"] if body["object"] == "text_completion" else c["message"]["content"]
            lp = c["logprobs"]
            tokens = None if lp is None else (lp["tokens"] if "tokens" in lp else [t["token"] for t in lp["content"]])
            choices.append((text, c["finish_reason"], tokens))
        out[rec["custom_id"]] = (choices, body["usage"]["prompt_tokens"], body["usage"]["completion_tokens"])
    return out


def complete_lines(path: Path) -> int:
    return path.read_bytes().count(b"\n") if path.exists() else 0


def error_keys(path: Path) -> list[str | int]:
    return [r["custom_id"] if r["custom_id"] is not None else r["error"]["line"] for r in records(path)]


def subprocess_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PAGEDQ_")}
    env.update({"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"})
    return env


# ------------------------------------------------------------------------------------ mapping (no I/O)


def _parse(raw: str) -> BatchLine:
    return parse_line(raw, 1, run_key="k", default_max_tokens=99)


def test_chat_and_completion_lines_map_to_jobs() -> None:
    line = _parse(
        chat(
            "a",
            [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}],
            max_tokens=5,
            max_completion_tokens=7,
            temperature=0,
            logprobs=True,
            top_logprobs=3,
            stop="END",
            seed=1,
            top_k=5,
            min_p=0.1,
            repetition_penalty=1.1,
            user="u",
            n=2,
        )
    )
    job = line.job
    assert line.kind == "chat" and line.model == "tiny" and line.custom_id == "a"
    assert job.messages is not None and job.messages[0].content == "Hi\nthere"
    assert (job.max_tokens, job.logprobs, job.stop, job.seed, job.top_k, job.n) == (7, 3, "END", 1, 5, 2)
    assert job.stream is False and job.id.startswith("batch-")
    assert _parse(chat("a", "Hi", logprobs=False)).job.logprobs is None
    assert job.strict_max_tokens is True  # the line's own limit must fit the context, as OpenAI's batch API
    default = _parse(chat("a", "Hi")).job
    assert default.max_tokens == 99 and not default.strict_max_tokens  # the default only caps
    schema = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}}
    job = _parse(chat("a", "Hi", response_format=fmt)).job
    assert job.response_format is not None and job.sampling_params().json_schema == schema
    assert _parse(chat("a", "Hi", guided_choice=["x", "y"])).job.sampling_params().choice == ["x", "y"]

    job = _parse(completion("b", [[5, 6, 7]], max_tokens=None, logprobs=2, frequency_penalty=0.5)).job
    assert job.prompt_token_ids == [5, 6, 7] and job.max_tokens == 99 and job.logprobs == 2
    assert _parse(completion("b", ["one prompt"])).job.prompt == "one prompt"
    # The job id is stable for the same request and differs when anything differs.
    assert _parse(completion("b", "p")).job.id == _parse(completion("b", "p")).job.id
    assert _parse(completion("b", "p")).job.id != _parse(completion("c", "p")).job.id
    assert _parse(completion("b", "p")).job.id != _parse(completion("b", "q")).job.id
    # --timeout-s is part of the request: a rerun with another deadline must not read back the old answers.
    timed = parse_line(completion("b", "p"), 1, run_key="k", default_max_tokens=99, timeout_s=5.0).job
    assert timed.timeout_s == 5.0 and timed.id != _parse(completion("b", "p")).job.id


def test_openai_tags_are_taken_as_the_gateway_takes_them_and_leave_the_job_id_alone() -> None:
    """``metadata``, ``user``, ``safety_identifier`` and ``prompt_cache_key`` (what the current SDK sends and
    a batch file copies) were an error line (the last two) or accepted and dropped (the first two): they are
    the job's metadata and affinity key, as the gateway's ``parse_request`` makes them. The job id is of the
    question only: a line keeps the id it had before (pinned here), so a resumed run finds its earlier jobs."""
    tags: dict[str, Any] = {
        "metadata": {"team": "search", "run": "7"},
        "user": "u",
        "safety_identifier": "user-hash-1",
        "prompt_cache_key": "queues-v1",
    }
    plain, tagged = _parse(chat("a", "Hi")).job, _parse(chat("a", "Hi", **tags)).job
    assert tagged.metadata == {"team": "search", "run": "7", "user": "u", "safety_identifier": "user-hash-1"}
    assert tagged.affinity == "queues-v1" and (plain.metadata, plain.affinity) == (None, None)
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], **tags}
    gateway = parse_request("chat", body, default_max_tokens=99, timeout_s=60).fields
    assert (gateway["metadata"], gateway["affinity"]) == (tagged.metadata, tagged.affinity)
    # The key picks the shard: another question with the same key queues beside this one.
    other = _parse(completion("b", "Something else entirely", prompt_cache_key="queues-v1")).job
    assert all(shard_for_job(other, k) == shard_for_job(tagged, k) for k in range(2, 9))
    assert _parse(chat("a", "Hi", prompt_cache_key="")).job.affinity is None  # "": no particular cache

    # The id a line without tags had before batch took them (run_key "k", default max_tokens 99): unchanged.
    assert plain.id == "batch-9e5f439f41e7e355be96ec0438c3b8b261ef32ed"
    assert tagged.id == plain.id  # and so is a tagged line's (user and metadata were accepted before)
    assert _parse(chat("a", "Hi!", **tags)).job.id != plain.id  # the question still makes the id


@pytest.mark.parametrize(
    ("raw", "needle", "custom_id"),
    [
        ("{nope", "not valid JSON", None),
        ("[1, 2]", "JSON object", None),
        (json.dumps({"method": "POST", "url": "/v1/completions", "body": {}}), "custom_id", None),
        (json.dumps({"custom_id": "x", "method": "GET", "url": "/v1/completions", "body": {}}), "POST", "x"),
        (json.dumps({"custom_id": "x", "url": "/v1/embeddings", "body": {}}), "url must be", "x"),
        (json.dumps({"custom_id": "x", "url": "/v1/completions", "body": []}), "body must be", "x"),
        (json.dumps({"custom_id": "x", "url": "/v1/completions", "body": {}, "extra": 1}), "unknown field", "x"),
        (completion("x", "p", stream=True), "stream", "x"),
        (completion("x", "p", echo=True), "echo", "x"),
        (completion("x", ["a", "b"]), "one prompt per request", "x"),
        (completion("x", 5), "body.prompt", "x"),
        (chat("x", "hi", response_format={"type": "xml"}), "response_format", "x"),
        (chat("x", "hi", tools=[]), "unsupported body field(s): tools", "x"),
        (chat("x", "hi", top_logprobs=2), "requires body.logprobs", "x"),
        (chat("x", [{"type": "image_url"}]), "text content parts only", "x"),
        (chat("x", "hi", temperature="hot"), "temperature", "x"),
        (chat("x", "hi", max_tokens=0), "max_tokens", "x"),
        # The engine's invariants, refused at read rather than dead-lettered by the worker after submission:
        (chat("x", "hi", max_tokens=5, min_tokens=9), "body.min_tokens: Value error, min_tokens (9) must be <=", "x"),
        (chat("x", "hi", prompt_cache_key=5), "body.prompt_cache_key: must be a string", "x"),
        (chat("x", "hi", prompt_cache_key="k" * 1025), "body.prompt_cache_key: String should have at most 1024", "x"),
        (chat("x", "hi", safety_identifier=["s"]), "body.safety_identifier: must be a string", "x"),
        (completion("x", "p", metadata={str(i): "v" for i in range(17)}), "body.metadata: at most 16", "x"),
        (completion("x", "p", metadata={"n": 1}), "body.metadata.n: must be a string", "x"),
        (chat("x", "hi", user="a", metadata={"user": "b"}), "body.metadata.user: the job's metadata holds", "x"),
        (chat("x", "hi", temperature=float("nan")), "not valid JSON", None),
        # Valid JSON, but no Unicode: neither a job id nor an output line can hold it (it was a traceback).
        (completion("x\ud800", "p"), "lone UTF-16 surrogate", None),
        (chat("x", "hi \udc80"), "lone UTF-16 surrogate", None),
    ],
)
def test_bad_lines_are_rejected_with_a_reason(raw: str, needle: str, custom_id: str | None) -> None:
    with pytest.raises(LineError) as info:
        _parse(raw)
    assert needle in info.value.message
    assert info.value.custom_id == custom_id


def test_a_responses_line_is_the_chat_lines_job() -> None:
    """A ``/v1/responses`` line asks what a chat line asks, in other words (``instructions`` a system message,
    ``input`` the conversation, ``max_output_tokens`` the limit): it becomes the very job the chat line
    becomes, with the same id rule (so the same id for the same custom_id), and the messages the gateway
    makes of the same body. Neutral values of the Responses-only fields the SDKs send pass."""
    line = _parse(
        responses(
            "a",
            [{"role": "user", "content": [{"type": "input_text", "text": "Hi"}]}],
            instructions="Be brief",
            max_output_tokens=7,
            temperature=0,
            tools=[],
            store=True,
            text={"format": {"type": "text"}},
            metadata={"team": "search"},
        )
    )
    asked = [{"role": "system", "content": "Be brief"}, {"role": "user", "content": "Hi"}]
    same = _parse(
        json.dumps(
            {
                "custom_id": "a",
                "url": "/v1/chat/completions",
                "body": {
                    "messages": asked,
                    "max_completion_tokens": 7,
                    "temperature": 0,
                    "metadata": {"team": "search"},
                },
            }
        )
    )
    assert line.kind == "responses" and line.model == "tiny" and line.job == same.job
    assert line.echo is not None and (line.echo["instructions"], line.echo["max_output_tokens"]) == ("Be brief", 7)
    body = {"model": "tiny", "input": "Hi", "instructions": "Be brief", "max_output_tokens": 7}
    gateway = parse_responses_request(body, default_max_tokens=99, timeout_s=60).fields
    job = _parse(responses("b", "Hi", instructions="Be brief", max_output_tokens=7)).job
    assert [m.model_dump(exclude_none=True) for m in job.messages or []] == gateway["messages"] == asked
    assert job.max_tokens == gateway["max_tokens"] == 7 and job.strict_max_tokens
    assert _parse(responses("b", "Hi")).job.max_tokens == 99  # the default only caps, as for chat


@pytest.mark.parametrize(
    ("raw", "needle"),
    [
        (responses("x", "hi", tools=[{"type": "function", "name": "f"}]), "body.tools: pagedq does not support"),
        (responses("x", "hi", previous_response_id="resp_1"), "body.previous_response_id"),
        (responses("x", "hi", n=2), "body.n"),
        (responses("x", "hi", stream=True), "body.stream: streaming is not available"),
        (json.dumps({"custom_id": "x", "url": "/v1/responses", "body": {}}), "body.input: required"),
        (responses("x", []), "body.input: a string or a non-empty list"),
        (responses("x", [{"type": "function_call"}]), "body.input[0].type: pagedq supports message items only"),
        (responses("x", [{"role": "user", "content": "a", "x": 1}]), "body.input[0].x: pagedq does not support"),
        (responses("x", [{"role": "user", "content": [{"type": "input_image"}]}]), "body.input[0].content[0]"),
        (responses("x", "hi", instructions=3), "body.instructions: must be a string"),
        (responses("x", "hi", max_output_tokens=0), "max_output_tokens: Input should be greater"),
        (responses("x", "hi", temperature="hot"), "temperature"),
        (responses("x", "hi", max_output_tokens=5, min_tokens=9), "must be <= max_output_tokens (5)"),
    ],
)
def test_bad_responses_lines_name_the_field(raw: str, needle: str) -> None:
    """Refused where the gateway refuses the same request, naming the field the line holds (never the chat
    field it became: ``max_output_tokens``, not ``max_tokens``), as an ordinary error line."""
    with pytest.raises(LineError) as info:
        _parse(raw)
    assert needle in info.value.message and info.value.custom_id == "x" and info.value.code == "invalid_request"


def _final(logprobs: bool) -> FinalEvent:
    lps = [
        Logprob(
            token_id=5, logprob=-0.5, top=[TopLogprob(token_id=5, logprob=-0.5), TopLogprob(token_id=6, logprob=-1.5)]
        ),
        Logprob(token_id=7, logprob=-0.1, top=[]),
    ]
    return FinalEvent(
        id="j1",
        attempt=1,
        worker="w",
        choices=[
            Choice(index=0, text="ab", token_ids=[5, 7], finish_reason="stop", logprobs=lps if logprobs else None)
        ],
        usage=Usage(prompt_tokens=3, completion_tokens=2, cached_tokens=1),
        timings=Timings(queued_s=0, total_s=0.1),
    )


def openai_body(body: dict[str, Any]) -> ChatCompletion | Completion:
    """The body parsed by the official SDK's model of its kind (raises when it is not that shape)."""
    if body["object"] == "chat.completion":
        return ChatCompletion.model_validate(body)
    return Completion.model_validate(body)


def test_response_bodies_are_openai_shaped() -> None:
    text = {5: "a", 6: "c", 7: "b"}.__getitem__
    body = response_body(_parse(chat("x", "hi")), _final(True), "served", text)
    # The request said "tiny": the body names the model that served it, as OpenAI's does.
    assert body["object"] == "chat.completion" and body["model"] == "served" and body["id"] == "chatcmpl-j1"
    assert openai_body(body).model == "served"
    (choice,) = body["choices"]
    assert choice["message"] == {"role": "assistant", "content": "ab"} and choice["finish_reason"] == "stop"
    first = choice["logprobs"]["content"][0]
    assert first["token"] == "a" and first["logprob"] == -0.5 and first["bytes"] == [97]
    assert [t["token"] for t in first["top_logprobs"]] == ["a", "c"]
    assert body["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 2,
        "total_tokens": 5,
        "prompt_tokens_details": {"cached_tokens": 1},
    }

    line = parse_line(
        json.dumps({"custom_id": "y", "url": "/v1/completions", "body": {"prompt": "p"}}),
        1,
        run_key="k",
        default_max_tokens=4,
    )
    body = response_body(line, _final(True), "served", text)
    assert body["object"] == "text_completion" and body["model"] == "served"
    lp = body["choices"][0]["logprobs"]
    assert lp["tokens"] == ["a", "b"] and lp["text_offset"] == [0, 1]
    assert lp["top_logprobs"][0] == {"a": -0.5, "c": -1.5}
    assert openai_body(body).model == "served"
    assert response_body(line, _final(False), "s", text)["choices"][0]["logprobs"] is None


def sdk_response(body: dict[str, Any]) -> Response:
    """The body read by the ``openai`` SDK's ``Response`` type, strictly (raises when it is not that shape)."""
    return Response.model_validate(body, strict=True)


def test_a_responses_lines_body_is_a_response_object() -> None:
    """The ``response`` object the gateway answers ``/v1/responses`` with (the SDK's ``Response`` reads it):
    one message holding one ``output_text`` part, usage in input/output tokens, ``incomplete`` with
    ``max_output_tokens`` for an answer cut at its limit; ids from the job id, the served model."""
    line = _parse(responses("x", "hi", instructions="Be brief", max_output_tokens=2))
    body = response_body(line, _final(False), "served", batch.token_id_text)
    parsed = sdk_response(body)
    assert parsed.output_text == "ab" and parsed.model == "served" and parsed.status == "completed"
    assert body["id"] == "resp_j1" and body["instructions"] == "Be brief" and body["max_output_tokens"] == 2
    assert body["output"][0]["id"] == "msg_j1" and body["incomplete_details"] is None
    usage = parsed.usage
    assert usage is not None and (usage.input_tokens, usage.output_tokens, usage.total_tokens) == (3, 2, 5)
    assert usage.input_tokens_details.cached_tokens == 1
    cut = _final(False)
    cut.choices[0].finish_reason = "length"
    body = response_body(line, cut, "served", batch.token_id_text)
    assert body["status"] == "incomplete" and body["incomplete_details"] == {"reason": "max_output_tokens"}
    assert sdk_response(body).status == "incomplete"


def test_without_token_texts_offsets_and_bytes_are_null_not_computed_over_stand_ins() -> None:
    """No tokenizer at hand: tokens are ``token_id:N``, and ``text_offset`` / ``bytes``, which only token
    texts can give, are null (OpenAI's schema allows it) rather than numbers about the stand-in strings."""
    line = _parse(completion("y", "p"))
    body = response_body(line, _final(True), "served", batch.token_id_text)
    lp = body["choices"][0]["logprobs"]
    assert lp["tokens"] == ["token_id:5", "token_id:7"] and lp["text_offset"] is None
    assert lp["top_logprobs"][0] == {"token_id:5": -0.5, "token_id:6": -1.5}
    assert openai_body(body).choices[0].logprobs is not None
    body = response_body(_parse(chat("x", "hi", logprobs=True)), _final(True), "served", batch.token_id_text)
    content = body["choices"][0]["logprobs"]["content"]
    assert [(e["token"], e["bytes"]) for e in content] == [("token_id:5", None), ("token_id:7", None)]
    assert all(t["bytes"] is None for e in content for t in e["top_logprobs"])
    assert isinstance(openai_body(body), ChatCompletion)


def test_a_windows_file_reads_like_any_other(tmp_path: Path) -> None:
    """A byte order mark before the first line and CRLF endings (a file saved by a Windows editor)."""
    path = tmp_path / "in.jsonl"
    first, second = json.dumps({"custom_id": "a"}), json.dumps({"custom_id": "b"})
    path.write_bytes(b"\xef\xbb\xbf" + first.encode() + b"\r\n\r\n" + second.encode() + b"\r\n")
    assert list(iter_lines(path)) == [(1, first), (3, second)]
    path.write_bytes(first.encode() + b"\n\xef\xbb\xbf" + second.encode())  # elsewhere it is the line's own
    assert list(iter_lines(path)) == [(1, first), (2, "\ufeff" + second)]


def test_read_done_cuts_a_torn_last_line(tmp_path: Path) -> None:
    path = tmp_path / "out.jsonl"
    unnamed = json.dumps({"custom_id": None, "error": {"line": 7, "line_sha256": "ab12"}})
    good = [json.dumps({"custom_id": "a"}), unnamed, json.dumps({"custom_id": None, "error": {"line": 8}})]
    path.write_text("\n".join(good) + '\n{"custom_id": "b", "resp')
    assert read_done(path) == ({"a"}, Counter({"ab12": 1}))  # by content; a bare line number keys nothing
    assert path.read_text() == "\n".join(good) + "\n"
    assert read_done(tmp_path / "missing.jsonl") == (set(), Counter())


def test_duplicate_custom_ids_are_refused_up_front(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    inp = tmp_path / "in.jsonl"
    inp.write_text("\n".join([completion("a", "x"), completion("b", "y"), completion("a", "z"), "{bad"]) + "\n")
    out = tmp_path / "out.jsonl"
    assert batch.main([str(inp), str(out), "--local"]) == 2
    err = capsys.readouterr().err
    assert "duplicate custom_id" in err and "'a' (lines 1, 3)" in err
    assert not out.exists() and not (tmp_path / "out.errors.jsonl").exists()


def test_an_output_that_cannot_be_written_is_refused_up_front(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before a model loads: the errors file is opened at the first error only, so a bad folder for it
    would otherwise surface as a traceback once the work was done."""
    inp = tmp_path / "in.jsonl"
    inp.write_text(completion("a", "x") + "\n")
    missing = tmp_path / "no-such-folder"
    cases = [
        ([str(missing / "out.jsonl")], "the folder"),
        ([str(tmp_path / "out.jsonl"), "--errors", str(missing / "e.jsonl")], "the folder"),
        ([str(tmp_path)], "is a folder"),
    ]
    for args, needle in cases:
        assert batch.main([str(inp), *args, "--local"]) == 2
        err = capsys.readouterr().err
        assert needle in err and "Traceback" not in err, err
    assert not missing.exists() and not (tmp_path / "out.jsonl").exists()


def test_progress_is_a_bar_on_a_terminal_and_log_lines_otherwise() -> None:
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    tty = Tty()
    p = Progress(total=4, initial=1, mode="auto", interval_s=10, stream=tty)
    assert p.mode == "bar"
    for _ in range(3):
        p.update(True, tokens=10)
    p.close("summary")
    assert "4/4" in tty.getvalue() and "tok_s" in tty.getvalue() and "summary" in tty.getvalue()

    log = io.StringIO()
    p = Progress(total=4, initial=0, mode="auto", interval_s=0, stream=log)
    assert p.mode == "log"
    p.update(True, tokens=5)
    p.update(False)
    p.close("summary")
    lines = log.getvalue().splitlines()
    assert "batch: 1/4 done (25.0%), 0 errors" in lines[0] and "ETA" in lines[0]
    assert "batch: 2/4 done (50.0%), 1 errors" in lines[1]
    assert "finished: 2/4" in lines[2] and lines[3] == "summary"


# ------------------------------------------------------------------------------------ local and queue


@pytest.fixture(scope="module")
def model_dir(tiny_model: Any) -> Path:
    return Path(tiny_model("llama_gqa"))


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> Any:
    """The in-process workers' engine (conftest's is session-scoped, over the session's ``model_dir``)."""
    return make_engine(model_dir)


@pytest.fixture(scope="module")
def batch_file(tmp_path_factory: pytest.TempPathFactory) -> BatchFile:
    return make_batch_file(tmp_path_factory.mktemp("batch") / "requests.jsonl")


@pytest.fixture(scope="module")
def local_output(batch_file: BatchFile, model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The whole file through ``--local`` (in this process), once for the module."""
    out = tmp_path_factory.mktemp("local") / "local.jsonl"
    started = time.monotonic()
    code = batch.main(
        [str(batch_file.path), str(out), "--local", "--model", str(model_dir), *ENGINE_FLAGS, "--progress", "none"]
    )
    print(f"--local batch of 200 lines: {time.monotonic() - started:.1f}s")
    assert code == LINES_FAILED  # every line answered, the malformed ones as errors
    return out


def check_complete(batch_file: BatchFile, out: Path) -> None:
    """Every line answered exactly once: valid ones in OUTPUT, malformed ones in the errors file."""
    errors = out.with_name(out.name.replace(".jsonl", ".errors.jsonl"))
    ok = [r["custom_id"] for r in records(out)]
    failed = error_keys(errors)
    counts = Counter(ok + failed)
    assert all(c == 1 for c in counts.values()), [k for k, c in counts.items() if c > 1]
    expected_errors = {cid if cid is not None else line for line, cid in batch_file.malformed.items()}
    assert set(failed) == expected_errors
    assert len(ok) + len(failed) == 200
    for rec in records(errors):
        assert rec["response"] is None and rec["error"]["message"] and rec["error"]["line"] in batch_file.malformed
    for rec in records(out):
        assert rec["error"] is None and rec["response"]["status_code"] == 200


def test_local_batch_answers_every_line_and_reports_malformed_ones(batch_file: BatchFile, local_output: Path) -> None:
    check_complete(batch_file, local_output)
    errors = {r["error"]["line"]: r["error"] for r in records(local_output.with_name("local.errors.jsonl"))}
    assert errors[6]["code"] == "invalid_json"
    assert any("temperature" in e["message"] for e in errors.values())
    assert any("tools" in e["message"] for e in errors.values())
    sample = answers(local_output)
    with_lp = [cid for cid, (choices, _, _) in sample.items() if choices[0][2] is not None]
    assert with_lp and all(not t.startswith("token_id:") for cid in with_lp for t in sample[cid][0][0][2])


def test_local_batch_resumes_from_a_partial_output(
    batch_file: BatchFile, local_output: Path, model_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "partial.jsonl"
    kept = local_output.read_text().splitlines()[:50]
    out.write_text("\n".join(kept) + "\n")
    code = batch.main(
        [str(batch_file.path), str(out), "--local", "--model", str(model_dir), *ENGINE_FLAGS, "--progress", "none"]
    )
    assert code == LINES_FAILED
    check_complete(batch_file, out)
    assert out.read_text().splitlines()[:50] == kept  # what was there is kept as is
    reference = answers(local_output)
    got = answers(out)
    assert {cid: got[cid] for cid in batch_file.greedy & set(got)} == {
        cid: reference[cid] for cid in batch_file.greedy & set(got)
    }
    # Nothing left to do: the run ends at once, without loading a model (exit 3: earlier runs failed lines).
    assert batch.main([str(batch_file.path), str(out), "--local", "--model", "/nonexistent"]) == LINES_FAILED


@pytest.fixture(scope="module")
def queue(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Ctx]:
    """A Debian redis-server and two worker processes (steps slowed a little so a run can be killed)."""
    tmp = tmp_path_factory.mktemp("queue")
    server: RedisServer = make_server("debian", tmp / "redis")
    ctx = Ctx(server)
    procs = [WorkerProcess(ctx, model_dir, tmp, f"bw{i}", step_delay_s=0.01) for i in range(2)]
    try:
        for p in procs:
            p.wait_ready()
        yield ctx
    finally:
        for p in procs:
            p.close()
        ctx.close()
        server.stop()


def batch_process(ctx: Ctx, inp: Path, out: Path, *extra: str) -> subprocess.Popen[str]:
    """``python -m ops.batch INP OUT`` on ``ctx``'s queue, as a script would run it."""
    argv = [sys.executable, "-m", "ops.batch", str(inp), str(out), "--redis-url", ctx.server.url,
            "--namespace", ctx.ns, *extra]  # fmt: skip
    return subprocess.Popen(
        argv, cwd=REPO, env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def run_batch(ctx: Ctx, batch_file: BatchFile, out: Path, model_dir: Path, *extra: str) -> subprocess.Popen[str]:
    return batch_process(ctx, batch_file.path, out, "--tokenizer", str(model_dir), *extra)


@pytest.fixture
def lone_queue(tmp_path: Path) -> Iterator[Ctx]:
    """A Redis server of the test's own with no worker yet: jobs stay queued until the test starts one."""
    server: RedisServer = make_server("debian", tmp_path / "redis")
    ctx = Ctx(server)
    try:
        yield ctx
    finally:
        ctx.close()
        server.stop()


def three_lines(tmp_path: Path) -> Path:
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(completion(f"c{i}", f"the sea {i}", max_tokens=2, temperature=0) + "\n" for i in range(3)))
    return inp


def finish(proc: subprocess.Popen[str], timeout: float = 60) -> str:
    """Its stderr once it ended (killed if it did not within ``timeout``)."""
    try:
        return proc.communicate(timeout=timeout)[1]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


@contextlib.contextmanager
def queued(ctx: Ctx, inp: Path, out: Path, *extra: str) -> Iterator[subprocess.Popen[str]]:
    """A batch run of :func:`three_lines` once its 3 jobs are queued (no worker yet); killed if left running."""
    proc = batch_process(ctx, inp, out, *extra)
    try:
        wait_for(lambda: ctx.backlog() == 3 or proc.poll() is not None, timeout=60, what="3 jobs queued")
        yield proc
    finally:
        finish(proc, timeout=0)


def test_a_second_run_on_the_same_output_is_refused(lone_queue: Ctx, engine: Any, tmp_path: Path) -> None:
    """Two runs on one OUTPUT would skip the same lines, wait for the same job ids and both write every
    answer: the second is refused (exit 2) while the first holds OUTPUT, which then ends as usual."""
    inp, out = three_lines(tmp_path), tmp_path / "out.jsonl"
    with queued(lone_queue, inp, out, "--progress", "none") as first:
        second = batch_process(lone_queue, inp, out, "--progress", "none")
        stderr = finish(second)
        assert second.returncode == 2, stderr
        assert "another pagedq batch is writing" in stderr and "Traceback" not in stderr
        with inprocess_worker(lone_queue, engine):
            stderr = finish(first)
    assert first.returncode == 0, stderr
    assert sorted(r["custom_id"] for r in records(out)) == ["c0", "c1", "c2"]


def test_jobs_lost_with_redis_data_are_queued_again(lone_queue: Ctx, engine: Any, tmp_path: Path) -> None:
    """Redis restarted without its data while the jobs waited in the queue: the run notices (its count of
    submissions in Redis is gone) and queues them again, instead of waiting forever for answers."""
    inp, out = three_lines(tmp_path), tmp_path / "out.jsonl"
    with queued(lone_queue, inp, out, "--progress", "log") as proc:
        server = lone_queue.server
        assert isinstance(server, RedisServer)
        server.stop()
        shutil.rmtree(server.data_dir / "appendonlydir")  # back without its data
        server.start()
        with inprocess_worker(lone_queue, engine):
            stderr = finish(proc)
    assert proc.returncode == 0, stderr
    assert "Redis lost queued jobs" in stderr
    assert sorted(r["custom_id"] for r in records(out)) == ["c0", "c1", "c2"]


def test_foreign_data_at_a_jobs_keys_fails_that_line_alone(lone_queue: Ctx, engine: Any, tmp_path: Path) -> None:
    """A result key holding no event of its job (written by hand, a foreign tool) ended the whole run with a
    traceback, and so did an entry that is no event in a reply stream (anyone may append there): now the
    first is that line's ``internal`` error, the second is ignored (reply streams only wake the wait)."""
    inp, out = three_lines(tmp_path), tmp_path / "out.jsonl"
    with queued(lone_queue, inp, out, "--progress", "none") as proc:
        entries = lone_queue.redis.xrange(lone_queue.keys.jobs)
        ids = {json.loads(f["job"])["prompt"]: json.loads(f["job"])["id"] for _, f in entries}
        lone_queue.redis.set(lone_queue.keys.result(ids["the sea 0"]), "not an event")
        lone_queue.redis.xadd(lone_queue.keys.reply(ids["the sea 1"]), {"event": "{broken"})
        with inprocess_worker(lone_queue, engine):
            stderr = finish(proc)
    assert proc.returncode == LINES_FAILED, stderr
    assert "Traceback" not in stderr
    assert sorted(r["custom_id"] for r in records(out)) == ["c1", "c2"]
    (error,) = records(tmp_path / "out.errors.jsonl")
    assert error["custom_id"] == "c0" and error["error"]["code"] == "internal"

    # --retry-errors deletes what is stored under c0's job id, then the errors file; with Redis down it
    # fails before either (exit 1), and the errors file is still there for the next --retry-errors.
    server = lone_queue.server
    assert isinstance(server, RedisServer)
    server.stop()
    retry = batch_process(lone_queue, inp, out, "--progress", "none", "--retry-errors")
    stderr = finish(retry)
    assert retry.returncode == 1, stderr
    assert error_keys(tmp_path / "out.errors.jsonl") == ["c0"]
    server.start()
    with inprocess_worker(lone_queue, engine):
        retry = batch_process(lone_queue, inp, out, "--progress", "none", "--retry-errors")
        stderr = finish(retry)
    assert retry.returncode == 0, stderr
    assert sorted(r["custom_id"] for r in records(out)) == ["c0", "c1", "c2"]
    assert not records(tmp_path / "out.errors.jsonl")


def test_a_resume_after_overwrite_finds_the_jobs_it_queued(lone_queue: Ctx, engine: Any, tmp_path: Path) -> None:
    """``--overwrite`` gives the run's job ids a fresh nonce (the old answers must not be read back); a rerun
    without the flag made ids without it, so the jobs the interrupted run had queued ran for nothing and
    every line was queued again. The nonce is kept in Redis: the rerun queues the same 3 ids again."""
    inp, out = three_lines(tmp_path), tmp_path / "out.jsonl"
    out.write_text(json.dumps({"custom_id": "c0", "response": {}}) + "\n")  # an earlier run's answer

    def queued_ids() -> Counter[str]:
        return Counter(json.loads(f["job"])["id"] for _, f in lone_queue.redis.xrange(lone_queue.keys.jobs))

    with queued(lone_queue, inp, out, "--progress", "none", "--overwrite") as first:
        first.terminate()
        stderr = finish(first)
        assert first.returncode == 130, stderr
    assert not records(out)  # emptied by --overwrite
    first_ids = queued_ids()
    assert len(first_ids) == 3
    resume = batch_process(lone_queue, inp, out, "--progress", "none")
    wait_for(lambda: sum(queued_ids().values()) == 6 or resume.poll() is not None, timeout=60, what="requeued")
    assert set(queued_ids()) == set(first_ids)  # the same jobs: a worker answers each id once
    inflight = output_key(lone_queue.ns, "inflight", out.resolve())
    assert lone_queue.redis.smembers(inflight) == set(first_ids)  # kept by a resume: nothing to cancel
    with inprocess_worker(lone_queue, engine):
        stderr = finish(resume)
    assert resume.returncode == 0, stderr
    assert sorted(r["custom_id"] for r in records(out)) == ["c0", "c1", "c2"]
    assert not lone_queue.redis.exists(inflight)  # every id left the set as its end was read


def test_overwrite_cancels_the_jobs_an_interrupted_run_left_queued(
    lone_queue: Ctx, engine: Any, tmp_path: Path
) -> None:
    """A run interrupted with jobs queued, rerun with ``--overwrite``: the rerun's ids carry a fresh nonce, so
    the old jobs' answers are never read, yet they ran on the workers all the same. Now the rerun cancels
    every id still in OUTPUT's in-flight set before it queues its own (the set then holds only those), the
    old jobs end ``cancelled`` and the rerun answers every line. 5 lines, 3 in flight: each run has 3 queued."""
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(completion(f"c{i}", f"the sea {i}", max_tokens=2, temperature=0) + "\n" for i in range(5)))
    inflight = output_key(lone_queue.ns, "inflight", out.resolve())

    def queued_ids() -> set[str]:
        return {json.loads(f["job"])["id"] for _, f in lone_queue.redis.xrange(lone_queue.keys.jobs)}

    with queued(lone_queue, inp, out, "--progress", "none", "--max-in-flight", "3") as first:
        first.terminate()
        stderr = finish(first)
        assert first.returncode == 130, stderr
    old = queued_ids()
    assert len(old) == 3 and lone_queue.redis.smembers(inflight) == old  # the interruption cancels nothing
    assert not any(lone_queue.redis.exists(lone_queue.keys.cancel(i)) for i in old)

    rerun = batch_process(lone_queue, inp, out, "--progress", "log", "--max-in-flight", "3", "--overwrite")
    try:
        # Its 3 jobs queued: the cancel came before them (the set gets the new ids with their entries).
        wait_for(lambda: lone_queue.backlog() == 6 or rerun.poll() is not None, timeout=60, what="6 jobs queued")
        new = queued_ids() - old
        assert len(new) == 3
        assert [lone_queue.redis.get(lone_queue.keys.cancel(i)) for i in sorted(old)] == ["1"] * 3
        assert 0 < lone_queue.redis.ttl(lone_queue.keys.cancel(min(old))) <= CANCEL_TTL_S
        assert not any(lone_queue.redis.exists(lone_queue.keys.cancel(i)) for i in new)
        assert lone_queue.redis.smembers(inflight) == new
        with inprocess_worker(lone_queue, engine):
            stderr = finish(rerun)
            wait_for(lambda: all(lone_queue.result(i) for i in old), timeout=60, what="the old jobs to end")
    finally:
        if rerun.poll() is None:  # an assertion above failed: not left running
            rerun.kill()
            rerun.communicate()
    assert rerun.returncode == 0, stderr
    assert "cancelled 3 unfinished job(s) of an earlier run on out.jsonl" in stderr
    assert sorted(r["custom_id"] for r in records(out)) == [f"c{i}" for i in range(5)]
    ended = [lone_queue.result(i) for i in old]
    assert all(isinstance(e, ErrorEvent) and e.code == "cancelled" for e in ended), ended
    assert not lone_queue.redis.exists(inflight)


@pytest.mark.slow  # a cluster of six redis-server processes
def test_overwrite_cancels_on_a_cluster(redis_cluster: ClusterServers, tmp_path: Path) -> None:  # noqa: F811
    """On a Redis Cluster, where each job's cancel key has its own slot and a pipeline refuses PUBLISH: every
    id in the in-flight set gets its cancel key and its notice on the cancel channel, and leaves the set."""
    ctx = Ctx(redis_cluster, shards=3)
    out = tmp_path / "out.jsonl"
    pubsub = ctx.redis.pubsub()
    try:
        pubsub.subscribe(ctx.keys.cancel_channel)
        wait_for(lambda: pubsub.get_message(timeout=0.1), what="the subscription confirmed")
        first = QueueBackend(redis_cluster.url, ctx.settings(), None)
        try:
            run_key = f"{out}#{first.generation(out, fresh=True)}"
            jobs = [
                parse_line(completion(f"c{i}", "p"), 1, run_key=run_key, default_max_tokens=2).job for i in range(5)
            ]
            first.submit(jobs)
        finally:
            first.close()
        ids = {job.id for job in jobs}
        inflight = output_key(ctx.ns, "inflight", out)
        assert ctx.redis.smembers(inflight) == ids
        second = QueueBackend(redis_cluster.url, ctx.settings(), None)
        try:
            assert second.cancel_earlier(out) == 5
            assert second.cancel_earlier(out) == 0  # the set is cleared: nothing is cancelled twice
        finally:
            second.close()
        assert all(ctx.redis.get(ctx.keys.cancel(i)) == "1" for i in ids)
        assert not ctx.redis.exists(inflight)
        notices: list[str] = []

        def all_notices() -> bool:
            while (msg := pubsub.get_message(timeout=0.1)) is not None:
                if msg["type"] == "message":
                    notices.append(msg["data"])
            return len(notices) >= 5

        wait_for(all_notices, timeout=30, what="5 cancel notices")
        assert sorted(notices) == sorted(ids)
    finally:
        pubsub.close()
        ctx.close()


@pytest.mark.slow  # a cluster of six redis-server processes
def test_waiting_for_jobs_on_a_cluster(redis_cluster: ClusterServers) -> None:  # noqa: F811
    """Each job's reply stream and result key have a slot of their own, and so has each worker's heartbeat:
    the one blocking XREAD over the jobs' reply streams, and the one MGET over the heartbeats of the workers
    that answered, were refused by the cluster client (``RedisClusterException``), so a batch on a cluster
    ended in a traceback once two jobs were in flight. The wait blocks on the oldest job's slot, and wakes
    when that job ends."""
    ctx = Ctx(redis_cluster)
    ids = [f"job-{i}" for i in range(3)]
    workers = [f"w{i}" for i in range(3)]
    assert len({key_slot(ctx.keys.reply(job_id).encode()) for job_id in ids}) == 3
    assert len({key_slot(ctx.keys.heartbeat(name).encode()) for name in workers[1:]}) == 2

    def end(job_id: str, worker: str) -> None:
        """What a worker leaves when a job ends (its heartbeat naming its model, the result, the event)."""
        event = ErrorEvent(id=job_id, attempt=1, code="cancelled", message="cancelled", worker=worker)
        ctx.redis.set(ctx.keys.heartbeat(worker), json.dumps({"model": f"/models/m-{worker}"}), ex=300)
        ctx.redis.set(ctx.keys.result(job_id), event.to_json(), ex=300)
        ctx.redis.xadd(ctx.keys.reply(job_id), {"event": event.to_json()})

    backend = QueueBackend(redis_cluster.url, ctx.settings(), None)
    try:
        assert backend.wait(ids, 0.2) == []
        with ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(backend.wait, ids, 60.0)
            end(ids[0], workers[0])
            (first,) = waiting.result(timeout=30)  # woken by the oldest job's end, not by the 60 s timeout
        assert first.id == ids[0] and backend.served_model(first) == "/models/m-w0"
        for job_id, worker in zip(ids[1:], workers[1:], strict=True):
            end(job_id, worker)
        rest = backend.wait(ids[1:], 0.2)
        assert sorted(e.id for e in rest) == ids[1:]
        assert sorted(backend.served_model(e) for e in rest) == ["/models/m-w1", "/models/m-w2"]
    finally:
        backend.close()
        ctx.redis.delete(*(ctx.keys.heartbeat(name) for name in workers))
        ctx.close()


@pytest.mark.slow  # a cluster of six redis-server processes
def test_a_batch_on_a_cluster_answers_every_line(
    redis_cluster: ClusterServers,  # noqa: F811
    engine: Any,
    tmp_path: Path,
) -> None:
    """``pagedq batch`` end to end on a cluster, a worker answering: it ended in a traceback (an XREAD across
    slots) as soon as two of its jobs were in flight."""
    ctx = Ctx(redis_cluster)
    inp, out = three_lines(tmp_path), tmp_path / "out.jsonl"
    try:
        with inprocess_worker(ctx, engine) as worker:
            proc = batch_process(ctx, inp, out, "--progress", "none")
            stderr = finish(proc, timeout=120)
    finally:
        ctx.close()
    assert proc.returncode == 0, stderr
    assert "Traceback" not in stderr
    written = records(out)
    assert sorted(r["custom_id"] for r in written) == ["c0", "c1", "c2"]
    assert all(r["response"]["body"]["model"] == worker.model_name for r in written), written


def test_retry_errors_runs_failed_lines_again(lone_queue: Ctx, engine: Any, tmp_path: Path) -> None:
    """Lines a worker failed (here their deadline passed while they waited) keep their job ids on a rerun,
    and the failure stays stored under those ids: ``--retry-errors`` must run them again, not read it back."""
    inp, out = three_lines(tmp_path), tmp_path / "out.jsonl"
    # The worker starts once the 3 jobs are queued, their deadlines past.
    with (
        queued(lone_queue, inp, out, "--progress", "none", "--timeout-s", "0.001") as first,
        inprocess_worker(lone_queue, engine),
    ):
        stderr = finish(first)
        assert first.returncode == LINES_FAILED, stderr
        assert len(error_keys(tmp_path / "out.errors.jsonl")) == 3 and not records(out)
        retry = batch_process(lone_queue, inp, out, "--progress", "none", "--retry-errors")
        stderr = finish(retry)
    assert retry.returncode == 0, stderr
    assert sorted(r["custom_id"] for r in records(out)) == ["c0", "c1", "c2"]
    assert not records(tmp_path / "out.errors.jsonl")


def test_chat_and_responses_lines_get_the_same_answer_in_their_shapes(
    lone_queue: Ctx, engine: Any, tmp_path: Path
) -> None:
    """A batch mixing a chat line and a ``/v1/responses`` line with the same greedy request, through the queue
    and a worker: the same text, token counts and ending, each in its own shape; a Responses line asking
    for tools becomes an error line naming ``tools`` while the others run."""
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    question = {"max_completion_tokens": 6, "temperature": 0}
    inp.write_text(
        "\n".join(
            [
                chat("c", "the sea robot", **question),
                responses("r", "the sea robot", max_output_tokens=6, temperature=0),
                responses("t", "the sea robot", tools=[{"type": "function", "name": "f", "parameters": {}}]),
            ]
        )
        + "\n"
    )
    with inprocess_worker(lone_queue, engine):
        proc = batch_process(lone_queue, inp, out, "--progress", "none")
        stderr = finish(proc)
    assert proc.returncode == LINES_FAILED, stderr
    bodies = {r["custom_id"]: r["response"]["body"] for r in records(out)}
    chat_body, resp_body = bodies["c"], bodies["r"]
    (choice,) = ChatCompletion.model_validate(chat_body).choices
    resp = sdk_response(resp_body)
    assert resp.object == "response" and resp.output_text == choice.message.content and resp.output_text
    assert resp.usage is not None and chat_body["usage"]["prompt_tokens"] == resp.usage.input_tokens
    assert (resp.usage.output_tokens, resp.usage.total_tokens) == (
        chat_body["usage"]["completion_tokens"],
        chat_body["usage"]["total_tokens"],
    )
    assert resp.status == ("incomplete" if choice.finish_reason == "length" else "completed")
    assert resp.model == chat_body["model"]  # the served model, whatever the line named
    (error,) = records(tmp_path / "out.errors.jsonl")
    assert error["custom_id"] == "t" and error["response"] is None and error["error"]["line"] == 3
    assert error["error"]["code"] == "invalid_request" and "body.tools" in error["error"]["message"]
