"""Draft tokens for speculative decoding by prompt lookup (n-gram matching), as vLLM's ``ngram`` method.

Why: a decode step with few sequences streams every weight of the model for a handful of rows, so
its cost hardly depends on how many tokens each sequence brings. If the text about to be generated
already occurs in the context (a quoted passage, a list being continued, a small model repeating
itself), the tokens that followed the latest occurrence of the last ``n`` tokens are a cheap guess
at the next ones; the model checks all of them in one forward and keeps the longest prefix it
agrees with, plus its own next token. Greedy output is unchanged, only reached in fewer steps.

Lookups are O(``max_n``) per proposal: each sequence keeps a dict from n-gram to where its latest
occurrence was followed, updated as tokens are appended, instead of rescanning its context every
step.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class NgramIndex:
    """For n in [min_n, max_n]: each n-gram of a token list -> start of what followed its latest
    occurrence. Only n-grams with a successor are indexed, so the list's own suffix never matches
    itself."""

    min_n: int
    max_n: int
    num_indexed: int = 0  # tokens whose predecessors' n-grams are in the index
    table: dict[tuple[int, ...], int] = field(default_factory=dict)

    def update(self, tokens: list[int]) -> None:
        """Index the n-grams that gained a successor since the last call (``tokens`` only grows)."""
        table = self.table
        for end in range(max(self.num_indexed, 1), len(tokens)):  # ``end``: the successor's position
            for n in range(self.min_n, min(self.max_n, end) + 1):
                table[tuple(tokens[end - n : end])] = end
        self.num_indexed = len(tokens)

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """``k`` tokens that followed the latest earlier occurrence of the longest matching suffix.

        The suffix recurring ``period`` tokens back says the text repeats with that period; where the
        continuation runs into the end of ``tokens`` (a period under ``k``: a loop) it goes on with the
        drafts' own first tokens rather than stopping short. Greedy decoding of a small model falls into
        such loops, where a draft cut at the loop's length (often 1-3 tokens) leaves most of the step's
        verification positions unused."""
        if k <= 0:
            return []
        self.update(tokens)
        for n in range(min(self.max_n, len(tokens)), self.min_n - 1, -1):
            start = self.table.get(tuple(tokens[-n:]))
            if start is not None:
                drafts = tokens[start : start + k]
                period = len(tokens) - start  # >= 1: only n-grams with a successor are indexed
                while drafts and len(drafts) < k:
                    drafts.append(drafts[len(drafts) - period])
                return drafts
        return []
