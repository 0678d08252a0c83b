"""Typed wire structs. Each message type has a name and a schema version.

Models are strict pydantic models (no coercion, unknown fields rejected, frozen), so a
decoded message has exactly the types written here. Tensors travel as {dtype, shape, data};
nothing is ever pickled.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

import blake3
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from .codec import DTYPE_SIZES, pack, tensor_nbytes, unpack
from .errors import SchemaViolation
from .limits import Limits

U64 = Annotated[int, Field(ge=0, lt=2**64)]
U32 = Annotated[int, Field(ge=0, lt=2**32)]
Hash32 = Annotated[bytes, Field(min_length=32, max_length=32)]
PeerIdStr = Annotated[str, Field(min_length=1, max_length=128)]
ShortStr = Annotated[str, Field(max_length=128)]
FiniteFloat = Annotated[float, Field(allow_inf_nan=False)]
Scalar = bool | int | FiniteFloat | Annotated[str, Field(max_length=256)]
DTypeName = Literal["float32", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8",
                    "bool"]


class WireModel(BaseModel):
    """Base of every wire struct."""

    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)

    TYPE: ClassVar[str] = ""
    VERSION: ClassVar[int] = 1

    def to_wire(self) -> dict[str, Any]:
        return self.model_dump(mode="python")

    def encode(self) -> bytes:
        return pack(self.to_wire())

    @classmethod
    def from_wire(cls, value: Any):
        """Validate a decoded msgpack value; any failure is a `SchemaViolation`."""
        try:
            return cls.model_validate(value)
        except ValidationError as e:
            first = e.errors()[0] if e.errors() else {}
            where = ".".join(str(p) for p in first.get("loc", ())) or "<root>"
            raise SchemaViolation(
                f"{cls.__name__}: field {where}: {first.get('msg', 'invalid')}"
            ) from None
        except (ValueError, TypeError, RecursionError) as e:
            raise SchemaViolation(f"{cls.__name__}: {e}") from None

    @classmethod
    def decode(cls, data: bytes, *, max_size: int | None = None):
        limit = max_size if max_size is not None else Limits().max_for(cls.TYPE)
        return cls.from_wire(unpack(data, max_size=limit))


class TensorData(WireModel):
    """A dense tensor: dtype name, shape, raw little-endian bytes (C order)."""

    dtype: DTypeName
    shape: Annotated[list[Annotated[int, Field(ge=0, lt=2**31)]], Field(max_length=8)]
    data: bytes

    @model_validator(mode="after")
    def _size_matches(self):
        if tensor_nbytes(self.dtype, self.shape) != len(self.data):
            raise ValueError(
                f"data is {len(self.data)} bytes but {self.dtype}{self.shape} needs "
                f"{tensor_nbytes(self.dtype, self.shape)}"
            )
        if self.dtype == "bool" and self.data.translate(None, b"\x00\x01"):
            raise ValueError("bool tensor bytes must be 0 or 1")
        return self

    @classmethod
    def from_numpy(cls, array) -> TensorData:
        import numpy as np

        array = np.ascontiguousarray(array)
        dtype = array.dtype.name
        if dtype not in DTYPE_SIZES:
            raise ValueError(f"dtype {dtype} cannot travel; use one of {sorted(DTYPE_SIZES)}")
        little = array.astype(array.dtype.newbyteorder("<"), copy=False)
        return cls(dtype=dtype, shape=list(array.shape), data=little.tobytes())

    @classmethod
    def from_torch(cls, tensor) -> TensorData:
        import torch

        tensor = tensor.detach().cpu().contiguous()
        if tensor.dtype == torch.bfloat16:
            raw = tensor.view(torch.int16).numpy().tobytes()
            return cls(dtype="bfloat16", shape=list(tensor.shape), data=raw)
        return cls.from_numpy(tensor.numpy())

    def to_numpy(self):
        import numpy as np

        if self.dtype == "bfloat16":
            raise ValueError("numpy has no bfloat16; use to_torch()")
        little = np.dtype(self.dtype).newbyteorder("<")
        return np.frombuffer(self.data, dtype=little).reshape(self.shape)

    def to_torch(self):
        import torch

        if self.dtype == "bfloat16":
            if self.data:
                flat = torch.frombuffer(bytearray(self.data), dtype=torch.int16)
            else:
                flat = torch.empty(0, dtype=torch.int16)
            return flat.view(torch.bfloat16).reshape(self.shape)
        return torch.from_numpy(self.to_numpy().copy())


# Tasks and rollouts ----------------------------------------------------------------------


class TaskRef(WireModel):
    """Names a task so that any node can regenerate its question and ground truth.

    `dataset` is e.g. "toy/digit_copy" or "rg/basic_arithmetic"; `params` is the generator
    config; (dataset, params, seed, index) determines the task.
    """

    dataset: Annotated[str, Field(min_length=1, max_length=96)]
    params: Annotated[dict[Annotated[str, Field(max_length=64)], Scalar], Field(max_length=32)] = {}
    seed: U64
    index: U64


class SamplingParams(WireModel):
    temperature: Annotated[float, Field(ge=0.0, le=10.0)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, Field(ge=0, le=1_000_000)] = 0
    max_new_tokens: Annotated[int, Field(ge=1, le=65536)] = 64


class Completion(WireModel):
    """One sampled completion of one task, with what verification needs."""

    task: TaskRef
    prompt_ids: TensorData
    completion_ids: TensorData
    logprobs: TensorData
    finish_reason: Literal["eos", "length"]
    seed: U64
    claimed_reward: FiniteFloat
    text: Annotated[str, Field(max_length=262_144)] = ""
    proof: bytes = b""

    @model_validator(mode="after")
    def _shapes(self):
        for name in ("prompt_ids", "completion_ids", "logprobs"):
            t = getattr(self, name)
            if len(t.shape) != 1:
                raise ValueError(f"{name} must be 1-D")
        if self.prompt_ids.dtype != "int32" or self.completion_ids.dtype != "int32":
            raise ValueError("token ids must be int32")
        if self.logprobs.dtype != "float32":
            raise ValueError("logprobs must be float32")
        if self.logprobs.shape != self.completion_ids.shape:
            raise ValueError("logprobs and completion_ids differ in length")
        return self


ModelDType = Literal["float32", "bfloat16", "float16"]


class RolloutBatch(WireModel):
    """Completions sampled by one node with one policy version in one round.

    `dtype` is the prover's inference dtype: a verifier checks in that dtype (its thresholds
    follow it) or rejects the batch with the non-punitive reason `config_dtype`."""

    TYPE: ClassVar[str] = "rollout_batch"

    swarm_id: ShortStr
    round: U64
    policy_id: PeerIdStr
    policy_version: U64
    sampling: SamplingParams
    completions: Annotated[list[Completion], Field(min_length=1, max_length=4096)]
    dtype: ModelDType = "float32"


class BatchRules(BaseModel):
    """What a batch may contain, so that a sender has no free choice to cherry-pick with
    (NODE_SPEC §5.2 "Batch rules"); every peer of a swarm must use the same values.

    - groups are complete: every seed index j < `completions_per_task` of each task;
    - tasks come from the first `tasks_per_round` of the sender's draw for the round;
    - the round is bound to the policy version: `round_window(version)`, so a sender gets
      exactly `rounds_per_version` draws per version, known in advance, none to choose from.
    Not a wire message: it comes from the config (`tasks.tasks_per_round`,
    `sampler.completions_per_task`, `sampler.batches_per_version`).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    completions_per_task: Annotated[int, Field(ge=1, le=256)]
    tasks_per_round: Annotated[int, Field(ge=1, le=256)]
    rounds_per_version: Annotated[int, Field(ge=1, le=1 << 20)]

    def round_window(self, version: int) -> range:
        """The rounds a batch sampled with `version` may carry."""
        return range(version * self.rounds_per_version, (version + 1) * self.rounds_per_version)

    def round_for(self, version: int, k: int) -> int:
        """The k-th round (0-based) of policy `version`."""
        if not 0 <= k < self.rounds_per_version:
            raise ValueError(f"round index {k} outside [0, {self.rounds_per_version})")
        return version * self.rounds_per_version + k


# Checkpoints and shards ------------------------------------------------------------------


SHARD_LIST_DOMAIN = b"swarm-node/checkpoint-shard-list/1\x00"


def shard_list_hash(total_size: int, shard_size: int, shard_hashes: list[bytes]) -> bytes:
    """The `checkpoint_hash` of a "blake3-shard-list" manifest: BLAKE3-256 of
    SHARD_LIST_DOMAIN || u64be total_size || u64be shard_size || the shard hashes in order.
    Each shard hash covers its bytes, so this names the concatenation as well as a hash of
    it would, and costs no pass over the bytes."""
    h = blake3.blake3(SHARD_LIST_DOMAIN)
    h.update(total_size.to_bytes(8, "big") + shard_size.to_bytes(8, "big"))
    for digest in shard_hashes:
        h.update(digest)
    return h.digest()


class FileEntry(WireModel):
    name: Annotated[str, Field(min_length=1, max_length=255, pattern=r"^[A-Za-z0-9._-]+$")]
    size: U64


class SwarmSettings(WireModel):
    """The swarm settings a trainer's policy is used with (NODE_SPEC 7.1): a follower adopts
    them, or refuses the policy naming the difference, so `--bootstrap` is all it needs."""

    protocol_version: U32
    model_id: ShortStr                  # model.name the trainer started from
    dtype: Annotated[str, Field(max_length=16)]
    max_context: U32
    task_mix: Annotated[dict[Annotated[str, Field(max_length=128)], FiniteFloat],
                        Field(min_length=1, max_length=256)]
    tasks_per_round: U32
    format_reward: FiniteFloat = 0.0
    completions_per_task: U32
    sampling: SamplingParams
    system_prompt: Annotated[str, Field(min_length=1, max_length=64)] = "default"  # rg prompt name
    few_shot: Annotated[int, Field(ge=0, le=16)] = 0  # worked examples before each rg question
    task_params: Annotated[dict[Annotated[str, Field(max_length=128)],
                                Annotated[dict[Annotated[str, Field(max_length=64)], Scalar],
                                          Field(max_length=32)]],
                           Field(max_length=256)] = {}  # generator params per rg dataset


class CheckpointManifest(WireModel):
    """A trainer's signed description of one policy version, split into shards.

    The checkpoint is the concatenation of `files` in order; shard i covers bytes
    [i*shard_size, min((i+1)*shard_size, total_size)).
    """

    TYPE: ClassVar[str] = "checkpoint_manifest"

    policy_id: PeerIdStr
    version: U64
    parent_version: Annotated[int, Field(ge=-1, lt=2**63)] = -1
    created_ms: U64 = 0
    # "blake3": checkpoint_hash = BLAKE3 of the whole concatenation (every receiver hashes
    # every byte twice); "blake3-shard-list": BLAKE3 of the shard hashes (shard_list_hash),
    # checked against the manifest alone, before a byte is fetched
    hash_algo: Literal["blake3", "blake3-shard-list"] = "blake3"
    files: Annotated[list[FileEntry], Field(min_length=1, max_length=1024)]
    total_size: Annotated[int, Field(ge=1, lt=2**50)]
    shard_size: Annotated[int, Field(ge=4096, le=1 << 30)]
    shard_hashes: Annotated[list[Hash32], Field(min_length=1, max_length=1 << 20)]
    checkpoint_hash: Hash32  # also the content hash of the policy's weights
    settings: SwarmSettings | None = None  # None: an origin that does not announce them

    def to_wire(self) -> dict[str, Any]:
        wire = super().to_wire()
        if wire["settings"] is None:
            del wire["settings"]  # absent, not nil: manifests without settings keep their bytes
        return wire

    @model_validator(mode="after")
    def _layout(self):
        if sum(f.size for f in self.files) != self.total_size:
            raise ValueError("file sizes do not add up to total_size")
        expected = -(-self.total_size // self.shard_size)
        if len(self.shard_hashes) != expected:
            raise ValueError(f"{len(self.shard_hashes)} shard hashes, layout needs {expected}")
        if len({f.name for f in self.files}) != len(self.files):
            raise ValueError("duplicate file names")
        return self

    @property
    def num_shards(self) -> int:
        return len(self.shard_hashes)

    def shard_list_hash(self) -> bytes:
        return shard_list_hash(self.total_size, self.shard_size, self.shard_hashes)

    def shard_range(self, index: int) -> tuple[int, int]:
        start = index * self.shard_size
        return start, min(start + self.shard_size, self.total_size)


class ShardRequest(WireModel):
    TYPE: ClassVar[str] = "shard_request"

    policy_id: PeerIdStr
    version: U64
    shard: U32
    offset: U32 = 0
    length: Annotated[int, Field(ge=0, lt=2**31)] = 0  # 0: to the end of the shard


class ShardResponseHeader(WireModel):
    """Sent before the raw bytes of a shard (or instead of them, with an error)."""

    TYPE: ClassVar[str] = "shard_response"

    ok: bool
    error: ShortStr = ""
    length: Annotated[int, Field(ge=0, lt=2**31)] = 0


class ShardAdvert(WireModel):
    """Which shards of which version a peer holds (verified) and can serve."""

    TYPE: ClassVar[str] = "shard_advert"

    policy_id: PeerIdStr
    version: U64
    complete: bool
    have: Annotated[bytes, Field(max_length=1 << 17)] = b""  # bitmap, bit i = shard i
    # "host:port" of a plain-TCP server speaking the same shard protocol (empty: libp2p only)
    endpoint: Annotated[str, Field(max_length=128)] = ""


# Peers -----------------------------------------------------------------------------------

Role = Literal["inference", "trainer", "relay", "verifier"]


class Hello(WireModel):
    TYPE: ClassVar[str] = "hello"

    swarm_id: ShortStr
    role: Role
    agent: ShortStr
    listen_addrs: Annotated[list[Annotated[str, Field(max_length=256)]], Field(max_length=16)] = []
    policy_id: Annotated[str, Field(max_length=128)] = ""
    policy_version: Annotated[int, Field(ge=-1, lt=2**63)] = -1


class PeerRefusal(WireModel):
    """The answer to a Hello from another swarm: who we are, so the asker can say at once
    which `--swarm` its bootstrap peer belongs to. Sent instead of the peer list."""

    TYPE: ClassVar[str] = "peer_refusal"

    reason: Literal["swarm_mismatch"]
    swarm_id: ShortStr

    @classmethod
    def example(cls) -> PeerRefusal:
        return cls(reason="swarm_mismatch", swarm_id="my-swarm")


class DialbackRequest(WireModel):
    """"Dial me back": the asker's TCP listen ports. The answering peer dials only the IP
    it sees the request come from (never an address named by the asker)."""

    TYPE: ClassVar[str] = "dialback_request"

    ports: Annotated[list[Annotated[int, Field(ge=1, le=65535)]],
                     Field(min_length=1, max_length=4)]

    @classmethod
    def example(cls) -> DialbackRequest:
        return cls(ports=[4001])


class DialbackResult(WireModel):
    """`ok`: a fresh connection to `addr` completed a Noise handshake with the asker's
    peer id. `observed`: the asker's address as seen by the answering peer."""

    TYPE: ClassVar[str] = "dialback_result"

    ok: bool
    addr: Annotated[str, Field(max_length=256)] = ""
    observed: Annotated[str, Field(max_length=256)] = ""
    reason: ShortStr = ""

    @classmethod
    def example(cls) -> DialbackResult:
        return cls(ok=True, addr="/ip4/203.0.113.7/tcp/4001",
                   observed="/ip4/203.0.113.7/tcp/51000")


class Status(WireModel):
    TYPE: ClassVar[str] = "status"

    swarm_id: ShortStr
    role: Role
    policy_id: Annotated[str, Field(max_length=128)] = ""
    policy_version: Annotated[int, Field(ge=-1, lt=2**63)] = -1
    round: U64 = 0
    peers: U32 = 0


class Verdict(WireModel):
    """A verifier's decision about one rollout. Others treat it as a hint unless they
    re-verify (the rollout itself is not inside)."""

    TYPE: ClassVar[str] = "verdict"

    rollout_id: Hash32
    subject: PeerIdStr
    accept: bool
    reason: Annotated[str, Field(max_length=64)]
    policy_version: U64 = 0
    detail: Annotated[str, Field(max_length=512)] = ""


class PayloadAnnounce(WireModel):
    """A payload too large for gossip: announced by hash and size, pulled over a stream."""

    TYPE: ClassVar[str] = "payload_announce"

    inner_type: Annotated[str, Field(max_length=64)]
    content_hash: Hash32
    size: Annotated[int, Field(ge=1, lt=2**40)]


MESSAGE_TYPES: dict[str, type[WireModel]] = {
    cls.TYPE: cls
    for cls in (RolloutBatch, CheckpointManifest, ShardRequest, ShardResponseHeader,
                ShardAdvert, Hello, Status, Verdict, PayloadAnnounce, PeerRefusal,
                DialbackRequest, DialbackResult)
}


def register_message_type(cls: type[WireModel]) -> type[WireModel]:
    """Class decorator for message types defined outside this module."""
    if not cls.TYPE or cls.TYPE in MESSAGE_TYPES:
        raise ValueError(f"message type {cls.TYPE!r} is empty or already registered")
    MESSAGE_TYPES[cls.TYPE] = cls
    return cls
