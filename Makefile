# Two commands: `make demo` (quickstart: the whole pipeline on a generated corpus, CPU, offline)
# and `make test` (the test suite). Both create or reuse .venv and install what is missing.
# `make lint`: ruff with pyproject.toml's rules (CI runs it before the tests).
VENV ?= .venv
PYTHON := $(VENV)/bin/python
PYTEST_ARGS ?=
# one test file per worker, a worker per core: most tests wait on single-threaded subprocesses
PYTEST_WORKERS ?= -n auto --dist loadfile

.PHONY: setup demo test lint
setup:
	bash scripts/setup_env.sh

demo: setup
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" bash scripts/quickstart.sh

test: setup
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PYTHON) -m pytest tests $(PYTEST_WORKERS) $(PYTEST_ARGS)

lint: setup
	$(VENV)/bin/ruff check .
