"""Streams and request/response (the request/response seam of P2PNode): handler
installation that completes once the handler is live, inbound byte budgets, per-peer
slots. Methods named `_t_*` run in the libp2p (trio) thread."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import trio
from libp2p.peer.id import ID

from .context import HostContext
from .errors import RequestError, StreamError
from .streams import (
    AsyncStream,
    PeerSlots,
    client_request,
    close_quietly,
    remote_peer,
    reset_quietly,
    serve_request,
)

log = logging.getLogger(__name__)

StreamHandler = Callable[[str, AsyncStream], Awaitable[None]]
RequestHandler = Callable[[str, bytes], Awaitable[bytes]]


class RequestService:
    """Stream and request handlers of one P2PNode, and its outgoing requests."""

    def __init__(self, ctx: HostContext):
        self.ctx = ctx
        self.cfg = cfg = ctx.cfg
        self.metrics = ctx.metrics
        self.bridge = ctx.bridge
        self._stream_handlers: dict[str, tuple[StreamHandler, int]] = {}
        self._request_handlers: dict[str, RequestHandler] = {}
        self._client_slots: dict[str, asyncio.Semaphore] = {}
        self._server_slots = PeerSlots(cfg.max_requests_per_peer)
        self._stream_slots = PeerSlots(cfg.max_streams_per_peer)

    def t_install_all(self) -> None:
        """At start, in the libp2p thread: install the handlers set before it."""
        for pid, (h, limit) in self._stream_handlers.items():
            self._t_install_stream_handler(pid, h, limit)
        for pid in self._request_handlers:
            self._t_install_request_handler(pid)

    def set_stream_handler(self, protocol_id: str, handler: StreamHandler, *,
                           max_inbound: int | None = None) -> Awaitable[None]:
        """`await handler(peer_id, stream)` for each inbound stream on `protocol_id`; the
        stream is closed when the handler returns. The peer may send at most `max_inbound`
        bytes per stream (default `p2p.max_request_bytes`); more breaks the stream.
        Returns an awaitable that completes once the handler is live (at once before
        start: start() installs it before it returns)."""
        limit = self.cfg.max_request_bytes if max_inbound is None else max_inbound
        self._stream_handlers[protocol_id] = (handler, limit)
        return self._install(self._t_install_stream_handler, protocol_id, handler, limit)

    def _install(self, fn, *args) -> Awaitable[None]:
        if not self.ctx.running:
            return _LIVE  # start() installs it before it returns

        async def install() -> None:
            fn(*args)

        return self.ctx.spawn(self.bridge.call(install), "install handler")

    def _t_install_stream_handler(self, protocol_id: str, handler: StreamHandler,
                                  max_inbound: int) -> None:
        async def on_stream(stream) -> None:
            peer = remote_peer(stream)
            if not self.ctx.allowed(peer) or not self._stream_slots.try_take(peer):
                self.metrics.inc("streams_refused")
                await reset_quietly(stream)
                return
            try:
                await self.bridge.to_asyncio(
                    handler, peer, AsyncStream(self.bridge, stream, peer, protocol_id,
                                               max_inbound=max_inbound))
            except Exception as e:  # noqa: BLE001 - counted; the stream is reset
                self.metrics.inc("stream_handler_errors")
                log.info("stream handler %s for %s failed: %s: %s", protocol_id, peer,
                         type(e).__name__, e)
                await reset_quietly(stream)
                return
            finally:
                self._stream_slots.give(peer)
            await close_quietly(stream)

        self.ctx.host.set_stream_handler(protocol_id, on_stream)

    async def open_stream(self, peer_id: str, protocol_id: str,
                          timeout: float | None = None) -> AsyncStream:
        timeout = self.cfg.request_timeout_s if timeout is None else timeout
        stream = await self.bridge.call(self._t_open_stream, ID.from_base58(peer_id),
                                         protocol_id, timeout)
        return AsyncStream(self.bridge, stream, peer_id, protocol_id)

    async def _t_open_stream(self, peer: ID, protocol_id: str, timeout: float):
        try:
            with trio.fail_after(timeout):
                return await self.ctx.host.new_stream(peer, [protocol_id])
        except trio.TooSlowError:
            raise StreamError(f"opening {protocol_id} to {peer} timed out after {timeout:.0f}s",
                              reason="timeout") from None
        except Exception as e:
            raise StreamError(f"cannot open {protocol_id} to {peer}: {type(e).__name__}: {e}",
                              reason="open_failed") from e

    def set_request_handler(self, protocol_id: str, handler: RequestHandler) -> Awaitable[None]:
        """`await handler(peer_id, request_bytes) -> response_bytes`; a raised exception is
        sent back as an error response (and the stream closed). Sizes and per-peer
        concurrency are limited by config. Returns an awaitable that completes once the
        handler is live."""
        self._request_handlers[protocol_id] = handler
        return self._install(self._t_install_request_handler, protocol_id)

    def _t_install_request_handler(self, protocol_id: str) -> None:
        async def on_stream(stream) -> None:
            peer = remote_peer(stream)
            if not self.ctx.allowed(peer):
                self.metrics.inc("streams_refused")
                await reset_quietly(stream)
                return
            await serve_request(self.bridge, stream, self._request_handlers[protocol_id],
                                slots=self._server_slots, timeout=self.cfg.request_timeout_s,
                                max_request=self.cfg.max_request_bytes,
                                max_response=self.cfg.max_response_bytes, metrics=self.metrics)

        self.ctx.host.set_stream_handler(protocol_id, on_stream)

    async def request(self, peer_id: str, protocol_id: str, payload: bytes,
                      timeout: float | None = None, *, max_response: int | None = None,
                      first_answer: float | None = None) -> bytes:
        """Send one framed request and return the response body. RequestError.reason is one
        of timeout, open_failed, too_large, busy, remote_error, no_handler, eof, reset.
        `first_answer`: seconds within which the response must begin once the request has
        one of the peer's request slots (else `timeout`)."""
        timeout = self.cfg.request_timeout_s if timeout is None else timeout
        max_response = self.cfg.max_response_bytes if max_response is None else max_response
        slots = self._client_slots.get(peer_id)
        if slots is None:
            slots = self._client_slots[peer_id] = asyncio.Semaphore(self.cfg.max_requests_per_peer)
        async with slots:
            self.metrics.inc("requests_sent")
            try:
                return await self.bridge.call(
                    _client_request_kw, self.ctx.host, ID.from_base58(peer_id), protocol_id,
                    bytes(payload), timeout, max_response, first_answer)
            except RequestError:
                self.metrics.inc("requests_failed")
                raise


class _Live:
    """Awaitable that is already done: a handler set before start() is live once start()
    returns."""

    def __await__(self):
        return iter(())


_LIVE = _Live()


async def _client_request_kw(host, peer, protocol_id, payload, timeout, max_response,
                             first_answer):
    return await client_request(host, peer, protocol_id, payload, timeout=timeout,
                                max_response=max_response, first_answer=first_answer)
