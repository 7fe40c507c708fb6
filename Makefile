# Two entry points for a fresh machine: `make demo` and `make test`; on a GPU machine,
# `make gpu-check` (with the venv if there is one, else $(PY) with torch installed).
# torch is pinned to 2.13.0: on the project's CPU machines that installs the
# local CPU build; an unpinned `torch` would pull several GB of CUDA wheels.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_PIN ?= torch==2.13.0

# The tests that compare a run with a single-process reference, once per kernel set
# torch can pick on this CPU (ATEN_CPU_CAPABILITY): default, then avx2 and avx512
# where /proc/cpuinfo lists avx2 and avx512f. Float32 sums round by the kernel set, so
# each comparison must hold on all. Not in `make test`: 4-7 min per set on 2 cores.
EQUIVALENCE_TESTS := \
	tests/api/test_pipeline_equivalence.py tests/api/test_pipeline_mixed.py \
	tests/api/test_pipeline_schedules.py tests/api/test_pipeline_models.py \
	tests/api/test_pipeline_recompute.py tests/api/test_pipeline_local.py \
	tests/api/test_pipeline_auto.py tests/api/test_checkpoint.py \
	tests/api/test_models_torchrun.py tests/api/test_pipeline_torchrun.py \
	tests/api/test_trace.py tests/api/test_shapes.py \
	tests/runtime/test_equivalence.py tests/runtime/test_tensor_split.py \
	tests/runtime/test_split_backward.py tests/runtime/test_fused.py \
	tests/runtime/test_recompute.py tests/runtime/test_two_bw.py \
	tests/runtime/test_staleness.py tests/runtime/test_stage.py \
	tests/api/test_pipeline_precision.py tests/runtime/test_zero.py \
	tests/runtime/test_block_recompute.py tests/reliability/test_multi_node.py
CPU_FLAGS := $(shell grep -m1 '^flags' /proc/cpuinfo 2>/dev/null)
KERNEL_SETS := default $(if $(filter avx2,$(CPU_FLAGS)),avx2) \
	$(if $(filter avx512f,$(CPU_FLAGS)),avx512)

.PHONY: setup demo test test-kernels lint bench gpu-check clean

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

# Every test but the timings runs on two processes (one a core), slow and multi-process
# ones too: each takes its own free port and temporary folders. Whole files go to a
# process (--dist loadfile), so that a file's shared run is made once, in the order
# tests/conftest.py gives (files with slow tests first). Then the tests that assert on
# measured seconds, rates or bandwidths (marker `timing`) run one at a time, alone.
# Bytecode is written even where the environment says not to: pytest keeps each test
# module's rewritten asserts (most of a 20 s collection) for the next session, and the
# workers' processes the tests' helpers, compiled once.
# The timings' run collects only the files that mark a test so (tests/conftest.py refuses
# a timing test whose file does not say ``mark.timing``), not all 2,500 tests again.
TIMING_FILES = $(shell grep -rl --include='test_*.py' 'mark\.timing' tests)
test: setup
	PYTHONDONTWRITEBYTECODE= OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -m "not timing" \
	  -n 2 --dist loadfile --no-loadscope-reorder --durations=15
	PYTHONDONTWRITEBYTECODE= OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -m timing \
	  --durations=10 $(TIMING_FILES)

test-kernels: setup
	@failed=; for set in $(KERNEL_SETS); do \
	  echo "== ATEN_CPU_CAPABILITY=$$set"; \
	  ATEN_CPU_CAPABILITY=$$set $(BIN)/python -c "import sys, torch; \
	    got = torch.backends.cpu.get_cpu_capability(); print('torch runs', got, 'kernels'); \
	    sys.exit(got.lower() != '$$set')" \
	  && ATEN_CPU_CAPABILITY=$$set OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q \
	    $(EQUIVALENCE_TESTS) || failed="$$failed $$set"; \
	done; test -z "$$failed" || { echo "failed under:$$failed"; exit 1; }

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
