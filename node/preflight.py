"""Checks a node runs before it announces anything: each failure is one NodeError line.

`check_config` needs no network and no weights: multiaddrs and peer ids, task names, the
device, the model's availability and whether it matches the checkpoints already in the data
dir. `claim_data_dir` and `check_ports` are what `join` adds: a lock on the data dir (the
holder's PID in the message) and a bind probe of every address the node will listen on, so
a taken port is named before the libp2p host starts (py-libp2p only logs it and runs on
without a listener). `join --dry-run` runs all of them without changing anything:
`check_config`, `check_ports` and `check_data_dir` (the lock probed, nothing created).
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import shutil
import socket
import time
from pathlib import Path
from typing import TYPE_CHECKING

import multiaddr
from filelock import FileLock, Timeout

from . import models
from .errors import NodeError
from .models import _hub_source
from .tasks import TaskSource
from .tasks.source import check_dataset

if TYPE_CHECKING:
    from .config import Config

LOCK_FILE = "node.lock"
START_WRITE_BYTES = 256 * 1024  # what a start writes besides large files, with room to spare
PID_FILE = "node.pid"
MODEL_RECORD = "model.json"
# Fields of a model's config.json that must agree for its checkpoints to be loadable.
SHAPE_KEYS = ("model_type", "hidden_size", "num_hidden_layers", "vocab_size",
              "num_attention_heads", "intermediate_size")


def check_config(cfg: Config, *, new_model: bool = False) -> list[str]:
    """All static checks; returns notes worth printing (e.g. 'resuming v12')."""
    check_addresses(cfg)
    check_tasks(cfg)
    check_device(cfg.model.device)
    shape = model_shape(cfg)
    return check_checkpoints(cfg, shape, new_model=new_model)


# addresses ------------------------------------------------------------------------------


def check_addresses(cfg: Config) -> None:
    for addr in cfg.node.listen:
        _tcp_part(addr, multiaddr)
    for addr in cfg.node.bootstrap:
        m = _maddr(addr, multiaddr)
        if "/p2p/" not in str(m):
            raise NodeError(f"bootstrap address {addr} lacks the /p2p/<peer id> part (copy "
                            "the full address the other node printed)")
        check_peer_id(str(m).rsplit("/p2p/", 1)[1], f"bootstrap address {addr}")
    for peer in cfg.node.follow:
        check_peer_id(peer, "--follow")


def _maddr(addr: str, multiaddr):
    if not addr.startswith("/"):
        raise NodeError(f"{addr!r} is not a multiaddr (expected e.g. "
                        "/ip4/203.0.113.7/tcp/4001/p2p/12D3KooW...)")
    try:
        return multiaddr.Multiaddr(addr)
    except Exception as e:  # noqa: BLE001 - multiaddr raises several types
        raise NodeError(f"{addr!r} is not a valid multiaddr ({e})") from None


def _tcp_part(addr: str, multiaddr) -> tuple[str, int]:
    m = _maddr(addr, multiaddr)
    for proto in ("ip4", "ip6"):
        try:
            return m.value_for_protocol(proto), int(m.value_for_protocol("tcp"))
        except Exception:  # noqa: BLE001, S112 - a missing protocol raises ProtocolLookupError
            continue
    raise NodeError(f"listen address {addr} must be /ip4/<ip>/tcp/<port> or "
                    "/ip6/<ip>/tcp/<port>")


def check_peer_id(peer: str, what: str) -> None:
    from libp2p.peer.id import ID

    try:
        ID.from_base58(peer)
    except Exception:  # noqa: BLE001 - base58/multihash raise several types
        raise NodeError(f"{what}: {peer!r} is not a peer ID (it looks like 12D3KooW... ; "
                        "`swarm-node id` prints one)") from None
    if not peer.startswith(("12D3KooW", "Qm")):
        raise NodeError(f"{what}: {peer!r} is not a libp2p peer ID (12D3KooW...)")


def check_ports(cfg: Config) -> list[str]:
    """Bind every listen address (and the admin and bulk-plane ports) once, so a taken one
    is named now. Returns warnings: a taken bulk-plane port derived from --listen ("auto")
    does not stop a node (it runs without its bulk plane), an explicit `bulk.listen` does."""
    for addr in cfg.node.listen:
        host, port = _tcp_part(addr, multiaddr)
        _probe(host, port, f"cannot listen on {addr}", "another swarm-node on this machine? "
               "pick another port with --listen /ip4/0.0.0.0/tcp/<port>")
    if cfg.admin.enabled and cfg.admin.port:
        _probe("127.0.0.1", cfg.admin.port, f"admin port 127.0.0.1:{cfg.admin.port} is taken",
               "another swarm-node on this machine? set --admin-port <port>, or "
               "--set admin.port=0 for a free one")
    setting = cfg.bulk.listen
    if setting == "off":
        return []
    if setting != "auto":
        host, _, port = setting.rpartition(":")
        _probe(host.strip("[]"), int(port), f"bulk.listen {setting!r}: cannot listen",
               "another swarm-node on this machine? set another bulk.listen")
        return []
    if not cfg.node.listen:
        return []
    host, port = _tcp_part(cfg.node.listen[0], multiaddr)
    if not port:
        return []
    try:
        _probe(host, port + 1, "", "")
    except NodeError as e:
        why = e.args[0].lstrip(": ")
        note = (f"warning: the bulk-plane port {host}:{port + 1} (the libp2p port + 1) is "
                f"taken ({why}): this node would run without its bulk plane (shards and "
                "gossip bodies over libp2p streams only); pick a --listen port whose next "
                "port is free too, or set bulk.listen")
        return [note]
    return []


def _probe(host: str, port: int, what: str, hint: str) -> None:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        # Same option as the real listeners (trio sets it): TIME_WAIT does not count as taken.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
            s.listen(1)
        except OSError as e:
            extra = f" ({hint})" if hint and e.errno == 98 else ""
            raise NodeError(f"{what}: {e.strerror or e}{extra}") from None


# tasks, device, model ---------------------------------------------------------------------


def check_tasks(cfg: Config) -> None:
    for name in cfg.tasks.mix:
        try:
            check_dataset(name)
        except NodeError as e:
            raise NodeError(f"tasks.mix: {e}") from None
    TaskSource.of(cfg.tasks, cfg.node.swarm_id)


def check_device(device: str) -> None:
    if device in ("auto", "cpu"):
        return
    import torch

    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            build = "a CPU-only build" if torch.version.cuda is None else \
                f"built for CUDA {torch.version.cuda}, but no GPU is visible"
            raise NodeError(f"model.device = {device!r} but this torch {torch.__version__} is "
                            f"{build}; install a CUDA torch (README: Install) or set "
                            "--set model.device=cpu")
        index = int(device.split(":", 1)[1]) if ":" in device else 0
        if index >= torch.cuda.device_count():
            raise NodeError(f"model.device = {device!r} but only {torch.cuda.device_count()} "
                            "GPU(s) are visible")
        return
    if device == "mps" and torch.backends.mps.is_available():
        return
    raise NodeError(f"model.device = {device!r} is not usable here (auto, cpu, cuda, cuda:N)")


def model_shape(cfg: Config) -> dict:
    """The model's config.json fields that decide checkpoint compatibility; checks it
    exists (local dir, built-in, or hub cache/hub) without loading weights."""
    name = cfg.model.name
    if name.startswith("builtin:"):
        # Built on first use (minutes for a converted one): not here. The recorded model
        # name still guards the checkpoints.
        if not _builtin_known(name):
            raise NodeError(f"model.name = {name!r}: unknown built-in model")
        return {}
    path = Path(name).expanduser()
    if not path.exists():
        if name.startswith(("/", ".", "~")):
            raise NodeError(f"model directory {name} does not exist")
        _hub_source(name)
        return _hub_config(name)
    return _read_shape(path / "config.json", f"model {name!r}")


def _builtin_known(name: str) -> bool:
    known = getattr(models, "BUILTIN_MODELS", None)
    if known is None:  # no registry: only the tiny model is certain
        return name == models.BUILTIN_TINY or name.startswith("builtin:smollm2")
    return name in known


def _hub_config(name: str) -> dict:
    try:
        import huggingface_hub

        path = huggingface_hub.hf_hub_download(name, "config.json", local_files_only=True)
    except Exception:  # noqa: BLE001 - not cached: compatibility is checked after download
        return {}
    return _read_shape(Path(path), f"model {name!r}")


def _read_shape(path: Path, what: str) -> dict:
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        raise NodeError(f"{what}: {path} does not exist (not a model directory?)") from None
    except (OSError, ValueError) as e:
        raise NodeError(f"{what}: cannot read {path}: {e}") from None
    return {k: doc.get(k) for k in SHAPE_KEYS if k in doc}


def checkpoints_dir(cfg: Config) -> Path:
    return cfg.data_dir / "trainer" / "checkpoints"


def latest_checkpoint(cfg: Config) -> Path | None:
    root = checkpoints_dir(cfg)
    try:
        found = [p for p in root.iterdir() if (p / "policy" / "config.json").exists()]
    except OSError:
        return None
    return max(found, key=lambda p: p.name) if found else None


def check_checkpoints(cfg: Config, shape: dict, *, new_model: bool) -> list[str]:
    """Refuse to resume another model's checkpoints (unless `new_model`: then they are
    moved aside at start). Returns notes for the operator."""
    if cfg.node.role != "trainer":
        return []
    latest = latest_checkpoint(cfg)
    if latest is None:
        return []
    recorded = _recorded_model(cfg)
    old = _read_shape(latest / "policy" / "config.json", f"checkpoint {latest}")
    differs = [k for k in SHAPE_KEYS if k in shape and k in old and shape[k] != old[k]]
    renamed = recorded is not None and recorded != cfg.model.name
    comparable = bool(shape) and bool(old)
    if not differs and (not renamed or comparable):
        # Same shapes under another name (a moved directory, a local copy of a hub model)
        # resume; the name alone refuses only when the shapes cannot be compared.
        note = f" (model.name was {recorded!r}; same architecture)" if renamed else ""
        return [f"resuming from checkpoint {latest.name}{note}"]
    what = (f"{recorded!r}" if recorded else "another model") + (
        f" ({', '.join(f'{k} {old[k]} vs {shape[k]}' for k in differs)})" if differs else "")
    if new_model:
        return [f"--new-model: the checkpoints of {what} will be moved aside"]
    raise NodeError(f"data dir {cfg.data_dir} holds checkpoints of {what}, not of "
                    f"{cfg.model.name!r}; pass --new-model to start {cfg.model.name!r} afresh "
                    "(old checkpoints are kept aside), or use another --data-dir")


def _recorded_model(cfg: Config) -> str | None:
    try:
        return json.loads((cfg.data_dir / MODEL_RECORD).read_text()).get("name")
    except (OSError, ValueError, AttributeError):
        return None


def record_model(cfg: Config, *, new_model: bool) -> None:
    """Write which model this data dir trains; with `new_model`, move the old trainer state
    aside first (nothing is deleted)."""
    if new_model and cfg.node.role == "trainer" and latest_checkpoint(cfg) is not None:
        # The old model's training state and published versions; the key (peer id) and the
        # reputation of peers stay. Followers that hold versions of the old model ignore
        # the new model's versions until it passes them: a fresh data dir (new key) avoids
        # that, which the log line says.
        aside = cfg.data_dir / f"old-model-{time.strftime('%Y%m%d-%H%M%S')}"
        aside.mkdir()
        for name in ("trainer", "broadcast", "round.json"):
            if (cfg.data_dir / name).exists():
                shutil.move(str(cfg.data_dir / name), str(aside / name))
        logging.getLogger("swarm_node").warning(
            "--new-model: moved the old model's checkpoints and published versions to %s; "
            "peers that hold its versions ignore this model's until it passes them (a fresh "
            "--data-dir, hence a new peer id, avoids that)", aside)
    if cfg.node.role == "trainer":
        (cfg.data_dir / MODEL_RECORD).write_text(json.dumps({"name": cfg.model.name}))


# the data dir -----------------------------------------------------------------------------


def prepare_data_dir(cfg: Config) -> Path:
    """Create the data dir (mode 0700); any OSError becomes one line naming the path."""
    path = cfg.data_dir
    probe = path / f".write-test.{os.getpid()}"
    try:
        path.mkdir(parents=True, exist_ok=True, mode=0o700)
        # the small files a start writes (pid, node.json, admin.port, history) must fit
        probe.write_bytes(b"\0" * START_WRITE_BYTES)
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise NodeError(_disk_full_line(path, e)) from None
        raise NodeError(f"data dir {path} is not usable: {e.strerror or e}"
                        f"{' (' + e.filename + ')' if e.filename else ''}; pick another "
                        "--data-dir") from None
    finally:
        try:
            probe.unlink(missing_ok=True)
        except OSError:
            pass  # the path is not a directory: said above
    return path


def claim_data_dir(cfg: Config) -> FileLock:
    """Lock the data dir for this process; NodeError naming the holder's PID if taken.
    The lock is an flock: the OS releases it when the process dies, even on kill -9."""
    path = prepare_data_dir(cfg)
    lock = FileLock(str(path / LOCK_FILE), timeout=0)
    try:
        lock.acquire()
    except Timeout:
        pid = _read_pid(path)
        raise NodeError(f"data dir {path} is in use by another swarm-node (pid {pid}); "
                        "stop it, or give this node its own --data-dir") from None
    except OSError as e:
        raise NodeError(f"cannot lock data dir {path}: {e.strerror or e}") from None
    try:
        (path / PID_FILE).write_text(f"{os.getpid()}\n")
    except OSError as e:
        lock.release()
        raise NodeError(_disk_full_line(path, e) if e.errno in (errno.ENOSPC, errno.EDQUOT)
                        else f"data dir {path} is not usable: {e.strerror or e}") from None
    return lock


def _disk_full_line(path: Path, e: OSError) -> str:
    free = shutil.disk_usage(path).free
    return (f"data dir {path}: the disk is full ({e.strerror}; {free / 2**20:.1f} MiB free); "
            "free some space there and start again")


def check_data_dir(cfg: Config) -> None:
    """What `claim_data_dir` would refuse, found without creating or locking anything: a
    path that cannot become a directory, one that is not writable, a data dir another
    swarm-node holds (its PID named)."""
    path = Path(cfg.data_dir)
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        raise NodeError(f"data dir {path} is not usable: {probe} is not a directory; pick "
                        "another --data-dir")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise NodeError(f"data dir {path} is not usable: {probe} is not writable; pick "
                        "another --data-dir")
    try:
        fd = os.open(path / LOCK_FILE, os.O_RDONLY)
    except OSError:
        return  # no lock file: no node has run here
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
    except OSError:
        raise NodeError(f"data dir {path} is in use by another swarm-node (pid "
                        f"{_read_pid(path)}); stop it, or give this node its own --data-dir"
                        ) from None
    finally:
        os.close(fd)


def _read_pid(path: Path) -> str:
    try:
        return (path / PID_FILE).read_text().strip() or "?"
    except OSError:
        return "?"
