"""The prepared GPU check: one script, one GPU, under 8 minutes, a JSON report.

Run as ``bash ops/gpu_check.sh OUT_DIR`` (or ``python -m ops.gpu_check OUT_DIR``) on a machine with
CUDA. Steps: the kernel tests natively; greedy parity against transformers for a bf16 model with CUDA
graphs on and off; tensor parallelism over 2 GPUs (NCCL) against one GPU, when the machine has 2 or more
(skipped with a message otherwise); the benchmark harness's quick GPU workload. Each step's outcome and
timings go to
``OUT_DIR/gpu_check.json``; the exit status is non-zero if any step failed.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

# The parity model: big enough to exercise the kernels' tiling (GQA 8:2, head_dim 32), built in seconds.
CHECK_MODEL_SHAPE = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 32,
}


def _kernel_tests(out: Path) -> dict[str, Any]:
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "tests/test_kernels.py",
        "tests/test_triton_engine.py",
        f"--junitxml={out / 'kernels.xml'}",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    tail = (proc.stdout + proc.stderr).strip().splitlines()[-15:]
    return {"ok": proc.returncode == 0, "returncode": proc.returncode, "tail": tail}


def _parity(out: Path) -> dict[str, Any]:
    import torch

    from engine import LLM, SamplingParams
    from tests.tiny_models import make_hf_model, make_tiny_checkpoint
    from tests.tiny_tokenizer import make_tokenizer

    del out
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp)
        make_tiny_checkpoint(path, "llama_gqa", **CHECK_MODEL_SHAPE)
        make_tokenizer(path)
        gen = torch.Generator().manual_seed(0)
        prompts = [
            torch.randint(1, 500, (int(n),), generator=gen).tolist()
            for n in torch.randint(5, 300, (24,), generator=gen)
        ]
        new_tokens = 32
        hf: Any = make_hf_model(path)
        hf = hf.to(device="cuda", dtype=torch.bfloat16)
        refs = []
        with torch.inference_mode():
            for p in prompts:
                x = torch.tensor([p], device="cuda")
                y = hf.generate(
                    x,
                    attention_mask=torch.ones_like(x),
                    max_new_tokens=new_tokens,
                    min_new_tokens=new_tokens,
                    do_sample=False,
                    pad_token_id=0,
                )
                refs.append(y[0, len(p) :].tolist())
        outputs = {}
        for graphs in (True, False):
            t0 = time.perf_counter()
            llm = LLM(str(path), device="cuda", dtype="bfloat16", cuda_graphs=graphs, max_num_seqs=32)
            res = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True))
            toks = [r.outputs[0].token_ids for r in res]
            outputs[graphs] = toks
            exact = sum(a == b for a, b in zip(toks, refs, strict=True))
            first8 = sum(a[:8] == b[:8] for a, b in zip(toks, refs, strict=True))
            stats = llm.stats()
            results[f"cuda_graphs_{'on' if graphs else 'off'}"] = {
                "prompts": len(prompts),
                "identical_to_transformers": exact,
                "first_8_identical": first8,
                "seconds": round(time.perf_counter() - t0, 2),
                "graphs_captured": llm.engine.runner.graphs is not None,
                "no_leak": stats.num_free_blocks == stats.num_total_blocks,
            }
            del llm
            torch.cuda.empty_cache()
        results["graphs_on_equals_off"] = outputs[True] == outputs[False]
    on, off = results["cuda_graphs_on"], results["cuda_graphs_off"]
    # bf16 rounding differs between kernels, so a near-tie may flip late in a sequence; the first
    # tokens and most whole sequences must agree, and graphs must not change anything.
    results["ok"] = bool(
        results["graphs_on_equals_off"]
        and on["graphs_captured"]
        and all(
            r["first_8_identical"] == r["prompts"]
            and r["identical_to_transformers"] >= 0.75 * r["prompts"]
            and r["no_leak"]
            for r in (on, off)
        )
    )
    return results


def _tensor_parallel(out: Path) -> dict[str, Any]:
    """TP=2 (NCCL, two GPUs) against TP=1 on the parity model in bf16: the same agreement bar as the
    parity step (an all-reduce of bf16 partial sums rounds differently from one matmul), no KV leak, and
    each rank holding under two thirds of the whole model's weights. Skipped below 2 GPUs."""
    import torch

    from engine import LLM, SamplingParams
    from tests.tiny_models import make_tiny_checkpoint
    from tests.tiny_tokenizer import make_tokenizer

    del out
    gpus = torch.cuda.device_count()
    if gpus < 2:
        message = f"skipped: tensor parallelism needs 2 or more GPUs, this machine has {gpus}"
        print(f"tensor_parallel {message}", flush=True)
        return {"ok": True, "skipped": message}
    results: dict[str, Any] = {"gpus": gpus}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp)
        make_tiny_checkpoint(path, "llama_gqa", **CHECK_MODEL_SHAPE)
        make_tokenizer(path)
        gen = torch.Generator().manual_seed(1)
        prompts = [
            torch.randint(1, 500, (int(n),), generator=gen).tolist()
            for n in torch.randint(5, 300, (24,), generator=gen)
        ]
        params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
        outputs: dict[int, list[list[int]]] = {}
        for size in (1, 2):
            t0 = time.perf_counter()
            with LLM(str(path), device="cuda", dtype="bfloat16", max_num_seqs=32, tensor_parallel_size=size) as llm:
                outputs[size] = [r.outputs[0].token_ids for r in llm.generate(prompts, params)]
                stats = llm.stats()
            results[f"tp{size}"] = {
                "seconds": round(time.perf_counter() - t0, 2),
                "rank_weight_bytes": stats.rank_weight_bytes,
                "rank_kv_bytes": stats.rank_kv_bytes,
                "no_leak": stats.num_free_blocks == stats.num_total_blocks,
            }
            torch.cuda.empty_cache()
    pairs = list(zip(outputs[2], outputs[1], strict=True))
    results["identical_to_tp1"] = sum(a == b for a, b in pairs)
    results["first_8_identical"] = sum(a[:8] == b[:8] for a, b in pairs)
    whole = results["tp1"]["rank_weight_bytes"][0]
    results["ok"] = bool(
        results["first_8_identical"] == len(prompts)
        and results["identical_to_tp1"] >= 0.75 * len(prompts)
        and results["tp1"]["no_leak"]
        and results["tp2"]["no_leak"]
        and all(w < 2 * whole / 3 for w in results["tp2"]["rank_weight_bytes"])
    )
    return results


def _bench(out: Path) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "ops.bench", "--quick", "--device", "cuda", "--json", str(out / "bench.json")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    tail = (proc.stdout + proc.stderr).strip().splitlines()[-30:]
    return {"ok": proc.returncode == 0, "returncode": proc.returncode, "tail": tail}


STEPS = (("kernels", _kernel_tests), ("parity", _parity), ("tensor_parallel", _tensor_parallel), ("bench", _bench))


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m ops.gpu_check OUT_DIR", file=sys.stderr)
        return 2
    out = Path(argv[0])
    out.mkdir(parents=True, exist_ok=True)
    import torch

    report: dict[str, Any] = {"cuda": torch.cuda.is_available()}
    if not torch.cuda.is_available():
        report["error"] = "no CUDA device"
    else:
        report["device"] = torch.cuda.get_device_name(0)
        for name, step in STEPS:
            t0 = time.perf_counter()
            try:
                report[name] = step(out)
            except Exception:  # a failed step is reported; the others still run
                report[name] = {"ok": False, "error": traceback.format_exc(limit=5)}
            report[name]["seconds"] = round(time.perf_counter() - t0, 1)
            print(name, json.dumps(report[name])[:2000], flush=True)
    ok = report.get("cuda", False) and all(report[name]["ok"] for name, _ in STEPS)
    report["ok"] = bool(ok)
    (out / "gpu_check.json").write_text(json.dumps(report, indent=2))
    print(f"gpu check {'passed' if ok else 'FAILED'}: {out / 'gpu_check.json'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
