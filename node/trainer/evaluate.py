"""Held-out greedy accuracy: how a policy does on tasks it was never trained on.

Used by `swarm-node demo --model smollm2` and benchmarks/learning.py. Three metrics over a
fixed set of task references:
  exact    the task's own reward (format_reward 0) is 1.0: what the swarm trains toward;
  tagged   the completion has an <answer>...</answer> tag (the rg answer format);
  lenient  the last number in the completion equals the answer (diagnostic only).
"""

from __future__ import annotations

import re

from ...protocol.messages import SamplingParams, TaskRef
from ..models import load_model
from ..sampler.hf import HFSampler
from ..tasks import DEFAULT_STYLE, PromptStyle, format_prompt, get_task
from .progress import ItemProgress

EVAL_SEED = 424_242  # generator seed of held-out sets; training draws never use it
_NUMBER = re.compile(r"-?\d+")


def held_out_refs(dataset: str, n: int, params: dict | None = None,
                  seed: int = EVAL_SEED) -> list[TaskRef]:
    return [TaskRef(dataset=dataset, params=params or {}, seed=seed, index=i)
            for i in range(n)]


def lenient_match(text: str, answer: str) -> bool:
    numbers = _NUMBER.findall(text)
    return bool(numbers) and numbers[-1] == answer.strip()


def greedy_accuracy(sampler, tokenizer, refs: list[TaskRef], max_new_tokens: int,
                    style: PromptStyle = DEFAULT_STYLE,
                    progress: ItemProgress | None = None) -> dict[str, float]:
    """Greedy (temperature 0) completions of `refs`, prompted in `style` (the swarm's
    tasks.system_prompt and few_shot), scored three ways (module docstring). The sampler's
    model should be in eval mode. `progress`: told after each of the sampler's batches (the
    same batches it would make of the whole list: the results do not change)."""
    tasks = [get_task(r, style=style) for r in refs]
    prompts = [(r, format_prompt(tokenizer, t)) for r, t in zip(refs, tasks)]
    params = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens)
    size = max(1, getattr(sampler, "max_batch", len(prompts)) or len(prompts))
    out = []
    for start in range(0, len(prompts), size):
        chunk = prompts[start:start + size]
        out += sampler.generate(chunk, 1, params, seeds=[[0]] * len(chunk))
        if progress is not None:
            progress.advance(len(chunk))
    if progress is not None:
        progress.close()
    exact = tagged = loose = 0
    for task, row in zip(tasks, out):
        text = row[0].text
        exact += task.score(text) == 1.0
        tagged += "<answer>" in text and "</answer>" in text
        loose += lenient_match(text, task.answer)
    n = max(len(prompts), 1)
    return {"exact": exact / n, "tagged": tagged / n, "lenient": loose / n}


def accuracy_of_model_dir(model_dir, refs: list[TaskRef], max_new_tokens: int,
                          max_batch: int = 32, style: PromptStyle = DEFAULT_STYLE,
                          say=None) -> dict[str, float]:
    """`greedy_accuracy` of the policy saved in `model_dir` (loaded on the CPU), its progress
    with an ETA said every few seconds (`say`: ItemProgress's; default: the log)."""
    model, tok = load_model(model_dir, device="cpu")
    sampler = HFSampler(model, tok, capture_hidden=False, max_batch=max_batch)
    progress = ItemProgress(f"held-out evaluation of {model_dir}", len(refs), "tasks",
                            say=say)
    return greedy_accuracy(sampler, tok, refs, max_new_tokens, style, progress)
