"""The admin endpoint: GET /status (JSON) and GET /metrics (Prometheus), on 127.0.0.1 only.

A deliberately tiny HTTP/1.1 server on asyncio streams (one request per connection, bounded
request size, a read timeout), so a running node needs no web framework. `print_status` is
the client behind `swarm-node status`.
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

from .dashboard import page
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

_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed",
            408: "Request Timeout", 431: "Request Header Fields Too Large",
            500: "Internal Server Error"}


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
            await asyncio.wait_for(writer.drain(), READ_TIMEOUT_S)
        except (TimeoutError, OSError):
            pass
        finally:
            writer.close()

    async def _respond(self, reader: asyncio.StreamReader) -> tuple[int, str, bytes]:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), READ_TIMEOUT_S)
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
        if target not in (b"/status", b"/metrics", b"/", b"/dashboard"):
            return 404, "text/plain", b"not found: try /status, /metrics or /dashboard\n"
        if method != b"GET":
            return 405, "text/plain", b"only GET\n"
        if target in (b"/", b"/dashboard"):
            return 200, "text/html; charset=utf-8", page()
        if target == b"/status":
            body = json.dumps(self.state.status(), default=str).encode()
            return 200, "application/json", body

        return 200, PROMETHEUS_CONTENT_TYPE, generate_latest(self.state.registry)


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


def print_status(cfg: Config, port: int | None = None, as_json: bool = False) -> None:
    """Print the local node's status: a rich table, or the raw JSON."""
    doc = fetch_status(port if port is not None else _port_or_default(cfg))
    if as_json:
        print(json.dumps(doc, indent=2, sort_keys=True))
        return

    console = Console()
    for table in render_tables(doc):
        console.print(table)


def render_tables(doc: dict[str, Any]) -> list:
    """The status document as rich tables: overview, rejects by reason, per-peer counts."""
    overview = Table(title=f"swarm-node {doc.get('role', '?')}", show_header=False)
    overview.add_column("", style="bold")
    overview.add_column("")
    reward = doc.get("reward")
    rows = [
        ("peer id", doc.get("peer_id")),
        ("swarm", doc.get("swarm_id")),
        ("uptime", f"{doc.get('uptime_s', 0):.0f} s"),
        ("connected peers", doc.get("connected_peers", len(doc.get("peers") or []))),
        ("policy", f"{doc.get('policy_id') or '-'} v{doc.get('policy_version')}"),
        ("reward", "-" if reward is None else f"{reward:.3f}"),
        ("rollouts sent", doc.get("rollouts_sent", 0)),
        ("rollouts accepted", doc.get("rollouts_accepted", 0)),
        ("rollouts rejected", sum((doc.get("rollouts_rejected") or {}).values())),
        ("versions published", doc.get("versions_published", 0)),
        ("banned peers", len(doc.get("banned") or [])),
        ("version", (f"{doc.get('software_version') or '?'} (protocol "
                    f"{doc.get('protocol_version', '?')})")),
    ]
    rt = doc.get("runtime") or {}
    if rt:
        rows.append(("runtime", (f"{rt.get('device')} {rt.get('dtype')} sampler "
                                f"{rt.get('backend')}, {rt.get('memory')}")))
    mine = doc.get("verdicts_about_me") or {}
    if mine.get("by_trainer"):
        rejected = mine.get("rejected") or {}
        rows.append(("my rollouts (trainers' verdicts)",
                     f"accepted {mine.get('accepted', 0)}, rejected {sum(rejected.values())}"
                     + (f" {dict(rejected)}" if rejected else "")))
    if mine.get("banned_by"):
        rows.append(("BANNED by", ", ".join(p[-8:] for p in mine["banned_by"])))
    ck = doc.get("checkpoint_progress") or {}
    if ck:
        rows.append(("checkpoint", (f"v{ck.get('version')}: {ck.get('shards_done')}/"
                                    f"{ck.get('shards_total')} shards")))
    for key, value in rows:
        overview.add_row(key, str(value))
    tables = [overview]

    rejected = doc.get("rollouts_rejected") or {}
    if rejected:
        t = Table(title="rejected rollouts by reason")
        t.add_column("reason")
        t.add_column("count", justify="right")
        for reason, n in sorted(rejected.items(), key=lambda kv: -kv[1]):
            t.add_row(str(reason), str(n))
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
    return tables
