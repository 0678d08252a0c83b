"""The record of every py-libp2p patch: what it replaces, why, the upstream issue, and a
check that its targets still have the shape the patch was written against.

Each topic module registers its patches here (`register`). Process-wide replacements go
through `replace`, which keeps the original (`original`): the tests run py-libp2p's own
code through it to show the upstream problem still exists (the patch is still needed)."""

from __future__ import annotations

import hashlib
import importlib
import inspect
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

PINNED_LIBP2P = "0.8.1"
"""The py-libp2p release every patch here was written and tested against."""

SCOPES = ("process", "host", "pubsub", "router", "connection")


class PatchError(RuntimeError):
    """A patch's target no longer has the shape the patch was written for."""


@dataclass(frozen=True)
class Patch:
    """One replacement of py-libp2p code.

    `targets` names what is replaced (`module:Qualname.attr`); `shape()` returns what no
    longer matches (empty when the patch applies); `fingerprints` pins the source of the
    upstream functions the patch re-implements (a change there means the copy here must be
    reviewed, even if the shape still matches)."""

    name: str
    scope: str
    targets: tuple[str, ...]
    why: str
    upstream: str
    shape: Callable[[], list[str]]
    fingerprints: dict[str, str] = field(default_factory=dict)


PATCHES: dict[str, Patch] = {}
_ORIGINALS: dict[tuple[object, str], object] = {}


def register(patch: Patch) -> Patch:
    if patch.scope not in SCOPES:
        raise ValueError(f"patch {patch.name}: unknown scope {patch.scope!r}")
    PATCHES[patch.name] = patch
    return patch


def replace(owner: object, attr: str, new: object) -> None:
    """`owner.attr = new` for the whole process, once; the original is kept."""
    current = getattr(owner, attr)
    if current is new:
        return
    _ORIGINALS.setdefault((owner, attr), current)
    setattr(owner, attr, new)


def original(owner: object, attr: str) -> object:
    """What py-libp2p had at `owner.attr` before `replace` (the current value if never
    replaced)."""
    return _ORIGINALS.get((owner, attr), getattr(owner, attr))


def resolve(target: str) -> tuple[object, str]:
    """(owner, attribute) of a `module:Qualname.attr` target."""
    module, _, path = target.partition(":")
    owner: object = importlib.import_module(module)
    *outer, attr = path.split(".")
    for part in outer:
        owner = getattr(owner, part)
    return owner, attr


def fingerprint(obj: object) -> str:
    """Short hash of an object's source (whitespace-normalised)."""
    src = " ".join(inspect.getsource(obj).split())
    return hashlib.sha256(src.encode()).hexdigest()[:16]


# Shape checks -----------------------------------------------------------------------------

def has_attr(owner: object, attr: str) -> list[str]:
    return [] if hasattr(owner, attr) else [f"{_name(owner)}.{attr} is gone"]


def has_signature(owner: object, attr: str, params: tuple[str, ...], *,
                  coroutine: bool | None = None) -> list[str]:
    """`owner.attr` exists, takes exactly `params` (names, in order) and is (or is not) a
    coroutine function. Checked on the original, not on our replacement."""
    if not hasattr(owner, attr):
        return [f"{_name(owner)}.{attr} is gone"]
    fn = original(owner, attr)
    problems = []
    try:
        got = tuple(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return [f"{_name(owner)}.{attr} has no readable signature"]
    if got != params:
        problems.append(f"{_name(owner)}.{attr} takes {got}, the patch expects {params}")
    if coroutine is not None and inspect.iscoroutinefunction(fn) != coroutine:
        problems.append(f"{_name(owner)}.{attr} is {'not ' if coroutine else ''}a coroutine "
                        "function now")
    return problems


def sets_attribute(cls: type, attr: str) -> list[str]:
    """`cls` assigns `self.attr` somewhere (a per-instance target that is replaced once
    the object exists)."""
    try:
        src = inspect.getsource(cls)
    except (OSError, TypeError):
        return [f"{_name(cls)} source unavailable"]
    if re.search(rf"self\.{re.escape(attr)}(: [^=]+)? = ", src):
        return []
    return [f"{_name(cls)} no longer sets self.{attr}"]


def _name(owner: object) -> str:
    return getattr(owner, "__qualname__", None) or getattr(owner, "__name__", repr(owner))


# The version gate -------------------------------------------------------------------------

def problems() -> list[str]:
    """Every registered patch whose targets changed shape, one line each."""
    return [f"{p.name}: {msg}" for p in PATCHES.values() for msg in p.shape()]


def check_version(version: str) -> bool:
    """True on the pinned py-libp2p. On another version: PatchError if any patch no longer
    applies, else one loud warning (the patches apply but were not tested there)."""
    if version == PINNED_LIBP2P:
        return True
    broken = problems()
    if broken:
        raise PatchError(
            f"py-libp2p {version} is installed but swarm-node's patches were written for "
            f"{PINNED_LIBP2P}, and {len(broken)} no longer apply: " + "; ".join(broken)
            + f". Install libp2p=={PINNED_LIBP2P}.")
    log.warning("py-libp2p %s is installed but swarm-node's patches were written for %s: "
                "they still apply, but untested there (stream-handler, rate-limit and "
                "yamux-window protections may not hold). Install libp2p==%s.", version,
                PINNED_LIBP2P, PINNED_LIBP2P)
    return False
