"""The admin endpoint: GET /status (JSON) and GET /metrics (Prometheus), on 127.0.0.1 only.

A deliberately tiny HTTP/1.1 server on asyncio streams (one request per connection, bounded
request size, a read timeout), so a running node needs no web framework. It answers only
requests whose `Host` names 127.0.0.1 or localhost (any port: an ssh tunnel may map
another): a web page the operator opens elsewhere could otherwise point its own domain at
127.0.0.1 (DNS rebinding) and read `/status`; those get 403 and are counted. `print_status`
is the client behind `swarm-node status`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import urllib.error
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self

from prometheus_client import generate_latest
from rich.console import Console
from rich.table import Table
from rich.text import Text

from .dashboard import page
from .dashboard.views import alerts, contribution, reason_notes, swarm
from .errors import NodeError

if TYPE_CHECKING:
    from .config import Config
    from .metrics import NodeState

log = logging.getLogger("swarm_node.admin")

HOST = "127.0.0.1"  # never configurable: the endpoint is for the local operator only
PORT_FILE = "admin.port"
MAX_REQUEST_BYTES = 8192
READ_TIMEOUT_S = 5.0
PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

LOCAL_HOSTS = ("127.0.0.1", "localhost", "[::1]")
"""`Host` header names the endpoint answers (with or without a port)."""

_REASONS = {200: "OK", 400: "Bad Request", 403: "Forbidden", 404: "Not Found",
            405: "Method Not Allowed", 408: "Request Timeout",
            431: "Request Header Fields Too Large", 500: "Internal Server Error"}


class AdminServer:
    """Serves one NodeState. `port` is known after `start()` (config port, or a free one)."""

    def __init__(self, state: NodeState, cfg: Config | None = None, *, port: int | None = None,
                 port_file: Path | None = None):
        self.state = state
        self.requested_port = port if port is not None else (cfg.admin.port if cfg else 0)
        self.port_file = port_file if port_file is not None else (
            cfg.data_dir / PORT_FILE if cfg is not None else None)
        self.port: int | None = None
        self.requests = 0
        self._server: asyncio.base_events.Server | None = None

    async def start(self) -> None:
        try:
            self._server = await asyncio.start_server(self._handle, HOST, self.requested_port,
                                                      limit=MAX_REQUEST_BYTES)
        except OSError as e:
            raise NodeError(f"cannot serve the admin endpoint on {HOST}:"
                            f"{self.requested_port}: {e.strerror or e} (set admin.port to "
                            "another port, or 0 for a free one)") from None
        self.port = self._server.sockets[0].getsockname()[1]
        if self.port_file is not None:
            _write_atomic(self.port_file, f"{self.port}\n")
        log.info("admin endpoint on http://%s:%d (/dashboard, /status, /metrics)", HOST,
                 self.port)

    async def close(self) -> None:
        if self._server is None:
            return
        self._server.close()
        await self._server.wait_closed()
        self._server = None
        if self.port_file is not None:
            try:  # only our own file: another node may have started on this data dir since
                if self.port_file.read_text().strip() == str(self.port):
                    self.port_file.unlink()
            except OSError:
                pass

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    # HTTP -----------------------------------------------------------------------------

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        try:
            status, ctype, body = await self._respond(reader)
        except Exception as e:  # noqa: BLE001 - a status read must never take the node down
            log.warning("admin request failed: %s: %s", type(e).__name__, e)
            status, ctype, body = 500, "text/plain", b"internal error\n"
        self.requests += 1
        head = (f"HTTP/1.1 {status} {_REASONS.get(status, '')}\r\n"
                f"Content-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
                "Cache-Control: no-store\r\nConnection: close\r\n\r\n")
        try:
            writer.write(head.encode() + body)
            async with asyncio.timeout(READ_TIMEOUT_S):
                await writer.drain()
        except (TimeoutError, OSError):
            pass
        finally:
            writer.close()

    async def _respond(self, reader: asyncio.StreamReader) -> tuple[int, str, bytes]:
        try:
            async with asyncio.timeout(READ_TIMEOUT_S):
                head = await reader.readuntil(b"\r\n\r\n")
        except TimeoutError:
            return 408, "text/plain", b"request timeout\n"
        except asyncio.LimitOverrunError:
            return 431, "text/plain", b"request too large\n"
        except (asyncio.IncompleteReadError, ConnectionError):
            return 400, "text/plain", b"incomplete request\n"
        parts = head.split(b"\r\n", 1)[0].split(b" ")
        if len(parts) != 3 or not parts[2].startswith(b"HTTP/1."):
            return 400, "text/plain", b"bad request line\n"
        method, target = parts[0], parts[1].split(b"?", 1)[0]
        hosts = _header_values(head, b"host")
        if not hosts and parts[2] != b"HTTP/1.0":
            return 400, "text/plain", b"missing Host header\n"
        bad = [h for h in hosts if not local_host(h)]
        if bad or len(hosts) > 1:
            self.state.count("admin_host_refused")
            log.warning("admin endpoint: refused a request for Host %r (only 127.0.0.1 and "
                        "localhost are answered: a DNS-rebinding defence)", (bad or hosts)[0])
            return 403, "text/plain", (b"forbidden: this endpoint answers only Host "
                                       b"127.0.0.1 or localhost\n")
        if target not in (b"/status", b"/metrics", b"/", b"/dashboard"):
            return 404, "text/plain", b"not found: try /status, /metrics or /dashboard\n"
        if method != b"GET":
            return 405, "text/plain", b"only GET\n"
        if target in (b"/", b"/dashboard"):
            return 200, "text/html; charset=utf-8", page()
        if target == b"/status":
            body = json.dumps(status_document(self.state), default=str).encode()
            return 200, "application/json", body

        return 200, PROMETHEUS_CONTENT_TYPE, generate_latest(self.state.registry)


def status_document(state: NodeState) -> dict[str, Any]:
    """GET /status: the node's state, its stuck states and its contribution."""
    doc = state.status()
    doc["alerts"] = alerts(doc)
    doc["contribution"] = contribution(doc)
    doc["swarm"] = swarm(doc)
    doc["reasons"] = reason_notes(doc)
    return doc


def _header_values(head: bytes, name: bytes) -> list[str]:
    out = []
    for line in head.split(b"\r\n")[1:]:
        key, sep, value = line.partition(b":")
        if sep and key.strip().lower() == name:
            out.append(value.strip().decode("latin-1"))
    return out


def local_host(value: str) -> bool:
    """Whether a `Host` header value names this machine's loopback (port optional)."""
    host = value.strip().lower()
    if host.startswith("["):
        name, _, rest = host.partition("]")
        host, port = name + "]", rest.removeprefix(":")
        if rest and not rest.startswith(":"):
            return False
    else:
        host, _, port = host.partition(":")
    return host in LOCAL_HOSTS and (port == "" or (port.isdigit() and len(port) <= 5))


def _write_atomic(path: Path, text: str) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
        tmp.write_text(text)
        os.replace(tmp, path)
    except OSError as e:
        raise NodeError(f"cannot write {path}: {e.strerror or e}") from None


# Client: `swarm-node status` ----------------------------------------------------------------


def find_port(cfg: Config) -> int:
    """The local node's admin port: node.json, then <data_dir>/admin.port, then the config."""
    data_dir = cfg.data_dir
    try:
        info = json.loads((data_dir / "node.json").read_text())
        if isinstance(info, dict) and isinstance(info.get("admin_port"), int):
            return info["admin_port"]
    except (OSError, ValueError):
        pass
    try:
        return int((data_dir / PORT_FILE).read_text().strip())
    except (OSError, ValueError):
        pass
    raise NodeError(f"no node is running with data dir {data_dir} (no {PORT_FILE} there); "
                    "start one with `swarm-node join`, or pass --data-dir or --port")


def _port_or_default(cfg: Config) -> int:
    """find_port, else the configured port if a node answers there."""
    try:
        return find_port(cfg)
    except NodeError:
        if not cfg.admin.port:
            raise
        try:
            fetch_status(cfg.admin.port, timeout=2.0)
        except NodeError:
            raise NodeError(f"no node is running with data dir {cfg.data_dir} (no {PORT_FILE} "
                            f"there, nothing on 127.0.0.1:{cfg.admin.port}); start one with "
                            "`swarm-node join`, or pass --data-dir or --port") from None
        return cfg.admin.port


def fetch_status(port: int, timeout: float = 5.0) -> dict[str, Any]:
    """GET /status from the node on 127.0.0.1:`port`; NodeError if nothing answers."""
    url = f"http://{HOST}:{port}/status"
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            doc = json.loads(r.read())
    except urllib.error.HTTPError as e:
        raise NodeError(f"{url} answered HTTP {e.code}") from None
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise NodeError(f"no node is answering on {HOST}:{port} ({reason}); is it running? "
                        "(a stale admin.port file is left by a node that was killed)") from None
    except ValueError as e:
        raise NodeError(f"{url} did not return JSON: {e}") from None
    if not isinstance(doc, dict):
        raise NodeError(f"{url} returned {type(doc).__name__}, expected a JSON object")
    return doc


def _stopped(data_dir: Path) -> str | None:
    """'not running' for a data dir whose last node has exited (its node.json names a
    process that is gone, as after any stop), else None."""
    try:
        info = json.loads((data_dir / "node.json").read_text())
        pid = int(info["pid"])
    except (OSError, ValueError, TypeError, KeyError):
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        role = info.get("role") if isinstance(info.get("role"), str) else "swarm-node"
        return (f"the {role} node with data dir {data_dir} is not running (its last process, "
                f"pid {pid}, has exited); start it again with `swarm-node join`")
    except OSError:
        return None
    return None


def print_status(cfg: Config, port: int | None = None, as_json: bool = False) -> None:
    """Print the local node's status: a rich table, or the raw JSON."""
    if port is not None:
        doc = fetch_status(port)
    else:
        port = _port_or_default(cfg)
        try:
            doc = fetch_status(port)
        except NodeError as e:
            raise NodeError(_stopped(cfg.data_dir) or str(e)) from None
    if as_json:
        print(json.dumps(doc, indent=2, sort_keys=True))
        return

    console = Console()
    for table in render_tables(doc):
        console.print(table)


def render_tables(doc: dict[str, Any]) -> list:
    """The status document as rich tables, for its role: what needs attention (each stuck
    state and its fix), an overview, what this node contributes, and the per-peer and
    per-reason counts a trainer keeps."""
    problems = doc["alerts"] if isinstance(doc.get("alerts"), list) else alerts(doc)
    contrib = doc["contribution"] if isinstance(doc.get("contribution"), dict) \
        else contribution(doc)
    tables = []
    if problems:
        t = Table(title="NEEDS ATTENTION", title_style="bold red", show_lines=True)
        t.add_column("", style="bold")
        t.add_column("what")
        t.add_column("fix")
        for a in problems:
            style = "red" if a.get("level") == "error" else "yellow"
            what = a.get("title", "") + (f"\n{a['detail']}" if a.get("detail") else "")
            t.add_row(f"[{style}]{a.get('level', '').upper()}[/{style}]", what,
                      a.get("fix", ""))
        tables.append(t)

    role = doc.get("role", "?")
    overview = Table(title=f"swarm-node {role}", show_header=False)
    overview.add_column("", style="bold")
    overview.add_column("")
    reward = doc.get("reward")
    rows: list[tuple[str, Any]] = [
        ("peer id", doc.get("peer_id")),
        ("swarm", doc.get("swarm_id")),
        ("state", f"{doc.get('phase', '?')}, up {_duration(doc.get('uptime_s', 0))}"),
        ("connected peers", doc.get("connected_peers", len(doc.get("peers") or []))),
        ("policy", _policy(doc)),
    ]
    starting = (doc.get("extra") or {}).get("starting") or {}
    if starting.get("doing"):
        eta = starting.get("eta_s")
        rows.insert(2, ("starting", f"{starting['doing']}: "
                        f"{_duration(starting.get('elapsed_s'))} so far, " + (
                            "first time: no ETA" if eta is None else f"ETA {_duration(eta)}")))
    if role == "trainer":
        rows += [
            ("reward", "-" if reward is None else f"{reward:.3f}"),
            ("rollouts accepted", doc.get("rollouts_accepted", 0)),
            ("rollouts rejected", sum((doc.get("rollouts_rejected") or {}).values())),
            ("versions published", doc.get("versions_published", 0)),
            ("banned peers", len(doc.get("banned") or [])),
        ]
    elif role == "inference":
        rows += [
            ("reward (my rounds)", "-" if reward is None else f"{reward:.3f}"),
            ("rollouts sent", doc.get("rollouts_sent", 0)),
        ]
    rows += _contribution_rows(contrib)
    ck = doc.get("checkpoint_progress") or {}
    if ck:
        rows.append(("checkpoint", _progress(ck)))
    step = (doc.get("extra") or {}).get("step") or {}
    if step.get("phase"):
        rows.append(("training step", _step(step)))
    if doc.get("join_command"):
        rows.append(("others join with", doc["join_command"]))
    rows.append(("version", (f"{doc.get('software_version') or '?'} (protocol "
                             f"{doc.get('protocol_version', '?')})")))
    rt = doc.get("runtime") or {}
    if rt:
        rows.append(("runtime", (f"{rt.get('device')} {rt.get('dtype')} sampler "
                                f"{rt.get('backend')}, {rt.get('memory')}")))
    mine = doc.get("verdicts_about_me") or {}
    if mine.get("banned_by"):
        rows.append(("BANNED by", ", ".join(p[-8:] for p in mine["banned_by"])))
    for key, value in rows:
        overview.add_row(key, str(value))
    tables.append(overview)

    if role == "inference" and contrib.get("trainers"):
        t = Table(title="my rollouts, as the trainers judged them")
        for col in ("trainer", "accepted", "rejected", "share of its accepted", "reasons"):
            t.add_column(col, justify="right" if col in ("accepted", "rejected") else "left")
        reasons = {p: r.get("reasons") or {} for p, r in (mine.get("by_trainer") or {}).items()}
        for tr in contrib["trainers"]:
            share = "-" if tr.get("share") is None else f"{100 * tr['share']:.1f}%"
            why = " ".join(f"{r}:{n}" for r, n in reasons.get(tr["trainer"], {}).items())
            t.add_row(str(tr["trainer"]), str(tr["accepted"]), str(tr["rejected"]), share,
                      why or "-")
        tables.append(t)
        tables.extend(_reason_lines(doc))

    rejected = doc.get("rollouts_rejected") or {}
    if rejected:
        t = Table(title="rejected rollouts by reason")
        t.add_column("reason")
        t.add_column("count", justify="right")
        t.add_column("meaning")
        notes = _notes(doc)
        for reason, n in sorted(rejected.items(), key=lambda kv: -kv[1]):
            t.add_row(str(reason), str(n), Text(_meaning(notes.get(reason) or {})))
        tables.append(t)

    by_peer = doc.get("accepted_by_peer") or {}
    if by_peer:
        banned = set(doc.get("banned") or [])
        t = Table(title="rollouts by peer")
        t.add_column("peer")
        t.add_column("accepted", justify="right")
        t.add_column("rejected", justify="right")
        t.add_column("banned")
        for peer, c in sorted(by_peer.items()):
            t.add_row(str(peer), str(c.get("accepted", 0)), str(c.get("rejected", 0)),
                      "yes" if peer in banned else "")
        tables.append(t)
    tables += _swarm_tables(doc["swarm"] if isinstance(doc.get("swarm"), dict) else swarm(doc))
    return tables


def _swarm_tables(view: dict[str, Any]) -> list:
    """The swarm as this node knows it (dashboard/views.py `swarm`): peers, then versions."""
    tables = []
    peers = view.get("peers") or []
    if peers:
        t = Table(title=f"the swarm as this node knows it ({view.get('peers_known', 0)} peers)")
        for col in ("peer", "role", "holds", "connection", "reachable", "accepted",
                    "rejected"):
            t.add_column(col, justify="right" if col in ("accepted", "rejected") else "left")
        for r in peers:
            holds = "-" if r.get("version") is None else \
                f"v{r['version']}" + ("" if r.get("complete") else " (partly)")
            t.add_row(str(r.get("peer")), str(r.get("role")), holds, str(r.get("connection")),
                      str(r.get("reach", "?")), str(r.get("accepted", "")),
                      str(r.get("rejected", "")))
        tables.append(t)
    versions = view.get("versions") or []
    if versions:
        t = Table(title="versions known in the swarm")
        for col in ("policy", "version", "peers advertising", "here"):
            t.add_column(col)
        for v in versions:
            t.add_row(str(v.get("policy_id")), f"v{v.get('version')}", str(v.get("holders", 0)),
                      str(v.get("here") or "-"))
        tables.append(t)
    return tables


def _reason_lines(doc: dict[str, Any]) -> list[str]:
    """One line per reject reason seen: its meaning, and whether it counts against the
    node (an honest node's stale or duplicate rounds are not cheating)."""
    return [Text(f"  {r}: {_meaning(n)}") for r, n in _notes(doc).items()]


def _notes(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return doc["reasons"] if isinstance(doc.get("reasons"), dict) else reason_notes(doc)


def _meaning(note: dict[str, Any]) -> str:
    return (str(note.get("text") or "?") + ("" if note.get("held_against") else
                                            " (not held against the sender: honest nodes hit it too)"))


def _contribution_rows(c: dict[str, Any]) -> list[tuple[str, Any]]:
    if c.get("role") == "trainer":
        return [("contribution", (f"{c.get('versions', 0)} versions trained, "
                                 f"{c.get('accepted_from_peers', 0)} rollouts accepted from "
                                 f"{c.get('peers_contributing', 0)} peers, "
                                 f"{c.get('tokens_trained', 0)} tokens trained; checkpoints "
                                 f"served: {c.get('bytes_served', 0) / 2**20:.1f} MiB to "
                                 f"{c.get('peers_served', 0)} peers"))]
    if c.get("role") == "relay":
        return [("contribution", (f"{c.get('versions_mirrored', 0)} versions mirrored "
                                 f"({c.get('bytes_downloaded', 0) / 2**20:.1f} MiB); served "
                                 f"{c.get('bytes_served', 0) / 2**20:.1f} MiB to "
                                 f"{c.get('peers_served', 0)} peers"))]
    rate = c.get("per_hour")
    shares = [t for t in c.get("trainers") or [] if t.get("share") is not None]
    share = ", ".join(f"{100 * t['share']:.1f}% of ...{t['trainer'][-8:]}'s accepted"
                      for t in shares)
    return [("accepted by trainers", f"{c.get('accepted', 0)}, rejected {c.get('rejected', 0)}"
             + (f"; {share}" if share else "")),
            ("accepted per hour", "- (after 1 min)" if rate is None else f"{rate:.0f}")]


def _policy(doc: dict[str, Any]) -> str:
    pid, version = doc.get("policy_id") or "", doc.get("policy_version", 0)
    if not pid:
        return f"none yet (v{version})" if version else "none yet"
    return f"{pid[-8:] if len(pid) > 16 else pid} v{version}"


def _progress(ck: dict[str, Any]) -> str:
    text = (f"v{ck.get('version')}: {ck.get('shards_done')}/{ck.get('shards_total')} shards, "
            f"{ck.get('bytes_done', 0) / 2**20:.1f}/{ck.get('bytes_total', 0) / 2**20:.1f} MiB")
    if ck.get("complete"):
        return text + " (complete)"
    if ck.get("eta_s") is not None:
        text += f", {ck.get('rate_bytes_s', 0) / 2**20:.1f} MiB/s, ETA {_duration(ck['eta_s'])}"
    return text


def _step(st: dict[str, Any]) -> str:
    """The trainer's step in progress (node/trainer/progress.py), on one line."""
    g = st.get("groups") or {}
    eta = st.get("eta_s")
    due = ("ETA after two steps" if eta is None else "due now" if eta <= 0
           else f"due in {_duration(eta)}")
    def part(have, need) -> str:  # more may wait than a step takes: "4/4 (+13 waiting)"
        have, need = have or 0, need or 0
        return f"{min(have, need)}/{need}" + (f" (+{have - need} waiting)" if have > need
                                               else "")

    return (f"v{st.get('next_version')}: {st.get('doing')}; groups "
            f"{part(g.get('local'), g.get('need_local'))} of this policy, "
            f"{part(g.get('external'), g.get('need_external'))} of others; {due}")


def _duration(seconds) -> str:
    s = int(seconds or 0)
    if s < 120:
        return f"{s} s"
    if s < 7200:
        return f"{s // 60} min"
    return f"{s // 3600} h {s % 3600 // 60} min"
