"""One TLS connection of the bulk plane, either side (`BulkConn`).

Small reads and writes (frames, requests, headers) run in the event loop on the
non-blocking socket; large bodies leave it: `receive_into` (a shard body into a sink:
hash + pwrite), `sendfile` (a shard from disk) and writes of 64 KiB or more run in a
worker thread on the blocking socket, where OpenSSL encrypts and decrypts with the GIL
released (profiled on the old plain-TCP plane: buffering through asyncio streams and a
thread hop per chunk were most of a client's CPU). An operation that is cancelled shuts
the socket down, which ends its thread at once; the connection is then unusable.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import socket
import ssl
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from .errors import BulkError

THREAD_WRITE_MIN = 64 * 1024  # writes at least this large go to a worker thread
BACKSTOP_TIMEOUT_S = 600.0  # socket timeout of a thread operation the caller bounds itself


def _name_native_thread(name: bytes) -> Callable[[], None]:
    """Give the OS thread a name (top -H, perf and /proc show it; Python 3.11 does not)."""
    def init() -> None:
        try:
            ctypes.CDLL(None).prctl(15, name)  # PR_SET_NAME; Linux only, harmless elsewhere
        except (OSError, AttributeError):
            pass
    return init


# Receiving and sending threads are separate pools: uploads a slow reader holds must never
# make our own downloads wait for a thread.
_RECV_POOL = ThreadPoolExecutor(max_workers=32, thread_name_prefix="bulk-rx",
                                initializer=_name_native_thread(b"bulk-rx"))
_SEND_POOL = ThreadPoolExecutor(max_workers=64, thread_name_prefix="bulk-tx",
                                initializer=_name_native_thread(b"bulk-tx"))


class RxStats:
    """recv calls and body bytes of the receiving threads, for the connections of one
    client (its /metrics counters; the benchmark's bytes-per-call figure)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.calls = 0
        self.bytes = 0

    def add(self, calls: int, n: int) -> None:
        with self._lock:
            self.calls += calls
            self.bytes += n

    def as_dict(self) -> dict[str, int]:
        return {"calls": self.calls, "bytes": self.bytes}


def _broken(e: BaseException, what: str) -> BulkError:
    if isinstance(e, TimeoutError | socket.timeout):
        return BulkError(f"{what}: timed out", reason="timeout")
    if isinstance(e, ssl.SSLError) and not isinstance(e, ssl.SSLEOFError):
        # a record that fails its MAC: someone on the path changed bytes
        return BulkError(f"{what}: TLS error {e.reason or e}", reason="tls_error")
    return BulkError(f"{what}: {type(e).__name__}: {e}", reason="broken")


class BulkConn:
    """A TLS connection, authenticated both ways (cert.py, hello.py) once handed out.
    `peer` is the other side's peer id, `kind` the request kind it carries."""

    def __init__(self, sock: ssl.SSLSocket, peer: str = "", kind: str = "",
                 rx: RxStats | None = None):
        self.sock = sock
        self.peer, self.kind = peer, kind
        self.rx = rx  # where body reads are counted (the client's), if anywhere
        self.loop = asyncio.get_running_loop()
        self.last_used = time.monotonic()
        self._op: asyncio.Future | None = None  # a thread operation in progress or ended
        self._waiter: asyncio.Future | None = None  # an event-loop wait for the socket
        self._watch: tuple[int, bool] | None = None  # (fd, writable) registered for it
        self._read_wait_since: float | None = None  # waiting for bytes to read since
        self._closed = False
        # before each read of the server side: False closes the connection (a ban)
        self.check: Callable[[], bool] | None = None
        # set by a client pool: after `reusable()`, close() hands the connection back
        self.release: Callable[[BulkConn], None] | None = None
        self._reusable = False
        self.idle_since = 0.0
        self.reused = False

    # Event-loop I/O (small frames) -----------------------------------------------------

    async def _wait(self, writable: bool) -> None:
        fd = self.sock.fileno()
        if fd < 0:
            raise BulkError("connection closed", reason="broken")
        fut = self._waiter = self.loop.create_future()
        add = self.loop.add_writer if writable else self.loop.add_reader
        add(fd, lambda: fut.done() or fut.set_result(None))
        self._watch = (fd, writable)
        try:
            await fut
        finally:
            self._unwatch()

    def _unwatch(self) -> None:
        if self._watch is not None:
            fd, writable = self._watch
            self._watch = None
            (self.loop.remove_writer if writable else self.loop.remove_reader)(fd)

    async def handshake(self) -> None:
        """The TLS handshake (either side), in the event loop."""
        while True:
            try:
                self.sock.do_handshake()
                return
            except ssl.SSLWantReadError:
                await self._wait(False)
            except ssl.SSLWantWriteError:
                await self._wait(True)
            except (OSError, ValueError) as e:
                raise _broken(e, "TLS handshake") from None

    def _allowed(self) -> None:
        if self.check is not None and not self.check():
            self.abort()
            raise BulkError(f"{self.peer} is refused (banned or cut)", reason="refused")

    def idle_for(self) -> float:
        """Seconds this connection has been waiting for bytes to read (on a server: for the
        next request), 0 while it works."""
        since = self._read_wait_since
        return 0.0 if since is None else time.monotonic() - since

    async def read(self, n: int) -> bytes:
        """Up to `n` bytes; b"" at the end of the stream. On a server, the peer is asked
        to be still allowed once bytes arrived (a ban closes it at its next request)."""
        self.last_used = time.monotonic()
        while True:
            try:
                data = self.sock.recv(n)
                self._read_wait_since = None
                if data:
                    self._allowed()
                return data
            except ssl.SSLWantReadError:
                if self._read_wait_since is None:
                    self._read_wait_since = time.monotonic()
                await self._wait(False)
            except ssl.SSLWantWriteError:
                await self._wait(True)
            except ssl.SSLZeroReturnError:
                self._read_wait_since = None
                return b""
            except (OSError, ValueError) as e:
                self._read_wait_since = None
                raise _broken(e, "read") from None

    async def readexactly(self, n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            part = await self.read(n - len(buf))
            if not part:
                raise asyncio.IncompleteReadError(bytes(buf), n)
            buf += part
        return bytes(buf)

    async def write(self, data: bytes) -> None:
        if len(data) >= THREAD_WRITE_MIN:
            await self._in_thread(_SEND_POOL, self._send_all, memoryview(data))
            return
        view = memoryview(data)
        while view:
            try:
                view = view[self.sock.send(view):]
            except ssl.SSLWantWriteError:
                await self._wait(True)
            except ssl.SSLWantReadError:
                await self._wait(False)
            except (OSError, ValueError) as e:
                raise _broken(e, "write") from None

    # Thread I/O (bodies) ---------------------------------------------------------------

    async def _in_thread(self, pool: ThreadPoolExecutor, fn, *args) -> None:
        self._op = self.loop.run_in_executor(pool, fn, *args)
        try:
            await asyncio.shield(self._op)
        except asyncio.CancelledError:
            self._shutdown()
            # the thread ends with an error nobody awaits: not one to log
            self._op.add_done_callback(lambda f: f.cancelled() or f.exception())
            raise
        finally:
            if self._op.done() and self.sock.fileno() >= 0:
                self.sock.setblocking(False)

    def _send_all(self, view: memoryview) -> None:
        self.sock.settimeout(BACKSTOP_TIMEOUT_S)
        try:
            self.sock.sendall(view)
        except (OSError, ValueError) as e:
            raise _broken(e, "write") from None

    async def sendfile(self, path, offset: int, count: int, chunk: int = 1 << 20) -> None:
        """`count` bytes of the file at `offset`, read and encrypted in a worker thread.
        The caller bounds the time (cancelling shuts the connection down)."""
        await self._in_thread(_SEND_POOL, self._send_file, path, offset, count, chunk)

    def _send_file(self, path, offset: int, count: int, chunk: int) -> None:
        self.sock.settimeout(BACKSTOP_TIMEOUT_S)
        buf = bytearray(min(chunk, count))
        fd = os.open(path, os.O_RDONLY)
        try:
            left = count
            while left > 0:
                k = os.preadv(fd, [memoryview(buf)[:min(len(buf), left)]], offset)
                if k <= 0:
                    raise BulkError(f"{path} ended {left} bytes early", reason="short_file")
                try:
                    self.sock.sendall(memoryview(buf)[:k])
                except (OSError, ValueError) as e:
                    raise _broken(e, "write") from None
                offset += k
                left -= k
        finally:
            os.close(fd)

    async def receive_into(self, n: int, sink: Callable[[memoryview], None],
                           chunk_timeout: float, chunk_size: int) -> None:
        """Exactly `n` body bytes into `sink`, `chunk_size` at a time, in a worker thread.
        BulkError (reason timeout: nothing for `chunk_timeout`; short_read; tls_error);
        what `sink` raises passes through."""
        await self._in_thread(_RECV_POOL, self._receive, n, sink, chunk_timeout, chunk_size)

    def _receive(self, n: int, sink, chunk_timeout: float, chunk_size: int) -> None:
        self.sock.settimeout(chunk_timeout)
        buf = memoryview(bytearray(min(chunk_size, n)))
        left, calls = n, 0
        while left > 0:
            want, got = min(len(buf), left), 0
            while got < want:  # a TLS record is at most 16 KiB: fill the chunk first
                calls += 1
                try:
                    k = self.sock.recv_into(buf[got:want])
                except (OSError, ValueError) as e:
                    err = _broken(e, f"body with {left - got} bytes left")
                    if err.reason == "broken":
                        err.reason = "short_read"
                    raise err from None
                if not k:
                    raise BulkError(f"stream ended with {left - got} bytes left",
                                    reason="short_read")
                got += k
            sink(buf[:got])
            left -= got
        if self.rx is not None:
            self.rx.add(calls, n)

    # Life ------------------------------------------------------------------------------

    def alive(self) -> bool:
        """Open with nothing unread (a peek that does not block): a connection the other
        side closed (its close_notify is bytes nobody asked for) reads as dead."""
        if self._closed or self.sock.fileno() < 0 or self.sock.pending():
            return False
        try:
            socket.socket.recv(self.sock, 1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except BlockingIOError:
            return True
        except OSError:
            return False
        return False

    def reusable(self) -> None:
        """The last response was read completely: the connection may carry another."""
        self._reusable = self.release is not None

    def _shutdown(self) -> None:
        try:  # the plain socket's shutdown (no TLS alert): ends a thread blocked on it
            socket.socket.shutdown(self.sock, socket.SHUT_RDWR)
        except OSError:
            pass

    def abort(self) -> None:
        """Close now (from the event loop), whatever is in progress."""
        if self._closed:
            return
        self._closed = True
        self._unwatch()  # before the fd closes (its number may be reused at once)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_exception(BulkError("connection closed", reason="broken"))
        op = self._op
        if op is not None and not op.done():
            self._shutdown()
            op.add_done_callback(lambda _: self.sock.close())
            return
        self.sock.close()

    discard = abort  # what a pool calls on an idle connection it drops

    async def close(self) -> None:
        if self._closed:
            return
        op = self._op
        if (self._reusable and (op is None or (op.done() and not op.cancelled()
                                               and op.exception() is None))):
            self._reusable = False
            self._op = None
            self.idle_since = time.monotonic()
            self.release(self)
            return
        self.abort()

    async def reset(self) -> None:
        self.abort()
