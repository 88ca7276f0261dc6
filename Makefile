# FlashAttention Lab. `make lab` opens the course, `make test` runs every test.
# Both set up .venv first (once, again when pyproject.toml changes).
#
# Overridable (see DEVELOPERS.md):
#   TORCH_SPEC   the torch to install when .venv has none (a CPU build here). A GPU user keeps
#                their own torch with `make test TORCH_SPEC=` (pip then resolves torch from
#                pyproject's range) or by creating .venv with --system-site-packages.
#   TORCH_PIP_ARGS  extra pip arguments for torch, e.g. --index-url https://download.pytorch.org/whl/cpu
#   TRITON_SPEC  Triton pinned to the GPU machine's minor version, so the code CI interprets is the
#                code the GPU compiles (Linux only; macOS runs the CPU track without Triton).
#   LAB_ARGS     extra JupyterLab arguments; run as root, make lab adds --allow-root itself.
#   TEST_WORKERS pytest-xdist processes for make test (default: the CPUs, at most 4; 0 runs in one process).
#   TEST_THREADS torch's CPU threads in each test process (default 1: with a process per core, a thread pool
#                per process oversubscribes the cores and its idle threads spin; on 2 cores make test took
#                twice as long with torch's default pool).
PYTHON ?= python3
VENV ?= .venv
VENV_ARGS ?=
TORCH_SPEC ?= torch==2.13.0
TORCH_PIP_ARGS ?=
TRITON_SPEC ?= triton==3.6.*
LAB_ARGS ?=
PYTEST_ARGS ?=
TEST_WORKERS ?= $(shell $(PYTHON) -c "import os; print(min(4, os.cpu_count() or 1))" 2>/dev/null || echo 1)
TEST_THREADS ?= 1

PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.fa-lab-installed
UNAME := $(shell uname -s)
# JupyterLab refuses to start as root (a container, a cloud VM) unless told --allow-root.
ALLOW_ROOT := $(if $(filter 0,$(shell id -u 2>/dev/null)),--allow-root)
# ruff covers all the Python that ships: the package, the tests, any scripts under benchmarks/ and docs/, and
# the code cells of the notebooks (lectures, solutions, and the labs generated from them; pyproject.toml says
# what the labs' TODO stubs may leave unused or undefined).
LINT_PATHS := fa_lab tests $(wildcard benchmarks docs) notebooks solutions labs

.PHONY: lab test test-fast test-gpu setup sandbox-tool assign lint bench clean

setup: $(STAMP) sandbox-tool

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV_ARGS) $(VENV)
	@if [ -n "$(TORCH_SPEC)" ] && ! $(PY) -c "import torch" 2>/dev/null; then \
		echo "installing $(TORCH_SPEC)"; $(PIP) install -q $(TORCH_PIP_ARGS) "$(TORCH_SPEC)"; fi
	@if [ "$(UNAME)" = "Linux" ] && [ -n "$(TRITON_SPEC)" ]; then $(PIP) install -q "$(TRITON_SPEC)"; fi
	$(PIP) install -q -e ".[dev]"
	touch $(STAMP)

# fa-lab grade runs each notebook in a bubblewrap sandbox (and its tests need it): install bwrap
# where this machine lets us (root with apt-get, as on CI), else say how.
sandbox-tool:
	@command -v bwrap >/dev/null 2>&1 || { \
	if [ "$(UNAME)" = "Linux" ] && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		echo "installing bubblewrap (the sandbox of fa-lab grade)"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap >/dev/null; \
	elif [ "$(UNAME)" = "Linux" ]; then \
		echo "note: bubblewrap (bwrap) is missing; fa-lab grade and its tests need it to sandbox notebooks:"; \
		echo "      sudo apt-get install bubblewrap (Debian, Ubuntu) or sudo dnf install bubblewrap (Fedora)"; \
	else \
		echo "note: fa-lab grade sandboxes notebooks with bubblewrap, on Linux only (elsewhere: --no-sandbox)"; \
	fi; }

lab: setup
	$(VENV)/bin/jupyter lab --ServerApp.root_dir="$(CURDIR)" $(ALLOW_ROOT) $(LAB_ARGS) README.md

# nbval runs with CUDA hidden so that notebooks take their recorded-results branch. Test files run in
# TEST_WORKERS processes (one file, and so one notebook's cells, per process: --dist loadfile); the grading
# runs with wall-clock limits (marked serial) run afterwards, alone.
test: setup
	CUDA_VISIBLE_DEVICES="" OMP_NUM_THREADS=$(TEST_THREADS) $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile \
		-m "not serial" tests notebooks solutions --nbval --nbval-sanitize-with tests/nbval_sanitize.cfg $(PYTEST_ARGS)
	CUDA_VISIBLE_DEVICES="" OMP_NUM_THREADS=$(TEST_THREADS) $(PY) -m pytest -q -m serial tests $(PYTEST_ARGS)

test-fast: setup
	$(PY) -m pytest -q tests -m "not slow" $(PYTEST_ARGS)

# On a GPU machine (see DEVELOPERS.md for the device machine, which has no nbval).
test-gpu:
	PYTHONPATH=. python3 -m pytest -q tests -m gpu $(PYTEST_ARGS)

assign: setup
	$(VENV)/bin/fa-lab assign

lint: setup
	$(PY) -m ruff check $(LINT_PATHS)

bench: setup
	$(VENV)/bin/fa-lab bench cpu --json benchmarks/cpu_2core.json --plot benchmarks/cpu_2core.png

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
