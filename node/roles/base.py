"""What every role shares: config, identity, p2p host, state, and one worker thread.

CPU-heavy work (generation, verification, training, hashing) runs in the role's single
worker thread, so it never blocks the event loop and never races on the model's weights.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

log = logging.getLogger("swarm_node")


class Role:
    name = "role"

    def __init__(self, cfg, identity, p2p, state):
        self.cfg = cfg
        self.identity = identity
        self.p2p = p2p
        self.state = state
        self.data_dir: Path = cfg.data_dir
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{self.name}-work")

    async def work(self, fn, *args, **kwargs):
        """Run `fn` in the role's worker thread."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, lambda: fn(*args, **kwargs))

    async def start(self) -> None:
        """Load what the role needs and subscribe to its topics."""

    def track_downloads(self, broadcaster, interval_s: float = 1.0) -> None:
        """Mirror the broadcaster's download in progress into `/status`."""
        async def loop():
            while True:
                for version, _task, d in list(broadcaster.downloads.values()):
                    m = d.entry.manifest
                    done = d.progress.done if d.progress is not None else 0
                    self.state.set_checkpoint_progress(version, len(d.entry.have),
                                                       m.num_shards, done, m.total_size)
                cp = self.state.checkpoint_progress
                finished = any(v == cp.get("version") for _, v in broadcaster.completed)
                if cp and not cp["complete"] and not broadcaster.downloads and finished:
                    self.state.set_checkpoint_progress(cp["version"], cp["shards_total"],
                                                       cp["shards_total"], cp["bytes_total"],
                                                       cp["bytes_total"])
                await asyncio.sleep(interval_s)
        self._tracker = asyncio.create_task(loop(), name=f"{self.name}-progress")

    async def run(self, stop: asyncio.Event) -> None:
        await stop.wait()

    async def close(self) -> None:
        tracker = getattr(self, "_tracker", None)
        if tracker is not None:
            tracker.cancel()
        self._pool.shutdown(wait=True, cancel_futures=True)

    # Small persistent counters (survive restarts) -------------------------------------

    def load_json(self, name: str, default):
        try:
            return json.loads((self.data_dir / name).read_text())
        except (OSError, ValueError):
            return default

    def save_json(self, name: str, value) -> None:
        path = self.data_dir / name
        tmp = path.with_name(name + ".tmp")
        with open(tmp, "w") as f:
            json.dump(value, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
