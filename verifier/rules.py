"""The swarm's batch rules from a node config (`BatchRules` in protocol/messages.py).

Senders (inference role) and verifiers (trainer role) call this one function, so both read
the same three settings the same way; `retention` is the versions a node keeps to verify.
"""

from __future__ import annotations

from ..protocol.messages import BatchRules


def batch_rules(cfg) -> BatchRules:
    """tasks.tasks_per_round, sampler.completions_per_task, sampler.batches_per_version."""
    return BatchRules(completions_per_task=cfg.sampler.completions_per_task,
                      tasks_per_round=cfg.tasks.tasks_per_round,
                      rounds_per_version=cfg.sampler.batches_per_version)


def retention(cfg, keep: int) -> int:
    """Versions to keep (own checkpoints or a followed policy's): at least
    trainer.max_staleness + 1 + verifier.queue_grace, so an honest peer at the largest
    allowed lag finds its version, also after its batch waited in the verification queue
    (a newcomer's waits behind the probation share, intake.py, while our versions move on)."""
    return max(int(keep), cfg.trainer.max_staleness + 1 + cfg.verifier.queue_grace)
