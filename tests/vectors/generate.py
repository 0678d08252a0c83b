"""Known-answer vectors: the inputs, and the code that computes each vector's answers.

    .venv/bin/python -m tests.vectors.generate            # rewrite every kind built here
    .venv/bin/python -m tests.vectors.generate proof      # rewrite one kind

Each `<kind>.json` in this folder holds `cases`; in each case the fields listed under
`outputs` are what this implementation computes from the others. `tests/protocol/
test_vectors.py` recomputes every output from the stored inputs and fails if one differs:
changing the wire is then a deliberate act (regenerate, say so in NODE_SPEC.md's version
history), never an accident. Bytes are lowercase hex. See README.md here for the format.
"""

from __future__ import annotations

import hashlib
import json
import struct
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
from swarm_node.node.broadcast.manifest import build_manifest
from swarm_node.node.sampler.seeded import completion_seed as seed_of
from swarm_node.node.sampler.seeded import ref_bytes
from swarm_node.node.tasks.source import TaskSource
from swarm_node.protocol.codec import pack
from swarm_node.protocol.envelope import DOMAIN, seal
from swarm_node.protocol.messages import MESSAGE_TYPES, SwarmSettings, TaskRef
from swarm_node.protocol.peerid import b58decode, peer_id_from_public_bytes
from swarm_node.verifier.proof import build_proof

HERE = Path(__file__).resolve().parent

# RFC 8032 section 7.1, test 1: its public key is d75a9801...511a, which pins our key
# derivation to the standard independently of this code.
RFC8032_SEED = "9d61b19deffd5a60ba844af492ec2cc44449c5697b326919703bac031cae7f60"
SEEDS = [RFC8032_SEED, "00" * 32, bytes(range(1, 33)).hex(), "ff" * 32]


def _key(seed_hex: str):

    return Ed25519PrivateKey.from_private_bytes(bytes.fromhex(seed_hex))


def _public_hex(seed_hex: str) -> str:

    return _key(seed_hex).public_key().public_bytes(Encoding.Raw, PublicFormat.Raw).hex()


def _peer_id(seed_hex: str) -> str:

    return peer_id_from_public_bytes(bytes.fromhex(_public_hex(seed_hex)))


# JSON <-> message fields: bytes are written as {"hex": "..."} so a reader knows the type.

def to_json(value):
    if isinstance(value, bytes):
        return {"hex": value.hex()}
    if isinstance(value, dict):
        return {k: to_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [to_json(v) for v in value]
    return value


def from_json(value):
    if isinstance(value, dict):
        if set(value) == {"hex"}:
            return bytes.fromhex(value["hex"])
        return {k: from_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [from_json(v) for v in value]
    return value


def _message(spec: dict):

    return MESSAGE_TYPES[spec["type"]].from_wire(from_json(spec["fields"]))


# Computations: case inputs -> case outputs. The test calls these on the stored inputs. ----


def peer_id(case: dict) -> dict:

    pid = _peer_id(case["seed"])
    return {"public_key": _public_hex(case["seed"]), "peer_id": pid,
            "peer_id_bytes": b58decode(pid).hex()}


def envelope(case: dict) -> dict:

    msg = _message(case["message"])
    sender = _peer_id(case["key_seed"])
    nonce = bytes.fromhex(case["nonce"])
    payload = msg.encode()
    signed = DOMAIN + pack([msg.VERSION, msg.TYPE, sender, case["ts_ms"], nonce, payload])
    wire = seal(msg, _key(case["key_seed"]), sender, ts_ms=case["ts_ms"], nonce=nonce)
    return {"sender": sender, "v": msg.VERSION, "payload": payload.hex(),
            "signed_bytes": signed.hex(), "signature": _key(case["key_seed"]).sign(signed).hex(),
            "envelope": wire.hex()}


def completion_seed(case: dict) -> dict:

    ref = TaskRef.from_wire(case["ref"])
    return {"ref_bytes": ref_bytes(ref).hex(),
            "seed": seed_of(ref, case["peer_id"], case["policy_version"], case["j"])}


def task_draw(case: dict) -> dict:

    source = TaskSource(case["mix"], case["swarm_id"])
    refs = source.draw(case["peer_id"], case["round"], case["n"])
    return {"refs": [r.to_wire() for r in refs]}


def hidden_states(case: dict):
    """The case's activations as a float32 tensor [tokens, hidden]: dense (`values`, the
    float32 little-endian bytes in C order) or sparse (`nonzero`: [flat index, float32 LE
    hex] pairs, every other value 0.0)."""

    t, h = case["tokens"], case["hidden"]
    if "values" in case:
        flat = np.frombuffer(bytes.fromhex(case["values"]), dtype="<f4").copy()
    else:
        flat = np.zeros(t * h, dtype=np.float32)
        for index, value in case["nonzero"]:
            flat[index] = np.frombuffer(bytes.fromhex(value), dtype="<f4")[0]
    return torch.from_numpy(flat.reshape(t, h))


def proof(case: dict) -> dict:

    data = build_proof(hidden_states(case))
    moduli, pos = [], 1
    while pos < len(data):  # walk the chunks to show each one's modulus
        moduli.append(struct.unpack_from("<H", data, pos)[0])
        k = min(128, min(32, case["tokens"] - 32 * len(moduli[:-1])) * case["hidden"])
        pos += 2 + 2 * k
    return {"proof": data.hex(), "proof_len": len(data), "moduli": moduli}


def manifest(case: dict) -> dict:

    policy_id = _peer_id(case["key_seed"])
    with tempfile.TemporaryDirectory() as tmp:
        for f in case["files"]:
            (Path(tmp) / f["name"]).write_bytes(bytes.fromhex(f["content"]))
        settings = case.get("settings")  # optional: the swarm settings a trainer announces
        m = build_manifest(Path(tmp), policy_id=policy_id, version=case["version"],
                           shard_size=case["shard_size"], parent_version=case["parent_version"],
                           settings=SwarmSettings.model_validate(settings) if settings else None,
                           hash_algo=case.get("hash_algo", "blake3"))
    m = m.model_copy(update={"created_ms": case["created_ms"]})
    wire = seal(m, _key(case["key_seed"]), policy_id, ts_ms=case["ts_ms"],
                nonce=bytes.fromhex(case["nonce"]))
    return {"policy_id": policy_id, "shard_hashes": [h.hex() for h in m.shard_hashes],
            "checkpoint_hash": m.checkpoint_hash.hex(), "payload": m.encode().hex(),
            "envelope": wire.hex()}


def noise(case: dict) -> dict:
    """Sampling noise (protocol/noise.py): exact integers only; g = -log(-log(u)) in float32
    may differ by an ulp between platforms' log implementations."""
    from swarm_node.protocol import noise as rule

    seeds = torch.tensor([case["seed"]] * len(case["tokens"]))
    positions = torch.tensor([case["position"]] * len(case["tokens"]))
    keys = rule.row_keys(seeds, positions)
    m = rule.mantissas(keys, torch.tensor(case["tokens"]))
    return {"row_key": f"{rule.row_key_py(case['seed'], case['position']):016x}",
            "bits": [f"{rule.noise_bits_py(case['seed'], case['position'], v):016x}"
                     for v in case["tokens"]],
            "mantissa": [int(x) for x in m],
            "u": [(2 * int(x) + 1) / 2.0 ** 24 for x in m]}


COMPUTE = {"peer_id": peer_id, "envelope": envelope, "completion_seed": completion_seed,
           "task_draw": task_draw, "proof": proof, "manifest": manifest, "noise": noise}


# Inputs ----------------------------------------------------------------------------------


def _stream(label: str, n: int) -> bytes:
    """n deterministic bytes (BLAKE2b in counter mode); only used to pick inputs."""
    out = b"".join(hashlib.blake2b(label.encode() + struct.pack("<Q", i)).digest()
                   for i in range(n // 64 + 1))
    return out[:n]


def _floats(label: str, n: int, scale: float) -> list[float]:
    words = struct.unpack(f"<{n}I", _stream(label, 4 * n))
    return [(w / 2**32 - 0.5) * scale for w in words]


def _f32_hex(x: float) -> str:
    return struct.pack("<f", x).hex()


def _inputs_peer_id() -> list[dict]:
    return [{"seed": s} for s in SEEDS]


def _inputs_envelope() -> list[dict]:
    pid0 = _peer_id(SEEDS[0])
    status = {"type": "status", "fields": {
        "swarm_id": "demo", "role": "trainer", "policy_id": pid0, "policy_version": 7,
        "round": 3, "peers": 4}}
    hello = {"type": "hello", "fields": {
        "swarm_id": "vectors", "role": "inference", "agent": "swarm-node/0.1.0",
        "listen_addrs": ["/ip4/127.0.0.1/tcp/4001"], "policy_id": "", "policy_version": -1}}
    verdict = {"type": "verdict", "fields": {
        "rollout_id": bytes(range(32)), "subject": _peer_id(SEEDS[2]), "accept": False,
        "reason": "proof_mismatch", "policy_version": 12, "detail": "chunk 0: 40 mismatches"}}
    return [
        {"key_seed": SEEDS[0], "ts_ms": 1_767_225_600_000, "nonce": "00" * 16,
         "message": to_json(status)},
        {"key_seed": SEEDS[1], "ts_ms": 1, "nonce": bytes(range(16)).hex(),
         "message": to_json(hello)},
        {"key_seed": SEEDS[3], "ts_ms": 2**63 - 1, "nonce": "ff" * 16,
         "message": to_json(verdict)},
    ]


def _inputs_completion_seed() -> list[dict]:
    pid = _peer_id(SEEDS[0])
    return [
        {"ref": {"dataset": "toy/digit_copy", "params": {}, "seed": 0, "index": 0},
         "peer_id": pid, "policy_version": 0, "j": 0},
        {"ref": {"dataset": "rg/basic_arithmetic", "params": {}, "seed": 4_294_967_295,
                 "index": 999_999}, "peer_id": pid, "policy_version": 17, "j": 7},
        {"ref": {"dataset": "rg/base_conversion", "params": {"max_base": 16, "hard": True,
                                                               "scale": 0.5, "name": "x"},
                 "seed": 2**64 - 1, "index": 123},
         "peer_id": _peer_id(SEEDS[1]), "policy_version": 2**63 - 1, "j": 4095},
    ]


def _inputs_task_draw() -> list[dict]:
    mix = {"rg/basic_arithmetic": 1.0, "rg/base_conversion": 2.0, "toy/digit_copy": 1.0}
    return [
        {"swarm_id": "demo", "mix": {"toy/digit_copy": 1.0}, "peer_id": _peer_id(SEEDS[0]),
         "round": 0, "n": 2},
        {"swarm_id": "vectors", "mix": mix, "peer_id": _peer_id(SEEDS[2]), "round": 41,
         "n": 4},
    ]


def _inputs_proof() -> list[dict]:
    dense = {"note": "2 chunks (32 + 8 tokens), hidden 8: k = 128 then 64",
             "tokens": 40, "hidden": 8,
             "values": b"".join(struct.pack("<f", x)
                                for x in _floats("proof/dense", 320, 16.0)).hex()}
    short = {"note": "one partial chunk: 3 tokens, hidden 8, k = 24",
             "tokens": 3, "hidden": 8,
             "values": b"".join(struct.pack("<f", x)
                                for x in _floats("proof/short", 24, 2.0)).hex()}
    # 128 nonzero values in a 32 x 4096 chunk. Pairs of indices collide mod 65497, 65496 and
    # 65495, so the canonical modulus is the next one down (65494).
    index = [100, 100 + 65497, 200, 200 + 65496, 300, 300 + 65495]
    index += [1000 + 1021 * i for i in range(122)]
    vals = _floats("proof/sparse", 128, 200.0)
    sparse = {"note": "one chunk, hidden 4096, top-k indices collide mod 65497..65495",
              "tokens": 32, "hidden": 4096,
              "nonzero": [[i, _f32_hex(v)] for i, v in zip(index, vals)]}
    return [dense, short, sparse]


def _inputs_manifest() -> list[dict]:
    config = json.dumps({"model_type": "llama", "hidden_size": 8}).encode()
    weights = _stream("manifest/weights", 4500)
    plain = {"key_seed": SEEDS[0], "version": 3, "parent_version": 2,
             "created_ms": 1_767_225_600_000, "shard_size": 4096,
             "ts_ms": 1_767_225_600_500, "nonce": "11" * 16,
             "files": [{"name": "config.json", "content": config.hex()},
                       {"name": "model.safetensors", "content": weights.hex()}]}
    settings = {"protocol_version": 2, "model_id": "builtin:smollm2-135m", "dtype": "float32",
                "max_context": 1024, "task_mix": {"rg/basic_arithmetic": 1.0},
                "tasks_per_round": 4, "format_reward": 0.0, "completions_per_task": 8,
                "sampling": {"temperature": 1.0, "top_p": 1.0, "top_k": 0,
                             "max_new_tokens": 10},
                "system_prompt": "direct", "few_shot": 2,
                "task_params": {"rg/basic_arithmetic": {"min_terms": 2, "max_terms": 2,
                                                        "max_digits": 1, "operators": "+-"}}}
    return [plain, {**plain, "version": 4, "parent_version": 3, "settings": settings},
            {**plain, "version": 5, "parent_version": 4, "hash_algo": "blake3-shard-list"}]


def _inputs_noise() -> list[dict]:
    return [
        {"seed": 0, "position": 0, "tokens": [0, 1, 2, 3, 49151]},
        {"seed": 7407829684988998362, "position": 5, "tokens": [0, 17, 476, 151935]},
        {"seed": 2**63 - 1, "position": 4095, "tokens": [2**31 - 1, 123456]},
        {"seed": 1, "position": 2**32 - 1, "tokens": [9, 10, 11]},
    ]


INPUTS = {"peer_id": _inputs_peer_id, "envelope": _inputs_envelope,
          "completion_seed": _inputs_completion_seed, "task_draw": _inputs_task_draw,
          "proof": _inputs_proof, "manifest": _inputs_manifest, "noise": _inputs_noise}

RULES = {
    "peer_id": "NODE_SPEC.md 1.2: Ed25519 seed (RFC 8032) -> public key -> libp2p peer ID",
    "envelope": "NODE_SPEC.md 1.3: message -> payload, signed bytes, Ed25519 signature, "
                "envelope (7-array)",
    "completion_seed": "NODE_SPEC.md 4: canonical task-reference bytes and completion seed",
    "task_draw": "NODE_SPEC.md 4: task assignment from (swarm id, peer ID, round, i, mix)",
    "proof": "NODE_SPEC.md 5.1: final-norm activations [tokens, hidden] (float32) -> proof "
             "bytes (format 1)",
    "manifest": "NODE_SPEC.md 7.1: checkpoint files -> shard hashes, checkpoint hash "
                "(hash_algo blake3: of the files; blake3-shard-list: of the shard hashes), "
                "manifest payload and the trainer's signed envelope",
    "noise": "NODE_SPEC.md 4: sampling noise (seed, position, token) -> row key, 64-bit "
             "bits, 23-bit mantissa m, u = (2m + 1) / 2^24; g = -log(-log(u)) in float32",
}


def build(kind: str) -> dict:
    cases = []
    for inputs in INPUTS[kind]():
        outputs = COMPUTE[kind](inputs)
        cases.append({**inputs, **outputs, "outputs": sorted(outputs)})
    return {"kind": kind, "rule": RULES[kind], "generator": "python -m tests.vectors.generate",
            "cases": cases}


def main(kinds: list[str]) -> None:
    for kind in kinds or list(INPUTS):
        path = HERE / f"{kind}.json"
        path.write_text(json.dumps(build(kind), indent=1) + "\n")
        print(f"wrote {path.relative_to(HERE.parent.parent)}")


if __name__ == "__main__":
    main(sys.argv[1:])
