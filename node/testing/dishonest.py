"""Cheating on purpose, for the demo and the integration tests (`node.dishonest` config).

`tamper_tokens`: after honest sampling and proving, every completion is replaced by the
ground-truth answer followed by EOS, with logprobs of 0 (probability 1) and a claimed reward
of 1.0 — what a peer fishing for reward would send. The original proof is kept.
`forge_reward`: honest tokens and proofs, but every claimed reward is 1.0.
"""

from __future__ import annotations

import numpy as np

from ...protocol.messages import RolloutBatch, TensorData
from ..errors import NodeError
from ..tasks import get_task

MODES = ("tamper_tokens", "forge_reward")


def tamper(batch: RolloutBatch, mode: str, tokenizer) -> RolloutBatch:
    """`batch` as a cheater in `mode` would send it."""
    if mode not in MODES:
        raise ValueError(f"unknown dishonest mode {mode!r}")
    completions = []
    for c in batch.completions:
        if mode == "tamper_tokens":
            answer = get_task(c.task).answer
            ids = list(tokenizer.encode(answer, add_special_tokens=False)) + [tokenizer.eos_token_id]
            c = c.model_copy(update={
                "completion_ids": TensorData.from_numpy(np.asarray(ids, dtype=np.int32)),
                "logprobs": TensorData.from_numpy(np.zeros(len(ids), dtype=np.float32)),
                "finish_reason": "eos", "text": answer, "claimed_reward": 1.0})
        else:
            c = c.model_copy(update={"claimed_reward": 1.0})
        completions.append(c)
    return batch.model_copy(update={"completions": completions})


def make_dishonest(role, mode: str) -> None:
    """Make an inference role tamper with every batch it publishes."""
    if mode not in MODES:
        raise ValueError(f"unknown dishonest mode {mode!r}")
    if not hasattr(role, "outgoing"):
        raise NodeError(f"node.dishonest = {mode!r}: only an inference peer can cheat, "
                        f"not a {role.name}")
    role.outgoing = lambda batch: tamper(batch, mode, role.tokenizer)
