"""``pagedq bench --profile DIR``: where pagedq's time goes, per op family, on ``mixed`` (else the first workload).

Runs after the timed runs (so they are unaffected) and makes three extra passes over the same requests:

1. **op timers**: wall time per op family (matmuls in the decoder, lm_head, attention incl. the KV write,
   attention planning, RMSNorm, rotary, SiLU-and-mul, embedding, the rest of the forward), taken by
   wrapping the model's modules and the shared ``Ops`` bundle of this one engine instance (attention's C calls
   also apart: the KV write, the decode kernel, the prefill kernel, with the whole-step plan on too), plus the
   engine's own phase split (:class:`~engine.step_stats.StepStats`: schedule, prepare, sample, detokenize).
   CPU ops are synchronous, so these are exact; each wrapper costs ~1 us per call.
2. **torch.profiler**: the aten-level table (self CPU time) in ``torch_ops.txt``.
3. **cProfile**: Python functions by cumulative and internal time in ``cprofile.txt``.
"""

from __future__ import annotations

import cProfile
import io
import pstats
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ops.bench.pagedq_system import PagedqSystem, step_breakdown
from ops.bench.system import BenchContext
from ops.bench.workloads import Workload


def _timed(fn: Callable[..., Any], bucket: dict[str, float], key: str) -> Callable[..., Any]:
    pc = time.perf_counter

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = pc()
        out = fn(*args, **kwargs)
        bucket[key] += pc() - t0
        return out

    return wrapper


def _instrument_model(engine: Any, bucket: dict[str, float]) -> None:
    """Wrap this engine's model: every Linear (decoder matmuls), lm_head, attention, norms, rotary, act.

    A gated MLP packed with its SiLU-and-mul fused (CPU) runs gate_up as one kernel: it counts as a matmul.
    """
    from engine.layers import Linear
    from engine.models.llama import LlamaMLP

    model = engine.runner.model
    for module in model.modules():
        if isinstance(module, Linear):
            module.forward = _timed(module.forward, bucket, "linear (decoder matmuls)")  # type: ignore[method-assign]
            # o_proj and down with the residual add and the next RMSNorm in one kernel call (Linear.add_norm)
            module.add_norm = _timed(module.add_norm, bucket, "linear + residual + rms_norm (one call)")  # type: ignore[method-assign]
        elif isinstance(module, LlamaMLP) and (module.gated or module.gated_int8) is not None:  # one kernel
            module.gate_up_act = _timed(module.gate_up_act, bucket, "linear (decoder matmuls)")  # type: ignore[method-assign]
    model.compute_logits = _timed(model.compute_logits, bucket, "lm_head (logits matmul, or its argmax)")
    model.compute_greedy = _timed(model.compute_greedy, bucket, "lm_head (logits matmul, or its argmax)")
    model.embed_tokens.forward = _timed(model.embed_tokens.forward, bucket, "embedding")
    ops = model.ops
    attn = ops.attention
    if hasattr(attn, "kernel_calls"):  # the CPU backend's C calls (the Triton backend launches its own)
        attn.forward, attn.kernel_calls = _attention_timed(attn.forward, attn.kernel_calls, bucket)
    else:
        attn.forward = _timed(attn.forward, bucket, ATTENTION)
    attn.prepare = _timed(attn.prepare, bucket, "attention planning (per step)")
    # Ops is a frozen dataclass shared by every layer: replacing its fields on this one instance times
    # every call without touching engine code.
    object.__setattr__(ops, "rms_norm", _timed(ops.rms_norm, bucket, "rms_norm (+residual add)"))
    object.__setattr__(ops, "rotary_embedding", _timed(ops.rotary_embedding, bucket, "rotary"))
    object.__setattr__(ops, "silu_and_mul", _timed(ops.silu_and_mul, bucket, "silu_and_mul"))


ATTENTION = "attention (KV write + kernel)"
PART = "attention: "  # what names a part of ATTENTION in the families
# The C calls inside attention, each kind in its own bucket as well: decode attention waits on memory (each
# token reads its whole context) and prefill attention on arithmetic, so the one total says neither what bounds
# it nor which kernel to work on. Keyed by the KernelCall's ``what``; a step the torch path takes (no C
# kernels) counts in the total only.
ATTENTION_PARTS = {
    "KV cache write": PART + "KV write",
    "paged decode attention": PART + "decode kernel (single queries, draft checks)",
    "paged prefill attention": PART + "prefill kernel",
}


def _attention_timed(
    forward: Callable[..., Any], build: Callable[..., Any], bucket: dict[str, float]
) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """``attention.forward`` timed into :data:`ATTENTION`, and ``attention.kernel_calls`` whose calls time
    themselves into their part. A whole-step plan (``engine/models/llama_cpu_plan.py``) builds those calls for
    every layer and makes them outside ``forward``: those count into the total here, so it is attention's time
    with the plan on or off, once."""
    from pagedq_kernels.kernel_call import KernelCall

    pc = time.perf_counter
    in_forward = [False]

    def timed_forward(*args: Any, **kwargs: Any) -> Any:
        t0 = pc()
        in_forward[0] = True
        try:
            return forward(*args, **kwargs)
        finally:
            in_forward[0] = False
            bucket[ATTENTION] += pc() - t0

    def timed_call(function: Callable[..., Any], what: str) -> Callable[..., Any]:
        key = next((v for k, v in ATTENTION_PARTS.items() if what.startswith(k)), PART + what)

        def call(*args: Any) -> Any:
            t0 = pc()
            status = function(*args)
            took = pc() - t0
            bucket[key] += took
            if not in_forward[0]:
                bucket[ATTENTION] += took
            return status

        return call

    def timed_build(*args: Any, **kwargs: Any) -> Any:
        calls = build(*args, **kwargs)
        if calls is None:
            return None
        return [[KernelCall(timed_call(c.function, c.what), c.args, c.what) for c in layer] for layer in calls]

    return timed_forward, timed_build


def profile_pagedq(workload: Workload, ctx: BenchContext, out_dir: Path) -> dict[str, Any]:
    """Run the three passes; write the detailed tables to ``out_dir`` and return the op-family summary."""
    out_dir.mkdir(parents=True, exist_ok=True)
    system = PagedqSystem()
    prompts = [r.prompt_ids for r in workload.requests]
    params = system.params(workload)

    # Pass 1: op-family timers + engine phases.
    llm = system.load(ctx)
    bucket: dict[str, float] = defaultdict(float)
    _instrument_model(llm.engine, bucket)
    t0 = time.perf_counter()
    llm.generate(prompts, params)
    wall = time.perf_counter() - t0
    phases = step_breakdown(llm.engine.step_stats, wall)
    forward = llm.engine.step_stats.phase_s["forward"]
    families = dict(bucket)
    # attention's parts are inside its total
    inside = sum(v for k, v in families.items() if k != "attention planning (per step)" and not k.startswith(PART))
    families["rest of forward (reshapes, splits, glue)"] = max(
        0.0, forward - inside - families.get("attention planning (per step)", 0.0)
    )
    ops_table = {k: {"s": round(v, 3), "share_of_wall": round(v / wall, 4)} for k, v in _ordered(families)}
    for k in ("prepare_inputs_s", "schedule_s", "sample_s", "detokenize_s", "stop_checks_s", "engine_other_s",
              "outside_step_s"):  # fmt: skip
        ops_table[f"engine: {k.removesuffix('_s')}"] = {
            "s": phases[k],
            "share_of_wall": round(phases[k] / wall, 4) if wall else 0.0,
        }
    (out_dir / "op_families.txt").write_text(_format_families(workload.name, ops_table, wall, phases), encoding="utf-8")
    del llm

    # Pass 2: torch.profiler (aten ops by self CPU time).
    llm = system.load(ctx)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if ctx.device.startswith("cuda"):
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        llm.generate(prompts, params)
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40)
    (out_dir / "torch_ops.txt").write_text(table, encoding="utf-8")
    del llm, prof

    # Pass 3: cProfile (Python-level view: scheduler, sampler, detokenizer, glue).
    llm = system.load(ctx)
    profiler = cProfile.Profile()
    profiler.enable()
    llm.generate(prompts, params)
    profiler.disable()
    buf = io.StringIO()
    stats = pstats.Stats(profiler, stream=buf)
    stats.sort_stats("cumulative").print_stats(45)
    stats.sort_stats("tottime").print_stats(45)
    (out_dir / "cprofile.txt").write_text(buf.getvalue(), encoding="utf-8")
    del llm

    return {"wall_s": round(wall, 3), "op_families": ops_table, "files": sorted(p.name for p in out_dir.iterdir())}


def _ordered(families: dict[str, float]) -> list[tuple[str, float]]:
    """Largest first, attention's parts (largest first) right after its total."""
    parts = sorted(((k, v) for k, v in families.items() if k.startswith(PART)), key=lambda kv: -kv[1])
    out: list[tuple[str, float]] = []
    for k, v in sorted(((k, v) for k, v in families.items() if not k.startswith(PART)), key=lambda kv: -kv[1]):
        out.append((k, v))
        if k == ATTENTION:
            out += parts
            parts = []
    return out + parts


def _format_families(workload: str, table: dict[str, dict[str, float]], wall: float, phases: dict[str, Any]) -> str:
    lines = [f"pagedq on {workload}: {wall:.2f} s wall, {phases['steps']} steps, {phases['mean_step_ms']:.1f} ms/step"]
    if not any(name.startswith("linear") for name in table):  # both linear families untimed
        lines.append("  (the whole-step CPU plan ran the matmuls, norms and rotary: they are in 'rest of forward';")
        lines.append("   PAGEDQ_DISABLE_CPU_PLAN=1 times them apart)")
    for name, row in table.items():
        label = f"  {name.removeprefix(PART)}" if name.startswith(PART) else name  # a part: indented
        lines.append(f"  {label:<55} {row['s']:>9.3f} s  {100 * row['share_of_wall']:>5.1f}%")
    return "\n".join(lines) + "\n"
