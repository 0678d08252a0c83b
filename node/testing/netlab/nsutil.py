"""Network namespaces: create, remove, run a function inside one, find and stop its processes.

Configuration runs in a short-lived thread that entered the namespace with setns(2), which
moves only the calling thread, so the lab's own threads never leave the root namespace and
pyroute2's netlink sockets (created in that thread) belong to the target namespace.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from pyroute2 import netns

from .errors import NetlabError

T = TypeVar("T")
NETNS_DIR = Path("/var/run/netns")
# Every live lab writes which namespaces it made; a later lab removes those of a dead owner.
REGISTRY = Path("/run/netlab")


def in_netns(name: str, fn: Callable[[], T]) -> T:
    """Run `fn` in a fresh thread inside namespace `name`; return its result or re-raise."""
    out: dict[str, object] = {}

    def work():
        try:
            netns.setns(name, flags=0)
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the caller's thread below
            out["error"] = e

    thread = threading.Thread(target=work, name=f"netlab-{name}", daemon=True)
    thread.start()
    thread.join()
    if "error" in out:
        raise out["error"]  # type: ignore[misc]
    return out.get("value")  # type: ignore[return-value]


def sysctl(key: str, value: str) -> None:
    """Write a sysctl of the calling thread's namespace (/proc/sys/net is per namespace)."""
    Path("/proc/sys", *key.split(".")).write_text(value)


def create(name: str) -> None:
    try:
        netns.create(name)
    except OSError as e:
        raise NetlabError(f"cannot create network namespace {name}: {e}") from e


def remove(name: str) -> None:
    if (NETNS_DIR / name).exists():
        netns.remove(name)


def pids_in(name: str) -> list[int]:
    """Processes whose network namespace is `name` (whatever started them)."""
    try:
        target = os.stat(NETNS_DIR / name).st_ino
    except OSError:
        return []
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if os.stat(f"/proc/{entry}/ns/net").st_ino == target:
                pids.append(int(entry))
        except OSError:
            continue  # exited meanwhile, or a kernel thread
    return pids


def kill_all_in(names: list[str], grace_s: float = 3.0) -> None:
    """SIGTERM every process in these namespaces, SIGKILL what is left after `grace_s`."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        pids = [p for n in names for p in pids_in(n)]
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace_s
        while pids and time.monotonic() < deadline:
            pids = [p for p in pids if _alive(p)]
            time.sleep(0.05)
        if not pids:
            return


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (exited, not yet reaped by its parent) counts as gone
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0] != "Z"
    except (OSError, IndexError):
        return False


def _start_time(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def register(lab_id: str, names: list[str]) -> Path:
    REGISTRY.mkdir(parents=True, exist_ok=True)
    path = REGISTRY / f"{lab_id}.json"
    path.write_text(json.dumps({"pid": os.getpid(), "start": _start_time(os.getpid()),
                                "namespaces": names}))
    return path


def sweep_stale() -> list[str]:
    """Remove the namespaces of labs whose owning process is gone (a crashed run)."""
    removed: list[str] = []
    if not REGISTRY.is_dir():
        return removed
    for path in REGISTRY.glob("*.json"):
        try:
            rec = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if _start_time(int(rec.get("pid", 0))) == rec.get("start"):
            continue  # its owner is still running
        names = [n for n in rec.get("namespaces", []) if (NETNS_DIR / n).exists()]
        kill_all_in(names)
        for name in names:
            remove(name)
        removed.extend(names)
        path.unlink(missing_ok=True)
    return removed


def unavailable_reason() -> str | None:
    """None if this process can build a lab, else one sentence saying why not."""
    if os.geteuid() != 0:
        return "the network lab needs root (network namespaces, veth, nftables, TUN)"
    if not os.path.exists("/dev/net/tun"):
        return "the network lab needs /dev/net/tun (the delay stage is a TUN device)"
    probe = f"netlabprobe{os.getpid()}"
    try:
        create(probe)
    except NetlabError as e:
        return f"the network lab cannot create network namespaces here: {e}"
    try:
        remove(probe)
    except OSError as e:
        return f"the network lab cannot remove network namespaces here: {e}"
    return None
