from __future__ import annotations

import pytest

from .rawhost import stop_sweepers


@pytest.fixture(autouse=True)
def _stop_pubsub_sweepers():
    yield
    stop_sweepers()
