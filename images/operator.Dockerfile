# The operator image: `tailor operator` and `tailor operator-check` (the chart's helm test), without torch or
# modelopt (the base install of pyproject.toml). Build from the repository root:
#   docker build -f images/operator.Dockerfile -t registry.example.com/tailor-operator:0.1.0 .
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
 && /opt/tailor/bin/pip install --constraint constraints.txt . \
 && /opt/tailor/bin/python -c "import tailor.operator.handlers"  # fails the build if torch were needed

FROM python:3.11.14-slim-bookworm
COPY --from=build /opt/tailor /opt/tailor
ENV PATH=/opt/tailor/bin:$PATH PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
# the chart runs it as this user, with a read-only root filesystem and /tmp an emptyDir
USER 65532:65532
ENTRYPOINT ["tailor"]
CMD ["operator", "--all-namespaces"]
