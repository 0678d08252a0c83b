"""The sampler interface shared by the Hugging Face and vLLM backends."""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Literal

import torch

from ...protocol.messages import SamplingParams, TaskRef
from ..errors import NodeError
from ..runtime import BatchLimit
from .seeded import completion_seed

Prompt = tuple[TaskRef, list[int]]


@dataclass
class Sample:
    """One completion of one prompt, with what training and verification need.

    `hidden[i]` is the final-norm hidden state (fp32) at the input position whose logits chose
    `completion_ids[i]`, i.e. positions P-1 .. P+T-2 of prompt + completion (P prompt tokens,
    T completion tokens). A verifier gets the same rows by prefilling prompt + completion[:-1].
    """

    task: TaskRef
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: torch.Tensor
    finish_reason: Literal["eos", "length"]
    seed: int
    text: str
    hidden: torch.Tensor | None
    policy_version: int


class Sampler(ABC):
    """Generates seeded, replayable completions and swaps weights between batches."""

    version: int = 0
    peer_id: str = ""
    batch: BatchLimit | None = None
    """Sequences decoded at once, where the backend batches itself (HF); an out-of-memory
    retry halves it. None: the engine sizes its own batches (vLLM)."""

    @abstractmethod
    def generate(self, prompts: list[Prompt], n: int, params: SamplingParams,
                 seeds: list[list[int]] | None = None) -> list[list[Sample]]:
        """`n` completions per prompt. `seeds[i][j]` seeds completion j of prompt i; when
        None, `completion_seed(ref, self.peer_id, self.version, j)` is used."""

    @abstractmethod
    def load_weights(self, path_or_state: str | os.PathLike | dict[str, Any],
                     version: int | None = None) -> None:
        """Swap in new weights (a checkpoint directory / safetensors file, or a state dict);
        sets `.version` to `version` (default: current + 1)."""

    def time_spent(self) -> dict[str, float]:
        """Cumulative seconds by phase since start, for /metrics (none: the backend keeps
        no timings)."""
        return {}

    def close(self) -> None:
        """Release engine resources (no-op for in-process backends)."""


def default_seeds(sampler: Sampler, prompts: list[Prompt], n: int) -> list[list[int]]:
    return [[completion_seed(ref, sampler.peer_id, sampler.version, j) for j in range(n)]
            for ref, _ in prompts]


def check_seeds(prompts: list[Prompt], n: int, seeds: list[list[int]]) -> None:
    if len(seeds) != len(prompts) or any(len(row) != n for row in seeds):
        raise NodeError(f"seeds must be a {len(prompts)} x {n} list (one per completion)")
