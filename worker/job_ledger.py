"""The account of every job a worker ends: its counters, the one canonical log line, and the metrics.

Each ended job is logged once, as ``job.finished``, with everything an operator asks about it (outcome,
reason, tokens, timings, and prompt and outputs only where ``log_prompts`` asks), and counted once, so the
heartbeat's ``jobs_*`` counters and ``/metrics`` agree with the logs.

Every terminal outcome goes through here, rejections included: a payload that is not a job (not JSON, wrong
types, an entry id in the future, a prompt too long for the model) ends as an ``error`` with its code and a
dead letter, exactly as a job that ran out of attempts does. Counting only the jobs that reached the
engine would make ``pagedq_jobs_total`` fall short of the jobs submitted by precisely the ones an
operator most needs to see, and ``pagedq_dead_letters_total`` disagree with the dead-letter stream.
"""

from __future__ import annotations

from typing import Any

from schemas.jobs import ErrorEvent, FinalEvent, JobRequest
from worker.metrics import COMPLETED_REASONS, WorkerMetrics

COUNTERS = ("final", "error", "duplicate", "lost")


def job_finish_reason(event: FinalEvent) -> str | None:
    """The finish reason of a whole ``final`` job: the first choice's that did not complete (``cancelled``,
    ``deadline``), else the first choice's.

    Why not simply the first choice's: a job with ``n`` > 1 cancelled after its first sample hit a stop token
    has ``stop`` there and ``cancelled`` after it, and its timings end at the cancel. Labelled ``stop``, it
    would enter the latency histograms as if it had completed (see :data:`~worker.metrics.COMPLETED_REASONS`)."""
    reasons = [choice.finish_reason for choice in event.choices]
    return next((r for r in reasons if r not in COMPLETED_REASONS), reasons[0] if reasons else None)


class JobLedger:
    """Job counters (``final``, ``error``, ``duplicate``, ``lost``) and the per-job record."""

    def __init__(self, *, log_prompts: bool) -> None:
        self.log_prompts = log_prompts
        self.counts: dict[str, int] = dict.fromkeys(COUNTERS, 0)
        self.tokens_generated = 0  # output tokens the engine produced for this worker's jobs, since start
        self.metrics: WorkerMetrics | None = None  # set when the metrics port is on

    def delivery(self, attempt: int) -> None:
        """A job was delivered (or is being run again as ``attempt``)."""
        if self.metrics is not None:
            self.metrics.delivery(attempt)

    def rejected(self, code: str | None = None) -> None:
        """A payload that could not be run was answered (when its id could be read) and dead-lettered:
        an ``error`` outcome with its error ``code`` (``unknown`` when the caller does not say), and a
        dead letter."""
        self.counts["error"] += 1
        if self.metrics is not None:
            self.metrics.job_finished(outcome="error", reason=code, dead_lettered=True)

    def ended(self, log: Any, request: JobRequest, event: FinalEvent | ErrorEvent, *, dead_lettered: bool) -> None:
        """A job's terminal event was queued: count it, log it, measure it."""
        if isinstance(event, ErrorEvent):
            self.counts["error"] += 1
            log.info(
                "job.finished", outcome="error", code=event.code, message=event.message, dead_lettered=dead_lettered
            )
            if self.metrics is not None:
                self.metrics.job_finished(outcome="error", reason=event.code, dead_lettered=dead_lettered)
            return
        self.counts["final"] += 1
        reason = job_finish_reason(event)
        usage, timings = event.usage, event.timings
        gen_s = timings.total_s - (timings.ttft_s if timings.ttft_s is not None else timings.total_s)
        log.info(
            "job.finished",
            outcome="final",
            finish_reason=reason,
            prompt_tokens=usage.prompt_tokens,
            completion_tokens=usage.completion_tokens,
            cached_tokens=usage.cached_tokens,
            tok_s=round(usage.completion_tokens / gen_s, 2) if gen_s > 0 else None,
            **timings.model_dump(),
            **self._user_text(request, event),
        )
        if self.metrics is not None:
            self.metrics.job_finished(
                outcome="final",
                reason=reason,
                prompt_tokens=usage.prompt_tokens,
                completion_tokens=usage.completion_tokens,
                **timings.model_dump(),
            )

    def _user_text(self, request: JobRequest, event: FinalEvent) -> dict[str, Any]:
        """Prompt and outputs for the canonical log line, only where ``log_prompts`` asks for them."""
        if not self.log_prompts:
            return {}
        prompt = request.prompt if request.prompt is not None else (request.messages or request.prompt_token_ids)
        return {"prompt": prompt, "outputs": [c.text for c in event.choices]}
