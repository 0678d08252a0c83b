"""Log lines: exactly one per event, plain or JSON, with structured fields."""

from __future__ import annotations

import io
import json
import logging
import threading

import pytest
from swarm_node.node.logs import event, setup_logging


@pytest.fixture
def capture():
    root = logging.getLogger()
    saved = (root.handlers[:], root.level)
    buf = io.StringIO()
    hook = threading.excepthook
    yield buf
    root.handlers[:] = saved[0]
    root.setLevel(saved[1])
    logging.captureWarnings(False)
    threading.excepthook = hook


def emit(log: logging.Logger) -> None:
    log.info("joined swarm %r as %s", "demo", "trainer")
    log.debug("hidden at INFO")
    event(log, "train_step", f"step 3: reward={0.5:.2f}", step=3, reward=0.5, obj=[1, 2])
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


def test_repeated_warnings_are_rate_limited_and_counted(capture):
    from swarm_node.node.logs import RateLimit

    now = [0.0]
    setup_logging("INFO", json_lines=True, stream=capture)
    limiter = RateLimit(burst=3, window_s=60.0, clock=lambda: now[0])
    logging.getLogger().handlers[0].filters[:] = [limiter]
    log = logging.getLogger("swarm_node.node.broadcast.service")
    for v in range(10):  # what a join used to print: ~10 of these
        log.warning("%s (from %s)", f"manifest rejected (not_newer): v{v} <= v12", "abcd1234")
    log.warning("%s (from %s)", "manifest rejected (bad_signature): x", "abcd1234")
    now[0] = 61.0
    log.warning("%s (from %s)", "manifest rejected (not_newer): v11 <= v12", "abcd1234")
    docs = [json.loads(line) for line in capture.getvalue().splitlines()]
    not_newer = [d for d in docs if "not_newer" in d["msg"]]
    assert len(not_newer) == 4  # 3 in the first window, then one carrying the count
    assert not_newer[-1]["suppressed"] == 7
    assert any("bad_signature" in d["msg"] for d in docs)  # another reason is not held back


def test_library_logs_go_through_our_formatter(capture):
    import libp2p  # noqa: F401 - its import reconfigures the `libp2p` logger
    from swarm_node.node.logs import route_library_logs
    from transformers.utils import logging as hf_logging

    setup_logging("INFO", json_lines=True, stream=capture)
    hf_logging.get_logger("transformers.modeling_utils")  # installs transformers' handler
    route_library_logs()
    logging.getLogger("libp2p.transport.tcp.tcp").critical("listener failed: %s", "Errno 98")
    logging.getLogger("transformers.modeling_utils").warning("weights not initialised")
    docs = [json.loads(line) for line in capture.getvalue().splitlines()]
    names = {d["logger"] for d in docs}
    assert {"libp2p.transport.tcp.tcp", "transformers.modeling_utils"} <= names


def test_routing_resets_only_the_library_loggers_that_set_a_level(capture, monkeypatch):
    # each setLevel clears the cache of every logger: done for each of ~800 library loggers
    # (torch and transformers once a model is loaded), that cost every node process CPU
    from swarm_node.node.logs import LIBRARY_LOGGERS, route_library_logs

    setup_logging("INFO", stream=capture)
    quiet = [logging.getLogger(f"torch.routing_probe.m{i}") for i in range(300)]
    loud = logging.getLogger("libp2p.routing_probe")
    loud.setLevel(logging.INFO)
    clears = []
    real = logging.Logger.manager._clear_cache
    monkeypatch.setattr(logging.Logger.manager, "_clear_cache",
                        lambda: (clears.append(1), real())[1])
    route_library_logs()
    assert loud.level == logging.NOTSET  # its own level no longer overrides libp2p's
    assert all(q.level == logging.NOTSET for q in quiet)
    logging.getLogger("libp2p.routing_probe").critical("still routed")
    assert "still routed" in capture.getvalue()
    assert len(clears) < len(LIBRARY_LOGGERS) + 50, len(clears)


def test_exact_repeats_of_info_lines_are_rate_limited(capture):
    from swarm_node.node.logs import RateLimit

    now = [0.0]
    setup_logging("INFO", json_lines=True, stream=capture)
    logging.getLogger().handlers[0].filters[:] = [RateLimit(clock=lambda: now[0])]
    log = logging.getLogger("swarm_node.node.broadcast.service")
    for _ in range(42):  # a full disk: the same refusal at every advert, a minute long
        log.info("manifest from %s: %s", "2QJidDdw", "manifest rejected (no_space): 0 MiB free")
    for r in range(5):  # news each time: all shown
        log.info("published round %d: %d completions", r, 16)
    now[0] = 61.0
    log.info("manifest from %s: %s", "2QJidDdw", "manifest rejected (no_space): 0 MiB free")
    docs = [json.loads(line) for line in capture.getvalue().splitlines()]
    refusals = [d for d in docs if "no_space" in d["msg"]]
    assert len(refusals) == 4 and refusals[-1]["suppressed"] == 39
    assert sum("published round" in d["msg"] for d in docs) == 5


def test_chosen_library_loggers_can_be_turned_up_for_diagnosis(capture):
    # py-libp2p is at CRITICAL; node.library_log_levels opens chosen loggers (a node's
    # hole-punch or swarm DEBUG lines) without opening the rest of the library, and
    # route_library_logs (run again after the heavy imports) keeps them open
    from swarm_node.node.logs import route_library_logs

    chosen = [logging.getLogger("libp2p.relay.circuit_v2.dcutr"),
              logging.getLogger("libp2p.network.swarm")]
    try:
        setup_logging("INFO", stream=capture, library_levels={
            "libp2p.relay.circuit_v2.dcutr": "DEBUG", "libp2p.network.swarm": "INFO"})
        route_library_logs()
        chosen[0].debug("hole punch to %s", "QmPeer")
        chosen[1].debug("not at INFO")
        chosen[1].info("closing connection")
        logging.getLogger("libp2p.network.connection").error("still CRITICAL only")
        lines = capture.getvalue().splitlines()
        assert [line.split(": ", 1)[1] for line in lines] == ["hole punch to QmPeer",
                                                              "closing connection"], lines
        assert "DEBUG   libp2p.relay.circuit_v2.dcutr" in lines[0]
    finally:
        setup_logging("INFO", stream=capture)  # back to the defaults for other tests
    assert all(logger.level == logging.NOTSET for logger in chosen)


def test_library_log_levels_are_checked_with_the_config():
    from pydantic import ValidationError
    from swarm_node.node.config import NodeSection

    assert NodeSection(library_log_levels={"libp2p": "WARNING"}).library_log_levels == {
        "libp2p": "WARNING"}
    with pytest.raises(ValidationError, match="library_log_levels"):
        NodeSection(library_log_levels={"libp2p": "LOUD"})
