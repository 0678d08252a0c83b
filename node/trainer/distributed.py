"""A multi-process trainer: N ranks of one trainer on torch.distributed.

Launch it the standard way, with torchrun (`swarm-node join --role trainer --procs N` does
exactly this; see `launch`):

    torchrun --standalone --nproc-per-node N --max-restarts 10 \\
        -m swarm_node.node.ranks --config resolved.toml

Rank 0 runs the whole node (p2p, verification, buffer, checkpoints, broadcast). Ranks 1..N-1
run `run_worker` only: each holds the same model, optimizer and scheduler, built from rank 0's
latest checkpoint. For every step rank 0 broadcasts the chosen groups (the buffer's own msgpack
encoding, never pickle); every rank computes the gradients of its share (groups balanced by
completion tokens); the gradients, weighted by each share's token count, are summed with
all_reduce (the DDP algorithm; the DDP wrapper itself is not used because the ranks run
different numbers of micro-batches); every rank then takes the same clipped AdamW step. Only
rank 0 writes checkpoints, so the published policy is the same full safetensors directory as
for one process.

Backends: gloo on CPU, NCCL on CUDA for the gradients; the small control messages always go
through a gloo group.

Failure: when a rank dies, torchrun stops the others and restarts all of them (up to
`--max-restarts`). Rank 0 resumes from its last checkpoint; the buffer returns the groups
claimed by lost steps (buffer.py), so nothing accepted is lost.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import select
import sys
import time
from datetime import timedelta
from pathlib import Path

import msgpack
import torch
import torch.distributed as dist

from ..errors import NodeError
from ..models import ensure_builtin
from .buffer import RolloutGroup
from .hooks import StepHooks
from .trainer import StepStats, Trainer

log = logging.getLogger(__name__)

CMD_READY, CMD_STEP, CMD_STOP, CMD_PARAMS = 1, 2, 3, 4
MAX_RESTARTS = 10
BUCKET_ELEMENTS = 1 << 24  # gradients are all-reduced in buckets of at most 64 MiB (fp32)
# Ranks wait for rank 0 between steps for as long as it waits for peers; a dead rank is
# detected by torchrun (process exit), not by this timeout.
IDLE_TIMEOUT = timedelta(hours=24)
LOSS_KEYS = ("loss", "clip_low_frac", "clip_high_frac", "delta_frac", "mean_ratio", "kl",
             "entropy")

_active: RankSync | None = None  # rank 0's sync, stopped by `stop_ranks` at exit


class RankSync:
    """One rank's side of the step protocol; set as `Trainer.grad_sync`."""

    def __init__(self, rank: int, world: int, ctrl):
        self.rank, self.world, self.ctrl = rank, world, ctrl
        self._local_tokens = self._global_tokens = 0

    @classmethod
    def from_env(cls) -> RankSync:
        """Join the process group torchrun describes in the environment."""
        if not dist.is_initialized():
            backend = "nccl" if torch.cuda.is_available() else "gloo"
            if backend == "nccl":
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
            dist.init_process_group(backend, store=_attempt_store(rank, world), rank=rank,
                                    world_size=world, timeout=IDLE_TIMEOUT)
        ctrl = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
        return cls(dist.get_rank(), dist.get_world_size(), ctrl)

    # control messages (rank 0 -> all) ---------------------------------------------------

    def send(self, cmd: int, payload: bytes = b"") -> None:
        dist.broadcast(torch.tensor([cmd, len(payload)], dtype=torch.int64), 0, group=self.ctrl)
        if payload:
            data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
            dist.broadcast(data, 0, group=self.ctrl)

    def recv(self) -> tuple[int, bytes]:
        header = torch.zeros(2, dtype=torch.int64)
        dist.broadcast(header, 0, group=self.ctrl)
        cmd, size = int(header[0]), int(header[1])
        if size == 0:
            return cmd, b""
        data = torch.empty(size, dtype=torch.uint8)
        dist.broadcast(data, 0, group=self.ctrl)
        return cmd, data.numpy().tobytes()

    def barrier(self) -> None:
        dist.barrier(group=self.ctrl)

    # the Trainer.grad_sync seam ----------------------------------------------------------

    def shard(self, batch: list[RolloutGroup]) -> list[RolloutGroup]:
        """Rank 0 sends the step's groups to every rank; each rank keeps its share."""
        if self.rank == 0:
            self.send(CMD_STEP, encode_batch(batch))
        shares = split_by_tokens(batch, self.world)
        self._global_tokens = sum(_tokens(g) for g in batch)
        self._local_tokens = sum(_tokens(g) for g in shares[self.rank])
        return shares[self.rank]

    def after_backward(self, model) -> None:
        """Sum the token-weighted gradients of all ranks (each rank's loss is a token mean
        over its own share, so its gradient is scaled by share tokens / step tokens)."""
        params = [p for p in model.parameters() if p.requires_grad]
        scale = self._local_tokens / max(self._global_tokens, 1)
        for bucket in _buckets(params, BUCKET_ELEMENTS):
            flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p))
                              .reshape(-1).float() for p in bucket])
            flat.mul_(scale)
            dist.all_reduce(flat)
            offset = 0
            for p in bucket:
                g = flat[offset:offset + p.numel()].view_as(p).to(p.dtype)
                offset += p.numel()
                if p.grad is None:
                    p.grad = g.clone()
                else:
                    p.grad.copy_(g)

    def finish(self, stats) -> None:
        """Make the step's statistics those of the whole batch, not of this rank's share."""
        n = stats.completions
        reward_sum = stats.mean_reward * n if n else 0.0
        vec = [float(stats.tokens), float(n), reward_sum]
        vec += [getattr(stats, k) * self._local_tokens for k in LOSS_KEYS]
        t = torch.tensor(vec, dtype=torch.float64)
        dist.all_reduce(t, group=self.ctrl)
        stats.tokens, stats.completions = int(t[0]), int(t[1])
        stats.mean_reward = float(t[2] / t[1]) if t[1] > 0 else float("nan")
        for i, k in enumerate(LOSS_KEYS):
            setattr(stats, k, float(t[3 + i] / max(self._global_tokens, 1)))

    def send_params(self, model) -> None:
        """Rank 0: give every rank rank 0's parameters (after a trainer-group average)."""
        self.send(CMD_PARAMS)
        self.recv_params(model)

    @torch.no_grad()
    def recv_params(self, model) -> None:
        for bucket in _buckets(list(model.parameters()), BUCKET_ELEMENTS):
            flat = torch.cat([p.detach().reshape(-1).float() for p in bucket])
            dist.broadcast(flat, 0)
            offset = 0
            for p in bucket:
                p.copy_(flat[offset:offset + p.numel()].view_as(p))
                offset += p.numel()

    def stop(self) -> None:
        if self.rank == 0:
            self.send(CMD_STOP)


def _attempt_store(rank: int, world: int):
    """torchrun's store, with keys private to this restart attempt: after a restart, gloo
    must not read the listening addresses that the previous attempt's ranks published."""
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          is_master=not agent_store and rank == 0, timeout=IDLE_TIMEOUT)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"swarm-node/attempt-{attempt}", store)


def _tokens(g: RolloutGroup) -> int:
    return sum(len(c.completion_ids) for c in g.completions)


def split_by_tokens(batch: list[RolloutGroup], world: int) -> list[list[RolloutGroup]]:
    """Deterministic shares with balanced completion tokens (largest group first to the
    least-loaded rank); each share keeps the batch order."""
    load = [0] * world
    owner = [0] * len(batch)
    for i in sorted(range(len(batch)), key=lambda i: (-_tokens(batch[i]), i)):
        r = min(range(world), key=lambda r: (load[r], r))
        owner[i] = r
        load[r] += _tokens(batch[i])
    return [[g for i, g in enumerate(batch) if owner[i] == r] for r in range(world)]


def _buckets(params, limit: int):
    bucket, size = [], 0
    for p in params:
        if bucket and size + p.numel() > limit:
            yield bucket
            bucket, size = [], 0
        bucket.append(p)
        size += p.numel()
    if bucket:
        yield bucket


def encode_batch(batch: list[RolloutGroup]) -> bytes:
    return msgpack.packb([[g.id, g.to_bytes()] for g in batch], use_bin_type=True)


def decode_batch(data: bytes) -> list[RolloutGroup]:
    return [RolloutGroup.from_bytes(raw, row_id) for row_id, raw in msgpack.unpackb(data)]


# rank 0 ---------------------------------------------------------------------------------

def attach_ranks(trainer) -> RankSync | None:
    """Rank 0: wait until every other rank has built its trainer from our latest checkpoint;
    returns the `grad_sync` hook that routes the trainer's updates through them (hooks.py).
    None outside torchrun (one process)."""
    global _active
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return None
    sync = RankSync.from_env()
    sync.send(CMD_READY)
    sync.barrier()
    sync.send_params(trainer.model)  # e.g. a trainer group's state loaded after the checkpoint
    _active = sync
    log.info("trainer rank 0 of %d: the other ranks are ready", sync.world)
    return sync


def stop_ranks() -> None:
    """Rank 0 at exit: tell the other ranks to finish (they exit 0, so torchrun does not
    restart them)."""
    global _active
    if _active is None:
        return
    try:
        _active.stop()
    except (RuntimeError, dist.DistBackendError) as e:  # a rank already gone: nothing to stop
        log.warning("could not stop the other ranks: %s", e)
    _active = None


# ranks 1..N-1 ---------------------------------------------------------------------------

def run_worker(cfg) -> None:
    """A rank other than 0: same model and optimizer, computes its share of every step."""
    sync = RankSync.from_env()
    cmd, _ = sync.recv()
    if cmd != CMD_READY:
        raise NodeError(f"rank {sync.rank}: expected READY from rank 0, got {cmd}")
    device = None
    if torch.cuda.is_available():
        device = f"cuda:{os.environ.get('LOCAL_RANK', '0')}"
    trainer = Trainer(cfg, model_dir_of(cfg), cfg.data_dir, device=device,
                      scale_out=lambda _trainer: StepHooks(grad_sync=sync))
    sync.barrier()
    log.info("trainer rank %d of %d ready at version %d", sync.rank, sync.world, trainer.version)
    try:
        while True:
            cmd, payload = sync.recv()
            if cmd == CMD_STOP:
                return
            if cmd == CMD_PARAMS:
                sync.recv_params(trainer.model)
                continue
            if cmd != CMD_STEP:
                raise NodeError(f"rank {sync.rank}: unknown command {cmd}")
            trainer.version += 1
            trainer.update(decode_batch(payload), StepStats(trainer.version, True))
    finally:
        trainer.close()


def model_dir_of(cfg) -> str:
    name = cfg.model.name
    return str(ensure_builtin(name)) if name.startswith("builtin:") else name


# entry points ---------------------------------------------------------------------------

def launch(cfg, procs: int, config_path: Path) -> None:
    """`swarm-node join --procs N`: write the resolved config and exec torchrun."""
    config_path.parent.mkdir(parents=True, exist_ok=True)
    config_path.write_text(cfg.to_toml())
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={procs}", f"--max-restarts={MAX_RESTARTS}",
            "-m", "swarm_node.node.ranks", "--config", str(config_path)]
    os.execv(sys.executable, argv)


class BufferWatch:
    """Wakes a trainer that waits for another process to write its buffer: Linux inotify on
    the buffer's directory (SQLite in WAL mode appends every commit to `buffer.sqlite-wal`).
    Where inotify is unavailable, `wait` returns after at most POLL_S (the caller polls)."""

    # IN_MODIFY | IN_CLOSE_WRITE | IN_MOVED_TO | IN_CREATE
    EVENTS = 0x002 | 0x008 | 0x080 | 0x100
    POLL_S = 0.2

    def __init__(self, directory: Path):
        self.fd = -1
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            fd = libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        except (OSError, AttributeError):  # no libc inotify (not Linux)
            return
        if fd >= 0 and libc.inotify_add_watch(fd, os.fsencode(directory), self.EVENTS) >= 0:
            self.fd = fd
        elif fd >= 0:
            os.close(fd)

    def drain(self) -> None:
        """Forget the writes seen so far (call it before looking at the buffer)."""
        if self.fd >= 0:
            try:
                while os.read(self.fd, 1 << 16):
                    pass
            except BlockingIOError:
                pass

    def wait(self, timeout: float) -> bool:
        """Until the directory is written to (True) or `timeout` s pass (False)."""
        if self.fd < 0:
            time.sleep(min(timeout, self.POLL_S))
            return False
        ready, _, _ = select.select([self.fd], [], [], timeout)
        return bool(ready)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def run_offline(cfg, steps: int, idle_s: float = 30.0) -> None:
    """No node: train on the buffer until version `steps`, waiting for groups when it is
    empty (another process may add them: a write to the buffer wakes the wait; `idle_s` only
    bounds it). Prints one JSON line per step (tests, benchmarks)."""
    trainer = Trainer(cfg, model_dir_of(cfg), cfg.data_dir,
                      scale_out=lambda t: StepHooks(grad_sync=attach_ranks(t)))
    watch = BufferWatch(trainer.buffer.path.parent)
    try:
        while trainer.version < steps:
            watch.drain()  # a write after this point wakes the wait below
            stats = trainer.step()
            if not stats.trained:
                watch.wait(idle_s)  # nothing buffered yet
                continue
            print(json.dumps({k: stats.as_dict()[k] for k in
                              ("version", "tokens", "completions", "loss", "grad_norm",
                               "seconds", "tokens_per_s")}), flush=True)
    finally:
        watch.close()
        stop_ranks()
        trainer.close()


def write_pid(data_dir: Path, rank: int) -> None:
    """<data_dir>/trainer/ranks/rank-R.pid: which process is which rank (operators, tests)."""
    d = Path(data_dir) / "trainer" / "ranks"
    d.mkdir(parents=True, exist_ok=True)
    tmp = d / f".rank-{rank}.pid.tmp"
    tmp.write_text(f"{os.getpid()} {os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}\n")
    os.replace(tmp, d / f"rank-{rank}.pid")
