"""What every system under test agrees to: the shared limits it is given, the result it returns, its interface.

Model loading and a short warm-up (first-call allocations, kernel compilation, thread pools) happen before
the clock starts and are reported separately (``load_s``); the clock covers exactly "hand over every
request, get every token back". Each system is asked for greedy decoding with EOS ignored and each
request's exact output length, and each result is checked: a system that produced the wrong number of tokens
for any request is flagged (``tokens_ok`` false) rather than silently credited with tokens it did not make.
The systems themselves are listed in :mod:`ops.bench.registry`.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ops.bench.workloads import Workload

Log = Callable[[str], None]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
WARMUP_PROMPT = list(range(3, 27))  # ids that no corpus window starts with: no prefix-cache hit later


@dataclass
class BenchContext:
    """Everything every system must agree on so that they do the same work under the same limits."""

    model_path: Path
    device: str
    dtype: str  # float32 | bfloat16 | float16
    threads: int
    seed: int
    max_num_seqs: int
    max_num_batched_tokens: int
    kv_cache_bytes: int | None  # None: each system sizes its cache itself (CUDA)
    block_size: int
    hf_batch_size: int
    work_dir: Path
    num_speculative_tokens: int | None = None  # pagedq: None -> the engine's default
    tensor_parallel_size: int = 1  # pagedq offline systems: the model split over this many ranks
    quantization: str | None = None  # pagedq systems: EngineConfig.quantization ("int8", "w8a8"); others load as given
    redis_stream: bool = False
    request_timeout_s: float = 1800.0
    repeat: int = 1  # rounds of every system on an offline workload; the fastest run of each is reported
    log: Log = print

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]


@dataclass
class SystemResult:
    """One system on one workload. ``outputs`` (token ids per request) stays out of the JSON."""

    system: str
    status: str  # ok | skipped | failed
    reason: str = ""
    wall_s: float = 0.0
    load_s: float = 0.0
    requests: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0  # useful output tokens: each request's own length, produced and counted
    cached_tokens: int = 0  # prompt tokens served from a prefix cache (not recomputed)
    cpu_s: float | None = None  # CPU time the system used while timed (all threads; worker included)
    tokens_ok: bool = False
    bad_requests: int = 0  # requests that did not come back with exactly max_tokens tokens
    extra: dict[str, Any] = field(default_factory=dict)
    outputs: list[list[int]] = field(default_factory=list, repr=False)

    @property
    def processed_tokens(self) -> int:
        """Tokens that went through the model: prompt tokens not served from cache, plus outputs."""
        return self.prompt_tokens - self.cached_tokens + self.output_tokens

    def check(self, workload: Workload) -> None:
        """Count useful tokens and flag requests whose output length is not exactly what was asked."""
        reqs = workload.requests
        self.requests = len(reqs)
        self.prompt_tokens = workload.prompt_tokens
        bad = 0
        useful = 0
        for i, r in enumerate(reqs):
            got = self.outputs[i] if i < len(self.outputs) else []
            if len(got) != r.max_tokens:
                bad += 1
            useful += min(len(got), r.max_tokens)
        self.output_tokens = useful
        self.bad_requests = bad
        self.tokens_ok = bad == 0 and len(self.outputs) == len(reqs)


class System:
    """A benchmarked system: says why it cannot run (or None), then runs workloads."""

    name = "system"

    def unavailable(self, ctx: BenchContext) -> str | None:
        """Why this system cannot run here (a missing package, the wrong device), or None."""
        return None

    def run(self, workload: Workload, ctx: BenchContext) -> SystemResult:
        raise NotImplementedError

    def close(self) -> None:
        """Release long-lived resources (worker processes); called once at the end of the benchmark."""


def free_memory() -> None:
    """Let the next system start from the memory this one held (its model and cache are dropped)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
