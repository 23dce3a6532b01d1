"""``pagedq bench --profile DIR``: where pagedq's time goes, per op family, on ``mixed`` (else the first workload).

Runs after the timed runs (so they are unaffected) and makes three extra passes over the same requests:

1. **op timers**: wall time per op family (matmuls in the decoder, lm_head, attention incl. the KV write,
   attention planning, RMSNorm, rotary, SiLU-and-mul, embedding, the rest of the forward), taken by
   wrapping the model's modules and the shared ``Ops`` bundle of this one engine instance, plus the
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
    attn.forward = _timed(attn.forward, bucket, "attention (KV write + kernel)")
    attn.prepare = _timed(attn.prepare, bucket, "attention planning (per step)")
    # Ops is a frozen dataclass shared by every layer: replacing its fields on this one instance times
    # every call without touching engine code.
    object.__setattr__(ops, "rms_norm", _timed(ops.rms_norm, bucket, "rms_norm (+residual add)"))
    object.__setattr__(ops, "rotary_embedding", _timed(ops.rotary_embedding, bucket, "rotary"))
    object.__setattr__(ops, "silu_and_mul", _timed(ops.silu_and_mul, bucket, "silu_and_mul"))


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
    inside = sum(v for k, v in families.items() if k != "attention planning (per step)")
    families["rest of forward (reshapes, splits, glue)"] = max(
        0.0, forward - inside - families.get("attention planning (per step)", 0.0)
    )
    ops_table = {
        k: {"s": round(v, 3), "share_of_wall": round(v / wall, 4)}
        for k, v in sorted(families.items(), key=lambda kv: -kv[1])
    }
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


def _format_families(workload: str, table: dict[str, dict[str, float]], wall: float, phases: dict[str, Any]) -> str:
    lines = [f"pagedq on {workload}: {wall:.2f} s wall, {phases['steps']} steps, {phases['mean_step_ms']:.1f} ms/step"]
    for name, row in table.items():
        lines.append(f"  {name:<45} {row['s']:>9.3f} s  {100 * row['share_of_wall']:>5.1f}%")
    return "\n".join(lines) + "\n"
