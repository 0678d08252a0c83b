"""The hivemind side of a trainer group: a child process of the trainer (group.py).

hivemind and py-libp2p cannot be imported into one Python process (both register the protobuf
symbol `crypto.pb.KeyType`), so the trainer starts this module with `python -m` and talks to it
over its stdin/stdout: one JSON object per line. The parameters travel through a shared
memory file (`torch.from_file(shared=True)`), one flat float32 vector, never through the pipe.

    stdin line 1    settings: {"name", "key" (hex), "numel", "shm", "initial_peers",
                    "host_maddrs", "identity_path", "timeout_s", "matchmaking_s"}
    stdout          {"event": "ready", "peer_id", "maddrs"}
    stdin/stdout    {"cmd": "load"}               -> {"ok", "version", "peer"}  (state into shm)
                    {"cmd": "average", "version"} -> {"ok", "group_size", "seconds", "error"}
                    {"cmd": "quit"}

Membership (NODE_SPEC.md, "Trainer groups"): a member's token is
HMAC-SHA256(group key, "swarm-node/group/1" 0x00 name 0x00 hivemind-peer-id-bytes). It rides in
every join request and in the group's gathered data; leaders refuse join requests, and every
member refuses a formed group, unless every peer's token matches that peer's transport-
authenticated peer ID. Tokens are also stored under `<prefix>.members` in the DHT; state is
served only to, and downloaded only from, peers whose stored token matches their peer ID.
"""

from __future__ import annotations

import ctypes
import hashlib
import hmac
import json
import os
import random
import signal
import sys
import time
from typing import AsyncIterator  # noqa: UP035 - hivemind reads typing hints (`_name`)

import torch
from hivemind import DHT
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.matchmaking import MatchmakingException
from hivemind.compression import deserialize_torch_tensor
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils.asyncio import aiter_with_timeout
from hivemind.utils.streaming import combine_from_streaming
from hivemind.utils.timed_storage import ValueWithExpiration, get_dht_time

TOKEN_DOMAIN = b"swarm-node/group/1"
MEMBER_TTL_S = 24 * 3600.0


def member_token(key: bytes, name: str, peer_id: bytes) -> bytes:
    return hmac.new(key, TOKEN_DOMAIN + b"\0" + name.encode() + b"\0" + peer_id,
                    hashlib.sha256).digest()


class GroupAverager(DecentralizedAverager):
    """A DecentralizedAverager that averages only with peers holding the group key."""

    def __init__(self, tensors, dht, *, key: bytes, name: str, **kwargs):
        self.group_key, self.group_name = key, name
        self.served = (None, None)  # (metadata, tensor) given to late joiners (host process)
        super().__init__(tensors, dht, **kwargs)

    def token_ok(self, peer_id: PeerID, token) -> bool:
        good = member_token(self.group_key, self.group_name, peer_id.to_bytes())
        return isinstance(token, bytes) and hmac.compare_digest(token, good)

    def _gathered_token_ok(self, peer_id: PeerID, gathered: bytes) -> bool:
        try:
            _bandwidth, _mode, user = self.serializer.loads(gathered)
            data = self.serializer.loads(user)
            return isinstance(data, dict) and self.token_ok(peer_id, data.get("token"))
        except Exception:  # noqa: BLE001 - malformed data from a peer is a non-member
            return False

    async def rpc_join_group(self, request: averaging_pb2.JoinRequest, context: P2PContext
                             ) -> AsyncIterator[averaging_pb2.MessageFromLeader]:
        if not self._gathered_token_ok(context.remote_id, request.gather):
            yield averaging_pb2.MessageFromLeader(code=averaging_pb2.PROTOCOL_VIOLATION)
            return
        async for response in super().rpc_join_group(request, context):
            yield response

    async def _aggregate_with_group(self, group_info, min_vector_size, **kwargs):
        for peer_id, gathered in zip(group_info.peer_ids, group_info.gathered):
            if not self._gathered_token_ok(peer_id, gathered):
                raise MatchmakingException(f"peer {peer_id} holds no token of this group")
        return await super()._aggregate_with_group(group_info, min_vector_size, **kwargs)

    async def _members(self) -> set[PeerID]:
        """Peers whose token stored in the DHT matches their peer ID."""
        found = await self.dht.get(f"{self.prefix}.members", latest=True, return_future=True)
        out = set()
        if found is not None and isinstance(found.value, dict):
            for sub, item in found.value.items():
                if not isinstance(sub, bytes) or not isinstance(item, ValueWithExpiration):
                    continue
                try:
                    peer = PeerID(sub)
                except Exception:  # noqa: BLE001, S112 - not a peer id: ignored
                    continue
                if self.token_ok(peer, item.value):
                    out.add(peer)
        return out

    async def rpc_download_state(self, request: averaging_pb2.DownloadRequest,
                                 context: P2PContext) -> AsyncIterator[averaging_pb2.DownloadData]:
        if context.remote_id not in await self._members():
            return  # not a member: nothing served
        async for part in super().rpc_download_state(request, context):
            yield part

    def get_current_state(self):
        meta, tensor = self.served
        if meta is None:
            return None, [], None  # nothing averaged yet: nothing to serve
        return meta, [tensor], None

    async def _load_state_from_peers(self, future, timeout=None):
        """hivemind's, restricted to members (token checked) and one flat tensor."""
        timeout = timeout or self.request_timeout
        try:
            members = await self._members()
            found = await self.dht.get(f"{self.prefix}.all_averagers", latest=True,
                                       return_future=True)
            offers = found.value if found is not None and isinstance(found.value, dict) else {}
            peers = [PeerID(p) for p, v in offers.items() if isinstance(p, bytes)
                     and isinstance(v, ValueWithExpiration) and isinstance(v.value, (int, float))]
            peers = [p for p in peers if p in members and p != self.peer_id]
            random.shuffle(peers)
            for peer in peers:
                try:
                    stub = self.get_stub(self._p2p, peer, namespace=self.prefix)
                    stream = await stub.rpc_download_state(averaging_pb2.DownloadRequest())
                    meta, parts = None, []
                    async for message in aiter_with_timeout(stream, timeout=timeout):
                        if message.metadata:
                            meta = self.serializer.loads(message.metadata)
                        parts.append(message.tensor_part)
                    if meta is None or not parts:
                        continue
                    tensor = deserialize_torch_tensor(combine_from_streaming(parts))
                    future.set_result((meta, [tensor], str(peer)))
                    return
                except Exception as e:  # noqa: BLE001 - try the next member
                    print(f"group: state from {peer} failed: {e!r}", file=sys.stderr)
        finally:
            if not future.done():
                future.set_result(None)


def _die_with_parent() -> None:
    """Linux: get SIGKILL when the trainer process dies, so no averager outlives it."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class Worker:
    def __init__(self, s: dict, out):
        self.s, self.out = s, out
        self.key = bytes.fromhex(s["key"])
        self.shm = torch.from_file(s["shm"], shared=True, size=s["numel"], dtype=torch.float32)
        self.dht = DHT(initial_peers=s["initial_peers"] or None, start=True,
                       host_maddrs=s["host_maddrs"], identity_path=s.get("identity_path"))
        self.token = member_token(self.key, s["name"], self.dht.peer_id.to_bytes())
        matchmaking = s["matchmaking_s"]
        self.averager = GroupAverager(
            [self.shm.clone()], self.dht, key=self.key, name=s["name"], prefix=s["prefix"],
            start=True, min_group_size=2, target_group_size=s.get("target_size"),
            min_matchmaking_time=matchmaking, request_timeout=max(1.0, matchmaking / 2),
            allreduce_timeout=s["timeout_s"], next_chunk_timeout=max(2.0, s["timeout_s"] / 4),
            allow_state_sharing=True, declare_state_period=max(5.0, s["timeout_s"] / 2))
        self.dht.store(f"{s['prefix']}.members", subkey=self.dht.peer_id.to_bytes(),
                       value=self.token, expiration_time=get_dht_time() + MEMBER_TTL_S)

    def reply(self, **msg) -> None:
        self.out.write(json.dumps(msg) + "\n")
        self.out.flush()

    def load(self) -> None:
        got = self.averager.load_state_from_peers(timeout=self.s["timeout_s"])
        if got is None:
            return self.reply(ok=False, error="no member serves a state")
        meta, tensors, peer = got
        t = tensors[0] if len(tensors) == 1 else None
        if (t is None or t.dtype != torch.float32 or t.shape != self.shm.shape
                or not bool(torch.isfinite(t).all()) or not isinstance(meta, dict)):
            return self.reply(ok=False, error=f"state from {peer} does not fit this model")
        self.shm.copy_(t)
        self._served(t, meta.get("version", 0))
        self.reply(ok=True, version=int(meta.get("version", 0)), peer=peer)

    def _served(self, tensor, version: int) -> None:
        self.averager.served = ({"version": int(version)}, tensor.clone())

    def average(self, version: int) -> None:
        t0 = time.perf_counter()
        with self.averager.get_tensors() as tensors:
            tensors[0].copy_(self.shm)
        try:
            gathered = self.averager.step(gather={"token": self.token, "version": version},
                                          timeout=self.s["timeout_s"], allow_retries=True)
        except Exception as e:  # noqa: BLE001 - alone, a member gone, a timeout: no round
            return self.reply(ok=False, error=repr(e)[:300], group_size=1,
                              seconds=time.perf_counter() - t0)
        with self.averager.get_tensors() as tensors:
            if not bool(torch.isfinite(tensors[0]).all()):
                return self.reply(ok=False, error="averaged state is not finite", group_size=1,
                                  seconds=time.perf_counter() - t0)
            self.shm.copy_(tensors[0])
            self._served(tensors[0], version)
        self.reply(ok=True, group_size=len(gathered or {}), seconds=time.perf_counter() - t0)

    def close(self) -> None:
        self.averager.shutdown()
        self.dht.shutdown()


def main() -> None:
    _die_with_parent()
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # hivemind and its libraries may print: keep stdout for our protocol
    settings = json.loads(sys.stdin.readline())
    worker = Worker(settings, out)
    worker.reply(event="ready", peer_id=str(worker.dht.peer_id),
                 maddrs=[str(m) for m in worker.dht.get_visible_maddrs()])
    try:
        for line in sys.stdin:
            msg = json.loads(line)
            if msg["cmd"] == "quit":
                break
            if msg["cmd"] == "load":
                worker.load()
            elif msg["cmd"] == "average":
                worker.average(int(msg["version"]))
    finally:
        worker.close()


if __name__ == "__main__":
    main()
