"""Per-socket TCP loss-recovery settings on every TCP connection the node opens: py-libp2p's
TCP transport (dialled and accepted: both wrap their socket in `TrioTCPStream`, patched here)
and the bulk plane (node/p2p/bulk calls `tune_socket` on its client and server sockets).

Why (issue #27, benchmarks/RESULTS.md "tcp-tail"): gossip messages are small writes on idle,
persistent connections, so a lost segment is mostly a *tail* loss no later segment reveals;
Linux recovers it by the tail loss probe (TLP) or the RTO, both floored by `rto_min`
(200 ms): the RTO is srtt + max(4 * rttvar, rto_min) and the probe of a one-segment flight
waits 2 * srtt + rto_min (capped at the RTO). On a 183 ms path a loss thus costs a message
~200 ms more than the RTT it must cost. Linux >= 6.15 lets a socket lower its own floor
(`TCP_RTO_MIN_US`). The floor only matters where 4 * rttvar is below it: on a path with RTT
jitter the variance term is larger anyway and keeps the RTO where it was; on a steady path
an ACK later than srtt + floor (a delayed ACK, a queue building) fires a probe or an RTO
early, which costs a duplicate segment (F-RTO, on by default, undoes the window cut of a
spurious RTO). The receiver's delayed ACK is capped as well (`TCP_DELACK_MAX_US`, to the same
value) so a lone segment's ACK does not come later than the lowered floor.

BBR only (the socket's congestion control, read from it; others are left untouched,
logged once at debug): under cubic a lower floor makes things worse (RESULTS "tcp-tail",
lossy 183 ms path, 64 KiB message: p95 1106 -> 1844 ms): an RTO that fires before the
probe would have restarts the window from one segment, and with
`net.ipv4.tcp_slow_start_after_idle` = 1 (the default) the window also halves once per RTO
a connection sat idle (lossless path: 187 -> 370 ms). BBR skips the idle restart and does
not rebuild its window from slow start after an RTO.

The congestion control itself (`p2p.tcp_congestion`, "bbr" by default; "" leaves the
kernel's): each socket asks for it (TCP_CONGESTION) before the floor is decided. Random loss
on home links is what loss-based controls take for congestion: in the simulated internet a
12-node gossip round's p95 was 2.8-3.9 s over cubic against 1.1-1.3 s over BBR (RESULTS
"wan: gossip"). A kernel without it loaded, or one that does not let this process choose
it (not root and not in net.ipv4.tcp_allowed_congestion_control), keeps its default, said
once at INFO.

`p2p.tcp_rto_min_ms` (0: the kernel's settings untouched). A kernel without the options
(older than 6.15, not Linux) refuses them: skipped, logged once at debug, never an error."""

from __future__ import annotations

import logging
import socket

from libp2p.io.trio import TrioTCPStream

from .registry import Patch, has_signature, original, register, replace

log = logging.getLogger(__name__)

TCP_RTO_MIN_US = 45
"""Linux >= 6.15 (include/uapi/linux/tcp.h); Python's socket module does not name it yet."""
TCP_DELACK_MAX_US = 46

TUNED_STREAM = register(Patch(
    name="tcp_loss_recovery",
    scope="process",
    targets=("libp2p.io.trio:TrioTCPStream.__init__",),
    why="py-libp2p's TCP sockets keep the kernel's 200 ms RTO floor: a lost tail segment of "
        "a small gossip write costs ~200 ms more than the path's RTT",
    upstream="none filed (searched 2026-12); a node-side setting, not a py-libp2p bug",
    shape=lambda: has_signature(TrioTCPStream, "__init__", ("self", "stream")),
))

_settings: list[tuple[int, int, str]] = []  # (option, value, name); empty: untouched
_refused: set[int] = set()  # options the kernel refused once (never tried again)
_congestion: list[str] = []  # the congestion control asked for (p2p.tcp_congestion); empty:
# the kernel's default
_refused_cc: set[str] = set()  # controls the kernel refused once (never asked again)


def configure(rto_min_ms: float, congestion: str = "") -> None:
    """The settings `tune_socket` applies from now on (process-wide: one node a process)."""
    us = int(rto_min_ms * 1000)
    _settings[:] = ([(TCP_RTO_MIN_US, us, "TCP_RTO_MIN_US"),
                     (TCP_DELACK_MAX_US, us, "TCP_DELACK_MAX_US")] if us > 0 else [])
    _congestion[:] = [congestion] if congestion else []


def _choose_congestion(sock) -> None:
    """Ask for the configured congestion control on `sock`; a kernel that does not have it
    loaded, or does not let this process choose it, keeps its default (said once, at INFO:
    the operator can load it; `swarm-node doctor` says how)."""
    for cc in _congestion:
        if cc in _refused_cc:
            return
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, cc.encode())
        except OSError as e:
            _refused_cc.add(cc)
            log.info("TCP congestion control %s not available to this node (%s): the "
                     "kernel's default stays (swarm-node doctor: how to enable it)", cc,
                     e.strerror or e)


TUNED_CCS = frozenset({"bbr", "bbr2", "bbr3"})
"""Congestion controls whose sockets get the settings (see the module's docstring)."""
_skipped_cc: set[str] = set()  # congestion controls left untouched (logged once each)


def tune_socket(sock) -> None:
    """Ask for the configured congestion control on a TCP socket (a stdlib or a trio one,
    before or after connect), then apply the RTO floor if that control is BBR. An option
    the kernel refuses is skipped from then on."""
    _choose_congestion(sock)
    if not _settings:
        return
    try:
        cc = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, 16)
        cc = cc.split(b"\0", 1)[0].decode()
    except OSError:
        cc = "unknown"
    if cc not in TUNED_CCS:
        if cc not in _skipped_cc:
            _skipped_cc.add(cc)
            log.debug("TCP's RTO floor left at the kernel's: congestion control %s", cc)
        return
    for opt, value, name in _settings:
        if opt in _refused:
            continue
        try:
            sock.setsockopt(socket.IPPROTO_TCP, opt, value)
        except OSError as e:
            _refused.add(opt)
            log.debug("%s refused by this kernel (%s): the kernel's default stays", name, e)


def install() -> None:
    replace(TrioTCPStream, "__init__", _init)


def _init(self, stream) -> None:
    original(TrioTCPStream, "__init__")(self, stream)
    try:
        sock = stream.socket
    except AttributeError:  # not a socket stream (a test's memory stream)
        return
    tune_socket(sock)
