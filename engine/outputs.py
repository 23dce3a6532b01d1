"""What the engine hands back: per-step deltas for streaming, and whole results for the offline API."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

# finish_reason values: "stop" (EOS, stop token or stop string), "length" (max_tokens or the
# model's context), "abort" (aborted by the caller), "error" (its request failed: RequestDelta.error).


@dataclass(frozen=True)
class Logprob:
    """One token's entry at a sampled position, as vLLM's ``Logprob``: ``rank`` is 1 for the most likely
    token (None for a sampled token outside the top N: the sampler does not rank the whole vocabulary),
    ``decoded_token`` its text (None where nothing decoded it: the step-level engine, ``detokenize=False``)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class TokenLogprobs(Mapping[int, Logprob]):
    """Log-probabilities at one sampled position: the sampled token's and the top-N alternatives.

    Also a read-only ``{token_id: Logprob}`` map, the shape vLLM's ``CompletionOutput.logprobs`` entries
    have (``lp[token_id].logprob``): the sampled token first, then the top N in rank order, each once, so
    the chosen token is always there. ``decoded`` holds the tokens' texts where the offline ``LLM`` filled it.
    """

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)
    decoded: dict[int, str] | None = None

    def _entries(self) -> dict[int, Logprob]:
        ranks = {t: i + 1 for i, (t, _) in enumerate(self.top)}
        names = self.decoded or {}
        entries = {self.token_id: Logprob(self.logprob, ranks.get(self.token_id), names.get(self.token_id))}
        for t, lp in self.top:
            entries.setdefault(t, Logprob(lp, ranks[t], names.get(t)))
        return entries

    def __getitem__(self, token_id: int) -> Logprob:
        return self._entries()[token_id]

    def __iter__(self) -> Iterator[int]:
        return iter(self._entries())

    def __len__(self) -> int:
        return len(self._entries())


@dataclass
class CompletionDelta:
    """What one sample (``index`` in 0..n-1) of a request produced during one engine step."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    logprobs: list[TokenLogprobs] | None = None
    # With logprobs: where each token's text starts in the sample's text, held-back text included (a stop
    # string holds text back, so ``text`` is not these tokens' text); one per token, as ``logprobs``.
    text_offsets: list[int] | None = None


@dataclass
class RequestDelta:
    """Everything new about one request after an engine step; ``finished`` once all samples ended.

    ``error`` is set (with ``finished`` True) when the request failed on its own, e.g. its sampling
    parameters made the probabilities non-finite: a short, user-safe reason. The request is then over,
    all its samples, its blocks are freed, and every sample still going has a last ``CompletionDelta``
    with finish_reason "error" (possibly with no tokens). The engine's other requests are unaffected.
    """

    request_id: str
    outputs: list[CompletionDelta]
    finished: bool
    prompt_token_ids: list[int]
    num_cached_tokens: int
    error: str | None = None


@dataclass
class CompletionOutput:
    """One sample's whole result, with vLLM's fields: ``stop_reason`` is the stop string or stop token id
    that ended it (None for EOS, a length finish, or a grammar's end), ``cumulative_logprob`` the sum of
    its tokens' logprobs (None unless logprobs were asked for, as in vLLM)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[TokenLogprobs] | None = None
    stop_reason: str | int | None = None
    cumulative_logprob: float | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """One request's whole result (the offline API). ``error`` is the reason when the request failed
    on its own (see ``RequestDelta.error``); its samples' finish_reason is then "error"."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int
    finished: bool = True
    error: str | None = None


@dataclass
class EngineStats:
    running: int
    waiting: int
    kv_cache_usage: float  # fraction of KV blocks in use by live requests
    prefix_cache_hit_rate: float  # hit tokens / queried tokens since start
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    num_free_blocks: int
    num_total_blocks: int
    spec_draft_tokens: int = 0  # speculative decoding: draft tokens verified since start
    spec_accepted_tokens: int = 0  # ... and accepted (each one a decode step saved)
    # CPU: the C-kernel build in use (generic, avx2, avx512; pagedq_kernels/cpu_isa) and the matmul weight dtype
    kernel_variant: str | None = None
    matmul_dtype: str = ""
    # Tensor parallelism: the rank count, and each rank's weight and KV cache bytes (one entry on one rank)
    tensor_parallel_size: int = 1
    rank_weight_bytes: list[int] = field(default_factory=list)
    rank_kv_bytes: list[int] = field(default_factory=list)
    kv_cache_dtype: str = ""  # what the paged KV cache stores (bfloat16 under CPU bf16: half the bytes)
    # Memory: bytes held for the weights (dense, packed and quantised forms all counted; every rank's) and
    # allocated to the KV cache; a quantised model leaves more of a memory budget to KV blocks.
    weight_bytes: int = 0
    kv_cache_bytes: int = 0
    quantization: str | None = None  # "int8", "w8a8", a GGUF's "gguf:Q4_1" (its predominant type), or None
