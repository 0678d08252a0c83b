"""The per-host and per-connection patches (node/p2p/patches: handlers, autodial,
yamux_buffers, inbound_slots, accept_gate, connected_shield) against plain py-libp2p hosts on loopback: py-libp2p alone still shows each
problem (the patch is still needed), and the patched object behaves."""

from __future__ import annotations

import struct

import pytest
import trio
from libp2p.network.auto_connector import AutoConnector
from libp2p.protocol_muxer.multiselect import MULTISELECT_PROTOCOL_ID, Multiselect
from swarm_node.node.p2p.context import ConnectionNotifee
from swarm_node.node.p2p.patches import (
    accept_gate,
    autodial,
    connected_shield,
    handlers,
    inbound_slots,
    yamux_buffers,
)
from swarm_node.node.p2p.patches.registry import original

from .rawhost import connect, raw_host, running, until

_YAMUX_DATA = struct.Struct("!BBHII")  # version, type 0 = DATA, flags, stream id, length


async def _bad_handler(stream) -> None:
    await stream.read(1)  # (raising before the protocol is confirmed fails the opener)
    raise ValueError("boom")


def test_needed_stream_handler_guard():
    async def main(guard: bool) -> list:
        a, b = raw_host(), raw_host()
        faults: list = []
        async with running(a, b):
            if guard:
                handlers.patch_stream_handlers(a, lambda *fault: faults.append(fault))
            a.set_stream_handler("/bad/1", _bad_handler)
            await connect(b, a)
            for _ in range(2):
                stream = await b.new_stream(a.get_id(), ["/bad/1"])
                await stream.write(b"x")
                n = len(faults)
                await until(lambda n=n: len(faults) > n, what="the fault")
        return faults

    with pytest.raises(BaseExceptionGroup) as ended:  # py-libp2p: the host's run() ends
        trio.run(main, False)
    assert ended.value.subgroup(ValueError) is not None
    faults = trio.run(main, True)  # guarded: counted, and the host serves the next stream
    assert [(p, type(e)) for _, p, e in faults] == [("/bad/1", ValueError)] * 2


class _RemovingOpener:
    """The opener's side of one multiselect negotiation for `protocol`, in memory: as the
    listener confirms the protocol (its await), `remove` runs, as another task of the host
    would (the DHT's switch to client mode removing /ipfs/kad/1.0.0)."""

    def __init__(self, protocol: str, remove):
        self.lines = [MULTISELECT_PROTOCOL_ID, protocol]
        self.protocol, self.remove = protocol, remove

    async def read(self) -> str:
        return self.lines.pop(0)

    async def write(self, line: str) -> None:
        if line == self.protocol:
            self.remove()
        await trio.lowlevel.checkpoint()


class _Stream:
    def __init__(self):
        self.was_reset = False

    async def reset(self) -> None:
        self.was_reset = True


def test_needed_removed_handler_refused():
    async def negotiate(guard: bool):
        mux = Multiselect()
        if guard:
            mux.handlers = handlers.GuardedHandlers(mux.handlers, lambda *fault: None)
        mux.add_handler("/kad/1", _bad_handler)
        opener = _RemovingOpener("/kad/1", lambda: mux.remove_handler("/kad/1"))
        return await mux.negotiate(opener)

    with pytest.raises(KeyError):  # py-libp2p: out of host.run(), the libp2p thread ends
        trio.run(negotiate, False)
    protocol, handler = trio.run(negotiate, True)  # guarded: that one stream is refused
    stream = _Stream()
    trio.run(handler, stream)
    assert (protocol, stream.was_reset) == ("/kad/1", True)


def test_needed_no_auto_connect():
    async def main() -> bool:
        a, b = raw_host(), raw_host()
        async with running(a, b):
            # b is only known (as discovery learns peers), not dialled by us
            a.get_peerstore().add_addrs(b.get_id(), b.get_addrs(), 3600)
            await original(AutoConnector, "maybe_connect")(a.get_network().auto_connector)
            await until(lambda: bool(a.get_network().connections.get(b.get_id())),
                        what="py-libp2p's own dial")
            autodial.patch_auto_connector(a)
            return a.get_network().auto_connector.maybe_connect is autodial._no_auto_connect

    assert trio.run(main)  # py-libp2p dials a known peer beside discovery.py



class _SlowConnectedNotifee(ConnectionNotifee):
    """A notifee whose `connected` waits for `release`: the window in which DCUtR's poll
    already sees the registered connection and cancels the dial that made it."""

    def __init__(self):
        self.entered, self.release = trio.Event(), trio.Event()

    async def connected(self, network, conn) -> None:
        self.entered.set()
        await self.release.wait()


def test_needed_connected_kept_on_cancel():
    async def main(shield: bool) -> tuple[bool, bool]:
        a, b = raw_host(), raw_host()
        a.set_stream_handler("/echo/1", _echo)
        notifee = _SlowConnectedNotifee()
        async with running(a, b):
            if shield:
                connected_shield.patch_connected_shield(b.get_network())
            b.get_network().register_notifee(notifee)
            async with trio.open_nursery() as dials:
                dials.start_soon(connect, b, a)
                await notifee.entered.wait()  # registered, b is telling its notifees
                registered = a.get_id() in b.get_network().connections
                dials.cancel_scope.cancel()  # as _perform_hole_punch once it sees it
                notifee.release.set()
            if a.get_id() not in b.get_network().connections:
                return registered, False
            stream = await b.new_stream(a.get_id(), ["/echo/1"])  # the connection works
            await stream.write(b"ping")
            return registered, await stream.read(4) == b"ping"

    # py-libp2p alone: the cancelled dial closes the connection it had registered
    assert trio.run(main, False) == (True, False)
    assert trio.run(main, True) == (True, True)


async def _echo(stream) -> None:
    await stream.write(await stream.read(4))
    await stream.close()

def _buffered(host, peer) -> int:
    conns = host.get_network().connections.get(peer)
    conn = conns[0] if isinstance(conns, list) else conns
    return sum(len(b) for b in conn.muxed_conn.stream_buffers.values())


async def _push_past_window(a, b, total: int, chunk: int = 64 * 1024) -> None:
    """b writes `total` bytes to a stream a never reads, as raw frames ignoring the window."""
    stream = await b.new_stream(a.get_id(), ["/sink/1"])
    ys = stream.muxed_stream
    frame = _YAMUX_DATA.pack(0, 0, 0, ys.stream_id, chunk) + bytes(chunk)
    for _ in range(total // chunk):
        try:
            await ys.conn._write_frame(frame)
        except Exception:  # noqa: BLE001 - the patched receiver cuts the connection
            return


def test_needed_yamux_receive_window_enforced():
    window = 256 * 1024  # what yamux grants a new stream

    async def main(bound: bool) -> tuple[int, list]:
        a, b = raw_host(), raw_host()
        violations: list = []
        hold = trio.Event()

        async def sink(stream) -> None:  # never reads
            await hold.wait()

        async with running(a, b):
            a.set_stream_handler("/sink/1", sink)
            await connect(b, a)
            await until(lambda: a.get_network().connections.get(b.get_id()), what="conn")
            if bound:
                conns = a.get_network().connections[b.get_id()]
                conn = conns[0] if isinstance(conns, list) else conns
                bounded = yamux_buffers.BoundedBuffers({}, "b", lambda p, n:
                                                       violations.append(n),
                                                       max_stream=2 * window,
                                                       max_conn=4 * window)
                conn.muxed_conn.stream_buffers = bounded
            await _push_past_window(a, b, 8 * window)
            if bound:
                await until(lambda: violations, what="the violation")
            else:
                await until(lambda: _buffered(a, b.get_id()) >= 8 * window, what="buffering")
            held = _buffered(a, b.get_id())
            hold.set()
            return held, violations

    held, _ = trio.run(main, False)
    assert held >= 8 * window  # py-libp2p buffers 8x the window it granted
    held, violations = trio.run(main, True)
    assert violations and held <= 2 * window


def test_needed_inbound_slot_released_on_close():
    async def main(release: bool) -> list[int]:
        a = raw_host()
        if release:
            inbound_slots.patch_inbound_slots(a.get_network())
        borrowed = []
        async with running(a):
            slots = a.get_network()._inbound_limiter
            for _ in range(3):
                b = raw_host()
                async with running(b):
                    await connect(b, a)
                    await until(lambda b=b: a.get_network().connections.get(b.get_id()),
                                what="the connection")
                    await b.disconnect(a.get_id())
                    await until(lambda b=b: not a.get_network().connections.get(b.get_id()),
                                what="the close")
                if release:
                    await until(lambda: slots.borrowed_tokens == 0, what="the slot back")
                borrowed.append(slots.borrowed_tokens)
        return borrowed

    # py-libp2p: each closed connection keeps its slot (250 of them, then no newcomer)
    assert trio.run(main, False) == [1, 2, 3]
    assert trio.run(main, True) == [0, 0, 0]


def test_needed_inbound_gated_at_accept():
    async def main(gated: bool) -> tuple[int, list]:
        a = raw_host()
        asked: list = []

        async def admit(ip, gone) -> bool:  # 2 allowed, then every one refused
            asked.append((ip, gone()))
            return len(asked) <= 2

        inbound_slots.patch_inbound_slots(a.get_network())
        if gated:
            accept_gate.patch_accept_gate(a.get_network(), admit)
        dialers = [raw_host() for _ in range(4)]
        for b in dialers:
            b.get_network().retry_config.max_retries = 0  # one TCP connection per dial
        async with running(a, *dialers):
            for b in dialers:
                with trio.move_on_after(5):
                    try:
                        await connect(b, a)
                    except Exception:  # noqa: BLE001, S110 - a refused dial: counted below
                        pass
            await until(lambda: len(asked) >= 4 if gated else
                        len(a.get_network().connections) == 4, what="every dial answered")
            return len(a.get_network().connections), asked

    # py-libp2p: every accepted TCP connection gets its Noise handshake, nothing asked first
    assert trio.run(main, False) == (4, [])
    n, asked = trio.run(main, True)
    assert n == 2 and len(asked) >= 4 and set(asked) == {("127.0.0.1", False)}
