"""The engine's knobs, validated once at construction so a bad value fails fast with its name."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16", "float": "float32"}

DEFAULT_CPU_KV_CACHE_BYTES = 2 * 1024**3

QUANTIZATIONS = ("int8", "w8a8")
"""``EngineConfig.quantization`` values: ``int8`` is symmetric per-output-channel int8 weights for every decoder
linear, activations unchanged (weight-only; pagedq_kernels/int8_linear). ``w8a8`` quantises the same weights and,
on CPU, each linear's input per token too, multiplying in int8 on the CPU's int8 dot products
(pagedq_kernels/w8a8_linear); it fails at load where that cannot run. GGUF checkpoints need none: they are
loaded in their own quantisation."""


@dataclass
class EngineConfig:
    model: str | None = None  # checkpoint folder (LLM() and the worker turn None into the default model)
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    kv_cache_bytes: int | None = None  # CPU budget; None -> DEFAULT_CPU_KV_CACHE_BYTES
    num_kv_blocks: int | None = None  # exact block count, overriding the byte budget (tests, tuning)
    gpu_memory_utilization: float = 0.85  # CUDA: fraction of free memory given to the KV cache
    block_size: int = 16
    enable_prefix_caching: bool = True
    # auto: bfloat16 on CUDA, and on CPUs with AMX or AVX512-bf16 (pagedq_kernels/cpu_isa: CpuIsa.bf16_matmul; where
    # the dot products are slower than fp32 FMAs the bf16 kernels multiply on the FMAs), else float32.
    # bfloat16 on CPU means bf16 matmul weights under fp32 activations.
    dtype: str = "auto"
    device: str = "cpu"
    max_model_len: int | None = None  # None -> the model's own context length
    attention_backend: str = "auto"  # auto | torch | triton
    cuda_graphs: bool = True
    cpu_weight_prepack: bool = True  # CPU: matmul weights packed once (pagedq_kernels/cpu_linear)
    # CPU: fewer threads while other processes take some of our cores, back when they leave
    # (engine/cpu_runtime.CoreShare); off keeps the start-up count.
    adapt_cpu_threads: bool = True
    quantization: str | None = None  # None, or one of QUANTIZATIONS, applied at load
    seed: int = 0  # seeds the generator shared by unseeded sampling requests
    # Speculative decoding by prompt lookup (engine/ngram_proposer.py), greedy requests only:
    # up to this many draft tokens per decode step; 0 turns it off.
    num_speculative_tokens: int = 8
    prompt_lookup_min: int = 2  # shortest context suffix (tokens) matched against earlier context
    prompt_lookup_max: int = 4  # longest one, tried first
    # No drafts while more sequences than this run: a big batch is compute-bound, and every rejected
    # draft would cost as much as a generated token. None: by where the matmuls run (draft_batch_limit),
    # and past that limit the sequences whose drafts keep coming true still draft (engine/draft_pace.py).
    speculative_disable_by_batch_size: int | None = None
    # Tensor parallelism (engine/distributed.py): the model split across this many ranks (processes),
    # one per device on CUDA; 1 runs in this process, as without it.
    tensor_parallel_size: int = 1
    # A collective of the model's (all-reduce, gather) that waits longer than this has lost a rank:
    # the step fails instead of hanging (gloo and NCCL time out).
    distributed_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        positive = ("max_num_seqs", "max_num_batched_tokens", "block_size")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.num_speculative_tokens < 0:
            raise ValueError(f"num_speculative_tokens must be >= 0, got {self.num_speculative_tokens}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(
                "prompt_lookup_min and prompt_lookup_max must satisfy 1 <= min <= max, got "
                f"{self.prompt_lookup_min} and {self.prompt_lookup_max}"
            )
        if self.speculative_disable_by_batch_size is not None and self.speculative_disable_by_batch_size < 1:
            raise ValueError(
                f"speculative_disable_by_batch_size must be >= 1, got {self.speculative_disable_by_batch_size}"
            )
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.tensor_parallel_size > 1 and self.quantization not in (None, "", "none"):
            # The row-parallel layers multiply their shard through cpu_linear/F.linear, not the int8 kernels.
            raise ValueError("quantization is not supported with tensor_parallel_size > 1 yet")
        if self.distributed_timeout_s <= 0:
            raise ValueError(f"distributed_timeout_s must be positive, got {self.distributed_timeout_s}")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes < 1:
            raise ValueError(f"kv_cache_bytes must be positive, got {self.kv_cache_bytes}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.attention_backend not in ("auto", "torch", "triton"):
            raise ValueError(f"attention_backend must be auto, torch or triton, got {self.attention_backend!r}")
        self.dtype = _ALIASES.get(self.dtype, self.dtype)
        if self.dtype != "auto" and self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of auto, {', '.join(_DTYPES)}; got {self.dtype!r}")
        torch.device(self.device)  # raises on a malformed device string
        if self.backend == "triton" and self.torch_device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            # Compiled Triton targets the GPU: handed CPU tensors it fails at the first launch with
            # "Pointer argument cannot be accessed from Triton", deep inside a step. Say so here instead.
            raise ValueError(
                "attention_backend='triton' on a CPU device runs only under Triton's interpreter: set "
                "TRITON_INTERPRET=1 before starting (slow, for tests), or use attention_backend='torch'"
            )
        if self.quantization is not None:
            self.quantization = self.quantization.strip().lower()
            if self.quantization in ("", "none"):
                self.quantization = None
            elif self.quantization not in QUANTIZATIONS:
                raise ValueError(
                    f"quantization must be one of none, {', '.join(QUANTIZATIONS)}; got {self.quantization!r}"
                    " (GGUF checkpoints are loaded in their own quantisation: pass the .gguf file as the model)"
                )

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.device)

    @property
    def torch_dtype(self) -> torch.dtype:
        """The dtype asked for, ``auto`` resolved: the one reported, and the matmuls' on CPU."""
        if self.dtype == "auto":
            if self.torch_device.type == "cuda":
                return torch.bfloat16
            from pagedq_kernels import cpu_isa

            return torch.bfloat16 if cpu_isa.current().bf16_matmul else torch.float32
        return _DTYPES[self.dtype]

    @property
    def activation_dtype(self) -> torch.dtype:
        """What the model computes in between matmuls. On CPU bf16 is a matmul-weight and KV-cache
        format (:attr:`kv_cache_dtype`): norms, rotary and attention run in fp32, on the fp32 C kernels
        (pagedq_kernels/cpu_*), and each matmul rounds its input to bf16 (pagedq_kernels/cpu_linear). The bf16 weights
        halve what a decode step streams; the fp32 activations cost little and keep more precision."""
        dtype = self.torch_dtype
        if self.torch_device.type == "cpu" and dtype == torch.bfloat16 and self.cpu_weight_prepack:
            from pagedq_kernels import cpu_isa

            if cpu_isa.current().bf16_matmul:
                return torch.float32
        # Elsewhere CPU bf16 runs every op in bf16 through torch: slow, but what was asked for.
        return dtype

    @property
    def draft_batch_limit(self) -> int:
        """Running sequences above which no drafts are proposed (``speculative_disable_by_batch_size``, or
        by where the matmuls run). A draft position is nearly free while a step's matmuls are bound by
        streaming the weights and costs a full token once they are bound by arithmetic; the turn comes at
        about peak FLOP/s / bandwidth rows x bytes per weight / 2. fp32 weights (4 bytes) on AVX2 cores (~130
        GFLOP/s for two cores, ~15 GB/s) turn near 35 rows: 32 sequences, measured best in runs 12-15. bf16
        weights (2 bytes) on AMX (2475 GFLOP/s measured on a 2-vCPU Xeon) or a GPU turn past 150 rows:
        on that Xeon the compass workload (64 sequences) ran 298 tok/s with the limit at 32 and 402 at 64
        (5912 of 7063 drafts accepted), so they take 128. bf16 on AVX512-bf16 dot products without AMX has
        twice the fp32 peak for half the bytes, the same turn as fp32: on a 2-vCPU AMD EPYC Zen 4 (family 25
        model 17; 441 GFLOP/s bf16, 34 GB/s), ``mixed`` n=128 in one process, interleaved rounds, best of 2:
        128 -> 333.1 tok/s, 32 -> 378.5, 16 -> 384.3, no drafts 324.2; in fp32 there 128 -> 194.4, 32 ->
        220.6, 16 -> 217.2. So 32 for every CPU without AMX. Past the limit (unless the user set it), the
        sequences whose drafts keep coming true still draft: engine/draft_pace.py."""
        if self.speculative_disable_by_batch_size is not None:
            return self.speculative_disable_by_batch_size
        if self.matmul_weight_dtype not in (torch.bfloat16, torch.float16):
            return 32
        if self.torch_device.type == "cpu":
            from pagedq_kernels import cpu_isa

            return 128 if "amx" in cpu_isa.current().levels else 32
        return 128

    @property
    def kv_cache_dtype(self) -> torch.dtype:
        """What the paged KV cache stores. It follows ``dtype``: under CPU bf16 (fp32 activations) the cache
        is bf16, half the bytes per block, so twice the blocks in the same ``kv_cache_bytes`` and half the
        bytes each decode step reads; the C attention kernels widen it back to fp32 as they read it
        (exactly) and the attention arithmetic stays fp32, except prefill's two products where AVX512-bf16 runs
        (bf16 dot products on the cache as it is: pagedq_kernels/cpu_attention.dp_attention_enabled). The K/V are
        rounded to bf16 once, when written.
        fp32 keeps an fp32 cache (exact parity)."""
        activations = self.activation_dtype
        if self.torch_device.type == "cpu" and self.torch_dtype == torch.bfloat16 and self.backend == "torch":
            return torch.bfloat16
        return activations

    @property
    def matmul_weight_dtype(self) -> torch.dtype:
        """The dtype matmul weights are stored and multiplied in."""
        return self.torch_dtype

    @property
    def backend(self) -> str:
        """Kernels backend: Triton on CUDA, torch on CPU, unless forced."""
        if self.attention_backend != "auto":
            return self.attention_backend
        return "triton" if self.torch_device.type == "cuda" else "torch"
