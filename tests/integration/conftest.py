"""Fixtures of the integration tests."""

from __future__ import annotations

import os
import subprocess

import pytest


@pytest.fixture
def small_disk(tmp_path):
    """A 48 MiB tmpfs: a filesystem this test can really fill."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs to fill needs root")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=48m", "tmpfs", str(mnt)],
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)
