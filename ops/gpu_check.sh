#!/usr/bin/env bash
# The prepared GPU check (one GPU, < 8 minutes): kernel tests natively, bf16 greedy parity with CUDA
# graphs on and off, tensor parallelism TP=2 vs TP=1 when 2+ GPUs are visible (skipped with a message
# otherwise), the benchmark's quick GPU workload. Usage: bash ops/gpu_check.sh OUT_DIR
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:?usage: bash ops/gpu_check.sh OUT_DIR}"
python3 -c "import torch, triton, transformers" 2>/dev/null || python3 -m pip install -q -e ".[dev,triton]"
export PYTHONUNBUFFERED=1
timeout 470 python3 -m ops.gpu_check "$out"
