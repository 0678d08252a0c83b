"""Tasks: references, regeneration, rewards, assignment and prompt formatting."""

from __future__ import annotations

from ...protocol.messages import TaskRef
from ..errors import NodeError
from .base import Task
from .rg import DEFAULT_RG_MIX, GENSYN_FAMILIES, rg_task
from .source import TaskSource
from .toy import TOY_FAMILIES, toy_task

__all__ = [
    "DEFAULT_RG_MIX",
    "GENSYN_FAMILIES",
    "TOY_FAMILIES",
    "Task",
    "TaskSource",
    "format_prompt",
    "get_task",
]


def get_task(ref: TaskRef, format_reward: float = 0.0) -> Task:
    """Regenerate the task named by `ref` (question, ground truth, scorer)."""
    if ref.dataset.startswith("toy/"):
        return toy_task(ref)
    if ref.dataset.startswith("rg/"):
        return rg_task(ref, format_reward)
    raise NodeError(f"task dataset {ref.dataset!r} must start with toy/ or rg/")


def format_prompt(tokenizer, task: Task) -> list[int]:
    """Prompt token ids: the chat template (with a generation prompt) where the tokenizer
    has one, else the system text and question joined by a blank line."""
    messages = ([{"role": "system", "content": task.system}] if task.system else []) + \
        [{"role": "user", "content": task.prompt}]
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return list(tokenizer.encode(text, add_special_tokens=False))
    text = "\n\n".join(m["content"] for m in messages) + "\n"
    return list(tokenizer.encode(text))
