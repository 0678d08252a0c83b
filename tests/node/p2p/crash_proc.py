"""`swarm-node join` in a process whose libp2p thread can be made to die from outside
(SIGUSR1 raises inside the trio run, past every guard), for the supervised-host test.
Usage: python crash_proc.py join --role relay ... (the swarm-node CLI arguments)."""

from __future__ import annotations

import asyncio
import signal


def main() -> None:
    from swarm_node.cli.main import main as cli_main
    from swarm_node.node.p2p.host import P2PNode

    start = P2PNode.start

    async def start_with_trigger(self, *args, **kwargs):
        await start(self, *args, **kwargs)

        def boom() -> None:
            raise RuntimeError("injected libp2p thread failure")

        asyncio.get_running_loop().add_signal_handler(
            signal.SIGUSR1, lambda: self.context.bridge.call_soon(boom))

    P2PNode.start = start_with_trigger
    cli_main()


if __name__ == "__main__":
    main()
