"""What the engine hands back: per-step deltas for streaming, and whole results for the offline API."""

from __future__ import annotations

from dataclasses import dataclass, field

# finish_reason values: "stop" (EOS, stop token or stop string), "length" (max_tokens or the
# model's context), "abort" (aborted by the caller), "error" (its request failed: RequestDelta.error).


@dataclass
class TokenLogprobs:
    """Log-probabilities at one sampled position: the sampled token's and the top-N alternatives."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class CompletionDelta:
    """What one sample (``index`` in 0..n-1) of a request produced during one engine step."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    logprobs: list[TokenLogprobs] | None = None


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
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[TokenLogprobs] | None = None


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
