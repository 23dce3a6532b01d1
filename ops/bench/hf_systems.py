"""The transformers baselines, on the same checkpoint, dtype, device and requests as pagedq.

* ``hf-static``: transformers ``generate``, left-padded static batches of 16. Requests are grouped by output
  length (sorted by output, then prompt length) so a batch runs for about as long as its members need; each
  batch uses ``max_new_tokens`` = its longest request and only each request's own length counts as useful
  output. This is the *best case* for static batching (it knows the output lengths in advance, which a real
  server does not), so ratios against it are conservative.
* ``hf-cb``: transformers' own continuous batching (``init_continuous_batching`` manager, per-request
  ``max_new_tokens``, ``eos_token_id=-1`` to ignore EOS), with the same KV byte budget and token budget as
  pagedq.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import torch

from ops.bench.system import WARMUP_PROMPT, BenchContext, System, SystemResult, free_memory
from ops.bench.workloads import BenchRequest, Workload


def _load_hf(ctx: BenchContext) -> Any:
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(str(ctx.model_path), dtype=ctx.torch_dtype)
    model = model.to(ctx.device).eval()
    # generate() fills unset fields from the model's generation config: clear EOS there so that the
    # explicit eos_token_id=None below really means "never stop early" (= ignore_eos).
    model.generation_config.eos_token_id = None
    return model


class HFStaticSystem(System):
    """transformers ``generate`` over left-padded static batches (see the module docs for the grouping)."""

    name = "hf-static"

    def run(self, workload: Workload, ctx: BenchContext) -> SystemResult:
        from transformers import GenerationConfig

        t0 = time.perf_counter()
        model = _load_hf(ctx)
        pad = _pad_id(model)
        warm = [BenchRequest(WARMUP_PROMPT, 4), BenchRequest(WARMUP_PROMPT[:9], 4)]
        self._generate(model, warm, pad, ctx, GenerationConfig)
        load_s = time.perf_counter() - t0

        reqs = workload.requests
        order = sorted(range(len(reqs)), key=lambda i: (reqs[i].max_tokens, len(reqs[i].prompt_ids)))
        outputs: list[list[int]] = [[] for _ in reqs]
        padded_prompt = 0
        generated = 0
        t1, cpu1 = time.perf_counter(), time.process_time()
        for start in range(0, len(order), ctx.hf_batch_size):
            idx = order[start : start + ctx.hf_batch_size]
            batch = [reqs[i] for i in idx]
            new, width = self._generate(model, batch, pad, ctx, GenerationConfig)
            padded_prompt += width * len(batch)
            generated += new.shape[0] * new.shape[1]
            for row, i in enumerate(idx):
                outputs[i] = new[row, : reqs[i].max_tokens].tolist()
        wall = time.perf_counter() - t1
        cpu_s = time.process_time() - cpu1

        res = SystemResult(self.name, "ok", wall_s=wall, load_s=load_s, cpu_s=cpu_s)
        res.outputs = outputs
        res.check(workload)
        res.extra = {
            "batch_size": ctx.hf_batch_size,
            "grouping": "sorted by (output length, prompt length); max_new_tokens = batch max",
            "padded_prompt_tokens": padded_prompt,
            "generated_tokens_incl_waste": generated,
            "attn_implementation": getattr(model.config, "_attn_implementation", None),
        }
        del model
        free_memory()
        return res

    @staticmethod
    @torch.inference_mode()
    def _generate(
        model: Any, batch: list[BenchRequest], pad: int, ctx: BenchContext, gen_cls: Any
    ) -> tuple[torch.Tensor, int]:
        """Left-pad the batch, generate its longest output length; returns (new tokens, prompt width)."""
        width = max(len(r.prompt_ids) for r in batch)
        ids = torch.full((len(batch), width), pad, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, r in enumerate(batch):
            n = len(r.prompt_ids)
            ids[row, width - n :] = torch.tensor(r.prompt_ids, dtype=torch.long)
            mask[row, width - n :] = 1
        max_new = max(r.max_tokens for r in batch)
        config = gen_cls(max_new_tokens=max_new, do_sample=False, eos_token_id=None, pad_token_id=pad)
        out = model.generate(input_ids=ids.to(ctx.device), attention_mask=mask.to(ctx.device), generation_config=config)
        return out[:, width:].cpu(), width


def _pad_id(model: Any) -> int:
    pad = getattr(model.config, "pad_token_id", None)
    if pad is None:
        pad = getattr(model.config, "bos_token_id", None)
    return int(pad) if pad is not None else 0


def _page_size(cb: Any) -> int:
    """Tokens per KV block of transformers' continuous batching: ``page_size`` from 5.2x, ``block_size``
    before (5.17 on the GPU machine's image)."""
    return int(getattr(cb, "page_size", None) or cb.block_size)


class HFContinuousSystem(System):
    """transformers continuous batching through its manager (per-request lengths, EOS disabled)."""

    name = "hf-cb"

    def __init__(self, caching: bool = True) -> None:
        self.caching = caching

    def unavailable(self, ctx: BenchContext) -> str | None:
        try:
            from transformers import ContinuousBatchingConfig  # noqa: F401
        except ImportError:
            return "this transformers has no continuous batching (needs transformers >= 5)"
        return None

    def _config(self, model: Any, ctx: BenchContext, workload: Workload) -> tuple[Any, Any]:
        from transformers import ContinuousBatchingConfig, GenerationConfig

        kwargs: dict[str, Any] = {"allow_block_sharing": self.caching}
        if ctx.device == "cpu":
            # Its auto-sizing reads GPU memory; on CPU give it pagedq's KV byte budget and token budget.
            cfg = model.config
            head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
            page = _page_size(ContinuousBatchingConfig())
            elem = torch.empty((), dtype=ctx.torch_dtype).element_size()
            per_block = page * 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * elem
            budget = ctx.kv_cache_bytes or 2 * 1024**3
            kwargs.update(
                num_blocks=max(4, budget // per_block),
                max_batch_tokens=ctx.max_num_batched_tokens,
                max_requests_per_batch=ctx.max_num_seqs,
            )
        gen = GenerationConfig(
            do_sample=False,
            max_new_tokens=max((r.max_tokens for r in workload.requests), default=16),
            eos_token_id=-1,
            pad_token_id=_pad_id(model),
        )
        return gen, ContinuousBatchingConfig(**kwargs)

    def run(self, workload: Workload, ctx: BenchContext) -> SystemResult:
        t0 = time.perf_counter()
        model = _load_hf(ctx)
        gen, cb = self._config(model, ctx, workload)
        manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cb)
        manager.start()
        try:
            self._collect(manager, [BenchRequest(WARMUP_PROMPT, 4)] * 2, "warm", ctx)
            load_s = time.perf_counter() - t0
            t1, cpu1 = time.perf_counter(), time.process_time()
            outputs = self._collect(manager, workload.requests, "r", ctx)
            wall = time.perf_counter() - t1
            cpu_s = time.process_time() - cpu1
        finally:
            manager.stop(block=True, timeout=30)
            with contextlib.suppress(Exception):
                manager.destroy()
        res = SystemResult(self.name, "ok", wall_s=wall, load_s=load_s, cpu_s=cpu_s)
        res.outputs = outputs
        res.check(workload)
        res.extra = {"num_blocks": cb.num_blocks, "page_size": _page_size(cb), "max_batch_tokens": cb.max_batch_tokens}
        del model, manager
        free_memory()
        return res

    @staticmethod
    def _collect(manager: Any, reqs: list[BenchRequest], prefix: str, ctx: BenchContext) -> list[list[int]]:
        ids = [f"{prefix}{i}" for i in range(len(reqs))]
        for rid, r in zip(ids, reqs, strict=True):
            manager.add_request(r.prompt_ids, request_id=rid, max_new_tokens=r.max_tokens, eos_token_id=-1)
        done: dict[str, list[int]] = {}
        deadline = time.monotonic() + ctx.request_timeout_s
        while len(done) < len(ids):
            result = manager.get_result(timeout=1.0)
            if result is None:
                fatal = manager.background_thread_status.fatal_error
                if fatal is not None or not manager.is_running():
                    raise RuntimeError(f"transformers' continuous batching stopped: {fatal!r}")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"hf-cb: {len(ids) - len(done)} requests unfinished")
                continue
            if result.is_finished():
                if result.error:
                    raise RuntimeError(f"hf-cb request {result.request_id} failed: {result.error}")
                done[result.request_id] = list(result.generated_tokens)
        return [done[rid] for rid in ids]
