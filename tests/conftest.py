"""Shared fixtures: tiny random-weight checkpoints (with a real byte-level BPE tokenizer)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

# Triton kernels run on the CPU through the interpreter here. The variable must be set before
# anything imports triton (transformers does, below), or triton's helpers are the compiled kind.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# dtype="auto" picks bf16 matmuls on CPUs with AMX or AVX512-bf16. The suite's exact-parity tests (against
# transformers in fp32, and between engine features) need fp32 whatever CPU CI lands on: cap the
# instruction set below bf16 for the whole run, worker subprocesses included. Tests of the bf16 path lift
# the cap themselves (tests/test_bf16.py).
os.environ.setdefault("PAGEDQ_CPU_ISA", "avx512")

from pagedq_kernels import c_build, cpu_isa
from tests.tiny_models import make_tiny_checkpoint
from tests.tiny_tokenizer import make_tokenizer

# Tests run tiny models (where thread start-up costs more than it saves) and often several
# processes at once (worker tests): one intra-op thread each avoids oversubscribing the cores,
# which with OpenMP's spinning threads slows everything down by an order of magnitude.
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests of the real default model (``realmodel``: a 135M-parameter conversion and forward passes)
    belong to the slow tier: ``make test`` stays under 5 minutes, ``make test-slow`` and CI run them."""
    for item in items:
        if item.get_closest_marker("realmodel") is not None:
            item.add_marker(pytest.mark.slow)


# The engine's CPU KV budget where a test on a tiny model sets none. The tiny models fill a few MB of it,
# while the product's 2 GiB default is zeroed up front (host_memory pre-faults it) and split into ~175k of
# their small blocks at every LLM(): 0.5-0.8 s per construction, ~70 s of the default tier on a 2-core AMD
# EPYC (315 -> 244 s). Tests that size the cache pass kv_cache_bytes or num_kv_blocks as before; tests of
# the real model, and worker subprocesses, keep the product's default.
TEST_KV_CACHE_BYTES = 256 * 1024**2


@pytest.fixture(autouse=True)
def small_default_kv_cache(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    if request.node.get_closest_marker("realmodel") is None:
        monkeypatch.setattr("engine.model_runner.DEFAULT_CPU_KV_CACHE_BYTES", TEST_KV_CACHE_BYTES)


@pytest.fixture(params=cpu_isa.current().runnable_variants)
def isa_variant(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each C-kernel build this machine can run (generic, avx2, avx512...), selected as an operator would,
    through the ``PAGEDQ_CPU_ISA`` cap: a test using it runs once per variant against the torch reference."""
    variant: str = request.param
    if variant != "native":
        monkeypatch.setenv(cpu_isa.ENV_CAP, variant)
        assert c_build.variant() == variant
    return variant


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """``tiny_model(arch)`` -> folder of a tiny checkpoint with tokenizer, built once per session."""
    built: dict[str, Path] = {}

    def get(arch: str = "llama_gqa") -> Path:
        if arch not in built:
            path = tmp_path_factory.mktemp(f"tiny-{arch}")
            make_tiny_checkpoint(path, arch)
            make_tokenizer(path)
            built[arch] = path
        return built[arch]

    return get


@pytest.fixture(scope="session")
def model_dir(tiny_model: Callable[[str], Path]) -> Path:
    """The tiny Llama checkpoint the worker tests serve (a module may define its own ``model_dir``)."""
    return tiny_model("llama_gqa")


@pytest.fixture(scope="session")
def engine(model_dir: Path) -> Any:
    """One engine over :func:`model_dir` with the worker tests' sizes, shared by the modules that do not
    define their own (each worker test checks it leaves no request and no KV block behind)."""
    from tests.worker_harness import make_engine

    return make_engine(model_dir)


@dataclass
class Prepared:
    path: Path
    models_dir: Path
    log: list[str]
    seconds: float


@pytest.fixture(scope="session")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Prepared]:
    """The default SmolLM2 model, really converted once per session into a tmp PAGEDQ_MODEL_DIR
    (never the user's cache); skipped with the reason where its package cannot be installed."""
    from engine.default_model import DefaultModelUnavailable, find_default_gguf, prepare_default_model

    try:
        find_default_gguf()
    except DefaultModelUnavailable as exc:
        pytest.skip(f"default model source not installed: {exc}")
    models_dir = tmp_path_factory.mktemp("models")
    lines: list[str] = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PAGEDQ_MODEL_DIR", str(models_dir))
        started = time.monotonic()
        path = prepare_default_model(log=lines.append)
        seconds = time.monotonic() - started
    print(f"\nprepared {path} in {seconds:.1f}s")
    yield Prepared(path, models_dir, lines, seconds)
