# Two commands set everything up on a fresh machine: `make train` and `make test`.
# Each creates .venv when it is missing and installs the project (torch is pinned in pyproject.toml only).
# `make train` installs what training needs (the base dependencies) plus matplotlib for `functitan report`;
# `make test` adds the test tools, jax + orbax (Orbax interop tests) and the docs tools (mkdocs, notebooks).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
ARGS   ?=
TRAIN_EXTRAS ?= plot
# the test extra (pytest, transformers, notebooks...), orbax (jax[cpu] + orbax-checkpoint, for the Orbax interop
# tests), elastic (torchft, for the live elastic tests), wandb (the W&B sink's tests) and docs (mkdocs) are installed
# by `make test` only
TEST_EXTRAS  ?= plot,test,orbax,elastic,wandb,docs
export NO_MKDOCS_2_WARNING := 1

.PHONY: train test docs install install-test clean lint

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(VENV)/.installed-train: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q -e '.[$(TRAIN_EXTRAS)]'
	touch $@

$(VENV)/.installed-test: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q -e '.[$(TEST_EXTRAS)]'
	touch $@ $(VENV)/.installed-train

install: $(VENV)/.installed-train

install-test: $(VENV)/.installed-test

train: $(VENV)/.installed-train
	$(BIN)/python -m functitan.train --config configs/debug.toml $(ARGS)

# lint first (ruff, format check, mypy: seconds), then the suite, which includes the notebooks
# (tests/test_notebooks.py) and the site built with --strict (tests/test_docs.py); it ends with each test file's
# wall time against tests/budget.toml
test: $(VENV)/.installed-test lint
	$(BIN)/python -m pytest $(ARGS)

# ruff (lint + format check) and mypy; LINT_PATHS narrows them (e.g. LINT_PATHS=functitan/transforms.py)
LINT_PATHS ?= functitan models tests benchmarks examples
lint: $(VENV)/.installed-test
	$(BIN)/python -m ruff check $(LINT_PATHS)
	$(BIN)/python -m ruff format --check $(LINT_PATHS)
	$(BIN)/python -m mypy

# the documentation site in site/ (open site/index.html); --strict: a broken link or reference fails
docs: $(VENV)/.installed-test
	$(BIN)/python -m mkdocs build --strict

clean:
	rm -rf $(VENV) runs site .cache .pytest_cache
