"""Log lines: exactly one per event, plain or JSON, with structured fields."""

from __future__ import annotations

import io
import json
import logging

import pytest

from swarm_node.node.logs import event, setup_logging


@pytest.fixture
def capture():
    root = logging.getLogger()
    saved = (root.handlers[:], root.level)
    buf = io.StringIO()
    yield buf
    root.handlers[:] = saved[0]
    root.setLevel(saved[1])


def emit(log: logging.Logger) -> None:
    log.info("joined swarm %r as %s", "demo", "trainer")
    log.debug("hidden at INFO")
    event(log, "train_step", "step 3: reward=%.2f" % 0.5, step=3, reward=0.5, obj=[1, 2])
    log.warning("two\nlines")
    try:
        raise ValueError("boom\nsecond line")
    except ValueError:
        log.exception("failed")
    logging.getLogger("libp2p.network").error("noisy library line")


def test_plain_one_line_per_event(capture):
    setup_logging("INFO", json_lines=False, stream=capture)
    emit(logging.getLogger("swarm_node.test"))
    lines = capture.getvalue().splitlines()
    assert len(lines) == 4
    assert "INFO    swarm_node.test: joined swarm 'demo' as trainer" in lines[0]
    assert "step 3: reward=0.50" in lines[1]
    assert "event=train_step" in lines[1] and "step=3" in lines[1] and "obj=[1, 2]" in lines[1]
    assert lines[2].endswith("two\\nlines")
    assert "failed | Traceback" in lines[3] and "ValueError: boom\\nsecond line" in lines[3]


def test_json_one_object_per_event(capture):
    setup_logging("DEBUG", json_lines=True, stream=capture)
    emit(logging.getLogger("swarm_node.test"))
    docs = [json.loads(line) for line in capture.getvalue().splitlines()]
    assert [d["level"] for d in docs] == ["INFO", "DEBUG", "INFO", "WARNING", "ERROR"]
    assert docs[0]["msg"] == "joined swarm 'demo' as trainer"
    assert docs[0]["logger"] == "swarm_node.test" and isinstance(docs[0]["ts"], float)
    step = docs[2]
    assert (step["event"], step["step"], step["reward"], step["obj"]) == \
        ("train_step", 3, 0.5, "[1, 2]")
    assert docs[3]["msg"] == "two\nlines"
    assert "ValueError: boom" in docs[4]["exc"]


def test_setup_is_idempotent(capture):
    setup_logging("INFO", stream=capture)
    setup_logging("INFO", stream=capture)
    logging.getLogger("swarm_node.x").info("once")
    assert capture.getvalue().count("once") == 1
