"""Small network probes the lab's tests and benchmark run inside hosts (plain sockets).

Run as `python probe.py <command> [args]`; standard library only. A server prints one JSON
line `{"listening": port}` once it accepts; every command ends with one JSON line of results.

  whoami PORT [N]             TCP server: tells each of N clients the address it sees
  ask HOST PORT [LOCAL_PORT [TIMEOUT]]  connect (from LOCAL_PORT), print the address the
                              server saw
  echo PORT                   TCP echo server (one client)
  rtt HOST PORT N             N one-byte round trips over one connection (TCP_NODELAY)
  udp-sink PORT SECONDS       count datagrams until SECONDS of silence after the first
  udp-send HOST PORT N RATE   send N numbered datagrams at RATE per second
  sink PORT                   TCP server: read one connection to its end, report arrivals
  send HOST PORT BYTES        TCP client: send BYTES, report the time
  source PORT BYTES           TCP server: send BYTES to one client
  fetch HOST PORT             TCP client: read to the end, report arrivals
  rendezvous PORT             wait for two peers, tell each the other's public endpoint
  punch HOST PORT LOCAL_PORT SECONDS   learn the peer from the rendezvous, then dial it from
                              LOCAL_PORT (TCP simultaneous open) until connected or SECONDS
"""

from __future__ import annotations

import json
import socket
import struct
import sys
import time


def out(**fields) -> None:
    print(json.dumps(fields), flush=True)


def listener(port: int, backlog: int = 16) -> socket.socket:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", port))
    s.listen(backlog)
    out(listening=s.getsockname()[1])
    return s


def bound_socket(local_port: int) -> socket.socket:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if local_port:
        s.bind(("0.0.0.0", local_port))
    return s


def whoami(port: str, n: str = "1") -> None:
    s = listener(int(port))
    seen = []
    for _ in range(int(n)):
        c, addr = s.accept()
        c.sendall(f"{addr[0]} {addr[1]}\n".encode())
        c.close()
        seen.append(list(addr))
    out(seen=seen)


def ask(host: str, port: str, local_port: str = "0", timeout: str = "10") -> None:
    s = bound_socket(int(local_port))
    s.settimeout(float(timeout))
    s.connect((host, int(port)))
    ip, seen_port = s.makefile().readline().split()
    out(local=list(s.getsockname()), seen=[ip, int(seen_port)])


def echo(port: str) -> None:
    s = listener(int(port))
    c, _ = s.accept()
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    while data := c.recv(65536):
        c.sendall(data)
    out(done=True)


def rtt(host: str, port: str, n: str) -> None:
    c = socket.create_connection((host, int(port)), timeout=10)
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    samples = []
    for _ in range(int(n)):
        t = time.monotonic()
        c.sendall(b"x")
        if c.recv(1) != b"x":
            raise SystemExit("echo broke")
        samples.append(time.monotonic() - t)
    c.close()
    out(rtt_s=samples)


def udp_sink(port: str, quiet_s: str) -> None:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
    s.bind(("0.0.0.0", int(port)))
    out(listening=s.getsockname()[1])
    seqs = set()
    s.settimeout(None)
    while True:
        data = s.recv(2048)
        seqs.add(struct.unpack("!I", data[:4])[0])
        s.settimeout(float(quiet_s))
        try:
            while True:
                data = s.recv(2048)
                seqs.add(struct.unpack("!I", data[:4])[0])
        except TimeoutError:
            break
    out(received=len(seqs))


def udp_send(host: str, port: str, n: str, rate: str) -> None:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    gap = 1.0 / float(rate)
    t0 = time.monotonic()
    for i in range(int(n)):
        delay = t0 + i * gap - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        s.sendto(struct.pack("!I", i) + b"\0" * 60, (host, int(port)))
    out(sent=int(n))


def sink(port: str) -> None:
    c, _ = listener(int(port)).accept()
    arrivals(c)


def fetch(host: str, port: str) -> None:
    arrivals(socket.create_connection((host, int(port)), timeout=30))


def arrivals(c: socket.socket) -> None:
    total, first, first_len, last = 0, None, 0, None
    while data := c.recv(1 << 20):
        now = time.monotonic()
        if first is None:
            first, first_len = now, len(data)
        total, last = total + len(data), now
    c.close()
    # the rate: bytes after the first read over the time from the first read to the last
    out(bytes=total, after_first=total - first_len, span_s=(last - first) if first else 0.0)


def send(host: str, port: str, nbytes: str) -> None:
    c = socket.create_connection((host, int(port)), timeout=30)
    block = b"\0" * (1 << 16)
    left = int(nbytes)
    t = time.monotonic()
    while left > 0:
        left -= c.send(block[:min(left, len(block))])
    c.shutdown(socket.SHUT_WR)
    c.recv(1)  # the sink closes once it has read everything
    out(seconds=time.monotonic() - t)


def source(port: str, nbytes: str) -> None:
    c, _ = listener(int(port)).accept()
    block = b"\0" * (1 << 16)
    left = int(nbytes)
    while left > 0:
        left -= c.send(block[:min(left, len(block))])
    c.close()
    out(sent=int(nbytes))


def rendezvous(port: str) -> None:
    s = listener(int(port))
    peers = [s.accept() for _ in range(2)]
    for (conn, _), (_, other) in zip(peers, reversed(peers), strict=True):
        conn.sendall(f"{other[0]} {other[1]}\n".encode())
        conn.close()
    out(peers=[list(a) for _, a in peers])


def punch(host: str, port: str, local_port: str, seconds: str) -> None:
    lp = int(local_port)
    r = bound_socket(lp)
    r.settimeout(10)
    r.connect((host, int(port)))
    peer_ip, peer_port = r.makefile().readline().split()
    r.close()
    deadline = time.monotonic() + float(seconds)
    attempts = 0
    while time.monotonic() < deadline:
        attempts += 1
        c = bound_socket(lp)
        c.settimeout(max(0.1, min(1.0, deadline - time.monotonic())))
        try:
            c.connect((peer_ip, int(peer_port)))
        except OSError:
            c.close()
            continue
        c.sendall(b"hi")
        ok = c.recv(2) == b"hi"
        c.close()
        out(connected=ok, attempts=attempts, peer=[peer_ip, int(peer_port)])
        return
    out(connected=False, attempts=attempts, peer=[peer_ip, int(peer_port)])


COMMANDS = {"whoami": whoami, "ask": ask, "echo": echo, "rtt": rtt, "udp-sink": udp_sink,
            "udp-send": udp_send, "sink": sink, "send": send,
            "source": source, "fetch": fetch, "rendezvous": rendezvous,
            "punch": punch}

if __name__ == "__main__":
    COMMANDS[sys.argv[1]](*sys.argv[2:])
