"""Runs one bench workload in vLLM's CPU build, inside vLLM's own virtualenv (``ops/bench/vllm_env.sh``).

Why a separate script: vLLM's CPU wheel brings its own torch and dependency pins, which cannot share a
process (or an environment) with pagedq's. So the bench (``VLLMCPUSystem`` in ``ops/bench/vllm_system.py``)
starts this file with the venv's interpreter, hands it the workload as JSON and reads the results back as
JSON. JSON, never pickle: the two sides run different Python environments, and nothing here may import
pagedq (its modules load the main environment's torch). Only the standard library is imported at module level.

Protocol (``python vllm_cpu_runner.py REQUEST.json RESULT.json``):

* request: ``{"backend": "vllm" | "transformers", "model": path, "dtype": "float32", "seed": 0,
  "max_num_seqs": n, "max_num_batched_tokens": n, "enable_prefix_caching": bool, "speculative": null |
  {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": a, "prompt_lookup_max": b, ...},
  "warmup_prompt": [ids], "requests": [{"prompt_ids": [ids], "max_tokens": n}, ...]}``
* result: ``{"status": "ok", "load_s", "wall_s", "cpu_s" (or null), "outputs": [[ids], ...], "cached_tokens",
  "versions": {...}, "speculative": {...} or null}``, or ``{"status": "failed", "reason": "..."}``.

Every request is greedy (temperature 0) with EOS ignored and asks for exactly ``max_tokens`` tokens, as
pagedq is asked. The ``transformers`` backend is a plain greedy loop, one request at a time: it lets the tests
run this protocol end to end on the tiny model where vLLM is not installed (CI); the bench never uses it.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

# Run as a script, Python puts this folder first on sys.path, and its neighbours would shadow the standard
# library for vLLM and transformers (``profile.py`` hides ``profile``, which ``cProfile`` needs).
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]


def _descendant_cpu_s() -> float | None:
    """CPU seconds of this process and its children (vLLM runs its engine core in a child process), or
    None without psutil (a vLLM dependency, so present in its venv)."""
    try:
        import psutil
    except ImportError:
        return None
    total = 0.0
    me = psutil.Process()
    for proc in [me, *me.children(recursive=True)]:
        try:
            times = proc.cpu_times()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        total += times.user + times.system
    return total


def _cpu_delta(start: float | None) -> float | None:
    end = _descendant_cpu_s()
    return None if start is None or end is None else end - start


def run_vllm(req: dict[str, Any]) -> dict[str, Any]:
    """The workload through ``vllm.LLM.generate``: token-id prompts, greedy, EOS ignored."""
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kwargs: dict[str, Any] = {
        "model": req["model"],
        "dtype": req["dtype"],
        "seed": req["seed"],
        "max_num_seqs": req["max_num_seqs"],
        "max_num_batched_tokens": req["max_num_batched_tokens"],
        "enable_prefix_caching": req["enable_prefix_caching"],
    }
    if req.get("max_model_len"):
        kwargs["max_model_len"] = req["max_model_len"]
    spec = req.get("speculative")
    if spec:
        kwargs["speculative_config"] = spec
        kwargs["disable_log_stats"] = False  # the draft/accepted counters (get_metrics) need stats on
    t0 = time.perf_counter()
    llm = LLM(**kwargs)
    warm = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    llm.generate([TokensPrompt(prompt_token_ids=req["warmup_prompt"])], warm, use_tqdm=False)
    load_s = time.perf_counter() - t0
    spec0 = _spec_counters(llm)

    prompts = [TokensPrompt(prompt_token_ids=r["prompt_ids"]) for r in req["requests"]]
    params = [SamplingParams(max_tokens=r["max_tokens"], temperature=0.0, ignore_eos=True) for r in req["requests"]]
    cpu0 = _descendant_cpu_s()
    t1 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t1
    cpu_s = _cpu_delta(cpu0)
    spec1 = _spec_counters(llm)
    outputs = [list(o.outputs[0].token_ids) for o in outs]
    cached = sum(int(getattr(o, "num_cached_tokens", 0) or 0) for o in outs)
    # Stop the engine-core child now rather than at interpreter exit (the bench waits for this process);
    # where this version lays its engine out differently, interpreter exit still cleans up.
    with contextlib.suppress(Exception):
        llm.llm_engine.engine_core.shutdown()
    speculative = None
    if spec and spec0 is not None and spec1 is not None:
        drafts, accepted = spec1[0] - spec0[0], spec1[1] - spec0[1]
        speculative = {
            "num_speculative_tokens": spec.get("num_speculative_tokens", 0),
            "draft_tokens": drafts,
            "accepted_tokens": accepted,
            "acceptance": round(accepted / drafts, 4) if drafts else 0.0,
        }
    return {
        "status": "ok",
        "load_s": load_s,
        "wall_s": wall,
        "cpu_s": cpu_s,
        "outputs": outputs,
        "cached_tokens": cached,
        "versions": {"vllm": vllm.__version__, **_torch_version()},
        "speculative": speculative,
    }


def _spec_counters(llm: Any) -> tuple[int, int] | None:
    """vLLM's draft and accepted token counters (V1 metrics), or None where this version lacks them."""
    try:
        metrics = llm.get_metrics()
    except Exception:
        return None
    drafts = accepted = 0
    found = False
    for m in metrics:
        name = getattr(m, "name", "")
        value = getattr(m, "value", None)
        if not isinstance(value, int | float):
            continue
        if name.endswith("spec_decode_num_draft_tokens"):
            drafts, found = int(value), True
        elif name.endswith("spec_decode_num_accepted_tokens"):
            accepted, found = int(value), True
    return (drafts, accepted) if found else None


def _torch_version() -> dict[str, str]:
    try:
        import torch
    except ImportError:
        return {}
    return {"torch": str(torch.__version__)}


def run_transformers(req: dict[str, Any]) -> dict[str, Any]:
    """The same protocol through a plain transformers greedy loop (the tests' stand-in for vLLM)."""
    import torch
    from transformers import AutoModelForCausalLM

    dtype = getattr(torch, req["dtype"])
    torch.manual_seed(req["seed"])
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(req["model"], dtype=dtype).eval()
    load_s = time.perf_counter() - t0

    def greedy(prompt: list[int], n: int) -> list[int]:
        ids = torch.tensor([prompt])
        out: list[int] = []
        past = None
        with torch.inference_mode():
            for _ in range(n):
                res = model(input_ids=ids, past_key_values=past, use_cache=True)
                past = res.past_key_values
                nxt = int(res.logits[0, -1].float().argmax())
                out.append(nxt)
                ids = torch.tensor([[nxt]])
        return out

    greedy(req["warmup_prompt"], 2)
    cpu0 = time.process_time()
    t1 = time.perf_counter()
    outputs = [greedy(r["prompt_ids"], r["max_tokens"]) for r in req["requests"]]
    wall = time.perf_counter() - t1
    return {
        "status": "ok",
        "load_s": load_s,
        "wall_s": wall,
        "cpu_s": time.process_time() - cpu0,
        "outputs": outputs,
        "cached_tokens": 0,
        "versions": _torch_version(),
        "speculative": None,
    }


BACKENDS = {"vllm": run_vllm, "transformers": run_transformers}


def main(argv: list[str]) -> int:
    """Read the request, run it, write the result; a failure is written as a result too (with its traceback's
    last lines), so the bench can say exactly how the run failed."""
    if len(argv) != 3:
        print(f"usage: {argv[0]} REQUEST.json RESULT.json", file=sys.stderr)
        return 2
    req = json.loads(Path(argv[1]).read_text(encoding="utf-8"))
    result_path = Path(argv[2])
    try:
        backend = BACKENDS[req.get("backend", "vllm")]
        result = backend(req)
    except BaseException as exc:  # reported to the bench, which says how the run failed
        tb = traceback.format_exc().strip().splitlines()[-6:]
        result = {"status": "failed", "reason": f"{type(exc).__name__}: {exc}", "traceback": tb}
    tmp = result_path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result), encoding="utf-8")
    os.replace(tmp, result_path)
    return 0 if result["status"] == "ok" else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
