"""Tasks: references, regeneration, rewards, assignment and prompt formatting."""

from __future__ import annotations

from ...protocol.messages import TaskRef
from ..errors import NodeError
from .base import DEFAULT_STYLE, PromptStyle, Task
from .rg import (
    DEFAULT_RG_MIX,
    GENSYN_FAMILIES,
    MAX_FEW_SHOT,
    SMALL_ARITHMETIC,
    rg_task,
    system_prompt_names,
)
from .source import TaskSource
from .toy import TOY_FAMILIES, toy_task

__all__ = [
    "DEFAULT_RG_MIX",
    "DEFAULT_STYLE",
    "GENSYN_FAMILIES",
    "MAX_FEW_SHOT",
    "SMALL_ARITHMETIC",
    "TOY_FAMILIES",
    "PromptStyle",
    "Task",
    "TaskSource",
    "format_prompt",
    "get_task",
    "system_prompt_names",
]


def get_task(ref: TaskRef, format_reward: float = 0.0,
             style: PromptStyle = DEFAULT_STYLE) -> Task:
    """Regenerate the task named by `ref` (question, ground truth, scorer). `style` (the
    swarm's tasks.system_prompt and tasks.few_shot) shapes rg prompts; toy tasks ignore it."""
    if ref.dataset.startswith("toy/"):
        return toy_task(ref)
    if ref.dataset.startswith("rg/"):
        return rg_task(ref, format_reward, style)
    raise NodeError(f"task dataset {ref.dataset!r} must start with toy/ or rg/")


def format_prompt(tokenizer, task: Task) -> list[int]:
    """Prompt token ids: the chat template (with a generation prompt) where the tokenizer
    has one, else the system text, examples and question joined by blank lines."""
    messages = [{"role": "system", "content": task.system}] if task.system else []
    for question, answer in task.examples:
        messages += [{"role": "user", "content": question},
                     {"role": "assistant", "content": answer}]
    messages.append({"role": "user", "content": task.prompt})
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return list(tokenizer.encode(text, add_special_tokens=False))
    text = "\n\n".join(m["content"] for m in messages) + "\n"
    return list(tokenizer.encode(text))
