"""One valid instance of every registered message type (and the nested structs)."""

from __future__ import annotations

import struct

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from swarm_node.node.identity import Identity
from swarm_node.protocol.messages import (
    MESSAGE_TYPES,
    CheckpointManifest,
    Completion,
    FileEntry,
    Hello,
    PayloadAnnounce,
    RolloutBatch,
    SamplingParams,
    ShardAdvert,
    ShardRequest,
    ShardResponseHeader,
    Status,
    TaskRef,
    TensorData,
    Verdict,
    WireModel,
)

# A fixed key, so examples (and their sizes) are the same on every run.
IDENTITY = Identity(Ed25519PrivateKey.from_private_bytes(bytes(range(32))))
OTHER = Identity(Ed25519PrivateKey.from_private_bytes(bytes(range(1, 33))))
PEER = IDENTITY.peer_id


def int32s(values: list[int]) -> TensorData:
    return TensorData(dtype="int32", shape=[len(values)],
                      data=struct.pack(f"<{len(values)}i", *values))


def float32s(values: list[float]) -> TensorData:
    return TensorData(dtype="float32", shape=[len(values)],
                      data=struct.pack(f"<{len(values)}f", *values))


def completion(n_tokens: int = 3, seed: int = 7) -> Completion:
    return Completion(
        task=TaskRef(dataset="toy/digit_successor", params={"digits": 3, "hard": False},
                     seed=42, index=5),
        prompt_ids=int32s([1, 2, 3, 4]),
        completion_ids=int32s(list(range(10, 10 + n_tokens))),
        logprobs=float32s([-0.5] * n_tokens),
        finish_reason="eos",
        seed=seed,
        claimed_reward=1.0,
        text="5",
        proof=b"\x01\x02" * 10,
    )


def valid_messages() -> dict[str, WireModel]:
    """type name -> one valid message of that type; covers every entry of MESSAGE_TYPES."""
    batch = RolloutBatch(
        swarm_id="demo", round=3, policy_id=PEER, policy_version=2,
        sampling=SamplingParams(temperature=0.7, top_p=0.9, top_k=50, max_new_tokens=8),
        completions=[completion(3, 1), completion(1, 2)],
    )
    manifest = CheckpointManifest(
        policy_id=PEER, version=4, parent_version=3, created_ms=1_700_000_000_000,
        files=[FileEntry(name="model.safetensors", size=10_000),
               FileEntry(name="config.json", size=240)],
        total_size=10_240, shard_size=4096,
        shard_hashes=[bytes([i]) * 32 for i in range(3)],
        checkpoint_hash=b"\xab" * 32,
    )
    messages = {
        "rollout_batch": batch,
        "checkpoint_manifest": manifest,
        "shard_request": ShardRequest(policy_id=PEER, version=4, shard=1, offset=100,
                                      length=200),
        "shard_response": ShardResponseHeader(ok=True, length=4096),
        "shard_advert": ShardAdvert(policy_id=PEER, version=4, complete=False, have=b"\x05"),
        "hello": Hello(swarm_id="demo", role="trainer", agent="swarm-node/0.1.0",
                       listen_addrs=["/ip4/127.0.0.1/tcp/4001"], policy_id=PEER,
                       policy_version=4),
        "status": Status(swarm_id="demo", role="inference", policy_id=PEER, policy_version=4,
                         round=9, peers=3),
        "verdict": Verdict(rollout_id=b"\x11" * 32, subject=PEER, accept=False,
                           reason="bad_proof", policy_version=4, detail="chunk 0"),
        "payload_announce": PayloadAnnounce(inner_type="rollout_batch",
                                            content_hash=b"\x22" * 32, size=1 << 20),
    }
    # Types registered by other modules (register_message_type) are covered when they
    # provide an `example()` classmethod.
    for name, cls in MESSAGE_TYPES.items():
        if name not in messages and hasattr(cls, "example"):
            messages[name] = cls.example()
    return messages
