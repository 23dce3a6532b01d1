"""Exponential backoff with jitter: the one retry schedule of every loop that waits out a Redis outage.

The worker loop, its keeper thread, start-up and ``pagedq batch`` all retry Redis the same way: the first
retry comes quickly, each failure doubles the wait up to a cap, and success resets it. Jitter (a factor
drawn from [0.5, 1.5)) keeps a fleet of replicas that lost the same Redis from reconnecting in lockstep.
"""

from __future__ import annotations

import random


class Backoff:
    """Waits for consecutive failures: ``initial_s``, doubling per failure up to ``max_s``.

    ``next_delay()`` returns the wait before the next attempt and doubles the base; ``reset()`` (after a
    success) starts over. Mechanism only: callers sleep, or schedule a retry time, as suits their loop.
    """

    def __init__(self, initial_s: float = 0.1, max_s: float = 5.0, *, jitter: bool = True) -> None:
        if initial_s <= 0 or max_s < initial_s:
            raise ValueError(f"need 0 < initial_s <= max_s, got initial_s={initial_s}, max_s={max_s}")
        self.initial_s = initial_s
        self.max_s = max_s
        self.jitter = jitter
        self.current_s = initial_s

    def next_delay(self) -> float:
        """The wait before the next attempt (jittered when asked), then the base doubles (capped)."""
        delay = self.current_s * (0.5 + random.random()) if self.jitter else self.current_s
        self.current_s = min(self.current_s * 2, self.max_s)
        return delay

    def reset(self) -> None:
        self.current_s = self.initial_s
