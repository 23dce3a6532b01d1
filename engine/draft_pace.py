"""Which sequences may draft once a batch is past the draft limit: those whose drafts keep coming true.

Why: below ``EngineConfig.draft_batch_limit`` a step's matmuls are bound by streaming the weights, and
a draft position rides along nearly free, so every greedy sequence drafts. Past it they are bound by
arithmetic, and a draft position costs what a generated token costs: a rejected one is a token's work
thrown away. Yet a sequence in a loop (greedy decoding of a small model falls into them; the compass
workload is full of them) has nearly every draft accepted, and its drafts still save what a token costs
beyond its matmul rows: a read of its whole K/V per layer, and a share of the step's fixed work. On a
2-vCPU AMD EPYC Zen 4, bf16, the compass workload (64 sequences, 87 % of drafts accepted) ran 432 tok/s
with drafts for all 64 and 382 with none past 32, while ``mixed`` (128 sequences of real text, 52 %
accepted) ran 333 and 378: an all-or-nothing limit loses one or the other.

So past the limit a sequence drafts only while it is *trusted*: its last drafted step had every draft
accepted, or, having not drafted lately, the first token its proposer offered came true on each of
its last :data:`SHADOW_HITS_TO_TRUST` steps. Those shadow proposals cost a dictionary lookup and no
row of the model. One rejected draft ends the trust; the shadow streak then has to be earned again.

Measured there (in one process, interleaved rounds, prefix caching off, best of 2, tok/s; limit 32 hard
-> paced -> 128 hard): bf16 compass 370.8 -> 419.2 -> 405.4 (drafts 1605 -> 7868 -> 8289, 85-88 %
accepted), bf16 mixed 369.9 -> 367.7 -> 336.3 (drafts 2398 -> 4004 -> 7573; accepted 86 %, 80 %, 51 %);
fp32 compass 229.4 -> 247.5, fp32 mixed 230.6 -> 227.5 (walls 33.8-34.7 s against 34.3-36.6 s: the
host's noise).
"""

from __future__ import annotations

from dataclasses import dataclass

SHADOW_HITS_TO_TRUST = 4  # consecutive steps whose undrafted proposal came true


@dataclass
class DraftPace:
    """One sequence's record of how its drafts, drafted or only proposed, fared."""

    trusted: bool = False  # may draft past the batch limit
    shadow_hits: int = 0  # consecutive steps whose proposed (not drafted) first token was the one sampled
    shadow_token: int | None = None  # this step's proposed first token, when it was not drafted

    def record_drafts(self, num_drafts: int, num_accepted: int) -> None:
        """A verified step: trust follows whether every draft was accepted."""
        self.trusted = num_accepted == num_drafts
        self.shadow_hits = 0
        self.shadow_token = None

    def propose_in_shadow(self, token: int | None) -> None:
        """The step goes on without drafts; ``token`` (None: no proposal) is what a draft would have begun with."""
        self.shadow_token = token

    def record_token(self, token: int) -> None:
        """The token an undrafted step sampled: a hit if the shadow proposal named it."""
        if self.shadow_token is None:
            return
        self.shadow_hits = self.shadow_hits + 1 if token == self.shadow_token else 0
        self.shadow_token = None
        if self.shadow_hits >= SHADOW_HITS_TO_TRUST:
            self.trusted = True
