"""One job's run through the engine: the lifecycle both front doors share.

The Redis-streams worker (:mod:`worker.consumer`) and the engine thread behind Celery and ``pagedq batch
--local`` (:mod:`worker.engine_thread`) differ only in transport: where jobs come from, where events go,
what clock stamps them and what happens on failure (redelivery, or an ``internal`` error). Everything in
between is here, once: turning a job into an engine prompt, starting it with bad input rejected by type,
folding the engine's deltas into choices, and assembling the token, final and error events of wire
protocol v1, so a job ends with the same JSON whichever door it came through.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from engine.errors import PromptTooLongError
from engine.outputs import EngineStats, RequestDelta
from schemas.jobs import (
    ErrorCode,
    ErrorEvent,
    FinalEvent,
    FinishReason,
    InvalidJob,
    JobRequest,
    Timings,
    TokenEvent,
    Usage,
    finite_or_none,
)
from schemas.sampling import SamplingParams
from worker.choices import ChoiceState, final_choices


class EngineLike(Protocol):
    """What the front doors need of ``engine.Engine`` (a protocol, so a test may wrap or replace it)."""

    tokenizer: Any
    max_model_len: int

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        priority: int = 0,
        *,
        strict_max_tokens: bool = False,
    ) -> None: ...
    def chat_prompt_ids(self, messages: list[dict[str, str]]) -> list[int]: ...
    def step(self) -> list[RequestDelta]: ...
    def abort(self, request_id: str) -> bool: ...
    def has_unfinished(self) -> bool: ...
    def num_waiting(self) -> int: ...
    def num_running(self) -> int: ...
    def stats(self) -> EngineStats: ...


def engine_prompt(engine: EngineLike, job: JobRequest) -> str | list[int]:
    """Text, token ids, or chat messages through the model's chat template. A template that refuses the
    messages (no template, roles that must alternate...) is the job's fault: :class:`InvalidJob`."""
    if job.prompt is not None:
        return job.prompt
    if job.prompt_token_ids is not None:
        return list(job.prompt_token_ids)  # the engine checks them against the vocabulary
    assert job.messages is not None
    try:
        return list(engine.chat_prompt_ids([m.model_dump() for m in job.messages]))
    except Exception as exc:
        raise InvalidJob(f"messages: {exc}") from exc


@dataclass(eq=False, kw_only=True)
class JobRun:
    """One attempt of a job in the engine, from start to its terminal event.

    Times are on the front door's clock: the Redis server's for the queue worker (``enqueued_at`` is the
    stream entry's time), the process's for the engine thread (``enqueued_at`` is the submit time).
    """

    request: JobRequest
    attempt: int
    enqueued_at: float
    request_id: str = ""  # the engine's request id while in the engine
    started_at: float | None = None
    first_token_at: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    choices: dict[int, ChoiceState] = field(default_factory=dict)

    @property
    def id(self) -> str:
        return self.request.id

    @property
    def deadline(self) -> float | None:
        timeout = self.request.timeout_s
        return None if timeout is None else self.enqueued_at + timeout

    @property
    def produced(self) -> bool:
        """Whether this attempt has produced a token (it then ends ``final``, whatever stops it)."""
        return self.first_token_at is not None

    def start(
        self,
        engine: EngineLike,
        request_id: str,
        *,
        max_num_seqs: int | None,
        now: float,
        owner: str,
        max_result_bytes: int | None = None,
    ) -> None:
        """Add the job to ``engine`` as ``request_id``.

        Bad input raises :class:`InvalidJob` with its wire code (``prompt_too_long`` for a prompt the
        model's context cannot hold, ``invalid_request`` for anything the engine refuses as a value);
        any other exception is the engine's own failure and propagates for the caller's policy.
        A job with more choices than ``max_num_seqs`` (None: no limit) could never be scheduled and is
        refused; ``owner`` names what that limit belongs to in the message ("worker", "engine"). So is a job
        whose result could grow past ``max_result_bytes`` (None: no limit).
        """
        try:
            prompt = engine_prompt(engine, self.request)
            params = self.request.sampling_params()
            n = self.request.n or 1
            if max_num_seqs is not None and n > max_num_seqs:
                raise InvalidJob(f"n={n} is larger than this {owner}'s max_num_seqs={max_num_seqs}")
            if max_result_bytes is not None:
                bound = self.request.result_bytes_bound(engine.max_model_len)
                if bound > max_result_bytes:
                    raise InvalidJob(
                        f"n x max_tokens x (1 + logprobs) could make a result of {bound / 2**20:.1f} MiB, more "
                        f"than this {owner}'s max_result_bytes={max_result_bytes / 2**20:.1f} MiB: lower "
                        "max_tokens, n or logprobs"
                    )
            engine.add_request(
                request_id,
                prompt,
                params,
                priority=self.request.priority,
                strict_max_tokens=bool(self.request.strict_max_tokens),
            )
        except InvalidJob:
            raise
        except PromptTooLongError as exc:
            raise InvalidJob(str(exc), "prompt_too_long") from exc
        except (ValueError, TypeError) as exc:
            raise InvalidJob(str(exc)) from exc
        self.request_id = request_id
        self.started_at = now

    def apply(self, delta: RequestDelta, now: float) -> None:
        """Fold one step's output of this job into its choices (``now`` stamps the first token)."""
        self.prompt_tokens = len(delta.prompt_token_ids)
        self.cached_tokens = delta.num_cached_tokens
        for out in delta.outputs:
            if (out.text or out.token_ids) and self.first_token_at is None:
                self.first_token_at = now
            self.choices.setdefault(out.index, ChoiceState()).add(out)

    def take_token_events(self) -> list[TokenEvent]:
        """One ``token`` event per choice with output not yet published (coalesced), in choice order; with
        logprobs asked, each carries the logprobs of its tokens (as the final event will, in the same order)."""
        with_logprobs = self.request.logprobs is not None
        events = []
        for index, choice in sorted(self.choices.items()):
            if not choice.pending_text and not choice.pending_ids:
                continue
            text = "".join(choice.pending_text)
            events.append(
                TokenEvent(
                    id=self.id,
                    attempt=self.attempt,
                    index=index,
                    text=text,
                    token_ids=choice.pending_ids,
                    logprobs=choice.pending_logprobs if with_logprobs else None,
                    text_offsets=choice.pending_text_offsets if with_logprobs else None,
                )
            )
            choice.pending_text = []
            choice.pending_ids = []
            choice.pending_logprobs = []
            choice.pending_text_offsets = []
        return events

    def has_pending_tokens(self) -> bool:
        return any(c.pending_text or c.pending_ids for c in self.choices.values())

    def timings(self, now: float) -> Timings:
        start = self.started_at if self.started_at is not None else now
        ttft = None if self.first_token_at is None else self.first_token_at - self.enqueued_at
        return Timings(
            queued_s=finite_or_none(max(0.0, start - self.enqueued_at)) or 0.0,
            ttft_s=finite_or_none(ttft),
            total_s=finite_or_none(max(0.0, now - self.enqueued_at)) or 0.0,
        )

    def final_event(self, stop_reason: FinishReason | None, now: float, worker: str) -> FinalEvent:
        """The ``final`` event: every choice, usage and timings. ``stop_reason`` is the job's own ending
        (cancelled, deadline) for choices the engine did not end itself."""
        choices = final_choices(self.choices, self.request.n or 1, stop_reason, self.request.logprobs is not None)
        completion = sum(len(c.token_ids) for c in choices)
        return FinalEvent(
            id=self.id,
            attempt=self.attempt,
            choices=choices,
            usage=Usage(
                prompt_tokens=self.prompt_tokens, completion_tokens=completion, cached_tokens=self.cached_tokens
            ),
            timings=self.timings(now),
            metadata=self.request.metadata,
            worker=worker,
        )

    def error_event(self, code: ErrorCode, message: str, worker: str) -> ErrorEvent:
        return ErrorEvent(
            id=self.id, attempt=self.attempt, code=code, message=message, metadata=self.request.metadata, worker=worker
        )

    def stopped_event(self, reason: FinishReason, now: float, worker: str) -> FinalEvent | ErrorEvent:
        """The terminal event of a job stopped from outside (cancelled, deadline): ``final`` with its
        partial text if this attempt produced tokens, else the matching error."""
        if self.produced:
            return self.final_event(reason, now, worker)
        if reason == "cancelled":
            return self.error_event("cancelled", "cancelled before it produced a token", worker)
        timeout = self.request.timeout_s
        return self.error_event("deadline_exceeded", f"deadline of {timeout}s passed before the first token", worker)

    def reset(self, attempt: int) -> None:
        """Forget a failed attempt's output before running the job again."""
        self.attempt = attempt
        self.request_id = ""
        self.started_at = self.first_token_at = None
        self.choices.clear()


Run = TypeVar("Run", bound=JobRun)


def apply_deltas(deltas: list[RequestDelta], runs: Mapping[str, Run], now: float) -> Iterator[tuple[Run, RequestDelta]]:
    """Fold a step's deltas into the runs they belong to (by engine request id), yielding each run with its
    delta for the front door's own follow-up (stream, end). Deltas of runs no longer held are dropped."""
    for delta in deltas:
        run = runs.get(delta.request_id)
        if run is None:
            continue
        run.apply(delta, now)
        yield run, delta
