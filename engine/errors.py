"""Errors the engine raises at its API boundary; each says what was wrong and what is accepted."""

from __future__ import annotations


class PromptTooLongError(ValueError):
    """The prompt leaves no room for a single generated token within the model's context."""

    def __init__(self, prompt_len: int, max_model_len: int) -> None:
        super().__init__(
            f"prompt is {prompt_len} tokens; the model's context is {max_model_len} tokens "
            f"and at least one must be left for generation"
        )
        self.prompt_len = prompt_len
        self.max_model_len = max_model_len


class RankFailedError(RuntimeError):
    """A tensor-parallel rank died or stopped answering: the engine cannot step again.

    ``engine_fatal`` tells its caller (the worker) that no job is to blame and none can run here any more:
    hand every job back to the queue and exit, so that the supervisor restarts the whole process."""

    engine_fatal = True

    def __init__(self, message: str) -> None:
        super().__init__(message)
