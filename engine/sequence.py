"""One sequence being generated: its tokens, how many of them are in the KV cache, and its blocks.

A request with ``n`` samples becomes ``n`` sequences that share the prompt's KV blocks (forked once
the prompt has been computed). Tokens are kept as one list (prompt then output) so the scheduler can
treat a fresh prompt, a decode step and a recompute after preemption the same way: compute
``token_ids[num_computed_tokens:]``, and sample when nothing is left to compute.
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.detokenizer import IncrementalDetokenizer
from engine.draft_pace import DraftPace
from engine.ngram_proposer import NgramIndex
from engine.outputs import TokenLogprobs
from schemas.sampling import SamplingParams

_arrival_counter = itertools.count()


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    request_id: str
    index: int  # sample index within the request (0..n-1)
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    priority: int
    detokenizer: IncrementalDetokenizer
    generator: torch.Generator | None = None
    arrival: int = field(default_factory=lambda: next(_arrival_counter))
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first admission
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # chained hashes of this sequence's full blocks
    num_committed_blocks: int = 0  # leading blocks already offered to the prefix cache
    logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None
    pending_fork: bool = False  # n > 1: fork the other samples once the prompt has been computed
    # Speculative decoding: draft tokens to verify in the next step (not in token_ids until accepted).
    spec_token_ids: list[int] = field(default_factory=list)
    ngram_index: NgramIndex | None = None
    draft_pace: DraftPace = field(default_factory=DraftPace)  # whether it drafts past the batch limit
    # Structured output: this sample's xgrammar GrammarMatcher (None when unconstrained), advanced by
    # every token appended to it and by nothing else.
    matcher: Any = None
    # Streaming bookkeeping: what has not been handed to the caller yet.
    new_token_ids: list[int] = field(default_factory=list)
    new_text: str = ""
    new_logprobs_from: int = 0
    # With logprobs: where each of new_token_ids' text starts in the sample's text (held-back text included):
    # a stop string holds text back, so a step's text is not its tokens' text.
    new_text_offsets: list[int] = field(default_factory=list)

    @property
    def seq_id(self) -> tuple[str, int]:
        return (self.request_id, self.index)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def is_decoding(self) -> bool:
        """Every token but the last (just sampled) is in the KV cache: the next step is a decode."""
        return self.num_computed_tokens == len(self.token_ids) - 1

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def sort_key(self) -> tuple[int, int]:
        """Scheduling order: higher priority first, then first come first served."""
        return (-self.priority, self.arrival)
