"""TCP's loss-recovery floor (`p2p.tcp_rto_min_ms`, node/p2p/patches/tcp_tuning.py) on the
bulk plane's sockets, both ends, over real loopback connections; and a kernel that refuses
the option (simulated by an option number Linux does not have) changes nothing else."""

from __future__ import annotations

import asyncio
import logging
import socket
from pathlib import Path

import pytest
from swarm_node.node.config import BulkSection, Config
from swarm_node.node.identity import Identity
from swarm_node.node.p2p.bulk import BulkClient, BulkServer
from swarm_node.node.p2p.bulk.cert import server_context
from swarm_node.node.p2p.metrics import P2PMetrics
from swarm_node.node.p2p.patches import tcp_tuning

RTO_MIN = tcp_tuning.TCP_RTO_MIN_US
DELACK_MAX = tcp_tuning.TCP_DELACK_MAX_US
DEFAULT_CC = Path("/proc/sys/net/ipv4/tcp_congestion_control").read_text().strip()
UNKNOWN_OPTION = 99  # no TCP option of this number: Linux answers ENOPROTOOPT


def _kernel_has_rto_min() -> bool:
    with socket.socket() as s:
        try:
            s.getsockopt(socket.IPPROTO_TCP, RTO_MIN)
        except OSError:
            return False
    return True


@pytest.fixture(autouse=True)
def _untouched_after(monkeypatch):
    # the floor applies to this machine's default congestion control unless a test says
    # otherwise (CI's is BBR; elsewhere it may be cubic)
    monkeypatch.setattr(tcp_tuning, "TUNED_CCS", tcp_tuning.TUNED_CCS | {DEFAULT_CC})
    monkeypatch.setattr(tcp_tuning, "_skipped_cc", set())
    monkeypatch.setattr(tcp_tuning, "_refused", set())
    # the settings are process-wide: a node an earlier test made in this worker set them
    saved = list(tcp_tuning._settings), list(tcp_tuning._congestion)
    monkeypatch.setattr(tcp_tuning, "_refused_cc", set())
    tcp_tuning.configure(0)
    yield
    tcp_tuning._settings[:], tcp_tuning._congestion[:] = saved


def _read(sock, opt: int):
    if opt == socket.TCP_CONGESTION:
        return sock.getsockopt(socket.IPPROTO_TCP, opt, 16).split(b"\0", 1)[0].decode()
    return sock.getsockopt(socket.IPPROTO_TCP, opt)


async def _bulk_options(opts: tuple[int, ...]) -> tuple[list, list]:
    """The options `opts` read on the client's and the server's socket of one bulk-plane
    connection that also carries a byte each way."""
    srv, me = Identity.generate(), Identity.generate()
    seen: asyncio.Future = asyncio.get_running_loop().create_future()

    async def serve(peer, conn) -> None:
        await conn.read(1)
        seen.set_result([_read(conn.sock, o) for o in opts])
        await conn.write(b"k")

    server = BulkServer(srv.peer_id, server_context(srv), BulkSection(), P2PMetrics())
    server.register("t", serve)
    _, port = await server.start("127.0.0.1", 0)
    client = BulkClient(me, BulkSection(), query=None)
    client.add_kind("t", "t", 1, 5.0)
    client.set_endpoint(srv.peer_id, f"127.0.0.1:{port}")
    try:
        conn = await client.open(srv.peer_id, "t")
        await conn.write(b"g")
        assert await conn.readexactly(1) == b"k"
        mine = [_read(conn.sock, o) for o in opts]
        conn.abort()
        return mine, await seen
    finally:
        await server.close()


@pytest.mark.skipif(not _kernel_has_rto_min(), reason="kernel older than 6.15")
def test_bulk_plane_sockets_get_the_floor_on_both_ends():
    assert asyncio.run(_bulk_options((RTO_MIN, DELACK_MAX))) == ([200_000, 200_000],
                                                                 [200_000, 200_000])
    tcp_tuning.configure(20)
    assert asyncio.run(_bulk_options((RTO_MIN, DELACK_MAX))) == ([20_000, 20_000],
                                                                 [20_000, 20_000])


def test_a_kernel_without_the_option_is_skipped_once_quietly(monkeypatch, caplog):
    monkeypatch.setattr(tcp_tuning, "TCP_RTO_MIN_US", UNKNOWN_OPTION)
    tcp_tuning.configure(20)
    calls: list[int] = []
    setsockopt = socket.socket.setsockopt

    class Counting(socket.socket):
        def setsockopt(self, level, opt, value, *rest):
            calls.append(opt)
            return setsockopt(self, level, opt, value, *rest)

    with caplog.at_level(logging.DEBUG, logger=tcp_tuning.__name__):
        for _ in range(3):
            with Counting() as s:
                tcp_tuning.tune_socket(s)  # never raises
    assert calls.count(UNKNOWN_OPTION) == 1  # refused once, then not tried again
    assert caplog.text.count("refused by this kernel") == 1
    assert not any(r.levelno > logging.DEBUG for r in caplog.records)
    # the connection still works (and gets the option the kernel has, where it has it)
    mine, theirs = asyncio.run(_bulk_options((socket.TCP_NODELAY,)))
    assert len(mine) == len(theirs) == 1


def test_the_key_is_validated():
    assert Config().p2p.tcp_rto_min_ms == 20.0
    assert Config.model_validate({"p2p": {"tcp_rto_min_ms": 0}}).p2p.tcp_rto_min_ms == 0
    for bad in (-1, 201):
        with pytest.raises(ValueError, match="tcp_rto_min_ms"):
            Config.model_validate({"p2p": {"tcp_rto_min_ms": bad}})


@pytest.mark.skipif(not _kernel_has_rto_min(), reason="kernel older than 6.15")
@pytest.mark.parametrize(("cc", "floor"), [("cubic", 200_000), ("reno", 200_000),
                                           ("bbr", 20_000)])
def test_the_floor_is_lowered_under_bbr_only(monkeypatch, caplog, cc, floor):
    monkeypatch.setattr(tcp_tuning, "TUNED_CCS", frozenset({"bbr", "bbr2", "bbr3"}))
    tcp_tuning.configure(20)
    with caplog.at_level(logging.DEBUG, logger=tcp_tuning.__name__):
        for _ in range(2):
            with socket.socket() as s:
                try:
                    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, cc.encode())
                except OSError:
                    pytest.skip(f"{cc} not available here")
                tcp_tuning.tune_socket(s)
                assert s.getsockopt(socket.IPPROTO_TCP, RTO_MIN) == floor
    assert caplog.text.count("left at the kernel's") == (floor == 200_000)


def _other_cc() -> str:
    """A congestion control this kernel has loaded other than its default (reno always is)."""
    loaded = Path("/proc/sys/net/ipv4/tcp_available_congestion_control").read_text().split()
    return next(cc for cc in ("bbr", "cubic", "reno") if cc in loaded and cc != DEFAULT_CC)


def test_bulk_plane_sockets_get_the_configured_congestion_control_on_both_ends():
    other = _other_cc()
    with socket.socket() as s:
        try:
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, other.encode())
        except OSError as e:  # not root and not allowed: the refused test covers that
            pytest.skip(f"{other} not selectable by this process: {e}")
    cc = (socket.TCP_CONGESTION,)
    assert asyncio.run(_bulk_options(cc)) == ([DEFAULT_CC], [DEFAULT_CC])  # untouched
    tcp_tuning.configure(0, congestion=other)
    assert asyncio.run(_bulk_options(cc)) == ([other], [other])


def test_a_congestion_control_the_kernel_refuses_keeps_its_default_said_once(caplog):
    tcp_tuning.configure(0, congestion="nosuchcc")
    with caplog.at_level(logging.INFO, logger=tcp_tuning.__name__):
        for _ in range(3):
            with socket.socket() as s:
                tcp_tuning.tune_socket(s)  # never raises
                assert _read(s, socket.TCP_CONGESTION) == DEFAULT_CC
    assert caplog.text.count("nosuchcc not available to this node") == 1
    # the connection still works, with the kernel's default
    assert asyncio.run(_bulk_options((socket.TCP_CONGESTION,))) == ([DEFAULT_CC],
                                                                    [DEFAULT_CC])


def test_the_congestion_key_is_validated():
    assert Config().p2p.tcp_congestion == "bbr"
    assert Config.model_validate({"p2p": {"tcp_congestion": ""}}).p2p.tcp_congestion == ""
    for bad in ("BBR", "bbr cubic", "x" * 17):
        with pytest.raises(ValueError, match="tcp_congestion"):
            Config.model_validate({"p2p": {"tcp_congestion": bad}})
