"""One sampling round of a peer: draw its tasks, sample seeded groups, build the RolloutBatch.

Used by the inference role, the trainer role's local sampling (SAPO), tests and benchmarks.
"""

from __future__ import annotations

import numpy as np

from ...protocol.messages import Completion, RolloutBatch, SamplingParams, TensorData
from ..tasks import DEFAULT_STYLE, PromptStyle, TaskSource, format_prompt, get_task


def sample_round(sampler, tokenizer, source: TaskSource, peer_id: str, round_: int,
                 n_tasks: int, group_size: int, params: SamplingParams,
                 style: PromptStyle = DEFAULT_STYLE):
    """`group_size` completions for each of the `n_tasks` tasks drawn for (peer, round),
    prompted in the swarm's `style` (tasks.system_prompt, tasks.few_shot)."""
    refs = source.draw(peer_id, round_, n_tasks)
    prompts = [(ref, format_prompt(tokenizer, get_task(ref, style=style))) for ref in refs]
    return [s for row in sampler.generate(prompts, group_size, params) for s in row]


def mean_reward(samples, score) -> float:
    rewards = [score(s.task, s.text) for s in samples]
    return sum(rewards) / len(rewards) if rewards else float("nan")


def to_batch(samples, swarm_id: str, policy_id: str, round_: int, params: SamplingParams,
             score=None):
    """Samples of one policy version as the RolloutBatch a node would publish."""
    comps = [Completion(
        task=s.task, prompt_ids=TensorData.from_numpy(np.asarray(s.prompt_ids, "int32")),
        completion_ids=TensorData.from_numpy(np.asarray(s.completion_ids, "int32")),
        logprobs=TensorData.from_torch(s.logprobs.float()), finish_reason=s.finish_reason,
        seed=int(s.seed), claimed_reward=float(score(s.task, s.text)) if score else 0.0,
        text=s.text) for s in samples]
    version = max(int(s.policy_version) for s in samples)
    return RolloutBatch(swarm_id=swarm_id, round=round_, policy_id=policy_id,
                        policy_version=version, sampling=params, completions=comps)
