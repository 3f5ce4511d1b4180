# The operator image: `tailor operator` and `tailor operator-check` (the chart's helm test), without torch or
# modelopt (the base install of pyproject.toml). `make images` builds it with buildah on a Debian base made by
# debootstrap (images/build.py); elsewhere, from the repository root:
#   docker build -f images/operator.Dockerfile -t registry.example.com/tailor-operator:0.1.0 .
# BASE is any Debian 12 (bookworm) root filesystem: debian:bookworm-slim, or the one `make images` makes.
ARG BASE=debian:bookworm-slim

FROM ${BASE} AS python
# Debian's Python 3.11, pinned (deb.debian.org keeps only a suite's newest version: a build that fails here
# names the version to pin, `apt-cache policy python3.11`)
ARG PYTHON_DEB=3.11.2-6+deb12u8
ARG DEBIAN_FRONTEND=noninteractive
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3.11=${PYTHON_DEB} python3.11-venv=${PYTHON_DEB} \
      libpython3.11-stdlib=${PYTHON_DEB} python3.11-minimal=${PYTHON_DEB} libpython3.11-minimal=${PYTHON_DEB} \
      ca-certificates \
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
# the secret `pip-cert`, where given, is the trust store of a build machine behind a TLS-inspecting proxy; it is
# used for the downloads and is in no layer
RUN --mount=type=secret,id=pip-cert,required=false \
    if [ -f /run/secrets/pip-cert ]; then export PIP_CERT=/run/secrets/pip-cert; fi \
 && python3.11 -m venv /opt/tailor \
 && /opt/tailor/bin/pip install --constraint /src/constraints.txt pip==25.3 \
 && /opt/tailor/bin/pip install --constraint /src/constraints.txt /src \
 && /opt/tailor/bin/python -c "import tailor.operator.handlers" \
 && if /opt/tailor/bin/python -c "import torch" 2>/dev/null; then echo "torch in the operator image" >&2; exit 1; fi

FROM python
COPY --from=build /opt/tailor /opt/tailor
ENV PATH=/opt/tailor/bin:$PATH PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
# the chart runs it as this user, with a read-only root filesystem and /tmp an emptyDir; the user has a name
# (kopf names the operator after it: a uid without one stops it at start)
RUN groupadd --system --gid 65532 tailor \
 && useradd --system --uid 65532 --gid 65532 --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin tailor
USER 65532:65532
ENTRYPOINT ["tailor"]
CMD ["operator", "--all-namespaces"]
