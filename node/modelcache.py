"""Helpers shared by the builtin models (models.py, smollm2.py): atomic folder builds and
quiet transformers loading."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from .errors import NodeError


def build_atomically(root: Path, target: Path, build) -> None:
    """Run `build(tmp)` in a temporary folder under `root`, then rename it to `target`.

    Readers never see a half-built folder; if two processes build at once the first rename
    wins and the other copy is discarded (callers that build slowly also hold a lock)."""
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise NodeError(f"cannot create model cache {root}: {e.strerror}") from None
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=root))
    try:
        build(tmp)
        try:
            os.rename(tmp, target)
        except OSError:  # another process won the race; its copy is identical
            if not (target / "config.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def quiet_transformers() -> None:
    """No progress bars from transformers (they flood node logs)."""
    # transformers (seconds to import) loads only when a model is built or loaded.
    from transformers.utils import logging as hf_logging  # noqa: PLC0415

    hf_logging.disable_progress_bar()
