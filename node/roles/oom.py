"""Recognising an out-of-memory error from any device, and freeing cached memory after it."""

from __future__ import annotations

import gc

import torch


def is_oom(e: BaseException) -> bool:
    """torch.OutOfMemoryError (CUDA), or a CPU allocator's RuntimeError/MemoryError."""
    if isinstance(e, (torch.OutOfMemoryError, MemoryError)):
        return True
    return isinstance(e, RuntimeError) and "out of memory" in str(e).lower()


def release_cached() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
