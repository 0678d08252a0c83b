"""Atomic, versioned checkpoints: one flat directory of files per policy version.

Layout under `root` (the trainer's `<data_dir>/trainer/checkpoints`):

    step-00000007/
        policy/                      a plain model directory, flat, regular files only:
            config.json, generation_config.json, model.safetensors   (save_pretrained)
            tokenizer.json, tokenizer_config.json, ...               (save_pretrained)
            checkpoint.json          {"version", "files": [{"name", "size"}]}
        trainer/                     this trainer's own state (never shipped):
            state.safetensors        optimizer tensors + torch RNG states
            state.json               optimizer groups, scheduler, python RNG, free-form state

`policy/` is what `load_model(dir)`, the sampler's `load_weights(dir)` and the broadcaster
(`checkpoint_files(dir)`) take. Nothing is ever read with torch.load / pickle: tensors are
safetensors, the rest JSON.

Atomicity: files are written into `.tmp-step-...`, each fsync'd, the directory fsync'd, then
renamed to `step-XXXXXXXX` and the parent fsync'd. A directory named `step-*` is therefore
always complete; leftovers of a crash (`.tmp-*`, `.trash-*`) are removed on open. Only the
last `keep` versions stay on disk.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from ..diskspace import as_disk_full, ensure_free, is_disk_full
from ..errors import NodeError

STEP_RE = re.compile(r"^step-(\d{8,})$")
POLICY, TRAINER = "policy", "trainer"
MAX_JSON_BYTES = 16 * 1024 * 1024


class CheckpointError(NodeError):
    """A checkpoint cannot be written or read."""


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    version: int

    @property
    def policy_dir(self) -> Path:
        """The model directory a sampler loads and the broadcaster ships."""
        return self.path / POLICY

    @property
    def trainer_dir(self) -> Path:
        return self.path / TRAINER

    def policy_files(self) -> list[Path]:
        return sorted(p for p in self.policy_dir.iterdir() if p.is_file())


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class CheckpointStore:
    def __init__(self, root: Path, keep: int = 3):
        if keep < 1:
            raise CheckpointError("keep must be >= 1")
        self.root = Path(root)
        self.keep = keep
        self.root.mkdir(parents=True, exist_ok=True)
        for leftover in self.root.iterdir():
            if leftover.name.startswith((".tmp-", ".trash-")):
                shutil.rmtree(leftover, ignore_errors=True)

    def list(self) -> list[Checkpoint]:
        out = []
        for p in self.root.iterdir():
            m = STEP_RE.match(p.name)
            if m and p.is_dir():
                out.append(Checkpoint(p, int(m.group(1))))
        return sorted(out, key=lambda c: c.version)

    def latest(self) -> Checkpoint | None:
        cks = self.list()
        return cks[-1] if cks else None

    def save(self, version: int, model, tokenizer, optimizer=None, scheduler=None,
             state: dict[str, Any] | None = None) -> Checkpoint:
        """Write version `version` atomically; prune to the last `keep`."""
        target = self.root / f"step-{version:08d}"
        if target.exists():
            raise CheckpointError(f"checkpoint {target} already exists")
        # weights + optimizer state (~2x for Adam); DiskFull: the caller pauses (diskspace.py)
        need = 3 * sum(p.numel() * p.element_size() for p in model.parameters())
        ensure_free(self.root, need)
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-step-{version:08d}-", dir=self.root))
        try:
            pol, tr = tmp / POLICY, tmp / TRAINER
            pol.mkdir()
            tr.mkdir()
            model.save_pretrained(pol, safe_serialization=True)
            tokenizer.save_pretrained(pol)
            files = sorted(p for p in pol.iterdir() if p.is_file())
            manifest = {"version": version,
                        "files": [{"name": p.name, "size": p.stat().st_size} for p in files]}
            (pol / "checkpoint.json").write_text(json.dumps(manifest, indent=1))
            tensors, meta = _trainer_state(optimizer, scheduler)
            meta["state"] = state or {}
            meta["version"] = version
            save_file(tensors, str(tr / "state.safetensors"))
            (tr / "state.json").write_text(json.dumps(meta))
            for sub in (pol, tr):
                for p in sub.iterdir():
                    if not p.is_file():
                        raise CheckpointError(f"unexpected non-file {p} in checkpoint")
                    _fsync_file(p)
                _fsync_dir(sub)
            _fsync_dir(tmp)
            os.rename(tmp, target)
            _fsync_dir(self.root)
        except BaseException as e:
            shutil.rmtree(tmp, ignore_errors=True)
            if is_disk_full(e):
                raise as_disk_full(e, self.root, need) from e  # the retry waits for `need`
            raise
        self._prune()
        return Checkpoint(target, version)

    def _prune(self) -> None:
        for ck in self.list()[:-self.keep]:
            trash = self.root / f".trash-{ck.path.name}"
            os.rename(ck.path, trash)  # a step-* name is either complete or gone
            shutil.rmtree(trash, ignore_errors=True)
        _fsync_dir(self.root)

    def restore(self, ckpt: Checkpoint, optimizer=None, scheduler=None) -> dict[str, Any]:
        """Load optimizer/scheduler/RNG state from `ckpt` (weights: `load_model(ckpt.policy_dir)`).

        Returns the free-form `state` dict saved with it.
        """
        meta_path = ckpt.trainer_dir / "state.json"
        try:
            if meta_path.stat().st_size > MAX_JSON_BYTES:
                raise CheckpointError(f"{meta_path} is larger than {MAX_JSON_BYTES} bytes")
            meta = json.loads(meta_path.read_text())
            tensors = load_file(str(ckpt.trainer_dir / "state.safetensors"))
        except (OSError, ValueError, SafetensorError) as e:
            raise CheckpointError(f"cannot read trainer state of {ckpt.path}: {e}") from None
        if meta.get("version") != ckpt.version:
            raise CheckpointError(f"{meta_path} says version {meta.get('version')}, "
                                  f"directory says {ckpt.version}")
        _restore_trainer_state(tensors, meta, optimizer, scheduler)
        return meta.get("state", {})


def _trainer_state(optimizer, scheduler) -> tuple[dict, dict]:
    tensors: dict[str, torch.Tensor] = {"rng.torch": torch.get_rng_state()}
    meta: dict[str, Any] = {"rng_python": rng_to_json(random.getstate())}
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"rng.cuda.{i}"] = s
    if optimizer is not None:
        sd = optimizer.state_dict()
        scalars: dict[str, dict[str, Any]] = {}
        for idx, st in sd["state"].items():
            for k, v in st.items():
                if isinstance(v, torch.Tensor):
                    tensors[f"optim.{idx}.{k}"] = v.detach().cpu().contiguous()
                else:
                    scalars.setdefault(str(idx), {})[k] = v
        meta["optimizer"] = {"param_groups": sd["param_groups"], "scalars": scalars}
    if scheduler is not None:
        meta["scheduler"] = {k: v for k, v in scheduler.state_dict().items()
                             if _jsonable(v)}
    return tensors, meta


def _restore_trainer_state(tensors, meta, optimizer, scheduler) -> None:
    try:
        torch.set_rng_state(tensors["rng.torch"])
        random.setstate(rng_from_json(meta["rng_python"]))
        if torch.cuda.is_available():
            states = [tensors[k] for k in sorted(tensors) if k.startswith("rng.cuda.")]
            if len(states) == torch.cuda.device_count():
                torch.cuda.set_rng_state_all(states)
        if optimizer is not None and "optimizer" in meta:
            state: dict[int, dict[str, Any]] = {}
            for name, t in tensors.items():
                if name.startswith("optim."):
                    _, idx, key = name.split(".", 2)
                    state.setdefault(int(idx), {})[key] = t
            for idx, sc in meta["optimizer"]["scalars"].items():
                state.setdefault(int(idx), {}).update(sc)
            groups = meta["optimizer"]["param_groups"]
            for g in groups:
                if isinstance(g.get("betas"), list):
                    g["betas"] = tuple(g["betas"])
            optimizer.load_state_dict({"state": state, "param_groups": groups})
        if scheduler is not None and "scheduler" in meta:
            scheduler.load_state_dict({**scheduler.state_dict(), **meta["scheduler"]})
    except (KeyError, ValueError, TypeError, RuntimeError) as e:
        raise CheckpointError(f"trainer state does not fit this trainer: {e}") from None


def _jsonable(v: Any) -> bool:
    try:
        json.dumps(v)
        return True
    except (TypeError, ValueError):
        return False


def rng_to_json(state) -> list:
    version, internal, gauss = state
    return [version, list(internal), gauss]


def rng_from_json(data) -> tuple:
    version, internal, gauss = data
    return (version, tuple(internal), gauss)
