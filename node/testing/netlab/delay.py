"""The lab's delay stage: one user-space process in the internet namespace that holds each
packet crossing the internet for its path's one-way delay, and drops it with its path's loss.

This kernel has no netem (no qdisc adds delay) and no nft `queue` expression, so the internet
router sends every transit packet to a TUN device (policy routing, see `lab.py`); this process
reads each packet from the TUN, and writes it back when it is due. Packets re-enter the router
from the TUN and are routed on to their destination's link. With IFF_VNET_HDR and TSO offloads
the kernel hands over whole GSO packets (up to 64 KiB) and takes them back unchanged, so a bulk
TCP flow costs one read and one write per GSO packet rather than per 1500-byte segment.

Per path (source address, destination address as seen in the internet, so a NAT'd host counts
as its home router): delay = leg(src) + leg(dst), loss = 1 - (1 - loss(src)) (1 - loss(dst)).
A partition drops every packet between two groups. Delay is the same for every packet of a
path, so a path's packets leave in the order they came.

Loss is per wire packet (1500-byte segment), as on the internet, not per GSO packet: dropping a
64 KiB GSO packet whole would lose ~40 segments in one burst and make a lossy path look far
better for bulk TCP than it is (a TCP flow's rate falls with the loss *events* it sees). Each
segment of a TCP GSO packet draws its own loss; if none is lost the GSO packet goes on whole,
otherwise it is cut into its segments here (the kernel's TSO split: sequence numbers, IP ids,
FIN/PSH on the last, CWR on the first) and only the lost ones are dropped.

Standard library only (it runs as `python delay.py`, not as part of the package). Control: one
JSON object per line on stdin, one JSON reply per line on stdout:
  {"op": "links", "links": {"11.0.1.2": [one_way_s, loss], ...}}  -> {"ok": true}
  {"op": "partition", "groups": [["11.0.1.2", ...], [...]]}      -> {"ok": true}
  {"op": "heal"}                                                  -> {"ok": true}
  {"op": "stats"}                                                 -> {"ok": true, "stats": {...}}
It prints {"ready": true} once the TUN exists, and exits when stdin closes.
"""

from __future__ import annotations

import fcntl
import heapq
import json
import os
import random
import select
import socket
import struct
import sys
import time

TUNSETIFF = 0x400454CA
TUNSETOFFLOAD = 0x400454D0
IFF_TUN, IFF_NO_PI, IFF_VNET_HDR = 0x0001, 0x1000, 0x4000
# checksum offload + TSO for IPv4/IPv6 (+ ECN): GSO packets pass through whole
TUN_F_CSUM, TUN_F_TSO4, TUN_F_TSO6, TUN_F_TSO_ECN = 0x01, 0x02, 0x04, 0x08
VNET_HDR_LEN = 10  # struct virtio_net_hdr (the default TUNSETVNETHDRSZ)
VNET_HDR = struct.Struct("<BBHHHH")  # flags, gso_type, hdr_len, gso_size, csum_start, csum_off
VNET_F_NEEDS_CSUM = 1
VNET_GSO_TCPV4, VNET_GSO_ECN = 1, 0x80
TCP_FIN, TCP_PSH, TCP_CWR = 0x01, 0x08, 0x80
READ_SIZE = 65536 + VNET_HDR_LEN + 64
READS_PER_WAKE = 256  # bound one burst of reads so due packets are not held back


class Stage:
    def __init__(self, fd: int, rng: random.Random):
        self.fd = fd
        self.rng = rng
        self.legs: dict[bytes, tuple[float, float]] = {}  # address -> (one-way s, loss)
        self.group: dict[bytes, int] = {}  # address -> partition group
        self.heap: list[tuple[float, int, bytes]] = []
        self.seq = 0
        self.stats = {"reads": 0, "packets": 0, "bytes": 0, "lost": 0, "partitioned": 0, "other": 0,
                      "max_held": 0, "late_s_max": 0.0, "late_2ms": 0, "late_10ms": 0,
                      "write_errors": 0, "split": 0}
        self.tun_name = ""

    def configure(self, msg: dict) -> dict:
        op = msg.get("op")
        if op == "links":
            for addr, (delay_s, loss) in msg["links"].items():
                self.legs[socket.inet_aton(addr)] = (float(delay_s), float(loss))
        elif op == "partition":
            self.group = {socket.inet_aton(a): i for i, grp in enumerate(msg["groups"])
                          for a in grp}
        elif op == "heal":
            self.group = {}
        elif op == "stats":
            cpu = os.times()
            return {"ok": True, "stats": {**self.stats, "held": len(self.heap),
                                          "cpu_s": cpu.user + cpu.system,
                                          "tun_drops": self.tun_drops()}}
        else:
            return {"ok": False, "error": f"unknown op {op!r}"}
        return {"ok": True}

    def take(self, pkt: bytes, now: float) -> None:
        """One packet read from the TUN: drop it, or hold it until it is due."""
        ip = pkt[VNET_HDR_LEN:]
        if len(ip) < 20 or ip[0] >> 4 != 4:
            # not IPv4 (the lab has no IPv6 routes): pass through undelayed
            self.stats["other"] += 1
            self._write(pkt)
            return
        src, dst = ip[12:16], ip[16:20]
        stats = self.stats
        n = tcp4_segments(pkt)
        stats["reads"] += 1
        stats["packets"] += n  # wire packets: a GSO packet counts as its segments
        stats["bytes"] += len(ip)
        group = self.group
        if group:
            gs, gd = group.get(src), group.get(dst)
            if gs is not None and gd is not None and gs != gd:
                stats["partitioned"] += 1
                return
        ds, ls = self.legs.get(src, (0.0, 0.0))
        dd, ld = self.legs.get(dst, (0.0, 0.0))
        due = now + ds + dd
        if ls or ld:
            loss = 1.0 - (1.0 - ls) * (1.0 - ld)
            lost = [self.rng.random() < loss for _ in range(n)]
            dropped = sum(lost)
            if dropped:
                stats["lost"] += dropped
                if dropped == n:
                    return
                stats["split"] += n > 1
                for seg, gone in zip(split_tcp4(pkt), lost, strict=True):
                    if not gone:
                        self._hold(due, seg)
                return
        self._hold(due, pkt)

    def _hold(self, due: float, pkt: bytes) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (due, self.seq, pkt))
        self.stats["max_held"] = max(self.stats["max_held"], len(self.heap))

    def release(self, now: float) -> float | None:
        """Write every due packet; returns seconds until the next one (None: none held)."""
        heap = self.heap
        while heap and heap[0][0] <= now:
            due, _, pkt = heapq.heappop(heap)
            late = now - due
            if late > 0.002:  # poll() wakes in whole ms: up to 1 ms late is normal
                stats = self.stats
                stats["late_2ms"] += 1
                if late > 0.010:
                    stats["late_10ms"] += 1
                stats["late_s_max"] = max(stats["late_s_max"], late)
            self._write(pkt)
        return (heap[0][0] - now) if heap else None

    def tun_drops(self) -> int:
        """Packets the kernel dropped before this stage read them (the TUN's queue was full:
        the stage fell behind). Not part of the configured loss; a benchmark reports it."""
        try:
            with open(f"/sys/class/net/{self.tun_name}/statistics/tx_dropped") as f:
                return int(f.read())
        except (OSError, ValueError):
            return -1

    def _write(self, pkt: bytes) -> None:
        try:
            os.write(self.fd, pkt)
        except OSError:
            # the destination's link is gone (a host torn down mid-run): the packet is lost
            self.stats["write_errors"] += 1


def tcp4_segments(pkt: bytes) -> int:
    """How many wire packets a packet read from the TUN stands for (>1: a TCP/IPv4 GSO packet
    whose checksum the kernel still has to fill in, which `split_tcp4` can cut)."""
    flags, gso_type, _, gso_size, _, _ = VNET_HDR.unpack_from(pkt)
    if gso_type & ~VNET_GSO_ECN != VNET_GSO_TCPV4 or not gso_size or \
            not flags & VNET_F_NEEDS_CSUM:
        return 1
    ihl = (pkt[VNET_HDR_LEN] & 0x0F) * 4
    doff = (pkt[VNET_HDR_LEN + ihl + 12] >> 4) * 4
    payload = len(pkt) - VNET_HDR_LEN - ihl - doff
    return max(1, -(-payload // gso_size))


def split_tcp4(pkt: bytes) -> list[bytes]:
    """A TCP/IPv4 GSO packet as its wire segments, each with its own virtio header asking the
    kernel to finish the TCP checksum (the field holds the pseudo-header sum, as for TSO)."""
    gso_size = VNET_HDR.unpack_from(pkt)[3]
    ip = memoryview(pkt)[VNET_HDR_LEN:]
    ihl = (ip[0] & 0x0F) * 4
    doff = (ip[ihl + 12] >> 4) * 4
    ip_id = struct.unpack_from("!H", ip, 4)[0]
    seq = struct.unpack_from("!I", ip, ihl + 4)[0]
    flags = ip[ihl + 13]
    addrs = bytes(ip[12:20])
    payload = ip[ihl + doff:]
    n = -(-len(payload) // gso_size)
    vnet = VNET_HDR.pack(VNET_F_NEEDS_CSUM, 0, 0, 0, ihl, 16)
    out = []
    for i in range(n):
        chunk = payload[i * gso_size:(i + 1) * gso_size]
        iph = bytearray(ip[:ihl])
        struct.pack_into("!HH", iph, 2, ihl + doff + len(chunk), (ip_id + i) & 0xFFFF)
        iph[10:12] = b"\0\0"
        struct.pack_into("!H", iph, 10, ~_sum16(iph) & 0xFFFF)
        tcph = bytearray(ip[ihl:ihl + doff])
        struct.pack_into("!I", tcph, 4, (seq + i * gso_size) & 0xFFFFFFFF)
        tcph[13] = flags & ~((TCP_FIN | TCP_PSH) if i < n - 1 else 0) & ~(TCP_CWR if i else 0)
        pseudo = addrs + struct.pack("!HH", socket.IPPROTO_TCP, doff + len(chunk))
        struct.pack_into("!H", tcph, 16, _sum16(pseudo))
        out.append(vnet + iph + tcph + chunk)
    return out


def _sum16(data: bytes | bytearray) -> int:
    """The ones'-complement sum of the 16-bit big-endian words of `data`, folded, not
    complemented. Adding words with end-around carry is addition modulo 0xFFFF (65536 = 1
    mod 0xFFFF), so the whole buffer read as one integer gives it at once."""
    if len(data) % 2:
        data = bytes(data) + b"\0"
    total = int.from_bytes(data, "big") % 0xFFFF
    return 0xFFFF if total == 0 and any(data) else total


def open_tun(name: str) -> int:
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    ifr = struct.pack("16sH", name.encode(), IFF_TUN | IFF_NO_PI | IFF_VNET_HDR)
    fcntl.ioctl(fd, TUNSETIFF, ifr)
    fcntl.ioctl(fd, TUNSETOFFLOAD, TUN_F_CSUM | TUN_F_TSO4 | TUN_F_TSO6 | TUN_F_TSO_ECN)
    return fd


def serve(tun_name: str, seed: int) -> None:
    fd = open_tun(tun_name)
    stage = Stage(fd, random.Random(seed))
    stage.tun_name = tun_name
    ctl = sys.stdin.buffer
    os.set_blocking(ctl.fileno(), False)
    pending = b""
    print(json.dumps({"ready": True}), flush=True)
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    poller.register(ctl.fileno(), select.POLLIN)
    clock = time.monotonic
    wait = None
    while True:
        timeout_ms = -1 if wait is None else max(0, int(wait * 1000.0 + 0.999))
        for fileno, _ in poller.poll(timeout_ms):
            if fileno == fd:
                now = clock()
                for _ in range(READS_PER_WAKE):
                    try:
                        pkt = os.read(fd, READ_SIZE)
                    except BlockingIOError:
                        break
                    stage.take(pkt, now)
            else:
                chunk = os.read(ctl.fileno(), 65536)
                if not chunk:
                    return
                pending += chunk
                while b"\n" in pending:
                    line, pending = pending.split(b"\n", 1)
                    try:
                        reply = stage.configure(json.loads(line))
                    except (ValueError, KeyError, TypeError, OSError) as e:
                        reply = {"ok": False, "error": f"{type(e).__name__}: {e}"}
                    print(json.dumps(reply), flush=True)
        wait = stage.release(clock())


def main() -> None:
    tun_name = sys.argv[1]
    seed = int(sys.argv[2]) if len(sys.argv) > 2 else 0
    # The stage is the network: its timing must not depend on how busy the nodes keep the
    # CPU. A low real-time priority runs it ahead of every normal process when a packet is
    # due (it sleeps in poll() otherwise; the kernel's RT throttling keeps 5% of each core
    # for the rest even if it saturates one); without the privilege, a high nice level.
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))
    except (OSError, AttributeError):
        try:
            os.nice(-10)
        except OSError:
            pass
    try:
        serve(tun_name, seed)
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
