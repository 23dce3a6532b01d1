"""Cumulative statistics of the engine's steps, recorded by the engine itself (vLLM's iteration stats).

A benchmark or profiler that wants to know where a step's time goes reads these instead of replacing
the engine's methods to find out. ``Engine.step`` brackets each phase with ``time.perf_counter``: a few
calls per step, plus one pair per appended token around the detokenizer call, which is well under 1 % of
a step even for a tiny model. The counters are plain attributes, read them at any time and ``reset()``
them between measurements.

Block fill (how many of the allocated KV slots hold computed tokens) walks every running sequence's block
table, so it is measured only while ``track_block_fill`` is set, and its own time is kept in
``block_fill_s``, outside ``step_s``, so that a caller can take it out of the wall time it reports.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

PHASES = ("schedule", "prepare_inputs", "forward", "sample", "append_tokens", "detokenize")
"""The timed phases of a step, in order; ``detokenize`` happens inside ``append_tokens``."""

# Block fill is measured at every new peak of KV usage and, for its mean, every this many steps.
BLOCK_FILL_EVERY_STEPS = 8


@dataclass
class StepStats:
    """Counters since the engine started or since the last :meth:`reset`; times in seconds.

    The phases of ``step_s`` (``phase_s``) are ``schedule``, ``prepare_inputs``, ``forward`` (the model,
    logits included), ``sample`` and ``append_tokens`` (appending the sampled tokens: detokenizing, stop
    checks, accepting drafts); what is left is :attr:`other_s` (fork bookkeeping, drafting, deltas).
    """

    steps: int = 0  # steps that ran a batch (a step with nothing scheduled is timed, not counted)
    scheduled_tokens: int = 0  # tokens through the model: prompt chunks, decode tokens, drafts
    scheduled_seqs: int = 0  # sequences summed over steps
    decode_only_steps: int = 0  # steps in which every sequence was decoding one token
    step_s: float = 0.0
    # Seconds per phase of step_s (PHASES); detokenize is part of append_tokens.
    phase_s: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    peak_kv_usage: float = 0.0  # highest fraction of KV blocks held by live sequences after a step
    # Block fill, only while tracked: filled / allocated slots at the usage peak, and summed over samples.
    track_block_fill: bool = False
    block_fill_at_peak: float = 0.0
    filled_slots: int = 0
    allocated_slots: int = 0
    block_fill_s: float = 0.0  # time spent measuring block fill, not part of step_s

    def reset(self) -> None:
        """Zero every counter; ``track_block_fill`` stays as it was set."""
        track = self.track_block_fill
        fresh = StepStats()
        for spec in fields(self):
            setattr(self, spec.name, getattr(fresh, spec.name))
        self.track_block_fill = track

    def record_batch(self, num_tokens: int, num_seqs: int) -> None:
        self.steps += 1
        self.scheduled_tokens += num_tokens
        self.scheduled_seqs += num_seqs
        if num_tokens == num_seqs:
            self.decode_only_steps += 1

    def record_block_fill(self, filled: int, allocated: int, at_peak: bool) -> None:
        if at_peak:
            self.block_fill_at_peak = filled / allocated if allocated else 0.0
        self.filled_slots += filled
        self.allocated_slots += allocated

    @property
    def stop_checks_s(self) -> float:
        """Appending tokens other than detokenizing: stop and length checks, finishing, draft acceptance."""
        return max(0.0, self.phase_s["append_tokens"] - self.phase_s["detokenize"])

    @property
    def other_s(self) -> float:
        """Step time outside the named phases."""
        named = sum(seconds for phase, seconds in self.phase_s.items() if phase != "detokenize")
        return max(0.0, self.step_s - named)

    @property
    def mean_block_fill(self) -> float:
        return self.filled_slots / self.allocated_slots if self.allocated_slots else 0.0
