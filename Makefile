# `make help` lists the targets. Everything installs what it needs into .venv (idempotent).
# Use another interpreter/environment with `make PY=python ...` (e.g. an activated conda env).

SHELL := /bin/bash
VENV ?= .venv
PY ?= $(VENV)/bin/python
# torch is installed only when the interpreter has none; override to pick a build/version.
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed
ARGS ?=
PYTEST_ARGS ?=
# the whole suite in parallel workers, one a core and one more (at most 6): the tests wait on
# the processes they start a part of the time, which the extra worker fills; more workers
# than that cost CPU (an interpreter and a preloaded server each, runs' threads contending;
# measured side by side in tests/README.md); each test file in one worker
XDIST ?= -n $(shell echo $$(( $$(nproc 2>/dev/null || echo 1) + 1 ))) --maxprocesses 6 --dist loadfile

.DEFAULT_GOAL := help
.PHONY: help install add new train test test-fast test-cuda test-gpu mutations verify bench gpu-check report lint format clean distclean

help: ## list the targets
	@grep -hE '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-10s %s\n", $$1, $$2}'

# --no-compile: pip would byte-compile every module of every package (torch's alone: 20 of the
# 28 s its install takes on 2 cores); Python compiles what is imported, on first import --
# which PYTHONDONTWRITEBYTECODE=1 in the caller's environment would turn into every import,
# so the targets that run Python here write the cache (./.venv, and __pycache__ under src/ and
# tests/, ignored by git). What every run and test process imports is compiled here, once, in
# one process: otherwise the test workers and their runs, starting together, each compile it
# (those imports take 11.8 s of CPU without the bytecode, 4.6 s with it, on the 2-core machine).
# torch._dynamo (which strict mode's torch.use_deterministic_algorithms imports) is compiled
# on the second core while pip installs the rest on the first; that import's outcome does not
# matter (a package pip is still writing may fail it): the last line imports it all again.
define install_into
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q --no-compile "$(TORCH_SPEC)"
	$(PY) -c "import torch._dynamo" >/dev/null 2>&1 & $(PY) -m pip install -q --no-compile -e ".[dev]"; s=$$?; wait; exit $$s
	$(PY) -c "import torch._dynamo, hydra, scipy.stats, pytest, xdist, repro.engine.loop, repro.cli, repro.tools.compare"
endef
unexport PYTHONDONTWRITEBYTECODE

ifeq ($(PY),$(VENV)/bin/python)
install: $(STAMP) ## create .venv and install the package with its dev extras (once)

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(install_into)
	touch $@
else
install:  # same, into $(PY)
	$(install_into)
endif

add: ## install a package (a zoo: PKG=timm) beside the installed torch, never replacing it; it must import
	@test -n "$(PKG)" || { echo "make add: give the package, e.g. make add PKG=timm" >&2; exit 2; }
	@$(PY) scripts/add.py $(PKG)

new: install ## start a project of your own: model, data, task, preset and its test (NAME=mylab [TASK=segmentation])
	@test -n "$(NAME)" || { echo "make new: give the name, e.g. make new NAME=mylab" >&2; exit 2; }
	$(PY) -m repro new $(NAME) --task $(or $(TASK),classification)

# the default run (no ARGS) ends with whether this machine is the one the README's digest
# was measured on (benchmarks/default-run.json): a match to expect, or why not
train: install ## train the default ConvNet on the synthetic data, strict mode (ARGS="key=value ...")
	$(PY) train.py $(ARGS)
	@$(if $(ARGS),true,$(PY) scripts/published_digest.py)

# what tests/conftest.py pins (PINNED, SESSION) and would otherwise re-execute pytest to set,
# given here so that pytest starts once (a plain `pytest` re-executes itself: the same run)
TEST_ENV := PYTHONHASHSEED=0 CUBLAS_WORKSPACE_CONFIG=:4096:8 OMP_WAIT_POLICY=PASSIVE

test: install ## run the whole test suite, as CI does (CUDA tests skip without a GPU)
	$(TEST_ENV) $(PY) -m pytest $(XDIST) $(PYTEST_ARGS)

test-fast: install ## the in-process tests only: for the edit-test loop
	$(TEST_ENV) $(PY) -m pytest -m "not e2e and not cuda" $(PYTEST_ARGS)

test-cuda: install ## run only the CUDA-marked tests (on a GPU machine)
	$(TEST_ENV) $(PY) -m pytest -m cuda $(PYTEST_ARGS)

test-gpu: install ## on a GPU machine: the whole suite, CUDA tests included; its log into benchmarks/
	PY=$(PY) XDIST="$(XDIST)" bash scripts/test_gpu.sh -- $(PYTEST_ARGS)

mutations: install ## check that the tests catch the bugs listed in tests/README.md
	$(PY) scripts/mutations.py $(ARGS)

verify: install ## train twice and with 0 vs 2 loader workers, compare bits: PASS/FAIL (ARGS="key=value ...")
	$(PY) scripts/verify.py $(if $(ARGS),-- $(ARGS))

bench: install ## on a CUDA machine: throughput, strict vs fast x amp x loader, into benchmarks/ (ARGS="--steps 200 ...")
	$(PY) scripts/benchmark.py $(ARGS)

gpu-check: install ## on a GPU machine: CUDA tests, drift demo, benchmark, multi-GPU checks; logs into benchmarks/
	PY=$(PY) bash scripts/gpu_check.sh $(ARGS)

report: install ## summarise a seed sweep (SWEEP=multirun/<date>/<time>_<id>; default: the newest)
	@sweep="$(or $(SWEEP),$$(ls -d multirun/*/*/ 2>/dev/null | sort | tail -n 1))"; \
	if [ -z "$$sweep" ]; then echo "no sweep under multirun/: run python train.py -m seed=0,1,2,3,4 first" >&2; exit 2; fi; \
	$(PY) -m repro report "$$sweep"

lint: install ## ruff: lint and check formatting
	$(PY) -m ruff check src tests scripts train.py
	$(PY) -m ruff format --check src tests scripts train.py

format: install ## ruff: fix what can be fixed and format
	$(PY) -m ruff check --fix src tests scripts train.py
	$(PY) -m ruff format src tests scripts train.py

clean: ## remove run outputs and caches (keeps .venv)
	rm -rf outputs multirun .pytest_cache .ruff_cache
	find . -name __pycache__ -type d -not -path "./$(VENV)/*" -prune -exec rm -rf {} +

distclean: clean ## also remove .venv
	rm -rf $(VENV) src/*.egg-info
