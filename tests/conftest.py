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
