"""`swarm-node join`: one process, one role, until SIGINT/SIGTERM.

Start-up order: logging, checks (config, data-dir lock, ports), identity, p2p host (listen,
bootstrap; meanwhile the role's module is imported and its model loaded), admin endpoint, role
(the rest of its start), and only then "joined swarm" (and, under
a supervisor that asks for it, the readiness notice: `notify_supervisor`). Every failure before
that point is one line naming what failed (a NodeError). Shutdown order is the reverse; the
role finishes or persists its in-flight work first. A second Ctrl-C exits at once.

The runner's background tasks (the host watch, the history writer) belong to one
TaskOwner; the counters of the p2p host, the bulk plane and the role's parts are registered
in the state's one metrics registry.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import shlex
import signal
import socket
from collections.abc import Callable
from pathlib import Path

from ..protocol import PROTOCOL_VERSION
from .admin import AdminServer
from .config import Config
from .diskspace import WaitStopped
from .diskspace import configure as configure_disk
from .doctor import runtime_summary
from .errors import NodeError
from .identity import Identity
from .lifecycle import TaskOwner
from .logs import route_library_logs, setup_logging
from .metrics import HISTORY_FILE, NodeState, load_history, save_history
from .p2p import P2PError, P2PNode, route_ip
from .preflight import check_config, check_ports, claim_data_dir, record_model
from .roles import role_class
from .roles.interfaces import BroadcastFeed
from .version import software_version

log = logging.getLogger("swarm_node")

NODE_INFO_FILE = "node.json"
HISTORY_SAVE_S = 30.0  # the dashboard's history is written this often (and at stop)
NOTIFY_SOCKET = "NOTIFY_SOCKET"  # set by a supervisor that wants the readiness notice


def run_node(cfg: Config, *, new_model: bool = False) -> None:
    # Library progress bars are not log lines (they break one-line and JSON logs).
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    setup_logging(cfg.node.log_level, json_lines=cfg.node.log_json,
                  library_levels=cfg.node.library_log_levels)
    notes = check_config(cfg, new_model=new_model)
    lock = claim_data_dir(cfg)
    try:
        check_ports(cfg)
        record_model(cfg, new_model=new_model)
        for note in notes:
            log.info("%s", note)
        asyncio.run(_main(cfg))
    except OSError as e:  # anything the checks did not foresee: still one line
        raise NodeError(f"{e.strerror or e}{': ' + str(e.filename) if e.filename else ''}"
                        ) from None
    finally:
        lock.release()


def write_node_info(data_dir: Path, info: dict) -> None:
    """Atomically write what other local tools need: peer id, addrs, admin port, pid."""
    tmp = data_dir / (NODE_INFO_FILE + ".tmp")
    tmp.write_text(json.dumps(info, indent=2))
    os.replace(tmp, data_dir / NODE_INFO_FILE)


class Interrupts:
    """First SIGINT/SIGTERM: stop gracefully and say what the node waits for; second: exit
    now (exit code 130), skipping the rest of the shutdown."""

    def __init__(self, stop: asyncio.Event):
        self.stop = stop
        self.waiting_for = "the role to start"
        self.role = None  # once set, its current work item is named
        self.count = 0

    def install(self, loop: asyncio.AbstractEventLoop) -> None:
        # A process-level handler (not loop.add_signal_handler): it stays in place after
        # the loop closes, while threads join and the interpreter exits.
        self.loop = loop
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        if self.count == 0 and not self.loop.is_closed():
            self.count = 1
            self.loop.call_soon_threadsafe(self._first)
            return
        self.count += 1
        self._exit_now()

    def fire(self) -> None:
        """Same as receiving SIGINT (in the loop's thread)."""
        self.count += 1
        if self.count == 1:
            self._first()
        else:
            self._exit_now()

    def _first(self) -> None:
        current = getattr(self.role, "current_work", None)
        what = f"{current} to finish" if current else self.waiting_for
        log.warning("stopping: waiting for %s (press Ctrl-C again to exit now)", what)
        self.stop.set()

    def _exit_now(self) -> None:
        log.warning("second interrupt: exiting now without a clean shutdown")
        logging.shutdown()
        os._exit(130)


async def _main(cfg: Config) -> None:
    stop = asyncio.Event()
    # the margin every large write keeps; a write waiting for space ends at `stop`
    configure_disk(cfg.node.min_free_disk_mib * 2**20, stop)
    try:
        await _run(cfg, stop)
    finally:
        configure_disk(cfg.node.min_free_disk_mib * 2**20, None)


async def _run(cfg: Config, stop: asyncio.Event) -> None:
    route_library_logs()  # py-libp2p's import reconfigured its loggers
    created = not cfg.key_path.exists()
    identity = Identity.load_or_create(cfg.key_path)
    if created:  # a key other than the one `swarm-node keygen`/`id` showed, maybe
        log.info("created this node's key %s (peer id %s): its identity in the swarm; keep "
                 "it with the data dir", cfg.key_path, identity.peer_id)
    state = NodeState(peer_id=identity.peer_id, role=cfg.node.role, swarm_id=cfg.node.swarm_id)
    state.software_version = software_version()
    state.protocol_version = PROTOCOL_VERSION
    history = cfg.data_dir / HISTORY_FILE
    if note := load_history(state, history):
        log.info("%s", note)
    interrupts = Interrupts(stop)
    interrupts.install(asyncio.get_running_loop())

    interrupts.waiting_for = "the libp2p host to start"
    log.info("starting the libp2p host on %s%s", ", ".join(cfg.node.listen),
             f"; joining through {len(cfg.node.bootstrap)} bootstrap peer(s)"
             if cfg.node.bootstrap else "")
    p2p = P2PNode(identity, cfg)
    # The role's code is imported and its model loaded while the host starts and dials its
    # bootstrap peers (issue #27: one after the other, a NAT'd peer in the WAN lab spent
    # 4-11 s dialling before it began a load as long). What needs the swarm (the checkpoint
    # feed, the trainer learnt from the bootstrap peer, subscriptions) waits in role.start().
    preparing = asyncio.create_task(_prepare_role(cfg, identity, p2p, state),
                                    name="role-prepare")
    try:
        await p2p.start(bootstrap=cfg.node.bootstrap)
        _check_listening(cfg, p2p)
    except BaseException as e:
        await _drop_role(preparing)
        if not isinstance(e, (P2PError, NodeError)):
            raise
        await p2p.close()
        raise NodeError(str(e)) from None
    try:
        role = await preparing
    except BaseException:
        await p2p.close()
        raise
    state.attach_transport(p2p)
    state.metrics.counters("bulk", "Bulk-plane connections this node opened, by kind, and "
                           "the bytes and reads of their bodies.", p2p.bulk.counters)
    admin = None
    if cfg.admin.enabled:
        admin = AdminServer(state, cfg)
    try:
        if cfg.node.dishonest != "none":
            # The cheat kit is loaded only when a (demo or test) config asks for a cheater.
            from .testing.dishonest import make_dishonest  # noqa: PLC0415

            make_dishonest(role, cfg.node.dishonest)
        if admin is not None:
            await admin.start()
        state.join_line = lambda: join_command(cfg, p2p.listen_addrs, _followed(role, cfg),
                                               reach=p2p.reachability)
        write_node_info(cfg.data_dir, {
            "peer_id": identity.peer_id, "role": cfg.node.role, "pid": os.getpid(),
            "listen_addrs": p2p.listen_addrs,
            "admin_port": admin.port if admin is not None else None,
        })
        notify_supervisor("STATUS=listening; loading the role")  # node.json is written
        interrupts.waiting_for = "the model to load"
        # A stop while the host or the role started (Ctrl-C during the first seconds): the
        # role does not start, or is not announced as joined (before: it loaded the model,
        # logged "joined swarm", then stopped, 12-24 s after Ctrl-C in the walkthrough).
        if not stop.is_set():
            await role.start()
        if not stop.is_set():
            await _joined_and_run(cfg, identity, p2p, state, role, stop, interrupts, history)
        if p2p.failure is not None:
            state.phase = "failed"
            raise NodeError(f"the libp2p host died ({p2p.failure}); exiting so that a "
                            "supervisor restarts this node")
    finally:
        state.phase = "stopping"
        log.info("shutting down")
        try:
            await role.close()
        finally:
            if admin is not None:
                await admin.close()
            await p2p.close()
            await _save_history(state, history)
    log.info("stopped")


async def _prepare_role(cfg: Config, identity, p2p, state: NodeState):
    """The role, its module imported in a thread (for a model role torch: seconds of CPU
    that would stop the event loop, and the host's start with it), its model load begun."""
    cls = await asyncio.to_thread(role_class, cfg.node.role)
    role = cls(cfg, identity, p2p, state)
    role.prepare()
    return role


async def _drop_role(preparing: asyncio.Task) -> None:
    """The role prepared beside a host that did not start: closed (a model load in its
    worker thread ends first). Its own failure, if any, is moot: the host's is the one said."""
    try:
        role = await preparing
    except Exception as e:  # noqa: BLE001 (the host's failure is the one raised)
        log.debug("dropped the role prepared beside the host: %s", e)
        return
    await role.close()


async def _joined_and_run(cfg: Config, identity, p2p, state: NodeState, role, stop,
                          interrupts: Interrupts, history: Path) -> None:
    """A started role: announce the node as joined, run the role until `stop`."""
    route_library_logs()  # libraries imported by the role may have added handlers
    state.hardware = runtime_summary(cfg, role)
    _log_joined(cfg, identity.peer_id, p2p.listen_addrs, state)
    state.phase = "running"
    interrupts.role = role
    interrupts.waiting_for = "the role's loop to stop"
    notify_supervisor("READY=1\nSTATUS=joined the swarm")
    _mirror_served(role, state)
    tasks = TaskOwner("runner", on_failure=lambda name, e: state.count("task_failed"))
    tasks.spawn(_stop_if_host_dies(p2p, stop), "host watch")  # supervised host
    tasks.spawn(_keep_history(state, history), "history")
    try:
        await _run_role(role, stop, cfg.node.role)
    finally:
        await tasks.close()


async def _keep_history(state: NodeState, path: Path) -> None:
    while True:  # a pace, not a poll: the history is written every HISTORY_SAVE_S
        await asyncio.sleep(HISTORY_SAVE_S)
        await _save_history(state, path)


def _mirror_served(role, state: NodeState) -> None:
    """Checkpoint bytes this node uploaded, per peer, into the state (a relay's and a
    trainer's contribution), from the feed's running totals, whenever the state is read."""
    feed = getattr(role, "feed", None)
    if not isinstance(feed, BroadcastFeed):  # a feed without uploads (a test's)
        return
    seen: dict[str, int] = {}

    def mirror() -> None:
        for peer, total in feed.served().items():
            if total > seen.get(peer, 0):
                state.record_served(peer, total - seen.get(peer, 0))
                seen[peer] = total
    state.metrics.before_read(mirror)


def notify_supervisor(message: str) -> None:
    """Tell a supervisor that waits for it (systemd `Type=notify`, the demo) how far the
    start got, in the sd_notify protocol on the datagram socket named by $NOTIFY_SOCKET (a
    path, or `@name` in the abstract namespace): `STATUS=listening...` once node.json is
    written, `READY=1` once joined. Nothing when it is not set; a failure is logged."""
    where = os.environ.get(NOTIFY_SOCKET)
    if not where:
        return
    address = "\0" + where[1:] if where.startswith("@") else where
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            sock.sendto(message.encode(), address)
    except OSError as e:
        log.warning("could not tell the supervisor that the node is ready (%s=%s): %s",
                    NOTIFY_SOCKET, where, e)


async def _save_history(state: NodeState, path: Path) -> None:
    """The dashboard's history is not worth a failure: a write that fails (a full disk) is
    counted and tried again at the next interval."""
    try:  # the document is taken here, in the loop that updates the state
        await asyncio.to_thread(save_history, state.history(), path)
    except OSError as e:
        state.count("history_save_failed")
        log.debug("history not saved to %s: %s", path, e)


async def _stop_if_host_dies(p2p, stop: asyncio.Event) -> None:
    await p2p.wait_failed()
    stop.set()


async def _run_role(role, stop: asyncio.Event, name: str) -> None:
    runner = asyncio.create_task(role.run(stop), name=f"role-{name}")
    stopper = asyncio.create_task(stop.wait())
    await asyncio.wait({runner, stopper}, return_when=asyncio.FIRST_COMPLETED)
    stop.set()
    stopper.cancel()
    try:
        await runner
    except WaitStopped as e:  # a write waiting for disk space: dropped, as at any stop
        log.info("%s", e)


def _check_listening(cfg: Config, p2p) -> None:
    """py-libp2p logs a failed listener and runs on; a node that cannot be dialled must
    not announce itself."""
    if not p2p.listen_addrs:
        raise NodeError(f"not listening on any of {', '.join(cfg.node.listen)} (the libp2p "
                        "host started without a listener); check --listen")
    for addr in cfg.node.listen:
        port = addr.rstrip("/").rsplit("/tcp/", 1)[-1].split("/", 1)[0]
        if port != "0" and not any(f"/tcp/{port}/" in a for a in p2p.listen_addrs):
            raise NodeError(f"cannot listen on {addr}: the libp2p host did not bind it")


_LOOPBACK = ("/ip4/127.", "/ip6/::1/")
_WILDCARD = ("/ip4/0.0.0.0/", "/ip6/::/")


def join_command(cfg: Config, addrs: list[str], trainer: str | None,
                 route_ip: Callable[[], str | None] = route_ip, reach=None) -> str:
    """The complete line another machine pastes to join the swarm through this node: the
    swarm id, this node's address, and the trainer to follow (this node, if a trainer).
    Behind NAT (`reach`, the host's Reachability, not public) its listen address is a LAN
    one nobody outside can dial: the line names its relayed address instead, or, when it
    holds no relay slot (unreachable), the bootstrap peer it joined through."""
    if not addrs:
        return ""
    verdict = getattr(getattr(reach, "verdict", None), "value", "unknown")
    if verdict in ("relayed", "direct") and reach.relay_addrs:
        addrs = [reach.relay_addrs[0]]
    elif verdict == "unreachable" and cfg.node.bootstrap:
        addrs = [cfg.node.bootstrap[0]]
    public = [a for a in addrs if not a.startswith(_LOOPBACK)]
    if not public and any(a.startswith(_WILDCARD) for a in cfg.node.listen):
        # Listening on every interface, but the host name resolves to loopback only (as on
        # most Linux installs): name the address of the default route, which other
        # machines can dial, never 127.0.0.1 (that dials the joiner itself).
        ip = route_ip()
        if ip is not None:
            public = [re.sub(r"^/ip4/127\.[0-9.]+/", f"/ip4/{ip}/", a) for a in addrs
                      if a.startswith("/ip4/127.")]
    parts = ["swarm-node", "join", "--role", "inference", "--swarm", cfg.node.swarm_id,
             "--bootstrap", (public or addrs)[0]]
    if trainer:
        parts += ["--follow", trainer]
    return shlex.join(parts)


def _followed(role, cfg: Config) -> str | None:
    """The trainer this node's followers should follow: itself for a trainer, else the one
    it follows (configured, or learnt from its bootstrap peer)."""
    if cfg.node.role == "trainer":
        return role.identity.peer_id
    feed = getattr(role, "feed", None)
    chosen = feed.chosen() if feed is not None else None
    return chosen or (cfg.node.follow[0] if cfg.node.follow else None)


def _log_joined(cfg: Config, peer_id: str, addrs: list[str], state: NodeState) -> None:
    hw = state.hardware
    log.info("runtime: device %s, dtype %s, sampler %s, memory %s", hw.get("device"),
             hw.get("dtype"), hw.get("backend"), hw.get("memory"))
    if cfg.node.role == "trainer":
        how = ("started swarm %r as its trainer" if state.policy_version == 0
               else f"resumed swarm %r as its trainer at v{state.policy_version}")
        log.info(how + "; others join with: %s  (--role relay for a relay)",
                 cfg.node.swarm_id, state.join_command)
    log.info("joined swarm %r as %s, peer id %s, listening on %s", cfg.node.swarm_id,
             cfg.node.role, peer_id, ", ".join(addrs))
