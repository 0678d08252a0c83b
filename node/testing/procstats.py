"""Resource figures a benchmark peer reports about its own process: peak RSS and CPU time.

Standard library only: benchmarks/shardcast_peer.py loads this file by path under the
shardcast venv, where swarm-node is not installed, so both systems are measured alike."""

from __future__ import annotations

import resource
from pathlib import Path


def peak_rss_mib() -> float:
    """Peak resident memory of this process (VmHWM: reset by exec, unlike ru_maxrss, which
    a child inherits from the parent it was forked from)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def peak_child_rss_mib() -> float:
    """Largest peak RSS among this process's waited-for children (e.g. a download tool)."""
    return resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024


def cpu_seconds() -> float:
    """User + system CPU time of this process so far (less sensitive to a busy machine than
    wall time)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime
