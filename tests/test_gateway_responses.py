"""``POST /v1/responses`` end to end: the official ``openai`` SDK's Responses API (``client.responses``)
against ``pagedq serve``, a real Redis and a real worker on the tiny model (:mod:`tests.test_gateway`'s
fixtures: this module gets its own Redis, worker and gateway).

A Responses request is a chat job, so the chat endpoint is the reference: the same greedy request must give
the same text and token counts through both.
"""

from __future__ import annotations

import json
from typing import Any, Literal

import openai
import pytest
from openai.types.responses import ResponseOutputMessage

from ops.gateway.openai_api import ApiError
from ops.gateway.responses_api import ResponseEvents, parse_responses_request, responses_names
from schemas.jobs import FinalEvent
from tests.test_gateway import Fleet, chat, fleet, redis_srv  # noqa: F401
from tests.worker_harness import wait_for

STREAM_ORDER = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
]
STREAM_END = ["response.output_text.done", "response.content_part.done", "response.output_item.done"]


def job_of(response_id: str) -> str:
    """The job behind a response: ``resp_<hex>`` is job ``resp-<hex>`` (job ids hold no ``_``)."""
    assert response_id.startswith("resp_")
    return "resp-" + response_id.removeprefix("resp_")


def test_a_greedy_response_is_the_chat_answer(fleet: Fleet) -> None:  # noqa: F811
    question = "Tell me about queues."
    reference = fleet.client.chat.completions.create(
        model=fleet.model,
        messages=[{"role": "system", "content": "Be brief."}, *chat(question)],
        max_tokens=12,
        temperature=0,
        seed=7,
    )
    (choice,) = reference.choices
    assert choice.message.content and reference.usage is not None

    out = fleet.client.responses.create(
        model=fleet.model,
        instructions="Be brief.",
        input=question,
        max_output_tokens=12,
        temperature=0,
        extra_body={"seed": 7},
    )
    assert out.object == "response" and out.id.startswith("resp_")
    assert out.output_text == choice.message.content
    (item,) = out.output
    assert item.type == "message" and item.role == "assistant" and item.id.startswith("msg_")
    (part,) = item.content
    assert part.type == "output_text" and part.annotations == []
    assert out.status == ("incomplete" if choice.finish_reason == "length" else "completed")
    assert out.instructions == "Be brief." and out.max_output_tokens == 12 and out.temperature == 0
    assert out.usage is not None
    assert out.usage.input_tokens == reference.usage.prompt_tokens
    assert out.usage.output_tokens == reference.usage.completion_tokens
    assert out.usage.total_tokens == out.usage.input_tokens + out.usage.output_tokens
    assert out.usage.output_tokens_details.reasoning_tokens == 0
    assert out.usage.input_tokens_details.cached_tokens >= 0
    stored = fleet.ctx.result(job_of(out.id))  # the response's job, in Redis under its id
    assert isinstance(stored, FinalEvent) and stored.text == out.output_text

    # The same conversation as message items: a developer message, and text parts.
    items: Any = [
        {"role": "developer", "content": "Be brief."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": question}]},
    ]
    again = fleet.client.responses.create(
        model=fleet.model, input=items, max_output_tokens=12, temperature=0, extra_body={"seed": 7}
    )
    assert again.output_text == out.output_text and again.id != out.id


def test_max_output_tokens_makes_an_incomplete_response(fleet: Fleet) -> None:  # noqa: F811
    out = fleet.client.responses.create(
        model=fleet.model,
        input="Tell me a story",
        max_output_tokens=3,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert out.status == "incomplete"
    assert out.incomplete_details is not None and out.incomplete_details.reason == "max_output_tokens"
    assert out.usage is not None and out.usage.output_tokens == 3
    assert out.output_text  # what was made before the limit is the answer
    message = out.output[0]
    assert isinstance(message, ResponseOutputMessage) and message.status == "incomplete"  # cut, as OpenAI marks it


def test_streamed_events_come_in_openais_order_and_add_up(fleet: Fleet) -> None:  # noqa: F811
    kw: dict[str, Any] = {
        "model": fleet.model,
        "input": "Tell me about streams.",
        "max_output_tokens": 10,
        "temperature": 0,
        "extra_body": {"seed": 3},
    }
    whole = fleet.client.responses.create(**kw)
    events = list(fleet.client.responses.create(stream=True, **kw))
    kinds = [e.type for e in events]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert deltas, kinds
    final = "response.incomplete" if whole.status == "incomplete" else "response.completed"
    assert kinds == [*STREAM_ORDER, *(["response.output_text.delta"] * len(deltas)), *STREAM_END, final]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in deltas)
    assert text == whole.output_text
    done = events[-4]
    assert done.type == "response.output_text.done" and done.text == text
    last = events[-1]
    assert last.type == final and last.response.output_text == text
    assert last.response.usage is not None and whole.usage is not None
    assert last.response.usage.output_tokens == whole.usage.output_tokens
    ids = {e.response.id for e in events if e.type in ("response.created", "response.in_progress", final)}
    assert len(ids) == 1 and ids != {whole.id}  # one response throughout, a job of its own


def test_the_stream_helper_reads_a_completed_response(fleet: Fleet) -> None:  # noqa: F811
    # guided_choice ends the answer by itself (its grammar is complete): a completed response whatever the model.
    kw: dict[str, Any] = {
        "model": fleet.model,
        "input": "Yes or no?",
        "max_output_tokens": 16,
        "temperature": 0,
        "extra_body": {"guided_choice": ["yes", "no"]},
    }
    reference = fleet.client.responses.create(**kw)
    assert reference.status == "completed" and reference.output_text in ("yes", "no")
    with fleet.client.responses.stream(**kw) as stream:
        helped = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        response = stream.get_final_response()
    assert helped == response.output_text == reference.output_text
    assert response.status == "completed" and response.usage is not None


def test_client_disconnect_mid_stream_cancels_the_job(fleet: Fleet) -> None:  # noqa: F811
    stream = fleet.client.responses.create(
        model=fleet.model,
        input="Write a very long story.",
        max_output_tokens=600,
        temperature=1.0,
        extra_body={"ignore_eos": True, "seed": 1},
        stream=True,
    )
    first = next(iter(stream))  # sent once the job's first event came: it is running
    assert first.type == "response.created"
    stream.close()
    event = wait_for(lambda: fleet.ctx.result(job_of(first.response.id)), 30, what="the disconnected job's end")
    assert isinstance(event, FinalEvent), event
    assert event.choices[0].finish_reason == "cancelled" and len(event.choices[0].token_ids) < 600


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tools": [{"type": "function", "name": "f", "parameters": {}}]}, "tools"),
        ({"previous_response_id": "resp_abc"}, "previous_response_id"),
        ({"background": True}, "background"),
        ({"reasoning": {"effort": "low"}}, "reasoning"),
        ({"n": 2}, "n"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"temperature": -1}, "temperature"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0]"),
        ({"input": [{"type": "function_call_output", "call_id": "c", "output": "x"}]}, "input[0]"),
        ({"input": [{"role": "tool", "content": "x"}]}, "input[0]"),
    ],
)
def test_what_pagedq_cannot_do_is_refused_by_name(fleet: Fleet, extra: dict[str, Any], param: str) -> None:  # noqa: F811
    body: dict[str, Any] = {"input": "hi", **extra}
    with pytest.raises(openai.BadRequestError) as refused:
        fleet.client.responses.create(model=fleet.model, extra_body=body)
    assert refused.value.status_code == 400
    assert refused.value.body["param"] == param, refused.value.body  # type: ignore[index]


def test_neutral_values_of_responses_fields_pass(fleet: Fleet) -> None:  # noqa: F811
    out = fleet.client.responses.create(
        model=fleet.model,
        input="hi",
        max_output_tokens=2,
        tools=[],
        store=True,
        parallel_tool_calls=True,
        truncation="disabled",
        text={"format": {"type": "text"}},
        metadata={"k": "v"},
    )
    assert out.output_text is not None and out.metadata == {"k": "v"}


def test_a_prompt_too_long_names_the_input(fleet: Fleet) -> None:  # noqa: F811
    # Only the worker knows the model's context (1024 tokens): its refusal is OpenAI's 400, in this API's names.
    with pytest.raises(openai.BadRequestError) as too_long:
        fleet.client.responses.create(model=fleet.model, input="a " * 1500, max_output_tokens=4)
    assert too_long.value.code == "context_length_exceeded"
    assert too_long.value.body["param"] == "input", too_long.value.body  # type: ignore[index]
    assert "in the messages, 4 in the completion). Please reduce the length of the messages" in str(too_long.value)


def test_raw_events_are_named_and_the_stream_has_no_done_marker(fleet: Fleet) -> None:  # noqa: F811
    # OpenAI's Responses stream names each event (``event:`` line, the data's ``type``) and ends without
    # chat's ``[DONE]``.
    raw = fleet.client.responses.with_raw_response.create(
        model=fleet.model, input="hi", max_output_tokens=3, temperature=0, stream=True
    )
    lines = raw.http_response.read().decode().splitlines()
    names = [line.removeprefix("event: ") for line in lines if line.startswith("event: ")]
    data = [json.loads(line.removeprefix("data: ")) for line in lines if line.startswith("data: ")]
    assert names == [d["type"] for d in data] and names[0] == "response.created"
    assert raw.headers["x-request-id"] == job_of(data[0]["response"]["id"])


def test_request_mapping_to_a_chat_job() -> None:
    body = {
        "model": "m",
        "instructions": "Be brief.",
        "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]},
            {"role": "assistant", "content": [{"type": "output_text", "text": "c", "annotations": []}]},
            {"role": "developer", "content": "d"},
        ],
        "max_output_tokens": 5,
        "top_p": 0.5,
        "store": True,
        "tools": [],
    }
    spec = parse_responses_request(body, default_max_tokens=100, timeout_s=30, random_seed=9)
    assert spec.fields["messages"] == [  # text parts joined as the chat endpoint joins them (schemas.chat_content)
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": "c"},
        {"role": "system", "content": "d"},
    ]
    assert spec.fields["max_tokens"] == 5 and spec.fields["top_p"] == 0.5 and spec.fields["seed"] == 9
    assert spec.job_id.startswith("resp-") and spec.response_id == "resp_" + spec.job_id[5:]
    assert parse_responses_request({"model": "m", "input": "x"}, default_max_tokens=100, timeout_s=30).fields[
        "messages"
    ] == [{"role": "user", "content": "x"}]
    with pytest.raises(ApiError) as bad:
        parse_responses_request(
            {"model": "m", "input": "x", "max_output_tokens": "many"}, default_max_tokens=1, timeout_s=1
        )
    assert bad.value.param == "max_output_tokens" and bad.value.message.startswith("max_output_tokens:")
    replayed = [{"role": "assistant", "content": "x", "phase": "final_answer"}, {"role": "user", "content": "y"}]
    assert (
        len(
            parse_responses_request({"model": "m", "input": replayed}, default_max_tokens=1, timeout_s=1).fields[
                "messages"
            ]
        )
        == 2
    )  # OpenAI asks clients to resend an assistant item's phase: accepted, not a 400
    with pytest.raises(ApiError) as missing:
        parse_responses_request({"model": "m"}, default_max_tokens=1, timeout_s=1)
    assert missing.value.param == "input"
    # A failure after the stream started is OpenAI's error event, numbered after what came before.
    events = ResponseEvents(spec)
    opening = events.opening()
    failure = events.error(ApiError(504, "too slow", type="server_error", code="timeout"))
    assert failure == {
        "type": "error",
        "sequence_number": len(opening),
        "code": "timeout",
        "message": "too slow",
        "param": None,
    }


def test_errors_name_the_responses_fields() -> None:
    """A chat reader's error names the field the Responses request holds: ``max_output_tokens`` where the chat
    job says ``max_completion_tokens``, and ``input[i]`` where it says ``messages[j]`` (one less after
    ``instructions``, which became the first message)."""
    with pytest.raises(ApiError) as conflict:
        parse_responses_request(
            {"model": "m", "input": "x", "max_output_tokens": 5, "min_tokens": 9}, default_max_tokens=1, timeout_s=1
        )
    assert conflict.value.param == "min_tokens"
    assert conflict.value.message == "min_tokens: must be at most max_output_tokens (5), got 9"
    assert responses_names("messages[2].content: too long", instructions=True) == "input[1].content: too long"
    assert responses_names("messages[0].content", instructions=True) == "instructions"
    assert responses_names("messages[0]; max_tokens", instructions=False) == "input[0]; max_output_tokens"
    assert responses_names("messages: required") == "input: required"


@pytest.mark.parametrize("finish", ["stop", "length"])
def test_every_shape_parses_strictly_as_the_sdks_types(finish: Literal["stop", "length"]) -> None:
    """The answer and every streamed event, validated by the SDK's own pydantic types with no extra or missing
    field tolerated where it requires one (a strict client raises on a missing required field, such as
    ``usage.input_tokens_details.cache_write_tokens``): the server tests' default client would not notice."""
    from openai.types.responses import Response, ResponseStreamEvent
    from pydantic import TypeAdapter

    from ops.gateway.responses_api import response_body
    from schemas.jobs import Choice, Timings, Usage

    spec = parse_responses_request({"model": "m", "input": "x"}, default_max_tokens=4, timeout_s=30)
    final = FinalEvent(
        id=spec.job_id,
        attempt=1,
        choices=[Choice(index=0, text="ab", token_ids=[1, 2], finish_reason=finish)],
        usage=Usage(prompt_tokens=3, completion_tokens=2, cached_tokens=1),
        timings=Timings(queued_s=0.0, ttft_s=0.01, total_s=0.02),
        worker="w",
    )
    answer = Response.model_validate(response_body(spec, final), strict=True)
    assert answer.output_text == "ab" and answer.usage is not None and answer.usage.total_tokens == 5
    assert answer.status == ("incomplete" if finish == "length" else "completed")
    message = answer.output[0]
    assert isinstance(message, ResponseOutputMessage) and message.status == answer.status
    events = ResponseEvents(spec)
    streamed = [*events.opening(), events.delta("a"), events.delta("b"), *events.closing(final)]
    adapter: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)
    parsed = [adapter.validate_python(event, strict=True) for event in streamed]
    assert [event.sequence_number for event in parsed] == list(range(len(streamed)))
    assert parsed[-1].type == f"response.{answer.status}" and parsed[-1].response.output_text == "ab"
