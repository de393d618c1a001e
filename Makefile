# The README's two commands are `make generate` and `make test`; every target creates/reuses .venv and installs what it needs.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
ARGS ?=

.PHONY: install generate test bench gpu-check

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.installed: $(BIN)/python setup.cfg pyproject.toml
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $@

install: $(VENV)/.installed

generate: install
	$(BIN)/python scripts/generate.py $(ARGS)

test: install
	$(BIN)/python -m pytest -q $(ARGS)

bench: install
	$(BIN)/python scripts/bench.py $(ARGS)

# On a machine with a CUDA GPU: native kernel tests, op and model tables, speculative frontier, compile report,
# written to gpu-check/ (gpu.md, gpu.csv, gpu.png); docs/kernels.md, "Running on a GPU".
gpu-check: install
	$(BIN)/python scripts/bench.py gpu $(ARGS)
