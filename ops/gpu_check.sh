#!/usr/bin/env bash
# The prepared GPU check (one GPU, < 8 minutes): kernel tests natively, bf16 greedy parity with CUDA
# graphs on and off, tensor parallelism TP=2 vs TP=1 when 2+ GPUs are visible (skipped with a message
# otherwise), the benchmark's quick GPU workload. Usage: bash ops/gpu_check.sh OUT_DIR
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:?usage: bash ops/gpu_check.sh OUT_DIR}"
# A machine that reaches no registry: the wheels ops/gpu_wheels.sh put in .whl/, installed beside the image's own.
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/pagedq-site .whl/*.whl
    export PYTHONPATH="/tmp/pagedq-site${PYTHONPATH:+:$PYTHONPATH}"
fi
python3 -c "import torch, triton, transformers, pydantic_settings, structlog" 2>/dev/null || python3 -m pip install -q -e ".[dev,triton]"
export PYTHONUNBUFFERED=1
timeout 470 python3 -m ops.gpu_check "$out"
