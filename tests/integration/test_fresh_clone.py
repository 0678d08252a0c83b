"""The README's set-up on a fresh clone: `make setup` into a new venv, then run.

Clones the committed HEAD into an empty temp folder, runs the Makefile's setup there with a
new venv, and runs a subset of the tests and the console script from that venv: the
Makefile's steps, its stamp (a second `make setup` installs nothing), the editable install of
the clone's own code with its dev extra, the console script.

The venv's third-party packages are seeded as hard links of this interpreter's (everything
but swarm-node itself), so pip finds the requirements satisfied instead of unpacking ~2 GB
again (that took 2-3 minutes of the suite) and the Makefile's torch-first line finds torch
importable. Installing every dependency from nothing is what CI does on each run anyway: its
`make lint` / `make test` run on a clean clone, with no venv (.ci/run).
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BASE_PYTHON = getattr(sys, "_base_executable", None) or shutil.which("python3")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def sh(args: list[str], cwd: Path, timeout: int, env: dict | None = None) -> str:
    proc = subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          check=False, env={**os.environ, **(env or {})})
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-40:])
        raise AssertionError(f"{' '.join(args)} exited {proc.returncode}:\n{tail}")
    return proc.stdout


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError as e:
        if e.errno != errno.EXDEV:
            raise
        shutil.copy2(src, dst)  # another file system


def seed_site_packages(venv: Path) -> None:
    """Hard-link this interpreter's installed packages, except swarm-node, into `venv`'s
    site-packages (pip replaces files by unlinking them, so this interpreter's stay intact).
    The venv itself (bin/python, pyvenv.cfg) is left for the Makefile to create."""
    def not_ours(folder: str, names: list[str]) -> set[str]:
        return {n for n in names if n.startswith(("swarm_node", "__editable__.swarm_node",
                                                  "__editable___swarm_node"))}

    for src in {Path(sysconfig.get_path("purelib")), Path(sysconfig.get_path("platlib"))}:
        if src.is_dir():
            shutil.copytree(src, venv / src.relative_to(sys.prefix), symlinks=True,
                            ignore=not_ours, copy_function=_link_or_copy)


@pytest.mark.skipif(shutil.which("make") is None or shutil.which("git") is None,
                    reason="needs make and git")
def test_fresh_clone_setup_and_run(tmp_path):
    if not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    clone = tmp_path / "clone"
    venv = tmp_path / "venv"
    sh(["git", "clone", "--quiet", str(REPO), str(clone)], tmp_path, 120)
    assert not (clone / ".venv").exists()

    seed_site_packages(venv)
    assert not (venv / "pyvenv.cfg").exists()
    make = ["make", f"VENV={venv}", "TORCH_SPEC=torch==2.13.0", f"PYTHON={BASE_PYTHON}"]
    # Keep the clone's environment clean of ours: no inherited venv on PATH.
    env = {"VIRTUAL_ENV": "", "PATH": os.pathsep.join(
        p for p in os.environ.get("PATH", "").split(os.pathsep)
        if not p.startswith(str(Path(sys.executable).parent)))}
    first = sh([*make, "setup"], clone, 2000, env)
    py = venv / "bin" / "python"
    assert (venv / "pyvenv.cfg").exists() and py.exists()  # the Makefile made the venv
    assert "pip install -q -e '.[dev]'" in first

    # Re-running the set-up installs nothing.
    again = sh([*make, "setup"], clone, 120, env)
    assert "pip install" not in again and "Nothing to be done" in again

    # The venv's torch is the pinned one, the installed package is the clone's, and its CLI
    # and tests work.
    probe = "import torch, swarm_node.protocol as p; print(torch.__version__, p.__file__)"
    version, where = sh([str(py), "-c", probe], clone, 120).split()
    assert version.startswith("2.13.0")
    assert Path(where).resolve().is_relative_to(clone.resolve())
    assert "keygen" in sh([str(venv / "bin" / "swarm-node"), "--help"], clone, 60)
    key = tmp_path / "k.pem"
    sh([str(venv / "bin" / "swarm-node"), "keygen", "--key", str(key)], clone, 60)
    # (one quick file: pytest, its plugins and the conftest in the clone's venv, the
    # clone's package and libp2p; the suite itself runs them all)
    sh([str(py), "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
        "tests/node/test_identity.py"], clone, 600)
