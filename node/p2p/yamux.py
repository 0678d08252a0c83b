"""Yamux and the Noise layer under it (trio side): the receive-window bound and the bulk
fast paths.

Enforce the yamux receive window (py-libp2p 0.8.1 only logs a violation).

py-libp2p appends every DATA frame to the stream's buffer and, when the peer exceeded the
window it was granted, logs a warning and carries on, so a peer that ignores flow control
fills our memory (384 MiB pushed in 8 s raised a victim's RSS by 386 MiB). Each connection's
`stream_buffers` dict is replaced, as the connection opens, by one whose buffers refuse to
grow past MAX_STREAM_BUFFER per stream or MAX_CONN_BUFFER per connection: the frame is
dropped, the stream marked broken by py-libp2p's own error path, and `on_violation(peer)`
penalises the peer (which cuts the connection).
"""

from __future__ import annotations

import functools
import logging
from collections import deque
from collections.abc import Callable

import libp2p.stream_muxer.yamux.yamux as yamux_mod
import trio
from cryptography.exceptions import InvalidTag
from libp2p.io.exceptions import IncompleteReadError
from libp2p.security.noise.io import MAX_PLAINTEXT_LENGTH, NoiseTransportReadWriter
from libp2p.security.secure_session import SecureSession
from noise.constants import MAX_NONCE
from noise.exceptions import NoiseInvalidMessage, NoiseMaxNonceError

from ...protocol.limits import MAX_CONN_BUFFER, MAX_STREAM_BUFFER

log = logging.getLogger(__name__)


class WindowViolation(Exception):
    """A peer sent more than the receive window allows."""


class BoundedBuffer(bytearray):
    """A yamux stream buffer that raises instead of growing past the limits."""

    owner: BoundedBuffers

    def extend(self, data) -> None:
        n = len(data)
        if len(self) + n > self.owner.max_stream or self.owner.total() + n > self.owner.max_conn:
            self.owner.violated(n)
            raise WindowViolation(f"peer exceeded the receive window by sending {n} bytes "
                                  f"onto {len(self)} buffered")
        super().extend(data)

    def __getitem__(self, key):
        """A slice comes out as bytes, copied once: py-libp2p reads a stream's data as
        `bytes(buffer[:n])`, which copied every received byte twice."""
        if isinstance(key, slice):
            with memoryview(self) as view:
                return bytes(view[key])
        return super().__getitem__(key)


class BoundedBuffers(dict):
    """Stands in for `Yamux.stream_buffers`."""

    def __init__(self, initial: dict, peer: str, on_violation: Callable[[str, int], None], *,
                 max_stream: int = MAX_STREAM_BUFFER, max_conn: int = MAX_CONN_BUFFER):
        super().__init__(initial)
        self.peer = peer
        self.on_violation = on_violation
        self.max_stream = max_stream
        self.max_conn = max_conn
        self.dropped = 0

    def __setitem__(self, stream_id, buf) -> None:
        if not isinstance(buf, BoundedBuffer):
            bounded = BoundedBuffer(buf)
            bounded.owner = self
            buf = bounded
        super().__setitem__(stream_id, buf)

    def total(self) -> int:
        return sum(len(b) for b in list(self.values()))

    def violated(self, n: int) -> None:
        first = self.dropped == 0
        self.dropped += n
        if first:
            log.warning("peer %s ignored the yamux receive window; dropping its data and "
                        "cutting the connection", self.peer)
        self.on_violation(self.peer, n)


def bound_buffers(muxed_conn, peer: str, on_violation: Callable[[str, int], None]) -> bool:
    """Install BoundedBuffers on a yamux connection; False if it is not one we know."""
    buffers = getattr(muxed_conn, "stream_buffers", None)
    if buffers is None or isinstance(buffers, BoundedBuffers):
        return buffers is not None
    bounded = BoundedBuffers({}, peer, on_violation)
    for sid, buf in list(buffers.items()):
        bounded[sid] = buf  # copies: readers look the buffer up again on each read
    muxed_conn.stream_buffers = bounded
    return True


def install_window_update_batching() -> None:
    """Return receive-window credit in batches, go-yamux semantics: one WINDOW_UPDATE once
    half the stream's target window was read, never one per read. Idempotent, per process.

    py-libp2p 0.8.1 sends a WINDOW_UPDATE after every read: by default for the bytes read
    (`PY_YAMUX_RELEASE_ON_READ`), and, with that off, still whenever any credit is owed
    below the half-window threshold (its "partial slack" branch), which is after every
    read but the first. Counted in a client's libp2p thread during an 8-client broadcast:
    160 of the 344 frames it wrote were window updates, for 219 reads. Each is a Noise
    encryption and a socket write here and a frame-loop pass and a decryption at the peer,
    for every small request, gossip RPC and shard stream. Installed with the bulk fast
    paths (`install_bulk_fast_paths`), whose 4 MiB window it grows streams to."""
    if yamux_mod.YamuxStream._auto_tune_and_send_window_update is not _batched_window_update:
        yamux_mod.YamuxStream._auto_tune_and_send_window_update = _batched_window_update


async def _batched_window_update(self, *, bytes_read: int = 0) -> None:
    """After a read of `bytes_read` bytes: grant the credit consumed since the last grant
    if it reached half the target window. The sender always keeps at least half the window
    of credit while we keep reading, so it never waits on us for more than that. A stream
    that has read BULK_AFTER_BYTES moves to the BULK_RECV_WINDOW target (one update);
    short request and gossip streams stay at yamux's 256 KiB and send none."""
    grant = 0
    async with self.window_lock:
        consumed = getattr(self, "_bytes_consumed", 0) + bytes_read
        self._bytes_consumed = consumed
        if consumed >= BULK_AFTER_BYTES and self.target_recv_window < BULK_RECV_WINDOW:
            self.target_recv_window = BULK_RECV_WINDOW
        buffered = len(self.conn.stream_buffers.get(self.stream_id, b""))
        owed = self.target_recv_window - (self.recv_window + buffered)
        if owed > 0 and owed >= self.target_recv_window // 2:
            self.recv_window += owed
            grant = owed
    if grant:
        await self.send_window_update(grant, skip_lock=True)


def freeze_tuning_env() -> None:
    """py-libp2p 0.8.1 reads its PY_YAMUX_* tuning variables from the environment on every
    stream read and window update (os.getenv, several per 64 KiB gossip message per hop:
    ~2% of the CPU of an 8-peer gossip run). Read each once per process instead.
    Idempotent."""
    if isinstance(yamux_mod._py_yamux_env, functools._lru_cache_wrapper):
        return
    yamux_mod._py_yamux_env = functools.lru_cache(maxsize=64)(yamux_mod._py_yamux_env)


def fit_frames_to_noise() -> None:
    """Size yamux frames (12-byte header + payload) as whole Noise messages (65519 bytes of
    plaintext each) and install the bulk fast paths below. py-libp2p 0.8.1 sends 65536-byte
    frames, which its Noise layer splits into a full message and a 17-byte one: every 64 KiB
    of stream data cost two encryptions, two socket writes, and two reads and decryptions
    at the peer. Frames the peer sends are accepted as before. Idempotent, per process."""
    install_bulk_fast_paths()


# Bulk fast paths --------------------------------------------------------------------------
#
# Profiled on one 128 MiB shard stream between two processes: crypto was ~10% of the CPU,
# the rest py-libp2p's Python per 64 KiB: per Noise message a 2-byte socket read for the
# length, more reads for the body, a lock and a send per write; per yamux frame a pass of
# the frame loop, locks, an event, a reader wake-up and a window check. The paths below keep
# the wire format exactly (every Noise message <= 65535 bytes, every yamux frame within the
# peer's window) and cut the per-message work: several Noise messages per socket read and
# per socket write, and frames of up to FRAME_MESSAGES Noise messages.

FRAME_MESSAGES = 17
"""Yamux DATA frames carry up to this many Noise messages (header + payload <= k x 65519
bytes, ~1.06 MiB): one frame-loop pass per MiB instead of per 64 KiB. 17, not 16: a 1 MiB
write (the shard chunk) plus its 12-byte header then fits one frame; at 16 it went out as a
frame of 1 MiB - 272 bytes and one of 272, two frame passes at each end for nothing. Frames
never exceed the send window the peer granted (py-libp2p's writer takes min(window,
frame))."""
NOISE_READ_BYTES = 256 * 1024
"""One socket read takes up to this many bytes of Noise messages."""
NOISE_MAX_PLAINTEXT_PER_READ = 1 << 20
"""At most this much plaintext is decrypted per read_msg call (memory per connection)."""
_LEN2 = 2
_TAG = 16  # ChaCha20-Poly1305 tag
_TX_KEEP = 2 * FRAME_MESSAGES * (MAX_PLAINTEXT_LENGTH + _LEN2 + _TAG)
"""A session keeps its seal buffer up to this size (two full frames)."""


def install_bulk_fast_paths() -> None:
    """Big yamux frames, and Noise reads/writes of several messages per socket call, for
    every connection of this process (gossip included). The wire stays valid Noise + yamux
    for any peer (Noise messages <= 65535 bytes, frames within the granted window; only the
    frame size differs), with fewer Python passes per MiB. Idempotent."""
    yamux_mod.MAX_MESSAGE_SIZE = FRAME_MESSAGES * MAX_PLAINTEXT_LENGTH
    yamux_mod.read_exactly = _read_exactly
    install_window_update_batching()
    if NoiseTransportReadWriter.read_msg is not _read_msgs:
        NoiseTransportReadWriter.read_msg = _read_msgs
        NoiseTransportReadWriter.write_msg = _write_msgs
        SecureSession.read = _session_read
        yamux_mod.Yamux._write_frame = _write_frame


BULK_RECV_WINDOW = 4 * 1024 * 1024
"""Receive window a stream grants once it has read BULK_AFTER_BYTES (yamux starts every
stream at 256 KiB; py-libp2p grows it only when reads come within 4 RTTs, which a loopback
or LAN RTT of ~0.1 ms never allows): a 4 MiB shard then needs two window updates, not 16+
round trips of credit, and frames can be their full ~1 MiB. Bounded: a peer can only send
what we granted, and BoundedBuffers caps what is buffered per stream and connection."""
BULK_AFTER_BYTES = 64 * 1024
"""Bytes a stream reads before it grows to BULK_RECV_WINDOW. Below it (requests, gossip)
the 256 KiB start window is never half consumed, so no WINDOW_UPDATE is sent at all."""


async def _read_exactly(reader, n: int, retry_count: int = 100) -> bytes:
    """py-libp2p's read_exactly (yamux frame headers and bodies) without its two copies of
    every body when one read returns it all (the Noise session reads until it has n)."""
    data = await reader.read(n)
    if len(data) == n:
        return data
    buf = bytearray(data)
    for _ in range(retry_count):
        if len(buf) >= n:
            return bytes(buf)
        more = await reader.read(n - len(buf))
        if not more:
            break
        buf.extend(more)
    if len(buf) >= n:
        return bytes(buf)
    raise IncompleteReadError(f"connection closed: expected {n} bytes, received {len(buf)}",
                              expected_bytes=n, received_bytes=len(buf))


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
        return await _ORIG_READ_MSG(self, prefix_encoded)
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
        return await _ORIG_WRITE_MSG(self, bytes(msg), prefix_encoded)
    out = self.__dict__.get("_swarm_tx")
    if out is None or self.__dict__.get("_swarm_tx_busy"):
        out = bytearray()  # an unserialised second writer gets its own buffer
    self._swarm_tx_busy = True
    try:
        n = _seal(self, msg, out)
        with memoryview(out) as view, view[:n] as sealed:
            await self.read_writer.read_write_closer.write(sealed)
    finally:
        self._swarm_tx_busy = False
    # keep the buffer for the next write, unless a rare huge write made it big
    self._swarm_tx = out if len(out) <= _TX_KEEP else None


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
        return await _ORIG_SESSION_READ(self, n)  # not ours, or bytes left in its buffer
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


async def _write_frame(self, data: bytes) -> None:
    """Yamux._write_frame without decoding every frame's header for a debug line that is
    formatted even when debug logging is off (one struct.unpack, a list and an f-string per
    frame); with debug on, py-libp2p's own method runs."""
    if yamux_mod.logger.isEnabledFor(logging.DEBUG):
        return await _ORIG_WRITE_FRAME(self, data)
    async with self._write_lock:
        await self.secured_conn.write(data)
    await trio.lowlevel.checkpoint()


_ORIG_WRITE_FRAME = yamux_mod.Yamux._write_frame
_ORIG_SESSION_READ = SecureSession.read
_ORIG_READ_MSG = NoiseTransportReadWriter.read_msg
_ORIG_WRITE_MSG = NoiseTransportReadWriter.write_msg
