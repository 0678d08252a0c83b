"""`swarm-node join`: one process, one role, until SIGINT/SIGTERM.

Start-up order: logging, identity, p2p host (listen, bootstrap), admin endpoint, role.
Shutdown order is the reverse; the role finishes or persists its in-flight work first.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
from pathlib import Path

from .config import Config
from .errors import NodeError

log = logging.getLogger("swarm_node")

NODE_INFO_FILE = "node.json"


def run_node(cfg: Config) -> None:
    from .logs import setup_logging

    setup_logging(cfg.node.log_level, json_lines=cfg.node.log_json)
    asyncio.run(_main(cfg))


def write_node_info(data_dir: Path, info: dict) -> None:
    """Atomically write what other local tools need: peer id, addrs, admin port, pid."""
    tmp = data_dir / (NODE_INFO_FILE + ".tmp")
    tmp.write_text(json.dumps(info, indent=2))
    os.replace(tmp, data_dir / NODE_INFO_FILE)


async def _main(cfg: Config) -> None:
    from .identity import Identity
    from .metrics import NodeState
    from .p2p import P2PError, P2PNode
    from .roles import make_role

    data_dir = cfg.data_dir
    data_dir.mkdir(parents=True, exist_ok=True)
    identity = Identity.load_or_create(cfg.key_path)
    state = NodeState(peer_id=identity.peer_id, role=cfg.node.role, swarm_id=cfg.node.swarm_id)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)

    p2p = P2PNode(identity, cfg)
    try:
        await p2p.start(bootstrap=cfg.node.bootstrap)
    except P2PError as e:
        await p2p.close()
        raise NodeError(str(e)) from None
    state.p2p = p2p
    role = make_role(cfg, identity, p2p, state)
    admin = None
    if cfg.admin.enabled:
        from .admin import AdminServer

        admin = AdminServer(state, cfg)
    try:
        if cfg.node.dishonest != "none":
            # The cheat kit is loaded only when a (demo or test) config asks for a cheater.
            from .testing.dishonest import make_dishonest

            make_dishonest(role, cfg.node.dishonest)
        if admin is not None:
            await admin.start()
        write_node_info(data_dir, {
            "peer_id": identity.peer_id, "role": cfg.node.role, "pid": os.getpid(),
            "listen_addrs": p2p.listen_addrs,
            "admin_port": admin.port if admin is not None else None,
        })
        if not cfg.node.bootstrap:
            addr = p2p.listen_addrs[0] if p2p.listen_addrs else "?"
            log.info("started a new swarm %r; others join with: swarm-node join --bootstrap %s",
                     cfg.node.swarm_id, addr)
        log.info("joined swarm %r as %s, peer id %s", cfg.node.swarm_id, cfg.node.role,
                 identity.peer_id)
        await role.start()
        state.phase = "running"
        runner = asyncio.create_task(role.run(stop), name=f"role-{cfg.node.role}")
        stopper = asyncio.create_task(stop.wait())
        done, _ = await asyncio.wait({runner, stopper}, return_when=asyncio.FIRST_COMPLETED)
        stop.set()
        if runner in done and runner.exception() is not None:
            raise runner.exception()
        await runner
    finally:
        state.phase = "stopping"
        log.info("shutting down")
        try:
            await role.close()
        finally:
            if admin is not None:
                await admin.close()
            await p2p.close()
    log.info("stopped")
