"""torchrun entry point of a multi-process trainer (`swarm-node join --procs N` starts it).

    torchrun --standalone --nproc-per-node N --max-restarts 10 \\
        -m swarm_node.node.ranks --config resolved.toml [--offline-steps K]

Rank 0 runs the node (runner.run_node: p2p, verification, broadcast, the trainer role);
ranks 1..N-1 run trainer/distributed.run_worker. It lives at the runner layer because rank 0
starts the whole node; the rank protocol itself is trainer/distributed.py.
"""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

import torch.distributed as dist

from .config import load_config
from .trainer.distributed import run_offline, run_worker, stop_ranks, write_pid


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m swarm_node.node.ranks",
                                 description="One rank of a multi-process trainer "
                                             "(start it with torchrun).")
    ap.add_argument("--config", type=Path, required=True, help="resolved TOML config")
    ap.add_argument("--offline-steps", type=int, default=0,
                    help="no node: train the buffered groups up to this version, then stop")
    args = ap.parse_args(argv)
    cfg = load_config(args.config)
    rank = int(os.environ.get("RANK", "0"))
    write_pid(cfg.data_dir, rank)
    if rank > 0:
        logging.basicConfig(level=cfg.node.log_level, format=f"rank {rank} %(message)s")
        run_worker(cfg)
    elif args.offline_steps:
        logging.basicConfig(level=cfg.node.log_level)
        run_offline(cfg, args.offline_steps)
    else:
        # Only rank 0 runs the node: the other ranks never load libp2p and the roles.
        from .runner import run_node  # noqa: PLC0415

        try:
            run_node(cfg)
        finally:
            stop_ranks()
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
