"""Rollouts with chosen texts (so rewards are known) for trainer tests."""

from __future__ import annotations

import torch
from swarm_node.node.sampler.base import Sample
from swarm_node.node.tasks import format_prompt, get_task
from swarm_node.protocol.messages import TaskRef


def ref(i: int, dataset: str = "toy/digit_successor") -> TaskRef:
    return TaskRef(dataset=dataset, params={}, seed=7, index=i)


def right_and_wrong(r: TaskRef) -> tuple[str, str]:
    """A completion text that scores 1.0 and one that scores 0.0 on task `r`."""
    return get_task(r).answer, "x"


def samples(tok, r: TaskRef, texts: list[str], version: int = 0) -> list[Sample]:
    prompt = format_prompt(tok, get_task(r))
    out = []
    for j, text in enumerate(texts):
        ids = list(tok.encode(text, add_special_tokens=False)) + [tok.eos_token_id]
        out.append(Sample(task=r, prompt_ids=prompt, completion_ids=ids,
                          logprobs=torch.full((len(ids),), -2.0), finish_reason="eos",
                          seed=j, text=text, hidden=None, policy_version=version))
    return out


def mixed_group(tok, i: int, version: int = 0, g: int = 4) -> list[Sample]:
    r = ref(i)
    good, bad = right_and_wrong(r)
    return samples(tok, r, [good if j % 2 == 0 else bad for j in range(g)], version)
