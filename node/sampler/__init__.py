"""Samplers: the `Sampler` interface, the HF and vLLM backends, and a factory."""

from __future__ import annotations

from .base import Prompt, Sample, Sampler
from .factory import make_sampler as _make
from .factory import sampling_params as _params

__all__ = ["Prompt", "Sample", "Sampler", "make_sampler", "sampling_params"]


def make_sampler(config, *, peer_id: str = "", model=None, tokenizer=None) -> Sampler:
    """Build the sampler the config asks for (`sampler.backend`: auto, hf, vllm)."""
    return _make(config, peer_id=peer_id, model=model, tokenizer=tokenizer)


def sampling_params(config):
    """The wire `SamplingParams` for the config's `sampler` section."""
    return _params(config)
