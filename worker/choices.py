"""Accumulating one job's engine deltas into the wire protocol's ``choices``.

Shared by the Redis-streams worker (``worker.consumer``) and the Celery engine thread
(``worker.engine_thread``), so both front doors end a job with the same final event.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.outputs import CompletionDelta
from schemas.jobs import Choice, FinishReason, Logprob, TopLogprob


@dataclass
class ChoiceState:
    """One sample's output so far; ``pending_*`` is what has not been published as token events yet.

    ``pending_ids`` holds every token the engine produced since the last event, held-back text or not (the
    detokenizer holds back text, never token ids), and ``pending_logprobs`` their logprobs, one each, in
    the same order (empty when the job asked for none)."""

    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[Logprob] = field(default_factory=list)
    finish_reason: str | None = None
    pending_text: list[str] = field(default_factory=list)
    pending_ids: list[int] = field(default_factory=list)
    pending_logprobs: list[Logprob] = field(default_factory=list)
    pending_text_offsets: list[int] = field(default_factory=list)  # with logprobs: one per pending token

    def add(self, out: CompletionDelta) -> None:
        self.text.append(out.text)
        self.token_ids.extend(out.token_ids)
        self.pending_text.append(out.text)
        self.pending_ids.extend(out.token_ids)
        for lp in out.logprobs or ():
            top = [TopLogprob(token_id=t, logprob=p) for t, p in lp.top]
            logprob = Logprob(token_id=lp.token_id, logprob=lp.logprob, top=top)
            self.logprobs.append(logprob)
            self.pending_logprobs.append(logprob)
        self.pending_text_offsets.extend(out.text_offsets or ())
        if out.finish_reason:
            self.finish_reason = out.finish_reason


def final_choices(
    choices: dict[int, ChoiceState], n: int, stop_reason: FinishReason | None, with_logprobs: bool
) -> list[Choice]:
    """The ``n`` choices of a final event. A sample the engine did not end itself ("abort", or never
    started) takes the job's reason: cancelled, deadline, or stop."""
    out = []
    for index in range(n):
        ch = choices.get(index, ChoiceState())
        reason = ch.finish_reason
        if reason not in ("stop", "length"):
            reason = stop_reason or ("cancelled" if reason == "abort" else "stop")
        out.append(
            Choice(
                index=index,
                text="".join(ch.text),
                token_ids=ch.token_ids,
                finish_reason=reason,  # type: ignore[arg-type]
                logprobs=ch.logprobs if with_logprobs else None,
            )
        )
    return out
