"""``vllm``: vLLM's offline API on the same token-id prompts, where it is importable (CUDA machines only)."""

from __future__ import annotations

import time

from ops.bench.system import WARMUP_PROMPT, BenchContext, System, SystemResult, free_memory
from ops.bench.workloads import Workload


class VLLMSystem(System):
    """vLLM's offline ``LLM.generate`` on token-id prompts (CUDA machines with vllm installed)."""

    name = "vllm"

    def __init__(self, caching: bool = True) -> None:
        self.caching = caching

    def unavailable(self, ctx: BenchContext) -> str | None:
        import importlib.util

        if importlib.util.find_spec("vllm") is None:
            return "vllm is not installed"
        if not ctx.device.startswith("cuda"):
            return "vllm is only benchmarked on CUDA"
        return None

    def run(self, workload: Workload, ctx: BenchContext) -> SystemResult:
        from vllm import LLM as VLLM
        from vllm import SamplingParams as VParams
        from vllm.inputs import TokensPrompt

        t0 = time.perf_counter()
        llm = VLLM(
            model=str(ctx.model_path),
            dtype=ctx.dtype,
            seed=ctx.seed,
            enable_prefix_caching=self.caching,
            max_num_seqs=ctx.max_num_seqs,
        )
        warm = VParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        llm.generate([TokensPrompt(prompt_token_ids=WARMUP_PROMPT)], warm, use_tqdm=False)
        load_s = time.perf_counter() - t0
        prompts = [TokensPrompt(prompt_token_ids=r.prompt_ids) for r in workload.requests]
        params = [VParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True) for r in workload.requests]
        t1, cpu1 = time.perf_counter(), time.process_time()
        outs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - t1
        res = SystemResult(self.name, "ok", wall_s=wall, load_s=load_s, cpu_s=time.process_time() - cpu1)
        res.outputs = [list(o.outputs[0].token_ids) for o in outs]
        res.check(workload)
        res.cached_tokens = sum(int(getattr(o, "num_cached_tokens", 0) or 0) for o in outs)
        del llm
        free_memory()
        return res
