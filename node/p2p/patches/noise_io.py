"""Patches on the Noise session under yamux: several Noise messages per socket read and per
socket write, and session reads with one copy.

Profiled on one 128 MiB shard stream between two processes: crypto was ~10% of the CPU, the
rest py-libp2p 0.8.1's Python per 64 KiB: per Noise message a 2-byte socket read for the
length, more reads for the body, a lock and a send per write, and in `SecureSession.read`
4-5 copies of each byte (BytesIO, drain, bytearray, bytes). The replacements keep the wire
format exactly (every Noise message <= 65535 bytes) and cut the per-message work:
- `NoiseTransportReadWriter.read_msg` returns the plaintext of every complete message
  already received (after the handshake the session is a byte stream), decrypted straight
  from the receive buffer (`decrypt_into`), reading the socket only when none is complete;
- `NoiseTransportReadWriter.write_msg` seals a write's messages into one reused buffer and
  sends them with one socket write;
- `SecureSession.read` takes exactly n bytes out of the decrypted chunks with one copy.
A sealed write is sent whole even when its caller is cancelled (`_send_whole`): half a Noise
message on the wire loses the connection."""

from __future__ import annotations

from collections import deque

import trio
from cryptography.exceptions import InvalidTag
from libp2p.io.exceptions import IncompleteReadError
from libp2p.network.connection.exceptions import RawConnError
from libp2p.security.noise.io import (
    MAX_PLAINTEXT_LENGTH,
    BaseNoiseMsgReadWriter,
    NoiseTransportReadWriter,
)
from libp2p.security.secure_session import SecureSession
from noise.constants import MAX_NONCE
from noise.exceptions import NoiseInvalidMessage, NoiseMaxNonceError

from .registry import Patch, has_signature, original, register, replace, sets_attribute
from .yamux_frames import FRAME_MESSAGES

BATCHED = register(Patch(
    name="noise_batched_io",
    scope="process",
    targets=("libp2p.security.noise.io:NoiseTransportReadWriter.read_msg",
             "libp2p.security.noise.io:NoiseTransportReadWriter.write_msg"),
    why="one socket read per Noise length prefix and body, one socket write per message",
    upstream="none filed (searched 2026-09)",
    shape=lambda: (has_signature(NoiseTransportReadWriter, "read_msg",
                                 ("self", "prefix_encoded"), coroutine=True)
                   + has_signature(NoiseTransportReadWriter, "write_msg",
                                   ("self", "msg", "prefix_encoded"), coroutine=True)
                   + sets_attribute(BaseNoiseMsgReadWriter, "noise_state")
                   + sets_attribute(BaseNoiseMsgReadWriter, "read_writer")),
    fingerprints={"libp2p.security.noise.io:NoiseTransportReadWriter.read_msg": "664834f466835e3a",
                  "libp2p.security.noise.io:NoiseTransportReadWriter.write_msg": "f3e9bbcedbd59f55"},
))
SESSION_READ = register(Patch(
    name="noise_session_read_one_copy",
    scope="process",
    targets=("libp2p.security.secure_session:SecureSession.read",),
    why="each byte read from a secure session is copied 4-5 times",
    upstream="none filed (searched 2026-09)",
    shape=lambda: (has_signature(SecureSession, "read", ("self", "n"), coroutine=True)
                   + sets_attribute(SecureSession, "low_watermark")
                   + sets_attribute(SecureSession, "high_watermark")),
    fingerprints={"libp2p.security.secure_session:SecureSession.read": "c4dfe7642d33db72"},
))


def install() -> None:
    replace(NoiseTransportReadWriter, "read_msg", _read_msgs)
    replace(NoiseTransportReadWriter, "write_msg", _write_msgs)
    replace(SecureSession, "read", _session_read)


NOISE_READ_BYTES = 256 * 1024
"""One socket read takes up to this many bytes of Noise messages."""
NOISE_MAX_PLAINTEXT_PER_READ = 1 << 20
"""At most this much plaintext is decrypted per read_msg call (memory per connection)."""
_LEN2 = 2
_TAG = 16  # ChaCha20-Poly1305 tag
_TX_KEEP = 2 * FRAME_MESSAGES * (MAX_PLAINTEXT_LENGTH + _LEN2 + _TAG)
"""A session keeps its seal buffer up to this size (two full frames)."""


class _NoiseRx:
    """Received, not yet decrypted bytes of one Noise session."""

    __slots__ = ("buf", "lock", "pos")

    def __init__(self) -> None:
        self.buf = bytearray()
        self.pos = 0
        self.lock = trio.Lock()

    def next_message(self) -> bytes | None:
        """The next complete encrypted message, or None if it has not fully arrived."""
        buf, pos = self.buf, self.pos
        if len(buf) - pos < _LEN2:
            return None
        n = (buf[pos] << 8) | buf[pos + 1]
        end = pos + _LEN2 + n
        if len(buf) < end:
            return None
        self.pos = end
        return bytes(memoryview(buf)[pos + _LEN2:end])

    def complete(self, max_plain: int) -> list[tuple[int, int]]:
        """(start, length) in `buf` of the complete messages from `pos`, as many as hold
        at most `max_plain` bytes of ciphertext (at least one if one is complete); `pos` is
        not moved (the caller moves it past each message it decrypted)."""
        buf, pos, end = self.buf, self.pos, len(self.buf)
        spans: list[tuple[int, int]] = []
        total = 0
        while end - pos >= _LEN2 and (not spans or total < max_plain):
            n = (buf[pos] << 8) | buf[pos + 1]
            if end < pos + _LEN2 + n:
                break
            spans.append((pos + _LEN2, n))
            total += n
            pos += _LEN2 + n
        return spans

    def unread(self, message: bytes) -> None:
        """Put back a message that failed to decrypt (the next call raises again)."""
        self.pos -= _LEN2 + len(message)

    def feed(self, data: bytes) -> None:
        if self.pos:  # drop consumed bytes before appending (keeps the buffer small)
            del self.buf[:self.pos]
            self.pos = 0
        self.buf.extend(data)

    def pending(self) -> int:
        return len(self.buf) - self.pos


async def _read_msgs(self, prefix_encoded: bool = False) -> bytes:
    """NoiseTransportReadWriter.read_msg: the plaintext of every complete message already
    received (up to NOISE_MAX_PLAINTEXT_PER_READ), reading the socket only when none is.
    After the handshake the session is a byte stream, so returning several messages'
    plaintext at once is what a reader of the session expects."""
    if prefix_encoded:
        return await original(NoiseTransportReadWriter, "read_msg")(self, prefix_encoded)
    parts = await _read_parts(self)
    return bytes(parts[0]) if len(parts) == 1 else b"".join(parts)


async def _read_parts(self) -> list[bytes | bytearray]:
    """The plaintexts of the complete messages received (at least one); the socket is read
    only when none is complete. IncompleteReadError at end of stream, as py-libp2p raises."""
    rx = self.__dict__.get("_swarm_rx")
    if rx is None:
        rx = self._swarm_rx = _NoiseRx()
    async with rx.lock:
        while True:
            parts = _decrypt_ready(self, rx)
            if parts:
                return parts
            data = await self.read_writer.read_write_closer.read(NOISE_READ_BYTES)
            if not data:
                left = rx.pending()
                raise IncompleteReadError(
                    f"connection closed with {left} bytes of a Noise message received",
                    expected_bytes=max(left, _LEN2), received_bytes=left)
            rx.feed(data)


def _decrypt_ready(self, rx: _NoiseRx) -> list[bytes | bytearray]:
    """The plaintext of the complete messages in `rx` (up to NOISE_MAX_PLAINTEXT_PER_READ),
    decrypted straight from the receive buffer into one output buffer (`decrypt_into`: no
    copy of each ciphertext, one object per read instead of one per message)."""
    state = self.noise_state.noise_protocol.cipher_state_decrypt
    aead = getattr(state.cipher, "cipher", None)
    if not hasattr(aead, "decrypt_into") or not state.has_key():
        return _decrypt_ready_slow(self, rx)
    spans = rx.complete(NOISE_MAX_PLAINTEXT_PER_READ)
    if not spans:
        return []
    out = bytearray(sum(n for _, n in spans) - _TAG * len(spans))
    dst = memoryview(out)
    src = memoryview(rx.buf)
    pos = 0
    try:
        for start, n in spans:
            if n < _TAG:
                raise NoiseInvalidMessage("Noise message shorter than its tag")
            if state.n >= MAX_NONCE:
                raise NoiseMaxNonceError("Nonce has depleted!")
            try:
                aead.decrypt_into(state.cipher.format_nonce(state.n), src[start:start + n],
                                  None, dst[pos:pos + n - _TAG])
            except InvalidTag:
                raise NoiseInvalidMessage("Failed authentication of message") from None
            state.n += 1
            pos += n - _TAG
            rx.pos = start + n
    except Exception:
        if not pos:
            raise  # nothing decrypted: the caller sees the error (again on every call)
        # deliver what decrypted first; the bad message raises at the next call
    finally:
        src.release()
    dst.release()
    if pos < len(out):
        del out[pos:]
    return [out] if out else []  # bytearray: _Plain.take copies it out once


def _decrypt_ready_slow(self, rx: _NoiseRx) -> list[bytes]:
    parts: list[bytes] = []
    size = 0
    while size < NOISE_MAX_PLAINTEXT_PER_READ:
        message = rx.next_message()
        if message is None:
            break
        try:
            plain = self.decrypt(message)
        except Exception:
            rx.unread(message)  # it raises again on every later call, never skipped
            if parts:  # deliver what decrypted first
                break
            raise
        if plain:
            parts.append(plain)
            size += len(plain)
    return parts


async def _write_msgs(self, msg, prefix_encoded: bool = False) -> None:
    """NoiseTransportReadWriter.write_msg: `msg` (any bytes-like) encrypted into the same
    sequence of <= 65535-byte Noise messages as py-libp2p's, each sealed straight into one
    output buffer (`encrypt_into` on memoryview slices: no copy of the plaintext, no join)
    and sent with one socket write. Callers serialise writes (yamux's write lock), so
    nonces go out in order."""
    if prefix_encoded or not msg:
        return await original(NoiseTransportReadWriter, "write_msg")(self, bytes(msg),
                                                                      prefix_encoded)
    out = self.__dict__.get("_swarm_tx")
    if out is None or self.__dict__.get("_swarm_tx_busy"):
        out = bytearray()  # an unserialised second writer gets its own buffer
    self._swarm_tx_busy = True
    try:
        n = _seal(self, msg, out)
        with memoryview(out) as view, view[:n] as sealed:
            await _send_whole(self.read_writer.read_write_closer, sealed)
    finally:
        self._swarm_tx_busy = False
    # keep the buffer for the next write, unless a rare huge write made it big
    self._swarm_tx = out if len(out) <= _TX_KEEP else None


WRITE_FINISH_S = 5.0
"""How long a sealed write may go on after its caller was cancelled (see _send_whole)."""


async def _send_whole(conn, sealed) -> None:
    """Send `sealed` Noise messages whole. Once sealed, their nonces are spent: a socket
    write cancelled partway (a caller's timeout, the asyncio side of the bridge cancelling)
    leaves half a message on the wire, and the peer then fails the next tag or waits for
    bytes that never come: the connection, and every stream on it, is lost (RESULTS "wan:
    swarm": a 112 s old connection closed on 'Failed authentication of message'). So the
    caller's cancellation waits until the write is done, for at most WRITE_FINISH_S; a write
    still unfinished then closes the connection (it cannot be used after a partial message)
    and raises. Closing the transport (liveness, closing.py) still ends such a write at once."""
    with trio.CancelScope(shield=True) as scope:
        scope.deadline = trio.current_time() + WRITE_FINISH_S
        await conn.write(sealed)
    if scope.cancelled_caught:
        with trio.CancelScope(shield=True), trio.move_on_after(1.0):
            await conn.close()
        raise RawConnError(f"a Noise write unfinished after {WRITE_FINISH_S:g} s "
                           "(connection closed: a partial message cannot be followed)")


def _seal(self, msg, out: bytearray) -> int:
    """u16 length + ciphertext of each <= MAX_PLAINTEXT_LENGTH piece of `msg`, written to
    the start of `out` (grown if needed; the session reuses it, so a 1 MiB write does not
    allocate and fault in 1 MiB of fresh memory); returns the length written. Nonces and the
    nonce limit as in the `noise` library's CipherState.encrypt_with_ad."""
    state = self.noise_state.noise_protocol.cipher_state_encrypt
    aead = getattr(state.cipher, "cipher", None)
    view = memoryview(msg).cast("B")
    size = len(view)
    count = -(-size // MAX_PLAINTEXT_LENGTH)
    total = size + count * (_LEN2 + _TAG)
    if not hasattr(aead, "encrypt_into") or not state.has_key():
        sealed = _seal_slow(self, view)
        out[:] = sealed
        return len(sealed)
    if len(out) < total:
        out.extend(bytes(total - len(out)))
    pos = 0
    with memoryview(out) as dst:  # released even on an error: `out` is reused
        for start in range(0, size, MAX_PLAINTEXT_LENGTH):
            piece = view[start:start + MAX_PLAINTEXT_LENGTH]
            sealed = len(piece) + _TAG
            if state.n >= MAX_NONCE:
                raise NoiseMaxNonceError("Nonce has depleted!")
            dst[pos] = sealed >> 8
            dst[pos + 1] = sealed & 0xFF
            aead.encrypt_into(state.cipher.format_nonce(state.n), piece, None,
                              dst[pos + _LEN2:pos + _LEN2 + sealed])
            state.n += 1
            pos += _LEN2 + sealed
    return pos


def _seal_slow(self, view: memoryview) -> bytearray:
    """`_seal` through the `noise` library's own calls (a cipher without encrypt_into)."""
    out = bytearray()
    for start in range(0, len(view), MAX_PLAINTEXT_LENGTH):
        sealed = self.encrypt(bytes(view[start:start + MAX_PLAINTEXT_LENGTH]))
        out += len(sealed).to_bytes(_LEN2, "big")
        out += sealed
    return out


class _Plain:
    """Decrypted bytes of one session not yet read: the chunks as decrypted, so that a
    read of n bytes costs one copy (py-libp2p's SecureSession copies each byte 4-5 times:
    BytesIO, drain, bytearray, bytes)."""

    __slots__ = ("chunks", "off", "size")

    def __init__(self) -> None:
        self.chunks: deque[bytes | bytearray] = deque()
        self.off = 0  # read offset into chunks[0]
        self.size = 0

    def put(self, parts: list[bytes | bytearray]) -> None:
        self.chunks.extend(parts)
        self.size += sum(len(p) for p in parts)

    def take(self, n: int) -> bytes:
        """Exactly n <= size bytes."""
        first = self.chunks[0]
        if self.off == 0 and n == len(first):
            self.chunks.popleft()
            self.size -= n
            return bytes(first)  # no copy if it is bytes already
        pieces: list[memoryview] = []
        need = n
        while need:
            first = self.chunks[0]
            avail = len(first) - self.off
            if avail <= need:
                pieces.append(memoryview(first)[self.off:])
                self.chunks.popleft()
                self.off = 0
                need -= avail
            else:
                pieces.append(memoryview(first)[self.off:self.off + need])
                self.off += need
                need = 0
        self.size -= n
        return b"".join(pieces)


async def _session_read(self, n: int | None = None) -> bytes:
    """SecureSession.read over a Noise session: exactly n bytes (n None: what is there, or
    the next messages), like py-libp2p's, with one copy per read."""
    if (not isinstance(self.conn, NoiseTransportReadWriter)
            or self.low_watermark != self.high_watermark):
        # not ours, or bytes left in its own buffer: py-libp2p's read
        return await original(SecureSession, "read")(self, n)
    if n == 0:
        return b""
    plain = self.__dict__.get("_swarm_plain")
    if plain is None:
        plain = self._swarm_plain = _Plain()
    if n is None:
        if not plain.size:
            plain.put(await _read_parts(self.conn))
        return plain.take(plain.size)
    while plain.size < n:
        plain.put(await _read_parts(self.conn))
    return plain.take(n)

