"""Rollout verification: every check a rollout must pass before anyone trains on it.

`RolloutVerifier.verify(batch, sender)` returns one `RolloutResult` per completion, each
accepted or rejected with a stable reason code (`reasons.py`). Everything without a forward
pass runs first, so a bogus batch costs no model compute (NODE_SPEC.md §5.2):

batch:       swarm id; followed policy id; policy version known and within
             [latest - max_policy_lag, latest], `latest` as of the batch's arrival (`as_of`:
             time in the verifier's queue is not the sender's lag; at most `queue_grace`
             versions of it are forgiven, then `queue_expired`, no penalty); prover dtype;
             sampling parameters; round in the version's window (BatchRules); round not
             used before (persisted).
cheap:       shapes and limits (context = min(config, model)); proof length for the
             verifier's own T and H; vocabulary; duplicates (persisted); the task among the
             first tasks_per_round of the sender's draw; the prompt; the seed index j;
             finish (EOS set of tokenizer + generation_config); text == decode(ids); reward.
groups:      complete groups (every j < completions_per_task); spot checks per group;
             `probe` (senders without history): one random group first, and the rest of
             the batch only when it passed.
model:       one prefill of prompt + completion (the prompt once per group; a prefix it
             shares with recent prompts once per model version): activation proof;
             logprobs within `logprob_tol` (the recomputed ones are handed on, never the
             claimed ones); seeded replay up to near-ties; EOS probability (of an EOS
             taken at a near-tie); sampling shape.
"""

from __future__ import annotations

import hashlib
import logging
import math
import random
import struct
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..node.config import VerifierSection
from ..node.diskspace import DiskFull
from ..node.errors import NodeError
from ..node.sampler.seeded import completion_seed, mask_logits, ref_bytes
from ..node.sampler.stops import context_limit, eos_token_ids
from ..node.tasks import DEFAULT_STYLE, PromptStyle, format_prompt, get_task
from ..protocol import noise
from ..protocol.messages import BatchRules, Completion, RolloutBatch, SamplingParams, Verdict
from .prefill import PromptCache, prefill, prefill_group, prefill_groups  # noqa: F401
from .proof import ProofThresholds, proof_size, verify_proof
from .seen import SeenStore, batch_digest

log = logging.getLogger(__name__)

ModelFor = Callable[[int], Any]
# logits computed at once: 2^24 float32 values (64 MiB; 341 rows of a 49k vocabulary)
LOGITS_BLOCK = 1 << 24
SpotCheck = Callable[[list[bytes]], bool]
# candidates whose protocol noise is hashed at once (noisy_top2)
NOISE_BLOCK = 1 << 16
# above this share of candidates, noisy_top2 hashes every token (row blocks) instead
DENSE_SHARE = 0.15


@dataclass(frozen=True)
class CheckSettings:
    """Thresholds of the model checks (defaults calibrated for float32 inference; see
    benchmarks/verifier.py and NODE_SPEC.md §5)."""

    max_policy_lag: int = 2
    # versions a batch may have waited in the verifier's queue and still be judged as of its
    # arrival (the config's verifier.queue_grace; checkpoints are kept that much longer:
    # rules.retention)
    queue_grace: int = VerifierSection.model_fields["queue_grace"].default
    logprob_tol: float = 1e-3
    tie_eps: float = 1e-3
    # at most one position per completion may trail by more than tie_eps, up to this (0: off)
    replay_outlier_eps: float = 0.0
    top_p_eps: float = 1e-4
    min_eos_prob: float = 1e-4
    shape_z_max: float = 6.0
    shape_min_tokens: int = 16
    max_completions_per_task: int = 256
    reward_tol: float = 1e-6
    prefill_token_budget: int = 8192
    proof: ProofThresholds = field(default_factory=ProofThresholds)

    @classmethod
    def for_dtype(cls, dtype: str, **overrides) -> CheckSettings:
        if dtype in ("bfloat16", "float16"):
            # measured on SmolLM2 bf16 (CPU, 180 completions; RESULTS.md "verifier-real"):
            # logprob diff up to 0.65 (one outlier, next 0.32: bf16 logits near 20-30 are
            # rounded to 1/8-1/4), replay gap up to 0.29. The trainer never uses claimed
            # logprobs; a bias inside the tolerance is the per-peer test's job.
            # One position per completion may trail by up to 2.0 (replay outlier; the
            # per-peer test counts them, sequential.py). Session 5's outliers (1.57, and
            # session 6's 1.48, 1.31) were the top-p cut moving (fixed by `_masks`: 0.02-0.17
            # on the same batches), but session 6 also measured an honest T = 1 gap of 0.43 in
            # a 63-token completion (second-worst 0.16), and single bf16 logits differ by up
            # to 0.74 (scaled, T = 0.7) between decode and prefill, so two tokens' gap can
            # reach ~1.5: 2.0 stays.
            base = {"logprob_tol": 1.0, "tie_eps": 0.4, "replay_outlier_eps": 2.0,
                    "top_p_eps": 1e-2,
                    "proof": ProofThresholds.for_dtype(dtype)}
        else:
            base = {}
        return cls(**{**base, **overrides})


@dataclass
class RolloutResult:
    index: int
    rollout_id: bytes
    accept: bool
    reason: str
    detail: str = ""
    reward: float | None = None
    stats: dict = field(default_factory=dict)
    text: str | None = None  # decoded from the verified token ids
    logprobs: Any = None  # recomputed float32 [T] (numpy); None when not model-checked

    def verdict(self, subject: str, policy_version: int) -> Verdict:
        return Verdict(rollout_id=self.rollout_id, subject=subject, accept=self.accept,
                       reason=self.reason, policy_version=policy_version,
                       detail=self.detail[:512])


def rollout_id(batch: RolloutBatch, c: Completion) -> bytes:
    """Content hash of one rollout: BLAKE2b-256 over the policy, task, tokens and seed."""
    h = hashlib.blake2b(digest_size=32, person=b"swarm-rollout1")
    for part in (batch.policy_id.encode(), struct.pack("<Q", batch.policy_version),
                 ref_bytes(c.task), c.prompt_ids.data, c.completion_ids.data,
                 struct.pack("<Q", c.seed)):
        h.update(struct.pack("<Q", len(part)))
        h.update(part)
    return h.digest()


class _Reject(Exception):
    def __init__(self, reason: str, detail: str = ""):
        super().__init__(detail)
        self.reason, self.detail = reason, detail


class RolloutVerifier:
    """Verifies rollout batches from untrusted peers.

    `model_for(version)` returns the model of a policy version (or None when unknown); a
    model instead of a callable serves every version. `latest_version()` is the newest
    version this node knows. `dtype` is the dtype the models run in: batches stating another
    prover dtype are rejected as `config_dtype` (no penalty). `rules` (BatchRules) turns on
    the no-free-choice rules; `seen` (SeenStore) persists accepted ids and used rounds.
    """

    def __init__(self, model_for: ModelFor, tokenizer, task_source, *, swarm_id: str,
                 latest_version: Callable[[], int], settings: CheckSettings | None = None,
                 policy_ids: set[str] | None = None, sampling: SamplingParams | None = None,
                 max_context: int = 1 << 20, format_reward: float = 0.0,
                 rules: BatchRules | None = None, dtype: str = "float32",
                 generation_config=None, seen: SeenStore | None = None,
                 style: PromptStyle = DEFAULT_STYLE):
        if isinstance(model_for, torch.nn.Module):  # one fixed model serves every version
            fixed = model_for
            generation_config = generation_config or getattr(fixed, "generation_config", None)
            model_for = lambda version: fixed
        self.model_for = model_for
        self.tokenizer = tokenizer
        self.task_source = task_source
        self.swarm_id = swarm_id
        self.latest_version = latest_version
        self.dtype = dtype
        self.settings = settings or CheckSettings.for_dtype(dtype)
        self.policy_ids = policy_ids
        self.sampling = sampling
        self.max_context = max_context
        self.format_reward = format_reward
        self.style = style  # tasks.system_prompt / few_shot: prompts must be built with it
        self.rules = rules
        self.seen = seen or SeenStore()
        self.prompt_cache = PromptCache()  # shared prompt prefixes, per model version
        self.counts: dict[str, int] = {}
        self.eos_ids = eos_token_ids(tokenizer, generation_config)
        self._assigned_cache: OrderedDict[tuple[str, int], set[bytes]] = OrderedDict()
        self._seed_cache: OrderedDict[tuple[bytes, str, int], dict[int, int]] = OrderedDict()
        self._rng = random.Random()  # which group a probe checks first: not the sender's pick

    # public ------------------------------------------------------------------------------

    def verify(self, batch: RolloutBatch, sender: str,
               spot_check: SpotCheck | None = None, probe: bool = False,
               as_of: int | None = None) -> list[RolloutResult]:
        """One result per completion. `spot_check(group_ids)` (optional) decides per task
        group whether its model checks run; a group it skips passes the cheap checks only and
        is accepted as `unchecked` (no recomputed logprobs). `probe`: model-check one group,
        drawn at random, before the others; when it fails, the rest of the batch is not
        checked (`batch_member_rejected`): a bogus batch of a sender without history costs
        one group's forward pass. Accepted and unchecked rollout ids are remembered on disk
        with the round and the batch's digest (replays fail, also after a restart; the same
        batch again is `already_accepted`, not a new choice). A full disk raises DiskFull
        before anything is remembered: the call can be repeated as it was.
        `as_of`: `latest_version()` when the batch arrived (the intake's queue; None: now):
        staleness is judged against it, so the sender is not charged for the wait (at most
        `queue_grace` versions of it, then `queue_expired`, no penalty). The sender cannot
        move it: a batch held back arrives, and is judged, later."""
        ids = [rollout_id(batch, c) for c in batch.completions]
        try:
            results = self._verify(batch, sender, ids, spot_check, probe, as_of)
        except _Reject as r:
            results = [RolloutResult(i, rid, False, r.reason, r.detail)
                       for i, rid in enumerate(ids)]
        except Exception as e:  # deliberate: count, reject, never crash the node
            log.exception("verifier error on a batch from %s", sender)
            results = [RolloutResult(i, rid, False, "verifier_error", f"{type(e).__name__}: {e}")
                       for i, rid in enumerate(ids)]
        kept = [r.rollout_id for r in results if r.accept]
        if kept:
            self.seen.add(kept, batch.policy_version, sender, batch.round, batch_digest(ids))
        for r in results:
            self.counts[r.reason] = self.counts.get(r.reason, 0) + 1
        try:
            self.seen.prune(self.latest_version() - self.settings.max_policy_lag
                            - self.settings.queue_grace)
        except DiskFull:
            pass  # what it would delete is rejected as stale anyway; the next call retries
        return results

    # batch checks ------------------------------------------------------------------------

    def _batch_checks(self, batch: RolloutBatch, sender: str, ids: list[bytes],
                      as_of: int | None = None):
        s = self.settings
        if batch.swarm_id != self.swarm_id:
            raise _Reject("wrong_swarm", f"swarm {batch.swarm_id!r}")
        if self.policy_ids is not None and batch.policy_id not in self.policy_ids:
            raise _Reject("unknown_policy", f"policy {batch.policy_id} is not followed")
        # The same batch again (a gossip re-delivery, a third party's replay within the
        # envelope window, a restart): not the sender's doing, whatever its version now is.
        used = self.seen.round_digest(sender, batch.round)
        if used is not None and used == batch_digest(ids):
            raise _Reject("already_accepted", f"round {batch.round}: this batch was "
                                              "accepted before (a re-delivery)")
        latest = self.latest_version()
        if batch.policy_version > latest:
            raise _Reject("unknown_policy", f"version {batch.policy_version} > latest {latest}")
        arrived = latest if as_of is None else min(as_of, latest)
        if batch.policy_version < arrived - s.max_policy_lag:
            raise _Reject("stale_policy", f"version {batch.policy_version}, latest {arrived}"
                                          f"{' at arrival' if arrived != latest else ''}, "
                                          f"lag limit {s.max_policy_lag}")
        # fresh when it arrived, stale now: the time in our queue is not the sender's doing
        queued = batch.policy_version < latest - s.max_policy_lag
        if queued and batch.policy_version < latest - s.max_policy_lag - s.queue_grace:
            raise _Reject("queue_expired", f"version {batch.policy_version} was within the lag "
                                           f"limit at arrival (latest {arrived}); now {latest}")
        if batch.dtype != self.dtype:
            raise _Reject("config_dtype", f"batch sampled in {batch.dtype}; this verifier "
                                          f"checks {self.dtype} (set model.dtype = "
                                          f"\"{self.dtype}\")")
        if self.sampling is not None and batch.sampling != self.sampling:
            raise _Reject("sampling_params", f"{batch.sampling} != {self.sampling}")
        if self.rules is not None and batch.round not in self.rules.round_window(
                batch.policy_version):
            w = self.rules.round_window(batch.policy_version)
            raise _Reject("round_out_of_range", f"round {batch.round} of v{batch.policy_version}"
                                                f" must be in [{w.start}, {w.stop})")
        if used is not None:
            raise _Reject("round_reused", f"round {batch.round} already accepted")
        model = self.model_for(batch.policy_version)
        if model is None:
            raise _Reject("queue_expired" if queued else "unknown_policy",
                          f"no model for version {batch.policy_version}")
        return model

    def _verify(self, batch, sender, ids, spot_check, probe=False,
                as_of=None) -> list[RolloutResult]:
        model = self._batch_checks(batch, sender, ids, as_of)

        limits = (context_limit(model.config, self.max_context), model.config.hidden_size)
        results: list[RolloutResult | None] = [None] * len(batch.completions)
        cheap: dict[int, tuple] = {}  # index -> (task, seed index j, text, reward)
        in_batch: set[bytes] = set()
        seeds: set[int] = set()
        max_prompt = max(c.prompt_ids.shape[0] for c in batch.completions)
        tasks: dict[bytes, tuple] = {}
        for i, c in enumerate(batch.completions):
            try:
                cheap[i] = self._static_checks(batch, c, sender, ids[i], in_batch, seeds,
                                               max_prompt, limits, tasks)
            except _Reject as r:
                results[i] = RolloutResult(i, ids[i], False, r.reason, r.detail)
            in_batch.add(ids[i])
        groups = self._groups(batch, results, cheap, ids)
        checked = []
        for members in groups:
            if spot_check is not None and not spot_check([ids[i] for i in members]):
                for i in members:
                    _, _, text, reward = cheap[i]
                    results[i] = RolloutResult(i, ids[i], True, "unchecked", reward=reward,
                                               text=text)
            else:
                checked.append(members)
        if probe and len(checked) > 1:
            first = checked.pop(self._rng.randrange(len(checked)))
            self._model_check(model, batch, [first], ids, cheap, results)
            if not all(results[i].accept for i in first):
                for members in checked:
                    self._reject_group(members, results, ids, "batch_member_rejected",
                                       "another group of this batch failed its checks")
                checked = []
        self._model_check(model, batch, checked, ids, cheap, results)
        for members in groups:  # a group is used whole or not at all
            if any(not results[i].accept for i in members):
                for i in members:
                    if results[i].accept:
                        results[i] = RolloutResult(i, ids[i], False, "group_member_rejected",
                                                   "another completion of its group failed")
        return results  # type: ignore[return-value]

    def _model_check(self, model, batch, groups, ids, cheap, results) -> None:
        """Model checks of `groups` (lists of completion indices) into `results`: one prompt
        pass per task group; the groups' completions then run packed together behind their
        prompts' KV caches (prefill.py)."""
        if not groups:
            return
        hidden_groups = prefill_groups(
            model, [(batch.completions[m[0]].prompt_ids.to_numpy(),
                     [batch.completions[i].completion_ids.to_numpy() for i in m])
                    for m in groups],
            self.settings.prefill_token_budget, self.prompt_cache, batch.policy_version)
        members_all = [i for m in groups for i in m]
        hiddens_all = [h for g in hidden_groups for h in g]
        for i, hidden, logits in zip(members_all, hiddens_all,
                                     self._group_logits(model, hiddens_all)):
            try:
                stats, logprobs = self._model_checks(batch, batch.completions[i], hidden, logits)
                _, _, text, reward = cheap[i]
                results[i] = RolloutResult(i, ids[i], True, "ok", reward=reward, stats=stats,
                                           text=text, logprobs=logprobs)
            except _Reject as r:
                results[i] = RolloutResult(i, ids[i], False, r.reason, r.detail)

    def _groups(self, batch, results, cheap, ids) -> list[list[int]]:
        """Task groups whose members all passed the cheap checks; with `rules`, a group must
        hold exactly the seed indices 0..completions_per_task-1 (else `incomplete_group` for
        all of it: a sender may not keep only the completions it likes)."""
        by_task: dict[bytes, list[int]] = {}
        for i, c in enumerate(batch.completions):
            by_task.setdefault(ref_bytes(c.task), []).append(i)
        groups = []
        for members in by_task.values():
            if any(results[i] is not None for i in members):
                self._reject_group(members, results, ids, "group_member_rejected",
                                   "another completion of its group failed")
                continue
            if self.rules is not None:
                got = sorted(cheap[i][1] for i in members)
                if got != list(range(self.rules.completions_per_task)):
                    self._reject_group(members, results, ids, "incomplete_group",
                                       f"seed indices {got[:8]}..., need 0.."
                                       f"{self.rules.completions_per_task - 1}")
                    continue
            groups.append(members)
        return groups

    @staticmethod
    def _reject_group(members, results, ids, reason: str, detail: str) -> None:
        for i in members:
            if results[i] is None:
                results[i] = RolloutResult(i, ids[i], False, reason, detail)

    # per-completion checks without the model ---------------------------------------------

    def _assigned(self, sender: str, round_: int) -> set[bytes]:
        key = (sender, round_)
        if key not in self._assigned_cache:
            n = self.rules.tasks_per_round if self.rules else self.task_source.max_per_round
            self._assigned_cache[key] = {ref_bytes(self.task_source.ref_at(sender, round_, i))
                                         for i in range(n)}
            while len(self._assigned_cache) > 64:
                self._assigned_cache.popitem(last=False)
        return self._assigned_cache[key]

    def _seed_index(self, c: Completion, rb: bytes, sender: str, version: int) -> int | None:
        """j such that c.seed == completion_seed(task, sender, version, j), j < 256. The
        seeds are derived lazily, the group's own (j < completions_per_task) first: an
        honest sender (or a fresh key's bogus batch) costs C hashes per task, not 256."""
        key = (rb, sender, version)
        entry = self._seed_cache.get(key)
        if entry is None:
            entry = self._seed_cache[key] = [{}, 0]  # seed -> j, next j to derive
            while len(self._seed_cache) > 4096:
                self._seed_cache.popitem(last=False)
        found = entry[0]
        limit = self.settings.max_completions_per_task
        first = self.rules.completions_per_task if self.rules is not None else 8
        while c.seed not in found and entry[1] < limit:
            upto = min(limit, first if entry[1] < first else limit)
            for j in range(entry[1], upto):
                found[completion_seed(c.task, sender, version, j)] = j
            entry[1] = upto
        return found.get(c.seed)

    def _static_checks(self, batch, c: Completion, sender, rid, in_batch, seeds, max_prompt,
                       limits, tasks: dict) -> tuple:
        """Everything that needs no forward pass, cheapest first. Returns (task, seed index,
        decoded text, recomputed reward). `tasks`: this batch's regenerated tasks and their
        prompts by task reference (a group's completions share them)."""
        max_context, hidden_size = limits
        p, t = c.prompt_ids.shape[0], c.completion_ids.shape[0]
        if p == 0 or t == 0:
            raise _Reject("bad_shape", f"prompt {p} / completion {t} tokens")
        if t > batch.sampling.max_new_tokens or p + t > max_context:
            raise _Reject("bad_shape", f"{p}+{t} tokens exceed the limits")
        if not c.proof:
            raise _Reject("proof_missing", "empty proof")
        if len(c.proof) != proof_size(t, hidden_size):
            raise _Reject("proof_length", f"{len(c.proof)} bytes, {t} tokens x {hidden_size} "
                                          f"need {proof_size(t, hidden_size)}")
        ids = c.completion_ids.to_numpy()
        prompt = c.prompt_ids.to_numpy()
        vocab = len(self.tokenizer)
        if (ids < 0).any() or (ids >= vocab).any() or (prompt < 0).any() or (prompt >= vocab).any():
            raise _Reject("bad_shape", "token id outside the vocabulary")
        if rid in in_batch or self.seen.seen(rid):
            raise _Reject("duplicate", "rollout seen before")
        rb = ref_bytes(c.task)
        if rb not in self._assigned(sender, batch.round):
            raise _Reject("config_task_mix", f"{c.task.dataset}#{c.task.index} is not among "
                                             f"the tasks drawn for round {batch.round} "
                                             "(check tasks.mix and tasks.tasks_per_round)")
        j = self._seed_index(c, rb, sender, batch.policy_version)
        if c.seed in seeds or j is None:
            raise _Reject("seed_mismatch", f"seed {c.seed} not derived for this sender/task")
        if self.rules is not None and j >= self.rules.completions_per_task:
            raise _Reject("config_group_size", f"seed index {j} >= completions_per_task "
                                               f"{self.rules.completions_per_task}")
        seeds.add(c.seed)
        self._finish_checks(batch, c, ids.tolist(), max_prompt, max_context)
        if rb not in tasks:
            try:
                task = get_task(c.task, self.format_reward, self.style)
            except (NodeError, ValueError, KeyError) as e:
                raise _Reject("bad_task", str(e)[:200]) from None
            tasks[rb] = (task, format_prompt(self.tokenizer, task))
        task, formatted = tasks[rb]
        if formatted != prompt.tolist():
            raise _Reject("prompt_mismatch", "prompt is not the task's formatted prompt")
        # The text and reward the trainer uses come from the token ids, never from the sender.
        text = self.tokenizer.decode(ids.tolist(), skip_special_tokens=True)
        if c.text and c.text != text:
            raise _Reject("text_mismatch", "claimed text is not the decoded completion")
        reward = task.score(text)
        if not abs(c.claimed_reward - reward) <= self.settings.reward_tol:
            raise _Reject("reward_mismatch", f"claimed {c.claimed_reward}, recomputed {reward}")
        return task, j, text, reward

    def _finish_checks(self, batch, c, ids: list[int], max_prompt: int, max_context: int):
        t = len(ids)
        eos_at = [k for k, tok in enumerate(ids) if tok in self.eos_ids]
        if eos_at and eos_at[0] < t - 1:
            raise _Reject("tokens_after_eos", f"EOS at {eos_at[0]}, {t} tokens")
        if c.finish_reason == "eos" and not eos_at:
            raise _Reject("bad_finish", "finish_reason eos but no final EOS token")
        if c.finish_reason == "length":
            if eos_at:
                raise _Reject("bad_finish", "finish_reason length but ends with EOS")
            cap = min(batch.sampling.max_new_tokens, max_context - max_prompt)
            if t < cap:
                raise _Reject("bad_finish", f"length stop at {t} < {cap} tokens")

    # model -------------------------------------------------------------------------------

    def _pad_id(self) -> int:
        return self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0

    @torch.inference_mode()
    def _logits(self, model, hidden: torch.Tensor) -> torch.Tensor:
        """LM head on one completion's hidden states."""
        head = model.get_output_embeddings()
        return head(hidden.to(head.weight.device, head.weight.dtype)).float().cpu()

    def _group_logits(self, model, hiddens: list[torch.Tensor]):
        """Logits [T, V] of each completion in `hiddens`, in order: the LM head runs over
        consecutive completions' rows together, in blocks of at most LOGITS_BLOCK values
        (memory). One matrix product over a few hundred rows runs about twice as many FLOPs
        per CPU second as one per completion (T rows; measured for SmolLM2's head:
        31 rows 32 GFLOP/s, 248 rows 65)."""
        vocab = model.get_output_embeddings().weight.shape[0]
        cap = max(1, LOGITS_BLOCK // vocab)
        i = 0
        while i < len(hiddens):
            j, rows = i + 1, hiddens[i].shape[0]
            while j < len(hiddens) and rows + hiddens[j].shape[0] <= cap:
                rows += hiddens[j].shape[0]
                j += 1
            block = self._logits(model, torch.cat(hiddens[i:j]))
            start = 0
            for h in hiddens[i:j]:
                yield block[start:start + h.shape[0]]
                start += h.shape[0]
            i = j

    def _model_checks(self, batch, c: Completion, hidden, logits):
        """Proof, logprobs, seeded replay, EOS and shape. Returns (stats, recomputed
        logprobs float32 [T]): the trainer trains on these, never on the claimed ones."""
        s = self.settings
        params = batch.sampling
        tokens = torch.from_numpy(c.completion_ids.to_numpy().astype("int64"))
        stats: dict[str, float] = {}

        proof = verify_proof(c.proof, hidden, s.proof)
        stats["proof_mismatches"] = proof.worst_mismatches
        stats["proof_mean_abs"] = proof.worst_mean_abs
        stats["proof_bias"] = proof.worst_bias
        stats["proof_mean_abs_ratio"] = proof.worst_mean_abs_ratio  # of the chunk's limit
        stats["proof_bias_ratio"] = proof.worst_bias_ratio
        if not proof.ok:
            raise _Reject(proof.reason, proof.detail)

        temp = params.temperature
        scaled = logits / temp if temp > 0 else logits
        # one log-softmax over the vocabulary, shared by the logprob and shape checks
        logp = torch.log_softmax(scaled, dim=-1)
        chosen = logp.gather(1, tokens[:, None])[:, 0]
        claimed = torch.from_numpy(c.logprobs.to_numpy().copy())
        if not torch.isfinite(claimed).all():
            raise _Reject("logprob_mismatch", "claimed logprobs contain NaN/inf")
        err = claimed - chosen
        stats["logprob_max_diff"] = float(err.abs().max())
        stats["lp_err_sum"] = float(err.double().sum())  # per-peer bias test (sequential.py)
        stats["lp_n"] = float(err.numel())
        if float(err.abs().max()) > s.logprob_tol:
            k = int(err.abs().argmax())
            raise _Reject("logprob_mismatch", f"position {k}: claimed {float(claimed[k]):.4f}, "
                                              f"recomputed {float(chosen[k]):.4f}")
        # the masks are full-vocabulary sorts: each computed once, shared by replay and shape
        tight, loose = _masks(scaled, params, s.top_p_eps, s.tie_eps)
        if params.top_p < 1.0 and temp > 0:  # calibration of top_p_eps (verifier_real.py)
            stats["top_p_excess"], stats["top_p_excess_near"] = top_p_excess(
                scaled, tokens, params, (0.0, s.tie_eps))
        stats.update(self._replay(c, params, scaled, tokens, tight, loose))
        if c.finish_reason == "eos":
            # the model's own probability (T = 1): the shared log-softmax when T is 0 or 1
            last = logp[-1] if temp in (0.0, 1.0) else torch.log_softmax(logits[-1], dim=-1)
            eos_p = float(last[tokens[-1]].exp())
            stats["eos_prob"] = eos_p
            # an EOS that replay shows was the seeded choice is honest whatever its
            # probability (an honest sampler does pick improbable EOS tokens: ~4e-4 of the
            # completions once the tiny trainer's policy pushed p(EOS) under 1e-4, issue 30);
            # the gate bounds only an EOS taken at a near-tie, where it trails the choice
            if eos_p < s.min_eos_prob and not stats["eos_seeded"]:
                raise _Reject("eos_improbable", f"EOS probability {eos_p:.2e}")
        if temp > 0 and tokens.shape[0] >= s.shape_min_tokens:
            # the loosened top-p, so a boundary near-tie accepted by replay is in the support
            z = sampling_shape_z(scaled, tokens, params, masked=loose,
                                 logq=logp if loose is scaled else None)
            stats["shape_z"] = z
            if not abs(z) <= s.shape_z_max:
                raise _Reject("sampling_shape", f"surprisal z-score {z:.2f}")
        return stats, chosen.float().numpy()

    def _replay(self, c, params, scaled, tokens, tight, loose) -> dict[str, float]:
        """Seeded replay. Near-ties: the claimed token's noisy score may trail the winner's by
        at most tie_eps (floating-point differences between decode and prefill), except at one
        position per completion, which may trail by up to replay_outlier_eps when that is set
        (bf16: rare honest float outliers; counted as `replay_outliers`). Also counts
        near-tie positions and how often the claimed token is not the verifier's own choice
        there (`ties`, `tie_flips`): the per-peer steering test (sequential.py) uses them."""
        s = self.settings
        if params.temperature == 0:
            top2 = scaled.topk(2, dim=-1)
            best_vals, best_idx = top2.values, top2.indices
            mine = scaled.gather(1, tokens[:, None])[:, 0]
        else:
            seeds = torch.full((tokens.shape[0],), c.seed, dtype=torch.int64)
            positions = torch.arange(tokens.shape[0], dtype=torch.int64)
            best_vals, best_idx = noisy_top2(tight, seeds, positions)
            mine = (loose.gather(1, tokens[:, None])[:, 0]
                    + noise.gumbel_at(seeds, positions, tokens[:, None])[:, 0])
        # NaN or a masked claimed token (mine = -inf): an infinite gap, rejected
        gap = torch.nan_to_num(best_vals[:, 0] - mine, nan=math.inf, posinf=math.inf)
        top = gap.topk(min(2, gap.shape[0])).values
        limit = max(s.tie_eps, s.replay_outlier_eps)  # one position may use the outlier limit
        second = float(top[1]) if top.shape[0] > 1 else -math.inf
        if not (float(top[0]) <= limit and second <= s.tie_eps):
            k = int(gap.argmax()) if float(top[0]) > limit else \
                int((gap == top[1]).nonzero()[0, 0])
            raise _Reject("token_mismatch", f"position {k}: token {int(tokens[k])} trails the "
                                            f"seeded choice by {float(gap[k]):.3g}")
        margin = best_vals[:, 0] - best_vals[:, 1]
        ties = margin <= s.tie_eps
        # a flip: the claimed token trails the verifier's best (with top-p, a token of the
        # loose mask that beats every token of the tight one is the sampler's choice, not a
        # runner-up; without top-p this is the same as "not the verifier's best")
        flips = ties & (tokens != best_idx[:, 0]) & (gap > 0)
        # "wide" ties (margin above a quarter of tie_eps): an honest float difference rarely
        # reorders those, a steering sender takes the runner-up there as often as it likes
        wide = ties & (margin > s.tie_eps / 4)
        # the last token is the seeded sampler's own choice (not a near-tie runner-up)
        seeded = bool(tokens[-1] == best_idx[-1, 0]) or float(gap[-1]) <= 0
        return {"replay_max_gap": float(top[0]), "replay_second_gap": max(second, 0.0),
                "eos_seeded": float(seeded),
                "replay_outliers": float((gap > s.tie_eps).sum()), "ties": float(ties.sum()),
                "tie_flips": float(flips.sum()), "wide_ties": float(wide.sum()),
                "wide_flips": float((wide & flips).sum()),
                # per near-tie position (calibration: benchmarks/verifier.py --real)
                "tie_margins": margin[ties].tolist(), "tie_flipped": flips[ties].tolist()}

def _masks(scaled, params: SamplingParams, eps: float, near: float):
    """(tight, loose) masks of the seeded replay: the best noisy score is taken over `tight`,
    the claimed token's over `loose`. Without top-p both are the claimed top-k mask. With
    top-p, the cut falls between two scores, and honest float differences move it: by mass
    (the probabilities differ a little: `eps` = top_p_eps) and by order (scores within
    `near` = tie_eps may swap places). So `loose` keeps top_p + eps plus every token within
    `near` below the lowest score that keeps (tokens the sampler may have had), and `tight`
    keeps the tokens the sampler surely had (`surely_kept` at top_p - eps; it may be empty,
    then any token of `loose` passes replay). Measured in bf16 (SmolLM2, T = 0.7 top-p 0.9;
    RESULTS.md verifier-real): an honest token with 4.8% of mass beyond top_p ahead of it
    at the verifier, and replay gaps of 1.3-1.6 at single positions."""
    if params.top_p >= 1.0:
        strict = mask_logits(scaled, params)
        return strict, strict
    base = mask_logits(scaled, params.model_copy(update={"top_p": 1.0}))  # top-k only
    (loose,) = top_p_masks(base, min(params.top_p + eps, 1.0))
    if near > 0:
        low = loose.masked_fill(loose == float("-inf"), float("inf")).amin(-1, keepdim=True)
        loose = base.masked_fill(base < low - near, float("-inf"))
    return surely_kept(base, max(params.top_p - eps, 0.0), near), loose


def surely_kept(scores: torch.Tensor, top_p: float, near: float) -> torch.Tensor:
    """`scores` with every token masked (-inf) but those whose mass ahead stays below top_p
    when each token within `near` below them is counted as ahead too: a top-p sampler whose
    scores differ from these by less than near/2 per token kept them (up to the mass
    difference the caller's top_p allows for). From a partial sort, as `top_p_masks`; a
    token whose near range runs past the sorted part is left out (conservative)."""
    v = scores.shape[-1]
    top, probs, cum = _top_prefix(scores, top_p)
    k = top.values.shape[-1]
    # per sorted token i: how many sorted tokens score >= s_i - near (itself included)
    neg = (-top.values).contiguous()
    count = torch.searchsorted(neg, (near - top.values).contiguous(), side="right")
    ahead = cum.gather(-1, (count - 1).clamp_min(0)) - probs
    keep = (ahead < top_p) & ((count < k) | (k == v))
    out = torch.full_like(scores, float("-inf"))
    return out.scatter(-1, top.indices, top.values.masked_fill(~keep, float("-inf")))


def top_p_excess(scaled: torch.Tensor, tokens: torch.Tensor, params: SamplingParams,
                 nears: tuple[float, ...] = (0.0,)) -> list[float]:
    """Per `near`: max_t (mass ahead of the claimed token under the verifier's top-k-masked
    probabilities - top_p), counting the tokens whose score exceeds the claimed one's by
    more than `near`. The top-p rule keeps a token iff that mass (near 0) is < top_p, the
    loose mask iff it is < top_p + top_p_eps with near = tie_eps: an honest token's excess
    measures how far the sampler's and the verifier's floats disagree at the boundary."""
    base = mask_logits(scaled, params.model_copy(update={"top_p": 1.0}))
    probs = torch.softmax(base, dim=-1)
    mine = base.gather(1, tokens[:, None])
    return [float(((probs * (base > mine + near)).sum(-1) - params.top_p).max())
            for near in nears]


def _top_prefix(scores: torch.Tensor, need: float):
    """The partial sort both top-p masks use: (topk, probs, cumulative mass) of the k highest
    scores per row, k grown 4x from 64 until every row's mass before its k-th score reaches
    `need` (so each row's top-p prefix ends inside the k), or k == V."""
    v = scores.shape[-1]
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    k = min(64, v)
    while True:
        top = scores.topk(k, dim=-1)
        probs = (top.values - lse).exp()
        cum = torch.cumsum(probs, dim=-1)
        if k == v or bool((cum[:, -1] - probs[:, -1] >= need).all()):
            return top, probs, cum
        k = min(v, 4 * k)


def top_p_masks(scores: torch.Tensor, *top_ps: float) -> list[torch.Tensor]:
    """`mask_logits`' top-p rule (node/sampler/seeded.py: keep the smallest prefix of the
    descending order whose mass reaches top_p) for each of `top_ps`, from one partial sort:
    the k highest scores per row, k doubled until every row's prefix is inside them, instead
    of a sort of the whole vocabulary. The kept set is the same as the full sort's; the
    probabilities come from one log-sum-exp over the row instead of a softmax of the sorted
    row, which may round differently in the last bit (the top_p_eps of the loose mask is
    10^3 times wider)."""
    top, probs, cum = _top_prefix(scores, max((p for p in top_ps if p < 1.0), default=0.0))
    before = cum - probs
    out = []
    for top_p in top_ps:
        if top_p >= 1.0:  # top-p off, as in mask_logits
            out.append(scores)
            continue
        keep = torch.zeros_like(scores, dtype=torch.bool)
        keep.scatter_(-1, top.indices, before < top_p)
        out.append(scores.masked_fill(~keep, float("-inf")))
    return out


def noisy_top2(scores: torch.Tensor, seeds: torch.Tensor,
               positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, indices) [T, 2] of the top two of scores[t, v] + g(seeds[t], positions[t], v)
    per row, with the protocol noise g computed only for tokens that can reach the top two.

    Why that is exact: g(u) = -log(-log u) increases with u, and every u the noise rule
    yields is at most U_MAX = 1 - 2^-24, so g(t, v) <= G_MAX for every token (the float32
    logs exceed the real G_MAX by ~1e-6, far less than NOISE_SPAN_MARGIN; protocol/noise.py).
    Let L be the second-largest noisy score among the row's 8 highest scores; L is at most
    the row's true second-largest noisy score S2. A token with scores[v] < L - G_MAX - margin
    has noisy score < L <= S2, so it holds neither of the top two places, and leaving it at
    -inf changes neither value nor index of the top two. The candidates get the protocol's
    noise for the same (seed, position, token) (`noise.gumbel_at`'s rule). A row with fewer
    than two finite scores has L = -inf and keeps every token; NaN scores are kept too (the
    full computation would put them on top). G_MAX is 16.6 logits: on SmolLM2 about 22% of
    the vocabulary stays at T = 1, 3% at T = 0.7, 0.5% at T = 0.5; the noise's integer hash
    (64-bit multiplies, not vectorised on this CPU) is what the pruning saves. tests/verifier/test_checks.py compares it with
    the full computation, and the verdicts with and without it."""
    t, v = scores.shape
    keys = noise.row_keys(seeds, positions)
    top = scores.topk(min(8, v), dim=-1)
    g_top = noise.gumbel_from_mantissas(noise.mantissas(keys[:, None].expand_as(top.indices),
                                                        top.indices))
    floor = (top.values + g_top).topk(min(2, g_top.shape[-1]), dim=-1).values[:, -1]
    bound = floor - noise.G_MAX - noise.NOISE_SPAN_MARGIN
    candidates = (scores >= bound[:, None]) | scores.isnan()
    if int(candidates.sum()) > DENSE_SHARE * t * v:
        return _dense_top2(scores, keys)
    flat = torch.nonzero(candidates.view(-1))[:, 0]
    noisy = torch.full((t * v,), float("-inf"), dtype=scores.dtype)
    flat_scores = scores.reshape(-1)
    # in blocks that stay in the CPU's cache: the hash is ~10 int64 passes over its input,
    # memory-bound over millions of candidates (measured 5x faster in 64k blocks, same bits)
    for start in range(0, flat.shape[0], NOISE_BLOCK):
        part = flat[start:start + NOISE_BLOCK]
        rows = part // v
        noisy[part] = flat_scores[part] + noise.gumbel_from_mantissas(
            noise.mantissas(keys[rows], part - rows * v))
    best = noisy.view(t, v).topk(2, dim=-1)
    return best.values, best.indices


def _dense_top2(scores: torch.Tensor, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The top two of scores + noise with the noise of every token (the definition itself),
    a few rows at a time so the hash's int64 passes stay in the CPU's cache. Where most of
    the vocabulary are candidates (SmolLM2 at T = 1: about half), this is cheaper than
    gathering and scattering the candidates (measured ~3x on the verifier's part)."""
    t, v = scores.shape
    step = max(1, NOISE_BLOCK // v)
    values, indices = [], []
    for start in range(0, t, step):
        g = noise.gumbel_from_mantissas(noise.mantissas(keys[start:start + step],
                                                        vocab_size=v))
        best = (scores[start:start + step] + g).topk(2, dim=-1)
        values.append(best.values)
        indices.append(best.indices)
    return torch.cat(values), torch.cat(indices)


def sampling_shape_z(scaled: torch.Tensor, tokens: torch.Tensor, params: SamplingParams,
                     masked: torch.Tensor | None = None,
                     logq: torch.Tensor | None = None) -> float:
    """z-score of the summed surprisal -log q(x_t) of the sampled tokens, where q is the
    claimed sampling distribution (temperature-scaled, top-k/top-p truncated and renormalised)
    recomputed by the verifier. Honest sampling gives mean 0, variance 1 (CLT over tokens);
    tokens drawn from another model or temperature shift it. `masked` (the truncated logits)
    or `logq` (their log-softmax) may be passed in when the caller has them."""
    if logq is None:
        q_logits = mask_logits(scaled, params) if masked is None else masked
        logq = torch.log_softmax(q_logits, dim=-1)
    # where q underflows to 0 (logq < -104, or -inf off the support) its terms are 0 either
    # way; the clamp only avoids 0 * -inf = NaN
    safe = logq.clamp_min(-1e4)
    q = safe.exp()
    q_log_q = q * safe
    entropy = -q_log_q.sum(-1)
    second = (q_log_q * safe).sum(-1)
    var = (second - entropy * entropy).clamp_min(0)
    surprisal = -logq.gather(1, tokens[:, None])[:, 0]
    surprisal = torch.nan_to_num(surprisal, posinf=1e4)  # a token outside the support
    total_var = float(var.sum())
    if total_var <= 1e-12:
        return 0.0 if float((surprisal - entropy).abs().max()) < 1e-3 else math.inf
    return float((surprisal - entropy).sum()) / math.sqrt(total_var)
