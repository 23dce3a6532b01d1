"""A chat message's ``content`` as the text a chat template takes: one rule for every door.

The gateway and ``pagedq batch`` (``ops/openai_request.py``) and the offline ``LLM.chat`` (``engine``) read
OpenAI's content parts the same way; it lives here, below both, because the gateway never imports the
engine (it would load torch).
"""

from __future__ import annotations


class ContentError(ValueError):
    """A content that is not text; ``where`` says which (``messages[0].content``)."""

    def __init__(self, message: str, where: str) -> None:
        super().__init__(message)
        self.where = where


def text_content(content: object, where: str) -> str:
    """A string as it is, or OpenAI's list of content parts with the text of its text parts joined by
    newlines (what vLLM does for a text-only model); other parts (images, audio) are refused, not dropped."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ContentError(f"{where}: pagedq supports text content parts only, got {kind!r}", where)
            texts.append(part["text"])
        return "\n".join(texts)
    raise ContentError(f"{where}: must be a string or a list of text parts, got {type(content).__name__}", where)
