"""The tiny-model verifier setup shared by test_checks.py and test_rules.py."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def kit(tiny_model_dir):
    """(model, tokenizer, task source) of the built-in tiny model, toy tasks only."""
    from swarm_node.node.models import load_model
    from swarm_node.node.tasks import TaskSource

    model, tokenizer = load_model(tiny_model_dir)
    source = TaskSource({"toy/digit_successor": 1.0, "toy/digit_copy": 1.0}, "default")
    return model, tokenizer, source
