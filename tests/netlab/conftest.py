"""The simulated internet needs root, /dev/net/tun and network namespaces (CI runs as root);
without them every test here skips with one reason."""

from __future__ import annotations

import json
import selectors
import subprocess
import sys

import pytest
from swarm_node.node.testing.netlab import Lab, probe, unavailable_reason

PROBE = [sys.executable, probe.__file__]


@pytest.fixture(scope="session")
def netlab_ok():
    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)


def start(lab: Lab, host: str, *args: str, timeout: float = 20.0) -> tuple[subprocess.Popen, int]:
    """Start a probe server on `host`; returns it and the port it listens on."""
    proc = lab.popen(host, [*PROBE, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout):
            raise AssertionError(f"probe {args[0]} on {host} did not start in {timeout:.0f}s")
    line = proc.stdout.readline()
    if not line:
        raise AssertionError(f"probe {args[0]} on {host} exited: {proc.stderr.read()!r}")
    return proc, json.loads(line)["listening"]


def result(proc: subprocess.Popen, timeout: float = 30.0) -> dict:
    """A started probe's final JSON line."""
    out, err = proc.communicate(timeout=timeout)
    lines = out.decode().strip().splitlines()
    assert proc.returncode == 0 and lines, f"probe failed ({proc.returncode}): {err!r}"
    return json.loads(lines[-1])


def run(lab: Lab, host: str, *args: str, timeout: float = 30.0) -> dict:
    """Run a probe client on `host` to its end; its final JSON line."""
    done = lab.run(host, [*PROBE, *args], timeout=timeout)
    assert done.returncode == 0, f"probe {args[0]} on {host}: {done.stderr.decode()[-800:]}"
    return json.loads(done.stdout.decode().strip().splitlines()[-1])
