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


async def test_a_start_up_stage_says_its_time_and_an_eta_from_the_last_run(tmp_path, caplog):
    import asyncio

    from swarm_node.node.trainer.progress import Stage

    from tests.waiting import async_wait_until

    clock, view = [0.0], {}

    async def load(done: asyncio.Event) -> str:
        await done.wait()
        return "model"

    for run, took in ((1, 40.0), (2, 12.0)):
        stage = Stage("loading the model", "model_load", tmp_path, view,
                      clock=lambda: clock[0], tick_s=0.01)
        done = asyncio.Event()
        with caplog.at_level(logging.INFO, logger="swarm_node.node.trainer.progress"):
            task = asyncio.ensure_future(stage.around(load(done)))
            await async_wait_until(lambda: view.get("doing"), 10, "the stage in the view")
            clock[0] += 11.0  # past the heartbeat: one line
            await async_wait_until(lambda: view.get("elapsed_s") == 11.0, 10, "a tick")
            await async_wait_until(lambda: caplog.records, 10, "the heartbeat line")
            if run == 1:
                assert view["eta_s"] is None and "first time: no ETA" in caplog.messages[-1]
            else:  # the first run took 40 s: 29 s to go
                assert view["eta_s"] == 29.0 and view["last_s"] == 40.0
                assert caplog.messages[-1] == ("loading the model: 11 s so far (took 40 s "
                                               "last time, ETA 29 s)")
            clock[0] += took - 11.0
            done.set()
            assert await task == "model" and view == {}
            caplog.clear()


def test_a_blocking_stage_says_a_line_at_once_and_every_heartbeat(tmp_path):
    """`doctor --load`'s form: the work in a thread, lines from the caller's thread."""
    import json

    import pytest
    from swarm_node.node.trainer.progress import STAGES_FILE, Stage

    from tests.waiting import wait_until

    lines: list[str] = []
    stage = Stage("loading", "doctor_load", tmp_path, {}, say=lines.append, heartbeat_s=0.01)
    got = stage.run_blocking(lambda: wait_until(lambda: len(lines) >= 3, 10, "3 lines") and 7)
    assert got == 7 and lines[0] == "loading: 0 s so far (first time: no ETA)"
    assert "doctor_load" in json.loads((tmp_path / STAGES_FILE).read_text())
    again = Stage("loading", "doctor_load", tmp_path, {}, say=lines.append)
    assert "last time" in again.line(0.0)
    with pytest.raises(ZeroDivisionError):  # the work's error reaches the caller
        again.run_blocking(lambda: 1 / 0)
