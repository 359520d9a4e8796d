# trainrun: every target does its own set-up on a fresh clone.
# Python 3.10 or newer, 3.11 preferred (the test extra's torch wheel); stock onnxruntime on every Python
# (pyproject.toml), onnxruntime-training (the training extra) in .venv-training for make test-training
PYTHON ?= $(shell for p in python3.11 python3.12 python3.10 python3.13 python3; do \
             $$p -c 'import sys; sys.exit(sys.version_info[:2] < (3,10))' >/dev/null 2>&1 && echo $$p && break; done)
# Python 3.13 for make test-py313: on PATH, else pyenv's
PYTHON313 ?= $(shell for p in python3.13 $$(pyenv root 2>/dev/null)/versions/3.13*/bin/python3.13; do \
             $$p -c 'import sys; sys.exit(sys.version_info[:2] != (3,13))' >/dev/null 2>&1 && echo $$p && break; done)
VENV   := .venv
BIN    := $(VENV)/bin
STAMP_RUN  := $(VENV)/.installed-run
STAMP_TEST := $(VENV)/.installed-test

.PHONY: setup setup-test setup-training setup-elastic test test-fast test-training test-py313 test-elastic test-cluster test-gpu demo bench bench-124m bench-cluster bench-zoo docs clean

$(BIN)/python:
	@test -n "$(PYTHON)" || { echo "trainrun needs Python 3.10 or newer on PATH" >&2; exit 2; }
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

# The edit loop: the tests that start no process (no trainrun, mpirun or trainrun-data run; tests/conftest.py's
# starts_process decides, and a test that starts one anyway fails there, naming itself)
test-fast: $(STAMP_TEST)
	TRAINRUN_FAST=1 $(BIN)/python -m pytest -q -m "not gpu and not cluster" $(PYTEST_ARGS)

# A venv beside .venv for another onnxruntime or Python: $(call side_venv,VENV,PYTHON,message where PYTHON
# is empty,pip install arguments for trainrun,scripts/requirements.py arguments); no commas in any of them
define side_venv
@test -n "$(2)" || { echo "$(3)" >&2; exit 2; }
test -x $(1)/bin/python || $(2) -m venv $(1)
$(1)/bin/pip install -q packaging
$(1)/bin/pip install -q $(4)
$(1)/bin/pip install -q $$($(1)/bin/python scripts/requirements.py $(5))
endef

# The reference leg: the graphs lane on onnxruntime-training 1.19.2 (the training extra, in place of stock
# onnxruntime) in its own venv (.venv-training, the same Python as .venv): trainrun --no-deps, then the training
# and test extras (scripts/requirements.py training test). TRAINRUN_LANE=graphs (tests/conftest.py): every test
# that starts no process, those marked graphs (what proves the builder's graphs and their numbers: both builders
# here) and those marked ort_training (onnxruntime-training's builder itself, skipped by make test, saying so);
# the run's mechanics that make test proved on the same code are not run again. The 50-step comparison of the
# own builder on stock onnxruntime (.venv) against onnxruntime-training's builder here runs from this leg.
VENV_TRAINING  := .venv-training
STAMP_TRAINING := $(VENV_TRAINING)/.installed-training
$(STAMP_TRAINING): pyproject.toml scripts/requirements.py
	$(call side_venv,$(VENV_TRAINING),$(PYTHON),trainrun needs Python 3.10 or newer on PATH,--no-deps -e .,training test)
	@touch $@

setup-training: $(STAMP_TRAINING)

test-training: $(STAMP_TRAINING)
	TRAINRUN_LANE=graphs PATH=$(CURDIR)/$(VENV_TRAINING)/bin:$$PATH $(if $(wildcard $(BIN)/python),TRAINRUN_STOCK_BUILD=$(CURDIR)/$(BIN) \
	TRAINRUN_REQUIRE_STOCK_COMPARISON=1) $(VENV_TRAINING)/bin/python -m pytest -q -m "not gpu and not cluster" $(PYTEST_ARGS)

# Elastic runs (distributed.elastic) on Open MPI's ULFM fault tolerance, in their own venv (.venv-elastic, the
# same Python as .venv): trainrun --no-deps, then its requirements with Open MPI's wheel in place of MPICH's (the
# elastic extra; both wheels install bin/mpirun and a libmpi, so they cannot share a venv). tests/test_elastic.py
# finds it beside .venv (or TRAINRUN_ELASTIC_VENV) and skips, saying so, without it; make test-elastic fails
# instead (TRAINRUN_REQUIRE_FT=1).
VENV_ELASTIC  := .venv-elastic
STAMP_ELASTIC := $(VENV_ELASTIC)/.installed-elastic
$(STAMP_ELASTIC): pyproject.toml scripts/requirements.py
	$(call side_venv,$(VENV_ELASTIC),$(PYTHON),trainrun needs Python 3.10 or newer on PATH,--no-deps -e .,--without mpich elastic)
	@touch $@

setup-elastic: $(STAMP_ELASTIC)

test-elastic: $(STAMP_TEST) $(STAMP_ELASTIC)
	TRAINRUN_REQUIRE_FT=1 $(BIN)/python -m pytest -q -rs tests/test_elastic.py $(PYTEST_ARGS)

# Python 3.13 (.venv-py313): trainrun with its plain dependencies (stock onnxruntime), the demo, then the
# graphs lane (as make test-training) of the tests that need no torch: the test extra without torch, transformers, peft and onnxscript (their tests skip, saying so)
VENV_PY313  := .venv-py313
STAMP_PY313 := $(VENV_PY313)/.installed-py313
$(STAMP_PY313): pyproject.toml scripts/requirements.py
	$(call side_venv,$(VENV_PY313),$(PYTHON313),make test-py313 needs python3.13 (on PATH or pyenv's; or PYTHON313=...),-e .,--without torch --without transformers --without peft --without onnxscript test)
	@touch $@

test-py313: $(STAMP_PY313)
	PATH=$(CURDIR)/$(VENV_PY313)/bin:$$PATH bash scripts/demo.sh
	TRAINRUN_LANE=graphs PATH=$(CURDIR)/$(VENV_PY313)/bin:$$PATH $(VENV_PY313)/bin/python -m pytest -q -m "not gpu and not cluster" $(PYTEST_ARGS)

# The multi-node suite (tests/test_cluster.py) on 2 pretend nodes (scripts/cluster/cluster.sh, root only), its
# elastic tests on 3 (Open MPI's ULFM: .venv-elastic, made first) and under a real SLURM on them
# (tests/test_slurm.py; as root, SLURM and munge are installed with apt-get when missing): skipped where
# namespaces cannot be made or SLURM is missing, failed then under TRAINRUN_REQUIRE_CLUSTER=1 (.ci/run sets it)
test-cluster: $(STAMP_TEST) $(STAMP_ELASTIC)
	scripts/cluster/cluster.sh install-slurm
	PATH=$(CURDIR)/$(BIN):$$PATH $(BIN)/python -m pytest -q -rs -m cluster tests/test_cluster.py tests/test_slurm.py $(PYTEST_ARGS)

# The GPU suite (tests/test_gpu.py and every test marked gpu) in its own venv, .venv-$(GPU): the extra GPU
# and pytest only (no torch: with torch installed, importing onnxruntime-training imports it, and torch's
# own CUDA libraries would load before trainrun's). GPU=gpu (the default): onnxruntime-training's CUDA 11.8
# build in place of stock onnxruntime, Python 3.10-3.11; GPU=gpu-cu12: stock onnxruntime-gpu for CUDA 12 in place
# of the CPU build, trainrun's own gradient builder (scripts/requirements.py: an extra's onnxruntime replaces). From the index, or offline from a
# wheel directory (make test-gpu WHEELS=/path/to/wheels). Refuses an onnxruntime without the CUDA
# provider; fails (TRAINRUN_REQUIRE_GPU=1), not skips, where no GPU is visible.
GPU       ?= gpu
VENV_GPU  := .venv-$(GPU)
STAMP_GPU := $(VENV_GPU)/.installed-gpu
PIP_GPU    = $(VENV_GPU)/bin/pip install -q $(if $(WHEELS),--no-index --find-links $(WHEELS))
$(STAMP_GPU): pyproject.toml scripts/requirements.py
	@test -n "$(PYTHON)" || { echo "trainrun needs Python 3.10 or newer on PATH" >&2; exit 2; }
	test -x $(VENV_GPU)/bin/python || $(PYTHON) -m venv $(VENV_GPU)
	$(PIP_GPU) packaging
	$(PIP_GPU) --no-deps -e .
	$(PIP_GPU) $$($(VENV_GPU)/bin/python scripts/requirements.py $(GPU)) \
	    'pytest>=8' 'pytest-timeout>=2.3'
	@touch $@

test-gpu: $(STAMP_GPU)
	@$(VENV_GPU)/bin/python -c 'import sys; from trainrun.step.cuda import environment_problem; \
	    p = environment_problem(); p and sys.exit("make test-gpu: " + p)'
	TRAINRUN_REQUIRE_GPU=1 PATH=$(CURDIR)/$(VENV_GPU)/bin:$$PATH $(VENV_GPU)/bin/python -m pytest -q -rs -m gpu $(PYTEST_ARGS)

demo: $(STAMP_RUN)
	PATH=$(CURDIR)/$(BIN):$$PATH bash scripts/demo.sh

# On stock onnxruntime (.venv); the GPT-2 124M section's older commit, which knew only onnxruntime-training's
# gradient builder, runs from .venv-training (scripts/bench/gpt2_124m.py)
bench: $(STAMP_TEST) $(STAMP_TRAINING)
	PATH=$(CURDIR)/$(BIN):$$PATH $(BIN)/python scripts/bench.py

# GPT-2 124M's targets alone (~10 min on 2 cores): its section of BENCHMARKS.md
bench-124m: $(STAMP_TEST) $(STAMP_TRAINING)
	PATH=$(CURDIR)/$(BIN):$$PATH $(BIN)/python scripts/bench.py --only gpt2-124m

# Scaling over a slow link (~30 min, root): GPT-2 mid and 124M on 2 pretend nodes of one core
# (scripts/cluster/cluster.sh) at link rates unlimited, 10 and 1 Gbit/s against one node alone; its section
# of BENCHMARKS.md; then (~40 min) elastic training on 3 pretend nodes for 20 minutes, a node killed every 2
# minutes and taken back 30 s later, against the same run without faults (scripts/bench/elastic.py)
bench-cluster: $(STAMP_TEST) $(STAMP_ELASTIC)
	PATH=$(CURDIR)/$(BIN):$$PATH $(BIN)/python scripts/bench/cluster.py
	PATH=$(CURDIR)/$(BIN):$$PATH $(BIN)/python scripts/bench/elastic.py

# The model zoo's families against PyTorch eager, 1 x 1 and 2 x 1, at the zoo's sizes and at batch 32, seq 32
# (~4 min each on 2 cores): the training build (.venv-training), then stock onnxruntime (.venv); the tables to
# BENCHMARKS.md's section by hand
bench-zoo: $(STAMP_TEST) $(STAMP_TRAINING)
	PATH=$(CURDIR)/$(VENV_TRAINING)/bin:$$PATH $(VENV_TRAINING)/bin/python scripts/bench/zoo_speed.py
	PATH=$(CURDIR)/$(BIN):$$PATH $(BIN)/python scripts/bench/zoo_speed.py
	PATH=$(CURDIR)/$(VENV_TRAINING)/bin:$$PATH $(VENV_TRAINING)/bin/python scripts/bench/zoo_speed.py $(ZOO_LARGER)
	PATH=$(CURDIR)/$(BIN):$$PATH $(BIN)/python scripts/bench/zoo_speed.py $(ZOO_LARGER)
	$(BIN)/python scripts/bench/zoo_speed.py --render
ZOO_LARGER := --batch 32 --seq 32 --rounds 6 --steps 3

# docs/configuration.md from the config schema, docs/models.md's table of ops with gradient rules from the builder
# (tests/test_docs.py checks both are up to date)
docs: $(STAMP_RUN)
	$(BIN)/python scripts/gen_config_docs.py

clean:
	rm -rf $(VENV) .venv-gpu .venv-gpu-cu12 $(VENV_TRAINING) $(VENV_PY313) $(VENV_ELASTIC) runs build *.egg-info
