"""Incremental detokenization with stop strings, for streaming one sample's text as tokens arrive.

Two separate hold-backs make streamed text safe:

1. Token level (vLLM's ``prefix_offset`` / ``read_offset`` scheme). Byte-level BPE splits emoji and CJK
   characters across tokens, so decoding the newest tokens alone yields U+FFFD. Each call decodes only
   a short window of ids: ``ids[prefix_offset:]``, where ``ids[prefix_offset:read_offset]`` is already
   released context. The new text is the window's text beyond the context's text; if it ends in U+FFFD
   (an incomplete character), nothing is released and the offsets stay put until later tokens complete
   it. Decoding with some context also keeps position-dependent decoders (sentencepiece's leading-space
   stripping) from eating the space of each new token. Each call costs O(window), not O(output).
2. Text level. A stop string may span several tokens, so the last ``max(len(stop)) - 1`` characters
   are held back: a prefix of a stop string is never streamed and then found to be part of one. Any
   stop-string occurrence starts inside this held-back tail, so only the tail is searched.

``min_tokens`` (vLLM's v1 detokenizer): a stop string counts only once the output has more than
``min_tokens`` tokens, and only where it ends in text that came after the ``min_tokens``-th token, so a
stop string inside the first ``min_tokens`` tokens' text never ends the output.
"""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

# vLLM's choice: enough prompt tokens to give the first output tokens their context.
_CONTEXT_TOKENS = 5
_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Streams the text of one sample: ``add_tokens`` per step, ``flush`` when it ends without a stop.

    Invariants: the concatenation of everything returned by ``add_tokens`` and ``flush`` equals
    ``text``; without a stop string hit, the final ``text`` equals ``tokenizer.decode(output_ids)``
    (for tokenizers whose decoding is context-free, such as byte-level BPE); with a hit, ``text`` ends
    right before the earliest stop string (right after it with ``include_stop_str``) and ``stopped`` is
    True. Tokenization-space clean-up is never applied, because it is not incremental (it would rewrite
    text that was already streamed).
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_token_ids: list[int],
        stop: list[str],
        skip_special_tokens: bool = True,
        min_tokens: int = 0,
        include_stop_str: bool = False,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._stop = list(stop)
        # Kept with include_stop_str too (vLLM streams it at once there): the search below reads only
        # the held-back tail and the new text, and a stop string spanning tokens starts in that tail.
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self._min_tokens = min_tokens
        self._include_stop = include_stop_str
        self._num_tokens = 0  # output tokens taken so far
        self._released = 0  # len(text)
        # Offset in the output text (released + pending) a stop string must end past to count: the
        # text of the first min_tokens tokens is exempt.
        self._check_from = 0
        context = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        # A prompt ending mid-character would merge with the first output bytes; decode standalone then.
        if context and self._decode(context).endswith(_REPLACEMENT):
            context = []
        self._ids: list[int] = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._pending = ""  # decoded but not yet released (the stop-string hold-back)
        self._parts: list[str] = []
        self._text_cache: str | None = ""
        self.stopped = False
        self.stop_string: str | None = None  # the stop string that ended the text (vLLM's stop_reason)

    @property
    def text(self) -> str:
        """All text released so far."""
        if self._text_cache is None:
            self._text_cache = "".join(self._parts)
        return self._text_cache

    @property
    def decoded_length(self) -> int:
        """Characters decoded so far, released or held back for a stop string: where the text of the next
        token starts in the sample's text (a token that ends in a partial character has its text start here
        too, though the character comes out with a later token)."""
        return self._released + len(self._pending)

    def add_tokens(self, new_token_ids: list[int]) -> str:
        """Take newly generated tokens; return the text that can be released now (maybe "")."""
        if self.stopped or not new_token_ids:
            return ""
        # The tokens up to min_tokens and those after it are taken apart: only the latter's text is
        # searched for stop strings (a chunk spanning the boundary comes from speculative decoding).
        exempt = max(0, min(self._min_tokens - self._num_tokens, len(new_token_ids)))
        out = ""
        if exempt:
            out = self._take(new_token_ids[:exempt])
        if exempt < len(new_token_ids):
            out += self._take(new_token_ids[exempt:])
        return out

    def _take(self, new_token_ids: list[int]) -> str:
        self._ids.extend(new_token_ids)
        self._num_tokens += len(new_token_ids)
        out = self._release(self._decode_new(final=False), final=False)
        if self._num_tokens <= self._min_tokens:
            self._check_from = self._released + len(self._pending)
        return out

    def flush(self) -> str:
        """Release everything still held back (the sequence ended for a reason other than a stop string).

        A stop string can still be found here (e.g. one containing U+FFFD), so check ``stopped`` after.
        """
        if self.stopped:
            return ""
        return self._release(self._decode_new(final=True), final=True)

    def _decode(self, ids: list[int]) -> str:
        text = self._tokenizer.decode(ids, skip_special_tokens=self._skip_special, clean_up_tokenization_spaces=False)
        assert isinstance(text, str)  # a flat id list decodes to one string
        return text

    def _decode_new(self, final: bool) -> str:
        """The text the tokens since ``read_offset`` add, or "" while it ends in an incomplete character."""
        if self._read_offset == len(self._ids):
            return ""
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        if not final and (len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT)):
            return ""
        # Ids before the new prefix are never decoded again: drop them so memory stays O(window) too.
        del self._ids[: self._read_offset]
        self._prefix_offset, self._read_offset = 0, len(self._ids)
        return new_text[len(prefix_text) :]

    def _release(self, new_text: str, final: bool) -> str:
        """Append ``new_text`` to the held-back tail, cut at a stop string, release what is safe."""
        pending = self._pending + new_text
        cut, self.stop_string = self._find_stop(pending) if self._num_tokens > self._min_tokens else (-1, None)
        if cut >= 0:
            self.stopped = True
            out, self._pending = pending[:cut], ""
        else:
            keep = 0 if final else min(self._hold, len(pending))
            out, self._pending = pending[: len(pending) - keep], pending[len(pending) - keep :]
        if out:
            self._parts.append(out)
            self._text_cache = None
            self._released += len(out)
        return out

    def _find_stop(self, pending: str) -> tuple[int, str | None]:
        """Where the text ends at the earliest stop string in ``pending`` that ends past ``_check_from``
        (its start, or its end with include_stop_str), and that string; (-1, None) when there is none."""
        exempt = self._check_from - self._released  # how much of pending belongs to the first min_tokens
        best: tuple[int, str] | None = None
        for stop in self._stop:
            at = pending.find(stop, max(0, exempt - len(stop) + 1))
            if at >= 0 and (best is None or at < best[0]):
                best = (at, stop)
        if best is None:
            return -1, None
        at, stop = best
        return (at + len(stop) if self._include_stop else at), stop
