"""The systems under test, each running a :class:`~ops.bench.workloads.Workload` and timing only the work.

Model loading and a short warm-up (first-call allocations, kernel compilation, thread pools) happen before
the clock starts and are reported separately (``load_s``); the clock covers exactly "hand over every
request, get every token back". Each system is asked for greedy decoding with EOS ignored and each
request's exact output length, and each result is checked: a system that produced the wrong number of tokens
for any request is flagged (``tokens_ok`` false) rather than silently credited with tokens it did not make.

Systems:

* ``pagedq``: ``engine.LLM.generate`` with every request at once (the offline API). The engine is
  instrumented from the outside (wrapped bound methods on its own objects, nothing in ``engine/`` changes)
  to split each step into scheduling, input preparation, forward, sampling and detokenising.
* ``pagedq-redis``: the same engine behind a real worker process (``python -m worker``) and an embedded
  Redis, driven by the client library; measures what the queue costs end to end.
* ``hf-static``: transformers ``generate``, left-padded static batches of 16. Requests are grouped by output
  length (sorted by output, then prompt length) so a batch runs for about as long as its members need; each
  batch uses ``max_new_tokens`` = its longest request and only each request's own length counts as useful
  output. This is the *best case* for static batching (it knows the output lengths in advance, which a real
  server does not), so ratios against it are conservative.
* ``hf-cb``: transformers' own continuous batching (``init_continuous_batching`` manager, per-request
  ``max_new_tokens``, ``eos_token_id=-1`` to ignore EOS), with the same KV byte budget and token budget as
  pagedq.
* ``vllm``: when importable (CUDA machines only).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ops.bench.workloads import BenchRequest, Workload

Log = Callable[[str], None]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_WARMUP_PROMPT = list(range(3, 27))  # ids that no corpus window starts with: no prefix-cache hit later


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
        return None

    def run(self, workload: Workload, ctx: BenchContext) -> SystemResult:
        raise NotImplementedError

    def close(self) -> None:
        """Release long-lived resources (worker processes); called once at the end of the benchmark."""


def _free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# --------------------------------------------------------------------------------------------- pagedq


class EngineProbe:
    """Times the phases of pagedq's engine steps by wrapping bound methods on the engine's own objects.

    Instance attributes shadow the class's methods, so ``engine.step`` / ``scheduler.schedule`` /
    ``sampler.sample`` / ``engine._append_token`` and each sequence's detokenizer are timed without touching
    ``engine/``. The wrappers cost a few ``perf_counter`` calls per step and per token (well under 1 %);
    KV-occupancy sampling, which walks the block tables, is timed separately and subtracted from the wall
    time by the caller (``overhead_s``).
    """

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.t: dict[str, float] = defaultdict(float)
        self.steps = 0
        self.batch_tokens = 0
        self.batch_seqs = 0
        self.decode_only_steps = 0
        self.peak_usage = 0.0
        self.peak_fill = 0.0
        self.fill_used = 0
        self.fill_alloc = 0
        self.overhead_s = 0.0

    def install(self) -> None:
        eng = self.engine
        pc = time.perf_counter
        t = self.t
        orig_step = eng.step
        orig_schedule = eng.scheduler.schedule
        orig_sample = eng.sampler.sample
        orig_append = eng._append_token
        orig_new_sequence = eng._new_sequence

        def step() -> Any:
            t0 = pc()
            out = orig_step()
            t["step"] += pc() - t0
            self._sample_kv()
            return out

        def schedule() -> Any:
            t0 = pc()
            batch = orig_schedule()
            t["schedule"] += pc() - t0
            if batch:
                n = batch.total_tokens
                self.steps += 1
                self.batch_tokens += n
                self.batch_seqs += len(batch.seqs)
                if n == len(batch.seqs):
                    self.decode_only_steps += 1
            return batch

        def sample(*args: Any, **kwargs: Any) -> Any:
            t0 = pc()
            out = orig_sample(*args, **kwargs)
            t["sample"] += pc() - t0
            return out

        def append(*args: Any, **kwargs: Any) -> Any:
            t0 = pc()
            out = orig_append(*args, **kwargs)
            t["append"] += pc() - t0
            return out

        def new_sequence(*args: Any, **kwargs: Any) -> Any:
            seq = orig_new_sequence(*args, **kwargs)
            det = seq.detokenizer
            add, flush = det.add_tokens, det.flush

            def add_tokens(ids: list[int]) -> str:
                t0 = pc()
                text: str = add(ids)
                t["detokenize"] += pc() - t0
                return text

            def do_flush() -> str:
                t0 = pc()
                text: str = flush()
                t["detokenize"] += pc() - t0
                return text

            det.add_tokens, det.flush = add_tokens, do_flush
            return seq

        eng.step = step
        eng.scheduler.schedule = schedule
        eng.sampler.sample = sample
        eng._append_token = append
        eng._new_sequence = new_sequence

    def _sample_kv(self) -> None:
        t0 = time.perf_counter()
        kv = self.engine.kv
        usage = kv.usage()
        new_peak = usage > self.peak_usage
        if new_peak or self.steps % 8 == 0:
            used, alloc = self._fill()
            if new_peak:
                self.peak_usage = usage
                self.peak_fill = used / alloc if alloc else 0.0
            self.fill_used += used
            self.fill_alloc += alloc
        self.overhead_s += time.perf_counter() - t0

    def _fill(self) -> tuple[int, int]:
        """(slots holding KV, slots allocated) over the distinct blocks of the running sequences."""
        bs = self.engine.kv.block_size
        filled: dict[int, int] = {}
        for seq in self.engine.scheduler.running:
            n = seq.num_computed_tokens
            for i, block in enumerate(seq.block_table):
                f = min(bs, max(0, n - i * bs))
                if f > filled.get(block, -1):
                    filled[block] = f
        return sum(filled.values()), len(filled) * bs

    def breakdown(self, wall_s: float) -> dict[str, Any]:
        """Seconds and shares of the wall time, per phase (see the module docs of ``report``)."""
        timings = self.engine.runner.timings
        t = self.t
        forward, prepare = timings.forward_s, timings.prepare_s
        step = t["step"]
        parts = {
            "forward_s": forward,
            "prepare_inputs_s": prepare,
            "schedule_s": t["schedule"],
            "sample_s": t["sample"],
            "detokenize_s": t["detokenize"],
            "stop_checks_s": max(0.0, t["append"] - t["detokenize"]),
            "engine_other_s": max(0.0, step - forward - prepare - t["schedule"] - t["sample"] - t["append"]),
            "outside_step_s": max(0.0, wall_s - step),
        }
        steps = max(1, self.steps)
        return {
            **{k: round(v, 4) for k, v in parts.items()},
            "shares": {k.removesuffix("_s"): round(v / wall_s, 4) if wall_s else 0.0 for k, v in parts.items()},
            "steps": self.steps,
            "mean_step_ms": round(1000 * step / steps, 3),
            "mean_forward_ms": round(1000 * forward / steps, 3),
            "mean_batch_tokens": round(self.batch_tokens / steps, 1),
            "mean_batch_seqs": round(self.batch_seqs / steps, 1),
            "decode_only_steps": self.decode_only_steps,
            "probe_overhead_s": round(self.overhead_s, 4),
        }


class PagedqSystem(System):
    """pagedq's offline API, all requests submitted at once; ``caching`` switches prefix caching."""

    def __init__(self, name: str = "pagedq", caching: bool = True) -> None:
        self.name = name
        self.caching = caching

    def make_llm(self, ctx: BenchContext) -> Any:
        from engine import LLM

        kwargs: dict[str, Any] = {
            "dtype": ctx.dtype,
            "device": ctx.device,
            "max_num_seqs": ctx.max_num_seqs,
            "max_num_batched_tokens": ctx.max_num_batched_tokens,
            "block_size": ctx.block_size,
            "enable_prefix_caching": self.caching,
            "seed": ctx.seed,
        }
        if ctx.num_speculative_tokens is not None:
            kwargs["num_speculative_tokens"] = ctx.num_speculative_tokens
        if ctx.kv_cache_bytes is not None:
            kwargs["kv_cache_bytes"] = ctx.kv_cache_bytes
        return LLM(str(ctx.model_path), **kwargs)

    @staticmethod
    def params(workload: Workload) -> list[Any]:
        from engine import SamplingParams

        return [SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True) for r in workload.requests]

    def run(self, workload: Workload, ctx: BenchContext) -> SystemResult:
        from engine import SamplingParams
        from engine.model_runner import StepTimings

        t0 = time.perf_counter()
        llm = self.make_llm(ctx)
        llm.generate([_WARMUP_PROMPT] * 2, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
        load_s = time.perf_counter() - t0
        engine = llm.engine
        engine.runner.timings = StepTimings()
        engine.kv.reset_counters()
        preemptions0 = engine.scheduler.num_preemptions
        drafts0, accepted0 = engine.num_draft_tokens, engine.num_accepted_tokens
        probe = EngineProbe(engine)
        probe.install()
        prompts = [r.prompt_ids for r in workload.requests]
        params = self.params(workload)

        t1, cpu1 = time.perf_counter(), time.process_time()
        outs = llm.generate(prompts, params)
        wall = time.perf_counter() - t1 - probe.overhead_s
        cpu_s = time.process_time() - cpu1

        stats = llm.stats()
        res = SystemResult(self.name, "ok", wall_s=wall, load_s=load_s, cpu_s=cpu_s)
        res.outputs = [list(o.outputs[0].token_ids) for o in outs]
        res.check(workload)
        res.cached_tokens = sum(o.num_cached_tokens for o in outs)
        fill = probe.fill_used / probe.fill_alloc if probe.fill_alloc else 0.0
        res.extra = {
            "breakdown": probe.breakdown(wall),
            "kv": {
                "total_blocks": stats.num_total_blocks,
                "block_size": ctx.block_size,
                "peak_usage": round(probe.peak_usage, 4),
                "peak_blocks": round(probe.peak_usage * stats.num_total_blocks),
                "block_fill_at_peak": round(probe.peak_fill, 4),
                "block_fill_mean": round(fill, 4),
                "preemptions": stats.num_preemptions - preemptions0,
            },
            "prefix_cache": {
                "enabled": self.caching,
                "hit_rate": round(stats.prefix_cache_hit_rate, 4),
                "hit_tokens": stats.prefix_cache_hits,
                "queried_tokens": stats.prefix_cache_queries,
            },
            "speculative": _speculative_record(
                engine.config.num_speculative_tokens, stats.spec_draft_tokens - drafts0,
                stats.spec_accepted_tokens - accepted0, sum(len(o) for o in res.outputs),
            ),
        }
        del llm, engine
        _free_memory()
        return res


def _speculative_record(k: int, drafts: int, accepted: int, output_tokens: int) -> dict[str, Any]:
    """Speculative decoding's share of a run: drafts verified, accepted, and the output tokens that
    came from accepted drafts (each one a decode step's token without a step of its own)."""
    return {
        "num_speculative_tokens": k,
        "draft_tokens": drafts,
        "accepted_tokens": accepted,
        "acceptance": round(accepted / drafts, 4) if drafts else 0.0,
        "output_share": round(accepted / output_tokens, 4) if output_tokens else 0.0,
    }


# --------------------------------------------------------------------------------------- transformers


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
        warm = [BenchRequest(_WARMUP_PROMPT, 4), BenchRequest(_WARMUP_PROMPT[:9], 4)]
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
        _free_memory()
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
            page = ContinuousBatchingConfig().page_size
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
            self._collect(manager, [BenchRequest(_WARMUP_PROMPT, 4)] * 2, "warm", ctx)
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
        res.extra = {"num_blocks": cb.num_blocks, "page_size": cb.page_size, "max_batch_tokens": cb.max_batch_tokens}
        del model, manager
        _free_memory()
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


# ------------------------------------------------------------------------------------------- Redis


class RedisWorker:
    """An embedded Redis plus one ``python -m worker`` process serving the benchmark's model.

    Started once and shared by the Redis workloads (loading a model in a fresh process takes seconds).
    The worker logs to ``worker.log`` in the work folder; its tail is quoted when it fails to start.
    """

    def __init__(self, ctx: BenchContext, caching: bool = True) -> None:
        from worker.embedded_redis import EmbeddedRedis

        self.ctx = ctx
        self.namespace = f"bench{uuid.uuid4().hex[:8]}"
        self.dir = ctx.work_dir / f"redis-{self.namespace}"
        self.redis = EmbeddedRedis(self.dir, appendfsync="no")
        self.caching = caching
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = ""
        self.log_path = self.dir / "worker.log"
        self.load_s = 0.0

    def start(self) -> None:
        t0 = time.perf_counter()
        self.url = self.redis.start()
        ctx = self.ctx
        import worker

        root = Path(worker.__file__).resolve().parents[1]
        cmd = [
            sys.executable, "-m", "worker",
            "--redis-url", self.url,
            "--namespace", self.namespace,
            "--name", "bench-worker",
            "--model", str(ctx.model_path),
            "--dtype", ctx.dtype,
            "--device", ctx.device,
            "--max-num-seqs", str(ctx.max_num_seqs),
            "--max-num-batched-tokens", str(ctx.max_num_batched_tokens),
            "--block-size", str(ctx.block_size),
            "--enable-prefix-caching" if self.caching else "--no-enable-prefix-caching",
            "--log-level", "warning",
            "--log-format", "json",
        ]  # fmt: skip
        if ctx.kv_cache_bytes is not None:
            cmd += ["--kv-cache-bytes", str(ctx.kv_cache_bytes)]
        if ctx.num_speculative_tokens is not None:
            cmd += ["--num-speculative-tokens", str(ctx.num_speculative_tokens)]
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        env["OMP_NUM_THREADS"] = str(ctx.threads)
        self.dir.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT)
        client = self._redis()
        key = f"{self.namespace}:worker:default:bench-worker"
        deadline = time.monotonic() + 300
        try:
            while not client.exists(key):
                if self.proc.poll() is not None:
                    raise RuntimeError(f"worker exited with {self.proc.returncode}: {self.log_tail()}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"worker not ready after 300 s: {self.log_tail()}")
                time.sleep(0.1)
        finally:
            client.close()
        self.offline([BenchRequest(_WARMUP_PROMPT, 4)] * 2, stream=False)
        self.load_s = time.perf_counter() - t0

    def _redis(self) -> Any:
        import redis

        return redis.Redis.from_url(self.url, decode_responses=True)

    def log_tail(self, n: int = 1500) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return "(no worker log)"

    def cpu_seconds(self) -> float:
        """CPU time used so far by the worker process (all threads) and this client process."""
        own = time.process_time()
        if self.proc is None:
            return own
        try:
            fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
            return own + (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, ValueError, IndexError):
            return own

    def heartbeat(self) -> dict[str, Any]:
        client = self._redis()
        try:
            raw = client.get(f"{self.namespace}:worker:default:bench-worker")
        finally:
            client.close()
        return json.loads(raw) if raw else {}

    def heartbeat_since(self, t: float, timeout_s: float = 10.0) -> dict[str, Any]:
        """The worker's first heartbeat whose status was taken at or after wall-clock time ``t``."""
        deadline = time.monotonic() + timeout_s
        hb = self.heartbeat()
        while float(hb.get("ts", 0.0)) < t and time.monotonic() < deadline:
            time.sleep(0.1)
            hb = self.heartbeat()
        return hb

    def offline(self, reqs: list[BenchRequest], stream: bool) -> list[Any]:
        """Submit every request in one pipeline and wait for every terminal event (FinalEvent)."""
        from worker.client import PagedqClient

        with PagedqClient(self.url, namespace=self.namespace) as client:
            ids = client.submit_many(
                [{"prompt_token_ids": r.prompt_ids, "max_tokens": r.max_tokens} for r in reqs],
                temperature=0.0,
                ignore_eos=True,
                stream=stream,
            )
            return [client.result(job_id, timeout=self.ctx.request_timeout_s) for job_id in ids]

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.redis.stop(force=True)


def _loop_breakdown(before: dict[str, Any], after: dict[str, Any], wall: float) -> dict[str, Any]:
    """Where the worker's loop spent the run (deltas of its cumulative ``loop`` status), as seconds and
    shares of the client's wall time; ``outside_loop`` is the rest (results reaching the client)."""
    keys = ("engine_step_s", "redis_s", "idle_s", "other_s")
    if not all(k in before and k in after for k in keys):
        return {}
    secs = {k[:-2]: max(0.0, float(after[k]) - float(before[k])) for k in keys}
    # Idle reads before the first job and after the last one fall outside the client's wall time.
    secs["idle"] = min(secs["idle"], max(0.0, wall - secs["engine_step"] - secs["redis"] - secs["other"]))
    secs["outside_loop"] = max(0.0, wall - sum(secs.values()))
    return {
        "ticks": int(after.get("ticks", 0)) - int(before.get("ticks", 0)),
        "seconds": {k: round(v, 3) for k, v in secs.items()},
        "shares": {k: round(v / wall, 4) if wall > 0 else 0.0 for k, v in secs.items()},
    }


@contextlib.contextmanager
def _sampling(fn: Callable[[], None], period_s: float) -> Iterator[None]:
    """Call ``fn`` every ``period_s`` on a daemon thread while the block runs (heartbeat sampling)."""
    stop = threading.Event()

    def loop() -> None:
        while not stop.wait(period_s):
            with contextlib.suppress(Exception):
                fn()

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(5)


class PagedqRedisSystem(System):
    """End to end through Redis: client -> embedded Redis -> one worker process -> pagedq engine."""

    name = "pagedq-redis"

    def __init__(self) -> None:
        self.worker: RedisWorker | None = None
        self._served: set[str] = set()  # workloads the current worker has run

    def unavailable(self, ctx: BenchContext) -> str | None:
        try:
            import worker.client
            import worker.embedded_redis
            import worker.run  # noqa: F401
        except Exception as exc:  # a half-built worker package can fail in any way on import
            return f"worker package not importable: {type(exc).__name__}: {exc}"
        return None

    def ensure_worker(self, ctx: BenchContext) -> RedisWorker:
        if self.worker is None:
            w = RedisWorker(ctx)
            try:
                w.start()
            except BaseException:
                w.stop()
                raise
            self.worker = w
        return self.worker

    def run(self, workload: Workload, ctx: BenchContext) -> SystemResult:
        if workload.name in self._served:
            # A repeat (--repeat): the worker's prefix cache still holds these prompts, which would turn
            # the rerun into cache hits. Start a cold one, as every offline pagedq run is.
            self.close()
        self._served.add(workload.name)
        fresh = self.worker is None
        w = self.ensure_worker(ctx)
        peak: dict[str, float] = {"kv_cache_usage": 0.0}

        def sample() -> None:
            hb = w.heartbeat()
            peak["kv_cache_usage"] = max(peak["kv_cache_usage"], float(hb.get("kv_cache_usage", 0.0)))

        hb0 = w.heartbeat_since(time.time())
        loop0 = hb0.get("loop", {})
        with _sampling(sample, 0.25):
            t1, cpu1 = time.perf_counter(), w.cpu_seconds()
            finals = w.offline(workload.requests, stream=ctx.redis_stream)
            wall = time.perf_counter() - t1
            cpu_s = w.cpu_seconds() - cpu1
        hb1 = w.heartbeat_since(time.time())
        loop1 = hb1.get("loop", {})
        res = SystemResult(self.name, "ok", wall_s=wall, load_s=w.load_s if fresh else 0.0, cpu_s=cpu_s)
        res.outputs = [list(f.choices[0].token_ids) for f in finals]
        res.check(workload)
        spec = {k: int(hb1.get(k, 0)) - int(hb0.get(k, 0)) for k in ("spec_draft_tokens", "spec_accepted_tokens")}
        from worker.settings import Settings

        # What the worker runs: its own setting's default unless the bench passed one.
        default = Settings.model_fields["num_speculative_tokens"].default
        k = default if ctx.num_speculative_tokens is None else ctx.num_speculative_tokens
        res.cached_tokens = sum(f.usage.cached_tokens for f in finals)
        queued = [f.timings.queued_s for f in finals]
        res.extra = {
            "stream": ctx.redis_stream,
            "worker_loop": _loop_breakdown(loop0, loop1, wall),
            "kv": {"peak_usage_sampled": round(peak["kv_cache_usage"], 4)},
            "speculative": _speculative_record(
                k, spec["spec_draft_tokens"], spec["spec_accepted_tokens"], sum(len(o) for o in res.outputs)
            ),
            "worker_timings": {
                "queued_s_mean": round(sum(queued) / len(queued), 4) if queued else 0.0,
                "total_s_max": round(max((f.timings.total_s for f in finals), default=0.0), 4),
            },
        }
        return res

    def run_online(self, workload: Workload, ctx: BenchContext) -> SystemResult:
        """Poisson arrivals with streaming; client-side TTFT / inter-token latency and throughput."""
        fresh = self.worker is None
        w = self.ensure_worker(ctx)
        t0, cpu0 = time.perf_counter(), w.cpu_seconds()
        records = asyncio.run(_online_client(w.url, w.namespace, workload.requests, ctx.request_timeout_s))
        wall = time.perf_counter() - t0
        cpu_s = w.cpu_seconds() - cpu0
        res = SystemResult(self.name, "ok", wall_s=wall, load_s=w.load_s if fresh else 0.0, cpu_s=cpu_s)
        res.outputs = [rec["tokens"] for rec in records]
        res.check(workload)
        res.cached_tokens = sum(rec["cached"] for rec in records)
        res.extra = {"online": _latency_stats(records, wall)}
        return res

    def close(self) -> None:
        if self.worker is not None:
            self.worker.stop()
            self.worker = None
        self._served.clear()


async def _online_client(url: str, namespace: str, reqs: list[BenchRequest], timeout: float) -> list[dict[str, Any]]:
    from worker.client import AsyncPagedqClient

    client = AsyncPagedqClient(url, namespace=namespace, block_ms=200)
    start = time.perf_counter()

    async def one(r: BenchRequest) -> dict[str, Any]:
        await asyncio.sleep(max(0.0, start + r.arrival_s - time.perf_counter()))
        t_submit = time.perf_counter()
        job_id = await client.submit(
            r.prompt_ids, max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True, stream=True
        )
        stamps: list[float] = []
        tokens: list[int] = []
        final_tokens: list[int] | None = None
        cached = 0
        async for ev in client.events(job_id, timeout=timeout):
            if ev.type == "token":
                if ev.token_ids:
                    stamps.append(time.perf_counter())
                    tokens.extend(ev.token_ids)
            elif ev.type == "final":
                final_tokens = list(ev.choices[0].token_ids)
                cached = ev.usage.cached_tokens
            else:
                raise RuntimeError(f"online job failed: {ev.code}: {ev.message}")
        done = time.perf_counter()
        return {
            "submit": t_submit - start,
            "stamps": [s - start for s in stamps],
            "done": done - start,
            "tokens": final_tokens if final_tokens is not None else tokens,
            "streamed_tokens": len(tokens),
            "cached": cached,
        }

    try:
        return list(await asyncio.gather(*(one(r) for r in reqs)))
    finally:
        await client.close()


def _pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    k = (len(ordered) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def _latency_stats(records: list[dict[str, Any]], wall: float) -> dict[str, Any]:
    """TTFT (submit -> first streamed token), ITL (gaps between token events), end-to-end, jobs/s."""
    ttft = [rec["stamps"][0] - rec["submit"] for rec in records if rec["stamps"]]
    itl = [b - a for rec in records for a, b in zip(rec["stamps"], rec["stamps"][1:], strict=False)]
    # Time per output token after the first (vLLM's TPOT): with speculative decoding one event can
    # carry several tokens, so the gap between events (ITL) is a step, not a token.
    tpot = [
        (rec["done"] - rec["stamps"][0]) / (rec["streamed_tokens"] - 1)
        for rec in records
        if rec["stamps"] and rec["streamed_tokens"] > 1
    ]
    e2e = [rec["done"] - rec["submit"] for rec in records]
    first = min((rec["submit"] for rec in records), default=0.0)
    last = max((rec["done"] for rec in records), default=0.0)
    span = max(last - first, 1e-9)
    ms = lambda v: round(1000 * v, 2)
    return {
        "ttft_ms": {"p50": ms(_pct(ttft, 50)), "p99": ms(_pct(ttft, 99)), "mean": ms(sum(ttft) / max(1, len(ttft)))},
        "itl_ms": {"p50": ms(_pct(itl, 50)), "p99": ms(_pct(itl, 99)), "mean": ms(sum(itl) / max(1, len(itl)))},
        "tpot_ms": {"p50": ms(_pct(tpot, 50)), "p99": ms(_pct(tpot, 99))},
        "e2e_ms": {"p50": ms(_pct(e2e, 50)), "p99": ms(_pct(e2e, 99))},
        "jobs_per_s": round(len(records) / span, 3),
        "span_s": round(span, 3),
        "streamed_tokens": sum(rec["streamed_tokens"] for rec in records),
        "itl_note": "gap between consecutive token events (one event = one engine step's tokens of a job)",
    }


# -------------------------------------------------------------------------------------------- vLLM


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
        llm.generate([TokensPrompt(prompt_token_ids=_WARMUP_PROMPT)], warm, use_tqdm=False)
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
        _free_memory()
        return res


SYSTEM_NAMES: tuple[str, ...] = ("pagedq", "pagedq-redis", "hf-static", "hf-cb", "vllm")


def make_system(name: str) -> System:
    factories: dict[str, Callable[[], System]] = {
        "pagedq": PagedqSystem,
        "pagedq-redis": PagedqRedisSystem,
        "hf-static": HFStaticSystem,
        "hf-cb": HFContinuousSystem,
        "vllm": VLLMSystem,
    }
    if name not in factories:
        raise ValueError(f"unknown system {name!r}; choose from {', '.join(SYSTEM_NAMES)}")
    return factories[name]()
