# `make demo` (quickstart: the whole pipeline on a generated corpus, CPU, offline), `make test`
# (the whole test suite, as CI runs it) and `make test-fast` (only the in-process tests marked
# fast, not the e2e ones that run fairseq, the scripts and the recipes in subprocesses: for
# quick feedback while developing). All create or reuse .venv and install what is missing.
# `make lint`: ruff with pyproject.toml's rules (CI runs it before the tests).
VENV ?= .venv
PYTHON := $(VENV)/bin/python
PYTEST_ARGS ?=
# one test file per worker, a worker per core: most tests wait on single-threaded subprocesses
PYTEST_WORKERS ?= -n auto --dist loadfile

.PHONY: setup demo test test-fast lint
setup:
	bash scripts/setup_env.sh

demo: setup
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" bash scripts/quickstart.sh

test: setup
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PYTHON) -m pytest tests $(PYTEST_WORKERS) $(PYTEST_ARGS)

# the fast tests compute in-process on tiny tensors: one intra-op thread per worker, since the
# workers already take a core each (two threads each made the run 1.5x slower on 2 cores)
test-fast: setup
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" OMP_NUM_THREADS=1 $(PYTHON) -m pytest tests -m fast $(PYTEST_WORKERS) $(PYTEST_ARGS)

lint: setup
	$(VENV)/bin/ruff check .
