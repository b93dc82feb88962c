# The two commands: `make run` (default pipeline) and `make test` (the test suite).
# Each creates .venv and installs everything on first use.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml constraints.txt | cksum | cut -d' ' -f1)

.PHONY: run test repro lint install gpu-check

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# The pinned torch first (the CPU wheel where the index has one), so no dependency pulls another build.
	$(BIN)/python -m pip install -q "torch==2.13.0"
	$(BIN)/python -m pip install -q -c constraints.txt -e ".[dev]"
	# PyPI's torchvision (pulled in by backpack, which needs it only for its examples) does not
	# load beside the CPU torch wheel, and transformers imports it whenever it is installed.
	$(BIN)/python -m pip uninstall -q -y torchvision
	# The compiled CPU merge kernels, so that a user's first TIES/DARE/DELLA merge does not compile for ~20 s.
	$(BIN)/python -m mergeflow.merge.warm
	rm -f $(VENV)/.installed-* && touch $@

run: $(STAMP)
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/mergeflow run

# The suite's files spread over one pytest-xdist worker per CPU, at most TEST_WORKERS (a test file stays on
# one worker, so that its module fixtures run once); TEST_WORKERS=1 runs it in one process.
TEST_WORKERS ?= 4
test: $(STAMP)
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/python -m pytest -q \
		$(if $(filter 1,$(TEST_WORKERS)),,-n logical --maxprocesses $(TEST_WORKERS) --dist loadfile)

repro: $(STAMP)
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/dvc repro

lint: $(STAMP)
	$(BIN)/ruff check .

# The GPU suite (tests/gpu): every stage and merge method on CUDA against the CPU. It needs only the
# library's own dependencies and pytest, not the venv: on a bare GPU machine, `make gpu-check PYTHON=python3`.
# MERGEFLOW_TEST_DEVICE=cpu checks the suite itself where there is no GPU.
GPU_PYTHON ?= $(if $(wildcard $(BIN)/python),$(BIN)/python,$(PYTHON))
gpu-check:
	PYTHONPATH="$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH}" $(GPU_PYTHON) -m pytest -q -s -m gpu -p no:cacheprovider tests/gpu
