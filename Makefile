# trainrun: every target does its own set-up on a fresh clone.
PYTHON ?= $(shell for p in python3.11 python3.12 python3.10 python3; do \
             command -v $$p >/dev/null 2>&1 && $$p -c 'import sys; sys.exit(not (3,10) <= sys.version_info[:2] <= (3,12))' && echo $$p && break; done)
VENV   := .venv
BIN    := $(VENV)/bin
STAMP_RUN  := $(VENV)/.installed-run
STAMP_TEST := $(VENV)/.installed-test

.PHONY: setup setup-test test test-cluster test-gpu demo bench bench-124m bench-cluster docs clean

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
	$(BIN)/python -m pytest -q -m "not gpu and not cluster" $(PYTEST_ARGS)

# The multi-node suite (tests/test_cluster.py) on 2 pretend nodes (scripts/cluster/cluster.sh, root only) and
# under a real SLURM on them (tests/test_slurm.py; as root, SLURM and munge are installed with apt-get when
# missing): skipped where namespaces cannot be made or SLURM is missing, failed then under
# TRAINRUN_REQUIRE_CLUSTER=1 (.ci/run sets it)
test-cluster: $(STAMP_TEST)
	scripts/cluster/cluster.sh install-slurm
	PATH=$(CURDIR)/$(BIN):$$PATH $(BIN)/python -m pytest -q -rs -m cluster tests/test_cluster.py tests/test_slurm.py $(PYTEST_ARGS)

# The GPU suite (tests/test_gpu.py and every test marked gpu) in its own venv, .venv-gpu: the gpu extra
# and pytest only (no torch: with torch installed, importing onnxruntime-training imports it, and torch's
# own CUDA libraries would load before trainrun's CUDA 11 ones). From the index, or offline from a wheel
# directory (make test-gpu WHEELS=/path/to/wheels). Refuses an onnxruntime without the CUDA provider;
# fails (TRAINRUN_REQUIRE_GPU=1), not skips, where no GPU is visible.
VENV_GPU  := .venv-gpu
STAMP_GPU := $(VENV_GPU)/.installed-gpu
$(STAMP_GPU): pyproject.toml
	@test -n "$(PYTHON)" || { echo "trainrun needs Python 3.10-3.12 on PATH" >&2; exit 2; }
	test -x $(VENV_GPU)/bin/python || $(PYTHON) -m venv $(VENV_GPU)
	$(VENV_GPU)/bin/pip install -q $(if $(WHEELS),--no-index --find-links $(WHEELS)) -e '.[gpu]' 'pytest>=8' 'pytest-timeout>=2.3'
	@touch $@

test-gpu: $(STAMP_GPU)
	@$(VENV_GPU)/bin/python -c 'import sys; from trainrun.cuda import environment_problem; \
	    p = environment_problem(); p and sys.exit("make test-gpu: " + p)'
	TRAINRUN_REQUIRE_GPU=1 PATH=$(CURDIR)/$(VENV_GPU)/bin:$$PATH $(VENV_GPU)/bin/python -m pytest -q -rs -m gpu $(PYTEST_ARGS)

demo: $(STAMP_RUN)
	PATH=$(CURDIR)/$(BIN):$$PATH bash scripts/demo.sh

bench: $(STAMP_TEST)
	PATH=$(CURDIR)/$(BIN):$$PATH $(BIN)/python scripts/bench.py

# GPT-2 124M's targets alone (~10 min on 2 cores): its section of BENCHMARKS.md
bench-124m: $(STAMP_TEST)
	PATH=$(CURDIR)/$(BIN):$$PATH $(BIN)/python scripts/bench.py --only gpt2-124m

# Scaling over a slow link (~30 min, root): GPT-2 mid and 124M on 2 pretend nodes of one core
# (scripts/cluster/cluster.sh) at link rates unlimited, 10 and 1 Gbit/s against one node alone; its section
# of BENCHMARKS.md
bench-cluster: $(STAMP_TEST)
	PATH=$(CURDIR)/$(BIN):$$PATH $(BIN)/python scripts/bench/cluster.py

# docs/configuration.md from the config schema (tests/test_docs.py checks it is up to date)
docs: $(STAMP_RUN)
	$(BIN)/python scripts/gen_config_docs.py

clean:
	rm -rf $(VENV) $(VENV_GPU) runs build *.egg-info
