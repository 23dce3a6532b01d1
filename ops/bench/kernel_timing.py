"""Times each C kernel under each instruction-set variant this CPU runs, on SmolLM2-135M's shapes.

Not a test and not part of ``pagedq bench``: the numbers that decide whether a variant keeps its own
code path (the comments beside each choice in ``pagedq_kernels/csrc`` quote them). Variants are switched in one
process through the ``PAGEDQ_CPU_ISA`` cap, interleaved, and each case reports its fastest of several
rounds, because on a shared machine one round can land far either way.

    python -m ops.bench.kernel_timing [--rounds 7] [--kv-dtype float32|bfloat16] [--only decode]

``--linears`` times the bf16 matmuls instead (no ISA variants: the packed kinds of ``pagedq_kernels/cpu_linear``
side by side, pagedq's AMX or AVX512-bf16 kernel against oneDNN, and beside them the W8A8 kernels that run here,
``pagedq_kernels/w8a8_linear``, and the weight-only int8 kernels a bf16 model's ``quantization="int8"`` (``int8``)
and GGUF (``q4_1``: Q4_1's layout) weights take; ``--linear-dtype float32``: the C panels) in GFLOP/s (W8A8:
integer GOP/s) over SmolLM2's projections and lm_head.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time
from collections.abc import Callable

import torch

from engine.layers import build_cos_sin_cache
from pagedq_kernels import cpu_attention, cpu_isa, cpu_linear, cpu_ops, host_memory, int8_linear, w8a8_linear

HEADS, KV_HEADS, HEAD_DIM, HIDDEN, INTER, BLOCK = 9, 3, 64, 576, 1536, 16  # SmolLM2-135M
VOCAB, LAYERS = 49152, 30
# name: (in_features, out_features, glu): the decoder's projections (gate_up fused with its SiLU-and-mul
# where the kind allows; else the product then the C SiLU-and-mul, as the engine runs it) and the lm_head.
LINEAR_SHAPES = {
    "qkv 576->960": (HIDDEN, (HEADS + 2 * KV_HEADS) * HEAD_DIM, False),
    "o 576->576": (HEADS * HEAD_DIM, HIDDEN, False),
    "gate_up 576->2x1536 glu": (HIDDEN, 2 * INTER, True),
    "down 1536->576": (INTER, HIDDEN, False),
    "lm_head 576->49152": (HIDDEN, VOCAB, False),
}
LINEAR_ROWS = (1, 4, 8, 12, 36, 64, 256, 2048)


def _paged_cache(
    seq_lens: list[int], head_dim: int, kv_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Caches with every sequence's blocks scattered (a shuffled block pool), and their block tables."""
    blocks = [-(-n // BLOCK) for n in seq_lens]
    order = torch.randperm(sum(blocks) + 1).tolist()
    tables = torch.zeros(len(seq_lens), max(blocks), dtype=torch.int32)
    for i, nb in enumerate(blocks):
        tables[i, :nb] = torch.tensor([order.pop() for _ in range(nb)], dtype=torch.int32)
    shape = (sum(blocks) + 1, BLOCK, KV_HEADS, head_dim)
    # In huge pages where the kernel grants them, as the engine's cache (pagedq_kernels/host_memory.py).
    k_cache, v_cache = host_memory.empty(shape, kv_dtype), host_memory.empty(shape, kv_dtype)
    k_cache.copy_(torch.randn(shape))
    v_cache.copy_(torch.randn(shape))
    return k_cache, v_cache, tables


def decode_case(
    num_seqs: int,
    seq_len: int,
    head_dim: int,
    kv_dtype: torch.dtype,
    layers: int = 1,
    queries: int = 1,
    prefill_kernel: bool = False,
) -> Callable[[], None]:
    """One decode step's attention; with ``layers`` > 1, each call attends the next of that many layers'
    caches in turn, as a model's step does: its K/V then come from memory, not from the caches. With
    ``queries`` > 1, each sequence's last ``queries`` positions attend (speculative verification): through
    the decode kernel where it takes several per sequence (the engine's choice, engine/attention.py), else,
    or with ``prefill_kernel``, through the prefill kernel."""
    caches: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # built on the first (untimed) call
    q = torch.randn(num_seqs * queries, HEADS, head_dim)
    out = torch.empty_like(q)
    rows = torch.arange(num_seqs) * queries
    lens = torch.full((num_seqs,), seq_len, dtype=torch.int32)
    q_lens = torch.full((num_seqs,), queries, dtype=torch.int32)
    layer = iter(range(1 << 62))

    def run() -> None:
        if not caches:
            caches.extend(_paged_cache([seq_len] * num_seqs, head_dim, kv_dtype) for _ in range(layers))
        k_cache, v_cache, tables = caches[next(layer) % layers]
        scale = head_dim**-0.5
        if queries == 1:
            cpu_attention.paged_decode_attention(q, k_cache, v_cache, out, rows, lens, tables, scale, cascade=False)
        elif not prefill_kernel and cpu_attention.multi_query_supported(kv_dtype):
            cpu_attention.paged_decode_attention(
                q, k_cache, v_cache, out, rows, lens, tables, scale, cascade=False, q_lens=q_lens
            )
        else:
            cpu_attention.paged_prefill_attention(q, k_cache, v_cache, out, rows, q_lens, lens, tables, scale)

    return run


def prefill_case(num_seqs: int, seq_len: int, kv_dtype: torch.dtype, cached: int = 0) -> Callable[[], None]:
    """``num_seqs`` chunks of ``seq_len`` new queries, each after ``cached`` positions already in the cache.
    Over a bf16 cache the ``avx512_bf16`` column runs the products on AVX512-bf16 dot products, the ``avx512``
    column on K/V widened to fp32."""
    total = cached + seq_len
    k_cache, v_cache, tables = _paged_cache([total] * num_seqs, HEAD_DIM, kv_dtype)
    q = torch.randn(num_seqs * seq_len, HEADS, HEAD_DIM)
    out = torch.empty_like(q)
    starts = torch.arange(num_seqs, dtype=torch.int64) * seq_len
    q_lens = torch.full((num_seqs,), seq_len, dtype=torch.int32)
    lens = torch.full((num_seqs,), total, dtype=torch.int32)
    return lambda: cpu_attention.paged_prefill_attention(q, k_cache, v_cache, out, starts, q_lens, lens, tables, 0.125)


def ops_cases(rows: int) -> dict[str, Callable[[], object]]:
    x, res, w = torch.randn(rows, HIDDEN), torch.randn(rows, HIDDEN), torch.randn(HIDDEN)
    gate_up = torch.randn(rows, 2 * INTER)
    qkv = torch.randn(rows, (HEADS + 2 * KV_HEADS) * HEAD_DIM)
    q = qkv[:, : HEADS * HEAD_DIM].view(rows, HEADS, HEAD_DIM)
    k = qkv[:, HEADS * HEAD_DIM : (HEADS + KV_HEADS) * HEAD_DIM].view(rows, KV_HEADS, HEAD_DIM)
    cache = build_cos_sin_cache(HEAD_DIM, 8192, 100000.0, None)
    positions = torch.randint(0, 8192, (rows,))
    return {
        f"rms_norm+residual {rows}x{HIDDEN}": lambda: cpu_ops.rms_norm_cpu(x, w, 1e-5, res),
        f"rotary {rows}x({HEADS}+{KV_HEADS})x{HEAD_DIM}": lambda: cpu_ops.rotary_embedding_cpu(positions, q, k, cache),
        f"silu_and_mul {rows}x{INTER}": lambda: cpu_ops.silu_and_mul_cpu(gate_up),
    }


def linear_case(
    kind: cpu_linear.Kind, k: int, n: int, glu: bool, rows: int, dtype: torch.dtype
) -> Callable[[], object] | None:
    """One linear with ``dtype`` weights under fp32 activations, as the engine calls it. Each call multiplies
    the next of ``LAYERS`` copies of the weight (the lm_head: one, 57 MB in bf16 already), so at decode sizes
    the weight comes from memory as in a model step, not from a cache that one repeated weight would sit in."""
    g = torch.Generator().manual_seed(n * k)
    dense = [torch.randn(n, k, generator=g) * k**-0.5 for _ in range(1 if n == VOCAB else LAYERS)]
    fused = glu and kind in ("panels", *cpu_linear.BF16_KINDS)  # the kinds with SiLU-and-mul in their epilogue
    if fused:
        packed = [cpu_linear.pack_gated(w, dtype) for w in dense]
    else:
        packed = [cpu_linear.pack(w, kind, dtype=dtype) for w in dense]
    if any(p is None or p.kind != kind for p in packed):
        return None
    ready = [p for p in packed if p is not None]
    x = torch.randn(rows, k, generator=g)
    layer = iter(range(1 << 62))
    if glu and not fused:
        return lambda: cpu_ops.silu_and_mul_cpu(cpu_linear.linear(x, ready[next(layer) % len(ready)], None))
    return lambda: cpu_linear.linear(x, ready[next(layer) % len(ready)], None)


def w8a8_case(kind: w8a8_linear.Kind, k: int, n: int, glu: bool, rows: int) -> Callable[[], object] | None:
    """:func:`linear_case` for a W8A8 kernel: per-channel int8 copies of the weight, x quantised per call as the
    engine's linears do; gate_up through the VNNI kernel's glu epilogue, or oneDNN's product then the row-scaled
    C SiLU-and-mul. None for the lm_head (the engine keeps it in the activation dtype)."""
    if n == VOCAB:
        return None
    g = torch.Generator().manual_seed(n * k)
    int8 = [int8_linear.quantize_per_channel(torch.randn(n, k, generator=g) * k**-0.5) for _ in range(LAYERS)]
    packed = [w8a8_linear.pack(w, kind) for w in int8]
    ready = [p for p in packed if p is not None]
    if len(ready) != len(packed):
        return None
    gated = [w8a8_linear.gated(p) for p in ready] if glu else []
    x = torch.randn(rows, k, generator=g)
    layer = iter(range(1 << 62))
    if glu and not all(gated):

        def unscaled() -> object:
            product, row_scales = w8a8_linear.matmul_unscaled(x, ready[next(layer) % len(ready)])
            return cpu_ops.silu_and_mul_cpu(product, row_scale=row_scales)

        return unscaled
    weights = [p for p in gated if p is not None] if glu else ready
    return lambda: w8a8_linear.linear(x, weights[next(layer) % len(weights)], None)


def int8_case(k: int, n: int, glu: bool, rows: int, group: int) -> Callable[[], object] | None:
    """:func:`linear_case` for a weight-only int8 weight under a bf16 model, as ``int8_linear.pack`` places it
    (AMX tiles, or the AVX512-bf16 kernel's widening): ``group`` == k per-channel (``quantization="int8"``),
    else GGUF-like groups with offsets (Q4_1's layout: 4-bit codes, a scale and a minimum per 32). None where the
    kernel does not take it, and for the lm_head (kept in the activation dtype)."""
    if n == VOCAB:
        return None
    g = torch.Generator().manual_seed(n * k + group)
    weights = []
    for _ in range(LAYERS):
        if group == k:
            weights.append(int8_linear.quantize_per_channel(torch.randn(n, k, generator=g) * k**-0.5))
            continue
        values = torch.randint(0, 16, (n, k), generator=g, dtype=torch.int8)
        scales = torch.rand(n, k // group, generator=g) * 0.01
        offsets = -8 * scales
        weights.append(int8_linear.Int8Weight(values, scales, offsets, group))
    packed = [int8_linear.pack(w, glu=glu, matmul_dtype=torch.bfloat16) for w in weights]
    ready = [p for p in packed if p is not None and p.amx]
    if len(ready) != len(packed):
        return None
    x = torch.randn(rows, k, generator=g)
    layer = iter(range(1 << 62))
    return lambda: int8_linear.linear(x, ready[next(layer) % len(ready)], None)


def time_linears(rounds: int, only: str, dtype: torch.dtype) -> None:
    """GFLOP/s of each linear kind for ``dtype`` weights (fastest of ``rounds`` interleaved rounds) per shape
    and row count: bf16's AMX or dpbf16 / oneDNN kinds, or fp32's C panels and oneDNN. dpbf16 twice, with its
    products on VDPBF16PS (``dpbf16``) and on fp32 FMAs (``dpbf16/f``): the numbers behind
    ``CpuIsa.bf16_products_on_fma``."""
    kinds = [k for k in cpu_linear.available_kinds(dtype) if dtype == torch.float32 or k != "panels"]
    if not kinds:
        raise SystemExit("no bf16 matmul kind runs here (the CPU probe found no AMX or AVX512-bf16)")
    # label: (kind, products on FMAs: None where the kind has no such choice)
    labels: dict[str, tuple[str, bool | None]] = {}
    for kind in kinds:
        if kind == "dpbf16":
            labels["dpbf16"], labels["dpbf16/f"] = (kind, False), (kind, True)
        else:
            labels[kind] = (kind, None)
    int8_kinds = w8a8_linear.available_kinds() if dtype == torch.bfloat16 else []
    labels |= {f"w8a8/{int8_kind}": (f"w8a8/{int8_kind}", None) for int8_kind in int8_kinds}
    # weight-only int8 (label: group, 0 = per channel) where a bf16 kernel takes it
    weight_only = {"int8": 0, "q4_1": 32} if dtype == torch.bfloat16 else {}
    labels |= {label: (label, None) for label in weight_only}
    best: dict[tuple[str, str, int], float] = {}
    for name, (k, n, glu) in LINEAR_SHAPES.items():
        if only not in name:
            continue
        made: dict[tuple[str, int], Callable[[], object] | None] = {
            (kind, rows): linear_case(kind, k, n, glu, rows, dtype) for kind in kinds for rows in LINEAR_ROWS
        }
        for int8_kind in int8_kinds:
            made |= {(f"w8a8/{int8_kind}", rows): w8a8_case(int8_kind, k, n, glu, rows) for rows in LINEAR_ROWS}
        for label, group in weight_only.items():
            made |= {(label, rows): int8_case(k, n, glu, rows, group or k) for rows in LINEAR_ROWS}
        for _ in range(rounds):
            for label, (made_as, on_fma) in labels.items():
                for rows in LINEAR_ROWS:
                    fn = made[made_as, rows]
                    if fn is None:
                        continue
                    with cpu_linear.dp_products(on_fma) if on_fma is not None else contextlib.nullcontext():
                        t = fastest(fn, 0.1)
                    best[name, label, rows] = min(best.get((name, label, rows), float("inf")), t)
        del made  # the weight copies: a few hundred MB per shape
    label_text = "bf16" if dtype == torch.bfloat16 else "fp32"
    print(f"threads={torch.get_num_threads()} {label_text} weights, fp32 x (GFLOP/s, fastest of {rounds} rounds)")
    print(f"{'linear':26s}{'kind':>12s}" + "".join(f"{'M=' + str(r):>9s}" for r in LINEAR_ROWS))
    for name, (k, n, _) in LINEAR_SHAPES.items():
        for label in labels:
            cells = [best.get((name, label, r)) for r in LINEAR_ROWS]
            pairs = zip(LINEAR_ROWS, cells, strict=True)
            text = [f"{2 * r * k * n / t / 1e9:9.0f}" if t else f"{'-':>9s}" for r, t in pairs]
            if any(t for t in cells):
                print(f"{name:26s}{label:>12s}" + "".join(text))


def fastest(fn: Callable[[], object], seconds: float = 0.2) -> float:
    """Fastest call (s) among as many as fit in ``seconds`` (at least 3), after one warm-up."""
    fn()
    best, spent, calls = float("inf"), 0.0, 0
    while spent < seconds or calls < 3:
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        best, spent, calls = min(best, dt), spent + dt, calls + 1
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--kv-dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--only", default="", help="run only the cases whose name contains this")
    parser.add_argument("--linears", action="store_true", help="time the linear kinds instead")
    parser.add_argument(
        "--linear-dtype", choices=["bfloat16", "float32"], default="bfloat16", help="weights for --linears"
    )
    args = parser.parse_args()
    if args.linears:
        torch.manual_seed(0)
        time_linears(args.rounds, args.only, getattr(torch, args.linear_dtype))
        return
    kv_dtype = getattr(torch, args.kv_dtype)
    variants: list[str] = [v for v in cpu_isa.current().runnable_variants if v != "generic"]
    if "avx512_bf16" in cpu_isa.current().probed:
        # The avx512 build with AVX512-bf16 allowed: a bf16 cache's attention on VDPBF16PS
        # (pagedq_kernels/cpu_attention.py dp_attention_enabled), beside the same build's fp32 arithmetic.
        variants.append("avx512_bf16")
    torch.manual_seed(0)
    cases: dict[str, Callable[[], object]] = {
        "decode 64 seqs x 350": decode_case(64, 350, HEAD_DIM, kv_dtype),
        "decode 64 seqs x 700": decode_case(64, 700, HEAD_DIM, kv_dtype),
        # 30 layers (SmolLM2-135M's): 0.5 GB of bf16 K/V, 1 GB of fp32, read from memory as in a model step
        "decode 64 seqs x 350, 30 layers": decode_case(64, 350, HEAD_DIM, kv_dtype, layers=30),
        "decode 1 seq x 2000": decode_case(1, 2000, HEAD_DIM, kv_dtype),
        "decode 32 seqs x 350, head_dim 80": decode_case(32, 350, 80, kv_dtype),
        "decode 32 seqs x 350, head_dim 20": decode_case(32, 350, 20, kv_dtype),
        # speculative verification, 1 + 8 drafts: the engine's kernel, and the prefill kernel beside it
        "verify 64 seqs x 350, 9 queries, 30 layers": decode_case(64, 350, HEAD_DIM, kv_dtype, 30, 9),
        "verify ... prefill kernel": decode_case(64, 350, HEAD_DIM, kv_dtype, 30, 9, prefill_kernel=True),
        "prefill 4 x 256": prefill_case(4, 256, kv_dtype),
        # the engine's 2048-token prefill steps: 8 prompts of 256, a 256-token chunk after 256 cached, one 2048
        "prefill 8 x 256": prefill_case(8, 256, kv_dtype),
        "prefill 1 x 256 after 256": prefill_case(1, 256, kv_dtype, cached=256),
        "prefill 1 x 2048": prefill_case(1, 2048, kv_dtype),
        **ops_cases(128),
        **ops_cases(2048),
    }
    cases = {name: fn for name, fn in cases.items() if args.only in name}
    best: dict[tuple[str, str], float] = {}
    for _ in range(args.rounds):
        for variant in variants:
            os.environ[cpu_isa.ENV_CAP] = variant
            for name, fn in cases.items():
                t = fastest(fn)
                best[name, variant] = min(best.get((name, variant), float("inf")), t)
    print(f"threads={torch.get_num_threads()} kv_dtype={args.kv_dtype} (fastest of {args.rounds} rounds, ms)")
    print(f"{'case':42s}" + "".join(f"{v:>12s}" for v in variants))
    for name in cases:
        print(f"{name:42s}" + "".join(f"{best[name, v] * 1e3:12.3f}" for v in variants))


if __name__ == "__main__":
    main()
