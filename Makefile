# Two entry points for a fresh machine: `make demo` and `make test`; on a GPU machine,
# `make gpu-check` (with the venv if there is one, else $(PY) with torch installed).
# torch is pinned to 2.13.0: on the project's CPU machines that installs the
# local CPU build; an unpinned `torch` would pull several GB of CUDA wheels.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_PIN ?= torch==2.13.0

.PHONY: setup demo test lint bench gpu-check clean

$(BIN)/dreampipe: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(TORCH_PIN)
	$(BIN)/pip install -q -e '.[dev]'
	$(BIN)/python -m compileall -q src  # every worker process imports these: compile once
	touch $@

setup: $(BIN)/dreampipe

demo: setup
	$(BIN)/dreampipe demo

test: setup
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q --durations=15

lint: setup
	$(BIN)/ruff check src tests benchmarks examples
	$(BIN)/mypy

bench: setup
	$(BIN)/python benchmarks/bench_planner.py
	$(BIN)/python benchmarks/bench_simulator.py
	$(BIN)/dreampipe bench

gpu-check:
	$(if $(wildcard $(BIN)/python),$(BIN)/python,$(PY)) benchmarks/gpu_check.py

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
