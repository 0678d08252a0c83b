"""Known-answer vectors (tests/vectors/*.json): the code must reproduce every stored answer.

Every JSON file in the folder is checked, so a vector file without a checker fails instead
of being skipped. Besides recomputing the answers through the code, the tests re-derive
what NODE_SPEC.md states independently of it (RFC 8032 key, py-libp2p's peer ID, the seed
formula, BLAKE3 shard hashes, the envelope layout) and decode the stored wire bytes.
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

import blake3
import pytest
from libp2p.crypto.ed25519 import Ed25519PublicKey as Libp2pEd25519PublicKey
from libp2p.peer.id import ID
from swarm_node.protocol.codec import pack, unpack
from swarm_node.protocol.envelope import DOMAIN, open_envelope
from swarm_node.protocol.messages import CheckpointManifest
from swarm_node.protocol.peerid import public_key_from_peer_id
from swarm_node.verifier.proof import verify_proof

from ..vectors import generate

VECTOR_DIR = Path(generate.__file__).parent
FILES = sorted(VECTOR_DIR.glob("*.json"))


def load(kind: str) -> list[dict]:
    return json.loads((VECTOR_DIR / f"{kind}.json").read_text())["cases"]


def test_vector_files_exist():
    assert {p.stem for p in FILES} >= set(generate.COMPUTE)


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.stem)
def test_code_reproduces_vector(path: Path):
    kind = path.stem
    compute = generate.COMPUTE.get(kind)
    assert compute is not None, (
        f"{path.name} has no checker: add a `{kind}` entry to COMPUTE in tests/vectors/generate.py")
    data = json.loads(path.read_text())
    assert data["cases"], f"{path.name} has no cases"
    for n, case in enumerate(data["cases"]):
        inputs = {k: v for k, v in case.items() if k not in case["outputs"]}
        got = compute(inputs)
        for field in case["outputs"]:
            assert got[field] == case[field], f"{path.name} case {n}: {field} changed"


# Independent checks of what the spec states --------------------------------------------


def test_rfc8032_public_key():
    case = next(c for c in load("peer_id") if c["seed"] == generate.RFC8032_SEED)
    assert case["public_key"] == (
        "d75a980182b10ab7d54bfed3c964073a0ee172f3daa62325af021a68f707511a")


@pytest.mark.parametrize("case", load("peer_id"), ids=lambda c: c["peer_id"][-6:])
def test_peer_id_matches_libp2p(case):
    key = Libp2pEd25519PublicKey.from_bytes(bytes.fromhex(case["public_key"]))
    assert ID.from_pubkey(key).to_base58() == case["peer_id"]
    assert case["peer_id_bytes"] == "00240801" "1220" + case["public_key"]


@pytest.mark.parametrize("case", load("envelope"), ids=lambda c: c["message"]["type"])
def test_envelope_layout_and_signature(case):
    payload, sig = bytes.fromhex(case["payload"]), bytes.fromhex(case["signature"])
    header = [case["v"], case["message"]["type"], case["sender"], case["ts_ms"],
              bytes.fromhex(case["nonce"])]
    assert bytes.fromhex(case["signed_bytes"]) == DOMAIN + pack([*header, payload])
    assert bytes.fromhex(case["envelope"]) == pack([*header, payload, sig])
    public_key_from_peer_id(case["sender"]).verify(sig, bytes.fromhex(case["signed_bytes"]))
    env = open_envelope(bytes.fromhex(case["envelope"]), max_skew_s=None)
    assert env.message.to_wire() == generate.from_json(case["message"]["fields"])


@pytest.mark.parametrize("case", load("completion_seed"), ids=lambda c: str(c["seed"]))
def test_completion_seed_formula(case):
    """NODE_SPEC.md 4: the seed from canonical JSON and BLAKE2b-64, written out again."""
    canonical = json.dumps(case["ref"], sort_keys=True, separators=(",", ":")).encode()
    assert canonical.hex() == case["ref_bytes"]
    parts = [b"swarm-node/completion-seed/v1", canonical, case["peer_id"].encode(),
             str(case["policy_version"]).encode(), str(case["j"]).encode()]
    digest = hashlib.blake2b(b"\x00".join(parts), digest_size=8).digest()
    assert struct.unpack("<Q", digest)[0] >> 1 == case["seed"]


@pytest.mark.parametrize("case", load("proof"), ids=lambda c: f"{c['tokens']}x{c['hidden']}")
def test_proof_vector_verifies(case):
    proof = bytes.fromhex(case["proof"])
    assert len(proof) == case["proof_len"] and proof[0] == 1
    result = verify_proof(proof, generate.hidden_states(case))
    assert result.ok, result.reason


def test_manifest_hashes_and_envelope():
    for case in load("manifest"):
        data = b"".join(bytes.fromhex(f["content"]) for f in case["files"])
        size = case["shard_size"]
        shards = [blake3.blake3(data[i:i + size]).hexdigest() for i in range(0, len(data), size)]
        assert shards == case["shard_hashes"]
        if case.get("hash_algo", "blake3") == "blake3":
            assert blake3.blake3(data).hexdigest() == case["checkpoint_hash"]
        else:  # blake3-shard-list: of the domain, total and shard size, the shard hashes
            listed = (b"swarm-node/checkpoint-shard-list/1\x00" + len(data).to_bytes(8, "big")
                      + size.to_bytes(8, "big") + b"".join(bytes.fromhex(h) for h in shards))
            assert blake3.blake3(listed).hexdigest() == case["checkpoint_hash"]
        env = open_envelope(bytes.fromhex(case["envelope"]), max_skew_s=None)
        assert env.sender == case["policy_id"] and env.payload.hex() == case["payload"]
        manifest = CheckpointManifest.decode(env.payload)
        assert [f.name for f in manifest.files] == [f["name"] for f in case["files"]]
        assert unpack(env.payload, max_size=1 << 20)["created_ms"] == case["created_ms"]


def test_noise_formula():
    """NODE_SPEC.md 4: SplitMix64 noise bits written out again from the spec's formula."""
    mask, golden = (1 << 64) - 1, 0x9E3779B97F4A7C15

    def mix64(z: int) -> int:
        z &= mask
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        return z ^ (z >> 31)

    domain = int.from_bytes(
        hashlib.blake2b(b"swarm-node/noise/v2", digest_size=8).digest(), "little")
    for case in load("noise"):
        key = mix64(mix64(case["seed"] ^ domain) + golden * (case["position"] + 1))
        assert f"{key:016x}" == case["row_key"]
        bits = [mix64(key + golden * (v + 1)) for v in case["tokens"]]
        assert [f"{b:016x}" for b in bits] == case["bits"]
        assert [b >> 41 for b in bits] == case["mantissa"]
        assert [(2 * (b >> 41) + 1) / 2**24 for b in bits] == case["u"]
