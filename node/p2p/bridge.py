"""The trio <-> asyncio bridge: py-libp2p runs under `trio.run` in its own thread.

Calls cross the thread boundary without blocking either event loop:
- asyncio -> trio: `await bridge.call(async_fn, *args)` schedules the function in the trio
  thread's nursery with `TrioToken.run_sync_soon` and awaits an asyncio future that the trio
  task resolves with `loop.call_soon_threadsafe`. Cancelling the asyncio caller cancels the
  trio task.
- trio -> asyncio: `await bridge.to_asyncio(coro_fn, *args)` (called in the trio thread)
  runs a coroutine on the asyncio loop and waits for it on a trio Event.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from .errors import NotRunning

log = logging.getLogger(__name__)


class TrioBridge:
    """Owns one thread running `trio.run(body)`; `body(started)` must call
    `started(nursery)` once it is ready to accept calls into `nursery`, then return when
    `stop_event` (a trio.Event, available inside body as `bridge.stop_event`) is set."""

    def __init__(self, name: str = "p2p-trio"):
        self.name = name
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._nursery: trio.Nursery | None = None
        self.stop_event: trio.Event | None = None
        self._ready: asyncio.Future | None = None
        self._done: asyncio.Future | None = None
        self.shutdown_errors: list[str] = []
        self.running = False
        self.stop_requested = False
        # Called on the asyncio loop with one line of text if the thread ends on its own.
        self.on_death: Callable[[str], None] | None = None

    # Lifecycle ------------------------------------------------------------------------

    async def start(self, body: Callable[[Callable[[trio.Nursery], None]], Awaitable[None]]
                    ) -> None:
        self._loop = asyncio.get_running_loop()
        self._ready = self._loop.create_future()
        self._done = self._loop.create_future()
        self._thread = threading.Thread(target=self._thread_main, args=(body,),
                                        name=self.name, daemon=True)
        self._thread.start()
        await asyncio.shield(self._ready)

    def _thread_main(self, body) -> None:
        error: BaseException | None = None
        try:
            trio.run(self._main, body)
        except BaseException as e:  # noqa: BLE001 - reported to the asyncio side below
            error = e
        finally:
            self.running = False
            self._nursery = None
            loop = self._loop
            if loop is not None and not loop.is_closed():
                try:
                    loop.call_soon_threadsafe(self._finish, error)
                except RuntimeError:  # loop closed meanwhile
                    pass

    def _finish(self, error: BaseException | None) -> None:
        if not self._ready.done():
            if error is None:
                error = NotRunning("the libp2p host stopped before it was ready")
            self._ready.set_exception(error)
        elif not self.stop_requested and self.on_death is not None:
            self.on_death(_describe(error) if error is not None
                          else "it returned without being stopped")  # the owner logs it
        elif error is not None:
            self.shutdown_errors.append(f"{type(error).__name__}: {error}")
            log.warning("libp2p thread ended with %s: %s", type(error).__name__, error)
        if not self._done.done():
            self._done.set_result(None)

    async def _main(self, body) -> None:
        self._token = trio.lowlevel.current_trio_token()
        self.stop_event = trio.Event()

        def started(nursery: trio.Nursery) -> None:
            self._nursery = nursery
            self.running = True
            self._loop.call_soon_threadsafe(_set_result_if_pending, self._ready, None)

        await body(started)

    async def stop(self, timeout: float = 10.0) -> None:
        """Ask body to return, then wait for the thread to end (joined, never left behind)."""
        self.stop_requested = True
        if self._thread is None:
            return
        token = self._token
        if token is not None and self.stop_event is not None:
            try:
                token.run_sync_soon(self.stop_event.set)
            except trio.RunFinishedError:
                pass
        try:
            async with asyncio.timeout(timeout):
                await asyncio.shield(self._done)
        except TimeoutError:
            log.warning("libp2p thread did not stop within %.0fs", timeout)
        await asyncio.to_thread(self._thread.join, timeout)
        if self._thread.is_alive():
            self.shutdown_errors.append("libp2p thread still alive after stop")
        self._thread = None

    # asyncio -> trio -----------------------------------------------------------------

    async def call(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> Any:
        """Run `await fn(*args)` in the trio thread; return its result or raise its error."""
        if not self.running or self._nursery is None or self._token is None:
            raise NotRunning("the libp2p host is not running")
        loop = self._loop
        fut: asyncio.Future = loop.create_future()
        scope_box: list[trio.CancelScope] = []
        nursery = self._nursery

        async def runner() -> None:
            with trio.CancelScope() as scope:
                scope_box.append(scope)
                if fut.cancelled():
                    return
                try:
                    result = await fn(*args)
                except BaseException as e:
                    if _is_cancellation(e):
                        loop.call_soon_threadsafe(_set_exception_if_pending, fut,
                                                  NotRunning("the libp2p host is closing"))
                        raise
                    loop.call_soon_threadsafe(_set_exception_if_pending, fut, e)
                    return
                loop.call_soon_threadsafe(_set_result_if_pending, fut, result)
            if scope.cancelled_caught:
                loop.call_soon_threadsafe(_set_exception_if_pending, fut,
                                          NotRunning("the libp2p host is closing"))

        def spawn() -> None:
            try:
                nursery.start_soon(runner)
            except RuntimeError as e:  # nursery closed: shutting down
                loop.call_soon_threadsafe(
                    _set_exception_if_pending, fut, NotRunning(f"the libp2p host is closing ({e})"))

        try:
            self._token.run_sync_soon(spawn)
        except trio.RunFinishedError:
            raise NotRunning("the libp2p host is not running") from None
        try:
            return await fut
        except asyncio.CancelledError:
            if scope_box:
                try:
                    self._token.run_sync_soon(scope_box[0].cancel)
                except trio.RunFinishedError:
                    pass
            raise

    def call_soon(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run the synchronous `fn(*args)` in the trio thread soon (fire and forget)."""
        if self._token is None:
            raise NotRunning("the libp2p host is not running")
        try:
            self._token.run_sync_soon(fn, *args)
        except trio.RunFinishedError:
            raise NotRunning("the libp2p host is not running") from None

    # trio -> asyncio -----------------------------------------------------------------

    async def to_asyncio(self, coro_fn: Callable[..., Awaitable[Any]], *args: Any) -> Any:
        """Called in the trio thread: run `await coro_fn(*args)` on the asyncio loop."""
        loop = self._loop
        if loop is None or loop.is_closed():
            raise NotRunning("the asyncio loop is gone")
        cfut: concurrent.futures.Future = asyncio.run_coroutine_threadsafe(coro_fn(*args), loop)
        done = trio.Event()
        token = self._token

        def wake(_f) -> None:
            try:
                token.run_sync_soon(done.set)
            except trio.RunFinishedError:
                pass

        cfut.add_done_callback(wake)
        try:
            await done.wait()
        except trio.Cancelled:
            cfut.cancel()
            raise
        return cfut.result()

    def to_asyncio_nowait(self, fn: Callable[..., Any], *args: Any) -> None:
        """Called in the trio thread: run the synchronous `fn(*args)` on the asyncio loop."""
        loop = self._loop
        if loop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(fn, *args)
            except RuntimeError:
                pass


def _describe(error: BaseException) -> str:
    """The root error of a (possibly grouped, possibly wrapped) exception, one line: trio
    wraps what broke its run in TrioInternalError, the cause is what an operator needs."""
    for _ in range(32):  # bounded: cause chains can loop
        if isinstance(error, BaseExceptionGroup) and error.exceptions:
            error = error.exceptions[0]
        elif error.__cause__ is not None:
            error = error.__cause__
        elif error.__context__ is not None and not error.__suppress_context__:
            error = error.__context__
        else:
            break
    return f"{type(error).__name__}: {error}"


def _is_cancellation(e: BaseException) -> bool:
    """trio.Cancelled, or a group of nothing else: py-libp2p's nurseries (e.g. stream-open
    notifications) wrap the cancellation of a closing host in an exception group, which
    reached the asyncio caller as a non-P2PError (test_close_under_load_is_clean, 1 in ~3
    runs under load)."""
    if isinstance(e, BaseExceptionGroup):
        return bool(e.exceptions) and all(_is_cancellation(x) for x in e.exceptions)
    return isinstance(e, trio.Cancelled)


def _set_result_if_pending(fut: asyncio.Future, value: Any) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception_if_pending(fut: asyncio.Future, error: BaseException) -> None:
    if not fut.done():
        fut.set_exception(error)

