# Two commands set everything up on a fresh machine: `make train` and `make test`.
# Each creates .venv when it is missing and installs the project (torch is pinned in pyproject.toml only).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
ARGS   ?=
# the test extra (pytest, transformers, matplotlib, tokenizers), orbax (jax[cpu] + orbax-checkpoint, for
# the Orbax interop tests) and elastic (torchft, for the live elastic tests) are installed by both commands, so one venv serves both
EXTRAS ?= test,orbax,elastic

.PHONY: train test install bench clean lint

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q -e '.[$(EXTRAS)]'
	touch $(STAMP)

install: $(STAMP)

train: $(STAMP)
	$(BIN)/python -m functitan.train --config configs/debug.toml $(ARGS)

test: $(STAMP)
	$(BIN)/python -m pytest $(ARGS)

# ruff (lint + format check) and mypy; LINT_PATHS narrows them (e.g. LINT_PATHS=functitan/transforms.py)
LINT_PATHS ?= functitan models tests benchmarks examples
lint: $(STAMP)
	$(BIN)/python -m ruff check $(LINT_PATHS)
	$(BIN)/python -m ruff format --check $(LINT_PATHS)
	$(BIN)/python -m mypy

clean:
	rm -rf $(VENV) runs .pytest_cache
