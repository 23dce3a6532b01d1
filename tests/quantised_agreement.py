"""How close a quantised tiny model stays to its float self: shared by the int8 and W8A8 tests."""

from __future__ import annotations

import torch

from engine import LLM
from engine.perplexity import perplexity
from schemas.sampling import SamplingParams


def agreement_and_perplexities(reference: LLM, candidate: LLM, seed: int = 0) -> tuple[float, float, float]:
    """``(share of 48 random prompts whose greedy next token agrees, reference perplexity, candidate's)`` on
    a random 600-token text: a random-weight model has thin argmax gaps, so these are the measures, not
    exactness."""
    g = torch.Generator().manual_seed(seed)
    prompts: list[list[int]] = [torch.randint(3, 500, (12,), generator=g).tolist() for _ in range(48)]
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    first = [o.outputs[0].token_ids for o in reference.generate(prompts, params)]
    second = [o.outputs[0].token_ids for o in candidate.generate(prompts, params)]
    agreement = sum(a == b for a, b in zip(first, second, strict=True)) / len(prompts)
    text: list[int] = torch.randint(3, 500, (600,), generator=g).tolist()
    return agreement, perplexity(reference.engine, text, 200), perplexity(candidate.engine, text, 200)
