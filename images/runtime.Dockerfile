# The runtime image of the stage Jobs (`tailor compress | quantize | evaluate | package`) and of the Triton
# pods: CUDA torch and nvidia-modelopt (the `compressor` extra), and `tritonserver`, the Triton Inference
# Server 2.51 bundled in nvidia-pytriton, with the Python backend that runs the model `tailor package` writes.
# torch's wheels bundle their CUDA 13 libraries and the NVIDIA container toolkit injects the driver, so a
# plain Python base serves. Build from the repository root (several GB, mostly torch's CUDA libraries):
#   docker build -f images/runtime.Dockerfile -t registry.example.com/tailor-runtime:0.1.0 .
FROM python:3.11.14-slim-bookworm AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml constraints.txt README.md ./
COPY cli cli
COPY operator operator
COPY compressor compressor
COPY devcluster devcluster
RUN python -m venv /opt/tailor \
 && /opt/tailor/bin/pip install --constraint constraints.txt pip==25.3 \
 && /opt/tailor/bin/pip install --constraint constraints.txt '.[compressor]' \
 && /opt/tailor/bin/python -c "import torch, modelopt.torch.quantization"

FROM python:3.11.14-slim-bookworm
COPY --from=build /opt/tailor /opt/tailor
ENV PATH=/opt/tailor/bin:$PATH PYTHONUNBUFFERED=1 HOME=/home/tailor \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility
RUN printf '#!/bin/sh\nexec tailor tritonserver -- "$@"\n' > /usr/local/bin/tritonserver \
 && chmod 755 /usr/local/bin/tritonserver
# the stage Jobs and Triton pods run as uid 1000 (operator/jobs.py, deployment.py); caches go to
# $TAILOR_CACHE_DIR on the artifacts claim
RUN useradd --uid 1000 --create-home --home-dir /home/tailor tailor
USER 1000:1000
WORKDIR /home/tailor
ENTRYPOINT ["tailor"]
