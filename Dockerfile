# dualserve: OpenAI-compatible server with AR, EAGLE and diffusion decoders.
#
# CPU image (default):
#   docker build -t dualserve .
#   docker run -p 8000:8000 -v dualserve-cache:/cache dualserve
#
# GPU image: build on a CUDA base with the gpu extra (flash-attn), e.g.
#   docker build -t dualserve:gpu \
#     --build-arg BASE=nvidia/cuda:12.8.1-cudnn-devel-ubuntu24.04 \
#     --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 \
#     --build-arg EXTRAS=gpu .
#   docker run --gpus all -p 8000:8000 -v dualserve-cache:/cache dualserve:gpu
ARG BASE=python:3.11-slim
FROM ${BASE}

ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ARG EXTRAS=""
ENV PIP_NO_CACHE_DIR=1 DUALSERVE_CACHE=/cache PYTHONUNBUFFERED=1

RUN if ! command -v python3 >/dev/null; then \
      apt-get update && apt-get install -y --no-install-recommends python3 python3-pip python3-venv && \
      rm -rf /var/lib/apt/lists/*; fi
# A C++ compiler: the CPU step packages (AOTInductor) and the project's kernels (models/kernels)
# compile on the host; without one the server runs eagerly with PyTorch's kernels.
RUN if ! command -v g++ >/dev/null; then \
      apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*; fi
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH

WORKDIR /app
COPY pyproject.toml setup.py README.md ./
COPY server ./server
COPY decoders ./decoders
COPY models ./models
COPY clients ./clients
# flash-attn (the gpu extra) compiles against the installed torch, so it is built without build
# isolation (an isolated build environment has no torch) before the package's own install.
RUN pip install --extra-index-url ${TORCH_INDEX} "torch==2.13.0" && \
    if echo ",${EXTRAS}," | grep -q ",gpu,"; then \
      pip install packaging ninja wheel && pip install --no-build-isolation "flash-attn>=2.6"; fi && \
    if [ -n "${EXTRAS}" ]; then pip install ".[${EXTRAS}]"; else pip install .; fi

# Fetch the embedded default model at build time so the container starts offline.
RUN dualserve pull && python -c "from dualserve.models import kernels; kernels.build()"

EXPOSE 8000
# Inside a container, bind all interfaces; the port mapping decides exposure.
CMD ["dualserve", "serve", "--host", "0.0.0.0", "--port", "8000"]
