# Minimal image for now; the KubeRay issue turns this into the CPU/CUDA image for
# components and Ray nodes.
FROM python:3.11.7-slim-bookworm
RUN useradd --create-home --uid 1000 rlhf
WORKDIR /app
COPY --chown=rlhf:rlhf . /app
USER rlhf
RUN bash scripts/venv.sh
ENV PATH=/app/.venv/bin:$PATH
ENTRYPOINT ["rlhf"]
