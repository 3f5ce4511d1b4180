# The runtime image of the stage Jobs (`tailor compress | quantize | evaluate | package`) and of the Triton
# pods of the Python fallback engine: CUDA torch and nvidia-modelopt (the `compressor` extra), and
# `tritonserver`, the Triton Inference Server 2.51 bundled in nvidia-pytriton, with the Python backend that runs
# the model `tailor package` writes. torch's wheels bundle their CUDA libraries and the NVIDIA container toolkit
# injects the driver, so a plain Debian base serves. `make images` builds it with buildah on a Debian base made
# by debootstrap (images/build.py); elsewhere, from the repository root (several GB, mostly CUDA libraries):
#   docker build -f images/runtime.Dockerfile -t registry.example.com/tailor-runtime:0.1.0 .
ARG BASE=debian:bookworm-slim

FROM ${BASE} AS python
# Debian's Python 3.11, pinned as in operator.Dockerfile; libpython3.11 is the library Triton's Python backend
# stub embeds
ARG PYTHON_DEB=3.11.2-6+deb12u8
ARG DEBIAN_FRONTEND=noninteractive
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3.11=${PYTHON_DEB} python3.11-venv=${PYTHON_DEB} \
      libpython3.11-stdlib=${PYTHON_DEB} python3.11-minimal=${PYTHON_DEB} libpython3.11-minimal=${PYTHON_DEB} \
      libpython3.11=${PYTHON_DEB} ca-certificates \
 && rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin

FROM python AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
# the sources in /src, and every command run from /: in /src, the folder `operator` would shadow the standard
# library's module of that name
COPY pyproject.toml constraints.txt README.md /src/
COPY cli /src/cli
COPY operator /src/operator
COPY compressor /src/compressor
COPY devcluster /src/devcluster
# `pip-cert`: as in operator.Dockerfile
RUN --mount=type=secret,id=pip-cert,required=false \
    if [ -f /run/secrets/pip-cert ]; then export PIP_CERT=/run/secrets/pip-cert; fi \
 && python3.11 -m venv /opt/tailor \
 && /opt/tailor/bin/pip install --constraint constraints.txt pip==25.3 \
 && /opt/tailor/bin/pip install --constraint /src/constraints.txt '/src[compressor]' \
 && /opt/tailor/bin/python -c "import torch, modelopt.torch.quantization"

FROM python
COPY --from=build /opt/tailor /opt/tailor
ENV PATH=/opt/tailor/bin:$PATH PYTHONUNBUFFERED=1 HOME=/home/tailor \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility
RUN printf '#!/bin/sh\nexec tailor tritonserver -- "$@"\n' > /usr/local/bin/tritonserver \
 && chmod 755 /usr/local/bin/tritonserver \
 && useradd --uid 1000 --create-home --home-dir /home/tailor tailor
# the stage Jobs and Triton pods run as uid 1000 (operator/jobs.py, deployment.py); caches go to
# $TAILOR_CACHE_DIR on the artifacts claim
USER 1000:1000
WORKDIR /home/tailor
ENTRYPOINT ["tailor"]
