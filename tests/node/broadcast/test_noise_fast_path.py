"""The Noise fast paths of the libp2p stream path (node/p2p/patches/noise_io.py): messages written in
one socket write, read back in any chunking, over a real Noise session (the `noise` library
py-libp2p uses, NN handshake in memory). End-to-end over real hosts: tests/node/p2p and the
libp2p cases of test_faults/test_service."""

from __future__ import annotations

import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st
from libp2p.io.exceptions import IncompleteReadError
from libp2p.security.noise.io import MAX_PLAINTEXT_LENGTH, NoiseTransportReadWriter
from noise.connection import NoiseConnection
from noise.exceptions import NoiseInvalidMessage
from swarm_node.node.p2p import patches
from swarm_node.node.p2p.patches import noise_io
from swarm_node.node.p2p.patches.registry import original

MSG_LIMIT = 65535


class Wire:
    """A raw connection in memory: writes are recorded; reads return the recorded bytes in
    the chunk sizes given (cycled), then b"" (end of stream)."""

    def __init__(self, chunks: list[int] | None = None):
        self.sent = bytearray()
        self.writes = 0
        self.chunks = chunks or [1 << 20]
        self.pos = 0
        self.reads = 0

    async def write(self, data: bytes) -> None:
        self.sent.extend(data)
        self.writes += 1

    async def read(self, n: int | None = None) -> bytes:
        await trio.lowlevel.checkpoint()
        size = min(n or 1 << 20, self.chunks[self.reads % len(self.chunks)])
        self.reads += 1
        out = bytes(self.sent[self.pos:self.pos + size])
        self.pos += len(out)
        return out


def noise_pair() -> tuple[NoiseConnection, NoiseConnection]:
    a = NoiseConnection.from_name(b"Noise_NN_25519_ChaChaPoly_SHA256")
    b = NoiseConnection.from_name(b"Noise_NN_25519_ChaChaPoly_SHA256")
    a.set_as_initiator()
    b.set_as_responder()
    a.start_handshake()
    b.start_handshake()
    b.read_message(a.write_message())
    a.read_message(b.write_message())
    assert a.handshake_finished and b.handshake_finished
    return a, b


def session(chunks: list[int] | None = None):
    """(writer, reader, wire): both ends of one Noise session over one in-memory wire."""
    patches.install()
    a, b = noise_pair()
    wire = Wire(chunks)
    return NoiseTransportReadWriter(wire, a), NoiseTransportReadWriter(wire, b), wire


def message_sizes(wire: Wire) -> list[int]:
    sizes, pos = [], 0
    while pos < len(wire.sent):
        n = int.from_bytes(wire.sent[pos:pos + 2], "big")
        sizes.append(n)
        pos += 2 + n
    assert pos == len(wire.sent)
    return sizes


async def read_all(reader, total: int) -> bytes:
    out = bytearray()
    while len(out) < total:
        out.extend(await reader.read_msg())
    return bytes(out)


def test_a_long_message_goes_out_in_one_write_as_valid_noise_messages():
    async def main():
        writer, reader, wire = session()
        payload = bytes(range(256)) * 4096 + b"tail"  # 1 MiB + 4: 17 Noise messages
        await writer.write_msg(payload)
        assert wire.writes == 1
        sizes = message_sizes(wire)
        assert len(sizes) == 17 and max(sizes) <= MSG_LIMIT
        assert sizes[0] == MAX_PLAINTEXT_LENGTH + 16  # full messages, 16-byte tag each
        assert await read_all(reader, len(payload)) == payload

    trio.run(main)


READS = 5_000  # per example: one wire read costs ~20 us of CPU (1-byte reads of 200 KB: 4.2 s)


@st.composite
def messages_and_chunkings(draw) -> tuple[list[int], list[int]]:
    """Message sizes and a read chunking (cycled) that take at most ~READS wire reads:
    small chunks come with small messages (1-byte reads: messages up to 833 bytes; a
    message of several Noise frames, > 65519 bytes, with chunks of ~80 bytes or more on
    average)."""
    chunks = draw(st.lists(st.integers(1, 300_000), min_size=1, max_size=5))
    cap = max(1, min(200_000, READS * sum(chunks) // len(chunks) // 6))
    return draw(st.lists(st.integers(1, cap), min_size=1, max_size=6)), chunks


@settings(max_examples=40, deadline=None)
@given(case=messages_and_chunkings())
def test_any_chunking_of_the_wire_reads_back_the_same_bytes(case):
    sizes, chunks = case

    async def main():
        writer, reader, _ = session(chunks)
        sent = [bytes([i % 251]) * n for i, n in enumerate(sizes)]
        for m in sent:
            await writer.write_msg(m)
        assert await read_all(reader, sum(sizes)) == b"".join(sent)
        with pytest.raises(IncompleteReadError) as end:
            await reader.read_msg()
        assert end.value.is_clean_close  # nothing left half-received

    trio.run(main)


def test_a_stream_cut_inside_a_message_is_an_incomplete_read():
    async def main():
        writer, reader, wire = session()
        await writer.write_msg(b"x" * 100_000)
        del wire.sent[-10:]
        assert await reader.read_msg() == b"x" * MAX_PLAINTEXT_LENGTH  # the whole one
        with pytest.raises(IncompleteReadError) as cut:
            await reader.read_msg()
        assert not cut.value.is_clean_close

    trio.run(main)


def test_a_tampered_message_is_refused_after_the_good_ones_before_it():
    async def main():
        writer, reader, wire = session()
        await writer.write_msg(b"a" * 70_000)  # two messages in one write
        wire.sent[-1] ^= 1  # the second message's tag
        assert await reader.read_msg() == b"a" * MAX_PLAINTEXT_LENGTH
        with pytest.raises(NoiseInvalidMessage):
            await reader.read_msg()
        with pytest.raises(NoiseInvalidMessage):  # still refused, never skipped
            await reader.read_msg()

    trio.run(main)


class PlainSession:
    """The state SecureSession.read uses (a stand-in: building a real SecureSession needs
    a full handshake with peer identities; the real one runs in every libp2p test)."""

    def __init__(self, conn):
        self.conn = conn
        self.low_watermark = self.high_watermark = 0


@settings(max_examples=30, deadline=None)
@given(reads=st.lists(st.integers(1, 150_000), min_size=1, max_size=12))
def test_session_reads_of_any_size_return_exactly_the_bytes_in_order(reads):
    async def main():
        writer, reader, _ = session([70_000, 3, 200_000])
        data = bytes(i % 253 for i in range(sum(reads)))
        await writer.write_msg(data)
        s = PlainSession(reader)
        got = [await noise_io._session_read(s, n) for n in reads]
        assert [len(g) for g in got] == reads
        assert b"".join(got) == data

    trio.run(main)


@settings(max_examples=20, deadline=None)
@given(sizes=st.lists(st.integers(0, 200_000), min_size=1, max_size=5))
def test_sealed_messages_read_back_with_the_noise_librarys_own_calls(sizes):
    """The fast writer (encrypt_into from any buffer kind, one reused output buffer) puts on
    the wire exactly what py-libp2p's own reader accepts, and the fast reader (decrypt_into)
    accepts what py-libp2p's own writer sends: the wire is plain Noise either way."""
    async def main():
        writer, reader, wire = session()
        sent = [bytes([i % 251]) * n for i, n in enumerate(sizes)]
        kinds = (bytes, bytearray, memoryview)
        for i, m in enumerate(sent):
            await writer.write_msg(kinds[i % 3](m))
        got = bytearray()
        while len(got) < sum(sizes):  # py-libp2p's read_msg: one Noise message per call
            got += await original(NoiseTransportReadWriter, "read_msg")(reader)
        assert bytes(got) == b"".join(sent)
        assert all(n <= MSG_LIMIT for n in message_sizes(wire))

        writer, reader, wire = session()
        for m in sent:
            for start in range(0, max(len(m), 1), MAX_PLAINTEXT_LENGTH):
                await original(NoiseTransportReadWriter, "write_msg")(
                    writer, m[start:start + MAX_PLAINTEXT_LENGTH])
        assert await read_all(reader, sum(sizes)) == b"".join(sent)

    trio.run(main)
