"""Stable reject reason codes of the verifier (NODE_SPEC.md §5 lists them).

Each is a short string that labels verdicts, metrics and logs. `CONFIG_REASONS` mean the
peer runs with other settings than this verifier (task mix, sampling parameters, dtype,
group size, round numbering): no reputation penalty at all, and the verdict is published so
the peer sees it. `HONEST_MISTAKES` (a superset) can come from an honest but slow,
misconfigured or unlucky peer (light or no penalty, see `reputation.PENALTIES`); every other
reject is evidence of cheating (heavy penalty).
No torch here: the CLI and roles import this module cheaply.
"""

from __future__ import annotations

PROOF_REASONS = {
    "proof_missing": "the completion carries no proof",
    "proof_version": "unknown proof format version",
    "proof_length": "proof length does not match the token count and hidden size",
    "proof_modulus": "a chunk's modulus is outside [32768, 65497] or not canonical",
    "proof_coefficient": "a coefficient is not reduced modulo PRIME",
    "proof_hidden": "the verifier's recomputed hidden states are unusable (NaN/inf/shape)",
    "proof_index_mismatch": "too many top-k positions whose committed value does not match",
    "proof_deviation": "committed values deviate from the recomputation on average",
    "proof_bias": "committed values are systematically scaled against the recomputation",
    "proof_error": "internal error while checking (counted; never expected)",
}

BATCH_REASONS = {
    "wrong_swarm": "the batch names another swarm",
    "unknown_policy": "policy id not followed, or policy version not known to this verifier",
    "stale_policy": "policy version older than latest - max_policy_lag (trainer.max_staleness)",
    "sampling_params": "sampling parameters differ from the swarm's (config; no penalty)",
    "config_dtype": "the batch states a prover dtype this verifier does not check in (config; "
                    "no penalty)",
    "round_out_of_range": "the round is outside the policy version's window (config; no penalty)",
    "queue_expired": "the version was within the lag limit when the batch arrived, but the "
                     "batch waited in the verifier's queue longer than queue_grace versions "
                     "(or its model is gone): not verified, not counted against the sender",
    "round_reused": "the sender already had another batch of this round accepted",
    "already_accepted": "this very batch was accepted before (a gossip re-delivery or a "
                        "replay, e.g. after the verifier restarted): a duplicate, not counted "
                        "against the sender",
}

COMPLETION_REASONS = {
    "bad_shape": "empty prompt or completion, too long, or token ids outside the vocabulary",
    "bad_task": "the task reference cannot be regenerated",
    "config_task_mix": "the task is not among the first tasks_per_round drawn for (sender, "
                       "round) under this swarm's task mix (config; no penalty)",
    "config_group_size": "a seed index j >= completions_per_task (config; no penalty)",
    "incomplete_group": "a task group lacks some seed index j < completions_per_task",
    "group_member_rejected": "another completion of the same task group was rejected (a group "
                             "is used whole or not at all; the penalty goes to that one)",
    "batch_member_rejected": "not checked: the group checked first failed (a sender without "
                             "verified history gets one group checked before the rest; the "
                             "penalty goes to that group)",
    "prompt_mismatch": "prompt tokens are not the formatted prompt of the task",
    "seed_mismatch": "the seed is not derived from (task, sender, policy version, index)",
    "duplicate": "the rollout id (content hash) was seen before, or twice in the batch",
    "tokens_after_eos": "the completion goes on after an EOS token",
    "bad_finish": "finish_reason eos without a final EOS, or length without reaching the limit",
    "eos_improbable": "the final EOS, taken at a near-tie, had probability below min_eos_prob",
    "logprob_mismatch": "claimed logprobs differ from the recomputation beyond tolerance",
    "token_mismatch": "a token is not the seeded sampler's choice from the recomputed logits",
    "sampling_shape": "sampled-token surprisal inconsistent with the claimed temperature/top-p",
    "reward_mismatch": "the claimed reward differs from the reward of the regenerated task",
    "text_mismatch": "the claimed text is not the decoded completion",
    "verifier_error": "internal error while verifying (counted; never expected)",
    "over_budget": "the sender's verification budget is spent (probation or flood; "
                   "not verified, no penalty)",
}

# Per-peer sequential tests across batches (sequential.py): verdicts about a peer, not about
# one rollout (the rollout that tipped the test is named).
PEER_REASONS = {
    "logprob_bias": "the peer's claimed logprobs lean one way beyond honest float error "
                    "(CUSUM across its batches, or one batch of a sender without history, or "
                    "pooled over such senders)",
    "tie_steering": "the peer takes the runner-up token at near-ties too often (the same "
                    "three tests)",
}

REASONS: dict[str, str] = {**BATCH_REASONS, **COMPLETION_REASONS, **PROOF_REASONS,
                           **PEER_REASONS}

# Honest misconfiguration: no penalty, the verdict tells the peer what to fix.
CONFIG_REASONS = {"sampling_params", "config_dtype", "config_task_mix", "config_group_size",
                  "round_out_of_range"}

# Reasons an honest peer can produce without cheating.
HONEST_MISTAKES = CONFIG_REASONS | {"unknown_policy", "stale_policy", "queue_expired",
                                    "wrong_swarm", "duplicate",
                                    "round_reused", "verifier_error", "over_budget",
                                    "group_member_rejected", "batch_member_rejected",
                                    "already_accepted"}

# Not a verdict about the sender at all: nothing recorded, counted or published.
NOT_JUDGED = {"already_accepted"}
