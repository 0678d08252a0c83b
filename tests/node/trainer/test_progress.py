"""Progress of a long loop over items (node/trainer/progress.py): the log line with an ETA."""

from __future__ import annotations

import logging

from swarm_node.node.trainer.progress import ItemProgress


def test_item_progress_logs_a_rate_and_an_eta(caplog):
    clock = [0.0]
    p = ItemProgress("held-out evaluation", 100, "tasks", clock=lambda: clock[0])
    with caplog.at_level(logging.INFO, logger="swarm_node.node.trainer.progress"):
        clock[0] = 2.0
        p.advance(10)  # before LOG_EVERY_S: quiet
        clock[0] = 8.0
        p.advance(30)  # 40 of 100 in 8 s: 60 more at 5/s
        assert p.view() == {"label": "held-out evaluation", "done": 40, "total": 100,
                            "unit": "tasks", "eta_s": 12.0}
        clock[0] = 20.0
        p.advance(60)  # done: no progress line, the closing one
        p.close()
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["held-out evaluation: 40/100 tasks (40%), 5.0/s, ETA 12 s",
                     "held-out evaluation: 100 tasks in 20.0 s"]


def test_a_held_out_evaluation_reports_its_progress(tiny_model_dir):
    """The real tiny model, 5 tasks in batches of 2: progress after each batch, one line at
    the end, and the same accuracy as in one batch (greedy: batch size changes nothing)."""
    from swarm_node.node.trainer.evaluate import accuracy_of_model_dir, held_out_refs

    refs = held_out_refs("toy/digit_successor", 5)
    said: list[str] = []
    acc = accuracy_of_model_dir(tiny_model_dir, refs, 4, max_batch=2, say=said.append)
    assert said[-1].startswith(f"held-out evaluation of {tiny_model_dir}: 5 tasks in ")
    assert acc == accuracy_of_model_dir(tiny_model_dir, refs, 4, max_batch=8, say=said.append)
