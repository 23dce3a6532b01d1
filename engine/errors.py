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
