"""The pubsub fast paths of node/p2p/patches as units: the buffered RPC reader over untrusted bytes,
the O(1) validation cache, the signed-record memo. (The real path runs in every gossip test.)"""

from __future__ import annotations

import pytest
from libp2p.exceptions import ParseError
from libp2p.io.exceptions import IncompleteReadError, MessageTooLarge
from libp2p.pubsub.pubsub import ValidationResult
from libp2p.utils.varint import encode_varint_prefixed
from swarm_node.node.p2p.patches.records import _memo_outgoing
from swarm_node.node.p2p.patches.rpc_reader import read_rpc
from swarm_node.node.p2p.patches.validation_cache import ValidationCache


class ChunkedStream:
    """Serves `data` in reads of at most `step` bytes (and at most what was asked)."""

    def __init__(self, data: bytes, step: int):
        self.data = data
        self.step = step
        self.asked: list[int] = []

    async def read(self, n: int) -> bytes:
        self.asked.append(n)
        out, self.data = self.data[:min(n, self.step)], self.data[min(n, self.step):]
        return out


@pytest.mark.parametrize("step", [1, 7, 300, 1 << 20])
async def test_rpcs_come_out_whole_however_the_bytes_arrive(step):
    rpcs = [b"", b"a", bytes(range(256)) * 3, b"x" * 70000]
    stream = ChunkedStream(b"".join(encode_varint_prefixed(r) for r in rpcs), step)
    assert [await read_rpc(stream, 1 << 20) for _ in rpcs] == rpcs
    with pytest.raises(IncompleteReadError):
        await read_rpc(stream, 1 << 20)


async def test_oversized_length_is_refused_before_the_body_is_read():
    stream = ChunkedStream(encode_varint_prefixed(b"y" * 5000), step=3)
    with pytest.raises(MessageTooLarge):
        await read_rpc(stream, 4096)
    assert len(stream.data) > 4990  # refused on the length prefix: the body was not read


async def test_overlong_varint_and_short_end_are_errors():
    with pytest.raises(ParseError):
        await read_rpc(ChunkedStream(b"\xff" * 11, step=4), 1 << 20)
    with pytest.raises(IncompleteReadError):
        await read_rpc(ChunkedStream(encode_varint_prefixed(b"z" * 100)[:50], step=64), 1000)


def test_validation_cache_keeps_the_newest_and_expires():
    cache = ValidationCache(ttl=60, max_size=3)
    results = {i: ValidationResult(is_valid=i % 2 == 0, timestamp=1e12) for i in range(5)}
    for i in range(4):
        cache.put(bytes([i]), results[i])
    assert cache.get(b"\x00") is None and cache.get(b"\x03") is results[3]
    cache.get(b"\x01")  # used: kept over 2
    cache.put(b"\x04", results[4])
    assert cache.get(b"\x02") is None and cache.get(b"\x01") is results[1]
    cache.put(b"\x05", ValidationResult(is_valid=True, timestamp=0.0))
    assert cache.get(b"\x05") is None  # past its ttl
    cache.clear_expired()
    assert len(cache.cache) <= 3


class FakeHost:
    def __init__(self, record: bytes):
        self.record = record


def test_outgoing_record_memo_never_serves_a_closed_hosts_record():
    # Keyed by id(host), a host that got a closed host's id sent that host's signed record,
    # and peers then dropped every RPC of it (a CI flake: gossip from a restarted node lost).
    memo = _memo_outgoing(lambda host: (host.record, False))
    old = FakeHost(b"old")
    assert memo(old) == (b"old", False)
    old_id = id(old)
    del old
    new = next((h for h in (FakeHost(b"new") for _ in range(1000)) if id(h) == old_id), None)
    if new is None:
        pytest.skip("the interpreter did not reuse the closed host's id")
    assert memo(new)[0] == b"new"
