# trainrun: every target does its own set-up on a fresh clone.
PYTHON ?= $(shell for p in python3.11 python3.12 python3.10 python3; do \
             command -v $$p >/dev/null 2>&1 && $$p -c 'import sys; sys.exit(not (3,10) <= sys.version_info[:2] <= (3,12))' && echo $$p && break; done)
VENV   := .venv
BIN    := $(VENV)/bin
STAMP_RUN  := $(VENV)/.installed-run
STAMP_TEST := $(VENV)/.installed-test

.PHONY: setup setup-test test demo bench clean

$(BIN)/python:
	@test -n "$(PYTHON)" || { echo "trainrun needs Python 3.10-3.12 on PATH" >&2; exit 2; }
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(STAMP_RUN): pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e .
	@touch $@

$(STAMP_TEST): pyproject.toml $(STAMP_RUN)
	$(BIN)/pip install -q -e '.[test]'
	@touch $@

setup: $(STAMP_RUN)

setup-test: $(STAMP_TEST)

test: $(STAMP_TEST)
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

demo: $(STAMP_RUN)
	PATH=$(CURDIR)/$(BIN):$$PATH bash scripts/demo.sh

bench: $(STAMP_TEST)
	PATH=$(CURDIR)/$(BIN):$$PATH $(BIN)/python scripts/bench.py

clean:
	rm -rf $(VENV) runs build *.egg-info
