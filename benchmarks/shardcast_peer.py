"""One shardcast 0.3.2 peer (origin, middle or client), run by benchmarks/broadcast.py under
the separate venv .venv-shardcast (shardcast is not installed in the project's venv).

shardcast binds 0.0.0.0 with no option; here its server class is patched to bind
127.0.0.1 and port 0 (the bound port is printed). Each served directory gets the
`data1.bin` that shardcast's downloader probes at start. Prints JSON lines on stdout.

    python shardcast_peer.py origin DATA_DIR FILE       # waits for "go" on stdin
    python shardcast_peer.py middle DATA_DIR UPSTREAM_URL
    python shardcast_peer.py client DATA_DIR SERVER_URL
"""

from __future__ import annotations

import importlib.util
import json
import sys
import time
from pathlib import Path


def emit(**obj) -> None:
    print(json.dumps(obj), flush=True)


def _procstats():
    """node/testing/procstats.py by path: the project is not installed in this venv."""
    path = Path(__file__).resolve().parents[1] / "node" / "testing" / "procstats.py"
    spec = importlib.util.spec_from_file_location("procstats", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


procstats = _procstats()


def patch_bind() -> None:
    from shardcast import server

    class LoopbackServer(server.ShardcastServer):
        def __init__(self, address, directory, shutdown_event=None):
            super().__init__(("127.0.0.1", 0), directory, shutdown_event)

    server.ShardcastServer = LoopbackServer


def private_temp(data_dir: Path) -> None:
    """shardcast 0.3.2 fetches the distribution file (the list of versions) into one path
    beside its package, `<site-packages>/temp_distribution.txt` (and `.tmp` while wget
    writes it), and deletes it after reading: every process of the same venv shares that
    path, so peers polling together can read each other's copies (one from a server that
    does not hold the version yet: "No versions available", the download given up) or
    find it deleted. The path is derived from the module's `__file__` at each call: point
    it into a directory of this peer's own, beside the one it serves."""
    from shardcast import client

    private = data_dir.parent / f"{data_dir.name}.shardcast-tmp"
    private.mkdir(parents=True, exist_ok=True)
    client.__file__ = str(private / "shardcast" / "client.py")


def main() -> int:
    role, data_dir = sys.argv[1], Path(sys.argv[2])
    data_dir.mkdir(parents=True, exist_ok=True)
    (data_dir / "data1.bin").write_bytes(b"\0" * 1024)
    patch_bind()
    private_temp(data_dir)
    import shardcast
    from shardcast.utils import logger

    logger.setLevel("WARNING")
    if role == "origin":
        origin = shardcast.OriginServer(str(data_dir), 0)
        emit(event="ready", url=f"http://127.0.0.1:{origin.http_server.server_address[1]}")
        sys.stdin.readline()
        t0 = time.time()
        version = origin.broadcast(sys.argv[3])
        emit(event="published", version=version, t0=t0, t=time.time())
        sys.stdin.readline()
        return 0
    if role == "middle":
        node = shardcast.MiddleNode([sys.argv[3]], str(data_dir), 0, check_interval=1)
        emit(event="ready", url=f"http://127.0.0.1:{node.http_server.server_address[1]}")
        sys.stdin.readline()
        return 0
    client = shardcast.ClientNode([sys.argv[3]], str(data_dir / "out"))
    emit(event="ready", rss_mib=procstats.peak_rss_mib())
    while "v1" not in client.list_available_versions():
        time.sleep(0.2)
    t_seen = time.time()
    path = client.download_version("v1", str(data_dir / "download_v1.bin"))
    children = procstats.peak_child_rss_mib()
    emit(event="complete" if path else "failed", t=time.time(), t_seen=t_seen, path=path,
         peak_rss_mib=procstats.peak_rss_mib(), peak_child_rss_mib=children)
    return 0


if __name__ == "__main__":
    sys.exit(main())
