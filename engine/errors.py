"""Errors the engine raises at its API boundary; each says what was wrong and what is accepted."""

from __future__ import annotations


class PromptTooLongError(ValueError):
    """The prompt leaves no room for a single generated token within the model's context, or, when the
    caller asked for its whole ``max_tokens`` to fit (``strict_max_tokens``), not room enough for them.

    The second message is OpenAI's own for the case (code ``context_length_exceeded``), numbers included,
    so a client that parses it keeps working against the gateway."""

    def __init__(self, prompt_len: int, max_model_len: int, max_tokens: int | None = None) -> None:
        if max_tokens is None:
            message = (
                f"prompt is {prompt_len} tokens; the model's context is {max_model_len} tokens "
                f"and at least one must be left for generation"
            )
        else:
            message = (
                f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                f"{prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} in the completion). "
                "Please reduce the length of the prompt or max_tokens."
            )
        super().__init__(message)
        self.prompt_len = prompt_len
        self.max_model_len = max_model_len
        self.max_tokens = max_tokens


class RankFailedError(RuntimeError):
    """A tensor-parallel rank died or stopped answering: the engine cannot step again.

    ``engine_fatal`` tells its caller (the worker) that no job is to blame and none can run here any more:
    hand every job back to the queue and exit, so that the supervisor restarts the whole process."""

    engine_fatal = True

    def __init__(self, message: str) -> None:
        super().__init__(message)
