"""The README's set-up on a fresh clone: `make setup` into an empty venv, then run.

Clones the committed HEAD into an empty temp folder, runs the Makefile's setup there with a
brand-new venv (CPU torch from TORCH_SPEC, then the project with its dev extra), and runs a
subset of the tests and the console script from that venv. Slow (minutes): it really
installs everything.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BASE_PYTHON = getattr(sys, "_base_executable", None) or shutil.which("python3")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]


def sh(args: list[str], cwd: Path, timeout: int, env: dict | None = None) -> str:
    proc = subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          check=False, env={**os.environ, **(env or {})})
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-40:])
        raise AssertionError(f"{' '.join(args)} exited {proc.returncode}:\n{tail}")
    return proc.stdout


@pytest.mark.skipif(shutil.which("make") is None or shutil.which("git") is None,
                    reason="needs make and git")
def test_fresh_clone_setup_and_run(tmp_path):
    if not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    clone = tmp_path / "clone"
    venv = tmp_path / "venv"
    sh(["git", "clone", "--quiet", str(REPO), str(clone)], tmp_path, 120)
    assert not (clone / ".venv").exists()

    make = ["make", f"VENV={venv}", "TORCH_SPEC=torch==2.13.0", f"PYTHON={BASE_PYTHON}"]
    # Keep the clone's environment clean of ours: no inherited venv on PATH.
    env = {"VIRTUAL_ENV": "", "PATH": os.pathsep.join(
        p for p in os.environ.get("PATH", "").split(os.pathsep)
        if not p.startswith(str(Path(sys.executable).parent)))}
    sh([*make, "setup"], clone, 2000, env)
    py = venv / "bin" / "python"
    assert py.exists()
    version = sh([str(py), "-c", "import torch; print(torch.__version__)"], clone, 120)
    assert version.startswith("2.13.0")

    # Re-running the set-up installs nothing.
    again = sh([*make, "setup"], clone, 120, env)
    assert "pip install" not in again and "Nothing to be done" in again

    # The installed package is the clone's, and its CLI and tests work.
    where = sh([str(py), "-c", "import swarm_node.protocol as p; print(p.__file__)"], clone, 60)
    assert Path(where.strip()).resolve().is_relative_to(clone.resolve())
    assert "keygen" in sh([str(venv / "bin" / "swarm-node"), "--help"], clone, 60)
    key = tmp_path / "k.pem"
    sh([str(venv / "bin" / "swarm-node"), "keygen", "--key", str(key)], clone, 60)
    sh([str(py), "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
        "tests/protocol/test_envelope.py", "tests/protocol/test_messages.py",
        "tests/node/test_identity.py"], clone, 900)
