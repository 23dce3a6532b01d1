# pagedq worker image.
#   CPU (default):  docker build -t pagedq .
#   CUDA:           docker build --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 \
#                                --build-arg EXTRAS=triton -t pagedq:cuda .
# torch is installed first, from the chosen index, so that installing pagedq does not pull the (GBs)
# CUDA build of torch into the CPU image, and so that this layer is cached across source changes.
FROM python:3.11-slim

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ARG EXTRAS=""

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PAGEDQ_LOG_FORMAT=json \
    PAGEDQ_METRICS_HOST=0.0.0.0 \
    PAGEDQ_METRICS_PORT=9400 \
    PAGEDQ_DATA_DIR=/data

RUN pip install --index-url "${TORCH_INDEX}" "torch==${TORCH_VERSION}"

WORKDIR /app
COPY pyproject.toml README.md ./
COPY engine ./engine
COPY kernels ./kernels
COPY schemas ./schemas
COPY worker ./worker
COPY ops ./ops
RUN pip install ".${EXTRAS:+[${EXTRAS}]}" \
    && useradd --create-home --uid 10001 pagedq \
    && mkdir -p /data /models && chown pagedq /data /models

USER pagedq
EXPOSE 9400
# /healthz: alive and Redis reachable. Orchestrators should use /readyz for traffic-independent rollout.
HEALTHCHECK --interval=10s --timeout=3s --start-period=120s --retries=3 \
    CMD python -c "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/healthz' % os.environ['PAGEDQ_METRICS_PORT'], timeout=2)" || exit 1
ENTRYPOINT ["pagedq"]
CMD ["worker"]
