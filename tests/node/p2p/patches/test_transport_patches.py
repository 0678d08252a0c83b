"""The process-wide yamux and Noise patches (node/p2p/patches: yamux_window, yamux_frames,
noise_io): py-libp2p's own code, restored for the test, still shows each problem (the patch
is still needed); the installed replacement does not."""

from __future__ import annotations

import logging
import os
import socket
import struct
from pathlib import Path

import libp2p.security.secure_session as secure_session_mod
import libp2p.stream_muxer.yamux.yamux as yamux_mod
import pytest
import trio
import trio.testing
from libp2p.io.trio import TrioTCPStream
from libp2p.security.noise.io import MAX_PLAINTEXT_LENGTH, NoiseTransportReadWriter
from libp2p.security.secure_session import SecureSession
from swarm_node.node.p2p import patches
from swarm_node.node.p2p.patches import noise_io, tcp_tuning
from swarm_node.node.p2p.patches.registry import original

from .rawhost import Wire, connect, noise_session_pair, raw_host, running, until


def _window_updates(monkeypatch, upstream: bool, reads: int = 20, size: int = 1024) -> int:
    """WINDOW_UPDATE frames sent while a stream reads `reads` small messages."""
    patches.install()
    stream_cls = yamux_mod.YamuxStream
    if upstream:
        monkeypatch.setattr(stream_cls, "_auto_tune_and_send_window_update",
                            original(stream_cls, "_auto_tune_and_send_window_update"))
    sent = []
    inner = stream_cls.send_window_update

    async def counted(self, increment: int, skip_lock: bool = False) -> None:
        sent.append(increment)
        await inner(self, increment, skip_lock)

    monkeypatch.setattr(stream_cls, "send_window_update", counted)

    async def main() -> int:
        a, b = raw_host(), raw_host()
        got: list[int] = []

        async def reader(stream) -> None:
            while len(got) < reads:
                got.append(len(await stream.read(size)))

        async with running(a, b):
            a.set_stream_handler("/read/1", reader)
            await connect(b, a)
            stream = await b.new_stream(a.get_id(), ["/read/1"])
            for _ in range(reads):
                await stream.write(b"m" * size)
                n = len(got)
                await until(lambda n=n: len(got) > n, what="the read")
        return len(sent)

    return trio.run(main)


def test_needed_yamux_window_update_batching(monkeypatch):
    assert _window_updates(monkeypatch, upstream=True) >= 10  # py-libp2p: one per read
    monkeypatch.undo()
    assert _window_updates(monkeypatch, upstream=False) == 0  # 20 KiB of a 256 KiB window


def test_needed_yamux_env_read_once(monkeypatch):
    patches.install()
    calls = []
    getenv = os.getenv
    monkeypatch.setattr(yamux_mod.os, "getenv", lambda *a: calls.append(a) or getenv(*a))
    upstream = original(yamux_mod, "_py_yamux_env")
    upstream("SWARM_TEST_KNOB")
    upstream("SWARM_TEST_KNOB")
    assert len(calls) == 2  # py-libp2p: the environment on every call
    yamux_mod._py_yamux_env("SWARM_TEST_KNOB")
    yamux_mod._py_yamux_env("SWARM_TEST_KNOB")
    assert len(calls) == 3  # memoised: once


def test_needed_yamux_frames_fit_noise():
    patches.install()
    upstream = original(yamux_mod, "MAX_MESSAGE_SIZE")  # a frame, header included
    assert upstream > MAX_PLAINTEXT_LENGTH  # a full frame is two Noise messages ...
    assert upstream - MAX_PLAINTEXT_LENGTH == 17  # ... the second one of 17 bytes
    assert yamux_mod.MAX_MESSAGE_SIZE % MAX_PLAINTEXT_LENGTH == 0  # ours: whole messages


class OneRead:
    def __init__(self, data: bytes):
        self.data = data

    async def read(self, n: int) -> bytes:
        out, self.data = self.data[:n], self.data[n:]
        return out


def test_needed_yamux_read_exactly_one_copy():
    patches.install()
    body = os.urandom(70_000)

    async def main(read_exactly) -> bytes:
        return await read_exactly(OneRead(body), len(body))

    upstream = trio.run(main, original(yamux_mod, "read_exactly"))
    assert upstream == body and upstream is not body  # py-libp2p copies it (twice)
    assert trio.run(main, yamux_mod.read_exactly) is body


class _Frames:
    """Enough of a Yamux connection for `_write_frame`."""

    is_initiator_value = True

    def __init__(self):
        self._write_lock = trio.Lock()
        self.written: list[bytes] = []
        self.secured_conn = self

    async def write(self, data: bytes) -> None:
        self.written.append(data)


def test_needed_yamux_write_frame_quiet(monkeypatch):
    patches.install()
    monkeypatch.setattr(yamux_mod.logger, "level", logging.INFO)
    unpacked = []

    class CountingStruct:
        def __getattr__(self, name):
            return getattr(struct, name)

        def unpack(self, fmt, data):
            unpacked.append(fmt)
            return struct.unpack(fmt, data)

    monkeypatch.setattr(yamux_mod, "struct", CountingStruct())
    frame = struct.pack(yamux_mod.YAMUX_HEADER_FORMAT, 0, 0, 0, 1, 3) + b"abc"
    conn = _Frames()
    trio.run(original(yamux_mod.Yamux, "_write_frame"), conn, frame)
    assert len(unpacked) == 1  # py-libp2p decodes the header for a debug line not logged
    trio.run(yamux_mod.Yamux._write_frame, conn, frame)
    assert len(unpacked) == 1 and conn.written == [frame, frame]


def test_needed_noise_batched_io():
    patches.install()
    three = os.urandom(3 * MAX_PLAINTEXT_LENGTH)

    async def main() -> tuple[int, int, int]:
        wire = Wire()
        writer, reader = noise_session_pair(wire)
        await original(NoiseTransportReadWriter, "write_msg")(writer, three)
        upstream_writes = wire.writes
        first = await original(NoiseTransportReadWriter, "read_msg")(reader)
        upstream_reads = wire.reads
        assert first == three[:MAX_PLAINTEXT_LENGTH]  # one message per call
        wire = Wire()
        writer, reader = noise_session_pair(wire)
        await writer.write_msg(three)
        ours = wire.writes
        assert await reader.read_msg() == three and wire.reads == 1
        return upstream_writes, upstream_reads, ours

    upstream_writes, upstream_reads, ours = trio.run(main)
    assert upstream_writes == 3 and upstream_reads >= 2  # a socket call per length and body
    assert ours == 1


class _Messages:
    """An encrypted-message reader that returns the given plaintexts (py-libp2p's interface)."""

    def __init__(self, messages: list[bytes]):
        self.messages = list(messages)

    async def read_msg(self) -> bytes:
        return self.messages.pop(0) if self.messages else b""


def test_needed_noise_session_read_one_copy(monkeypatch):
    patches.install()
    copied = []

    class CountingBytearray(bytearray):
        def __init__(self, *args):
            super().__init__(*args)
            copied.append(len(self))

        def extend(self, data) -> None:
            copied.append(len(data))
            super().extend(data)

    monkeypatch.setattr(secure_session_mod, "bytearray", CountingBytearray, raising=False)
    messages = [os.urandom(40_000) for _ in range(3)]
    session = SecureSession.__new__(SecureSession)
    session.conn = _Messages(messages)
    session._reset_internal_buffer()

    async def main() -> bytes:
        return await original(SecureSession, "read")(session, 100_000)

    assert trio.run(main) == b"".join(messages)[:100_000]
    # py-libp2p assembles every read in a bytearray (then copies it out again as bytes)
    assert sum(copied) >= 100_000

    async def ours() -> bytes:
        wire = Wire()
        writer, reader = noise_session_pair(wire)
        for m in messages:
            await writer.write_msg(m)
        ours_session = SecureSession.__new__(SecureSession)
        ours_session.conn = reader
        ours_session._reset_internal_buffer()
        copied.clear()
        return await ours_session.read(100_000)

    assert trio.run(ours) == b"".join(messages)[:100_000] and sum(copied) == 0



class _Socket:
    """A raw connection over one end of a real socket pair (py-libp2p's interface)."""

    def __init__(self, sock):
        self.stream = trio.SocketStream(sock)

    async def write(self, data) -> None:
        await self.stream.send_all(data)

    async def read(self, n: int | None = None) -> bytes:
        return await self.stream.receive_some(n or 65536)

    async def close(self) -> None:
        await self.stream.aclose()


async def _write_cut(writer, big: bytes, after: bytes, scopes: list) -> None:
    with trio.CancelScope() as scope:
        scopes.append(scope)
        await writer.write_msg(big)
    await writer.write_msg(after)


async def _read_all(reader, got: bytearray, size: int) -> None:
    while len(got) < size:  # a broken session waits here for bytes never sent
        got.extend(await reader.read_msg())


@pytest.mark.parametrize("ours", [True, False])
def test_a_cancelled_noise_write_does_not_break_the_session(ours, monkeypatch):
    """A write cancelled while the socket is full (its reader not reading yet) must not leave
    half a Noise message: the reader then gets the whole first write and the next one. With
    the socket write cancellable anywhere (py-libp2p's, and ours before) the session breaks:
    the reader waits for the rest of a message that never comes."""
    patches.install()
    if not ours:
        monkeypatch.setattr(noise_io, "_send_whole", lambda conn, data: conn.write(data))
    big, after = os.urandom(4 * MAX_PLAINTEXT_LENGTH), b"after the cancelled write"

    async def main() -> bytes:
        left, right = trio.socket.socketpair()
        for sock in (left, right):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        writer, reader = noise_session_pair(Wire())
        writer.read_writer.read_write_closer = _Socket(left)
        reader.read_writer.read_write_closer = _Socket(right)
        got = bytearray()
        scopes: list = []
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_write_cut, writer, big, after, scopes)
            await trio.testing.wait_all_tasks_blocked()  # the socket buffers are full
            scopes[0].cancel()
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(_read_all, reader, got, len(big) + len(after))
            await trio.testing.wait_all_tasks_blocked()  # all read, or stuck for good
            nursery.cancel_scope.cancel()
        return bytes(got)

    got = trio.run(main)
    if ours:
        assert got == big + after
    else:  # the problem: the cancelled write's tail is lost, the session stuck
        assert len(got) < len(big) and not got.endswith(after)


def _rto_floors(monkeypatch, upstream: bool) -> list[int]:
    """TCP_RTO_MIN_US of both ends (the dialled and the accepted socket) of one libp2p
    connection, with `p2p.tcp_rto_min_ms` = 20."""
    patches.install()
    tcp_tuning.configure(20)
    default_cc = Path("/proc/sys/net/ipv4/tcp_congestion_control").read_text().strip()
    monkeypatch.setattr(tcp_tuning, "TUNED_CCS", tcp_tuning.TUNED_CCS | {default_cc})
    if upstream:
        monkeypatch.setattr(TrioTCPStream, "__init__", original(TrioTCPStream, "__init__"))
    made: list[TrioTCPStream] = []
    init = TrioTCPStream.__init__

    def recorded(self, stream) -> None:
        init(self, stream)
        made.append(self)

    monkeypatch.setattr(TrioTCPStream, "__init__", recorded)

    async def main() -> list[int]:
        a, b = raw_host(), raw_host()
        async with running(a, b):
            await connect(b, a)
            await until(lambda: len(made) == 2, what="both ends' TCP streams")
            return [s.stream.socket.getsockopt(socket.IPPROTO_TCP, tcp_tuning.TCP_RTO_MIN_US)
                    for s in made]

    try:
        return trio.run(main)
    finally:
        tcp_tuning.configure(0)


def _kernel_has_rto_min() -> bool:
    with socket.socket() as s:
        try:
            s.getsockopt(socket.IPPROTO_TCP, tcp_tuning.TCP_RTO_MIN_US)
        except OSError:
            return False
    return True


@pytest.mark.skipif(not _kernel_has_rto_min(), reason="kernel older than 6.15")
def test_needed_tcp_loss_recovery(monkeypatch):
    assert _rto_floors(monkeypatch, upstream=True) == [200_000, 200_000]  # the kernel's
    monkeypatch.undo()
    assert _rto_floors(monkeypatch, upstream=False) == [20_000, 20_000]
