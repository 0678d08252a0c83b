"""The trainer group's shared key file, apart from group.py so that `swarm-node group keygen`
does not import torch (~3 s of CPU a run)."""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from ..errors import NodeError


class GroupError(NodeError):
    """The trainer group cannot be joined or used."""


def read_group_key(path: Path) -> bytes:
    """The group's shared secret: 64 hex chars in a file only its owner can read."""
    try:
        if path.stat().st_mode & 0o077:
            raise GroupError(f"{path} must not be readable by others (chmod 600)")
        key = bytes.fromhex(path.read_text().strip())
    except (OSError, ValueError) as e:
        raise GroupError(f"cannot read the group key {path}: {e}") from None
    if len(key) < 16:
        raise GroupError(f"the group key in {path} is shorter than 16 bytes")
    return key


def write_group_key(path: Path) -> None:
    """Create a new group key (mode 0600); copy the file to every member."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32) + "\n")
