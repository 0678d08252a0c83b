"""Stable reject reason codes of the verifier (NODE_SPEC.md §5 lists them).

Each is a short string that labels verdicts, metrics and logs. `HONEST_MISTAKES` can come
from an honest but slow, misconfigured or unlucky peer (light reputation penalty, see
`reputation.PENALTIES`); every other reject is evidence of cheating (heavy penalty).
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
    "sampling_params": "sampling parameters differ from the swarm's",
    "round_reused": "the sender already had a batch of this round accepted",
}

COMPLETION_REASONS = {
    "bad_shape": "empty prompt or completion, too long, or token ids outside the vocabulary",
    "bad_task": "the task reference cannot be regenerated",
    "task_not_assigned": "the task is not among those the seed assigns to (sender, round)",
    "prompt_mismatch": "prompt tokens are not the formatted prompt of the task",
    "seed_mismatch": "the seed is not derived from (task, sender, policy version, index)",
    "duplicate": "the rollout id (content hash) was seen before, or twice in the batch",
    "tokens_after_eos": "the completion goes on after an EOS token",
    "bad_finish": "finish_reason eos without a final EOS, or length without reaching the limit",
    "eos_improbable": "the final EOS had probability below min_eos_prob",
    "logprob_mismatch": "claimed logprobs differ from the recomputation beyond tolerance",
    "token_mismatch": "a token is not the seeded sampler's choice from the recomputed logits",
    "sampling_shape": "sampled-token surprisal inconsistent with the claimed temperature/top-p",
    "reward_mismatch": "the claimed reward differs from the reward of the regenerated task",
    "text_mismatch": "the claimed text is not the decoded completion",
    "verifier_error": "internal error while verifying (counted; never expected)",
}

REASONS: dict[str, str] = {**BATCH_REASONS, **COMPLETION_REASONS, **PROOF_REASONS}

# Reasons an honest peer can produce without cheating.
HONEST_MISTAKES = {"unknown_policy", "stale_policy", "wrong_swarm", "duplicate", "round_reused",
                   "sampling_params", "verifier_error"}
