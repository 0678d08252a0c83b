"""Disk-full recognition: OSError errnos and Rust writers that report the OS error in text."""

from __future__ import annotations

import errno

from safetensors import SafetensorError
from swarm_node.node.diskspace import DiskFull, as_disk_full, is_disk_full


def test_disk_full_recognised_from_oserror_and_safetensors(tmp_path):
    assert is_disk_full(OSError(errno.ENOSPC, "No space left on device"))
    assert is_disk_full(OSError(errno.EDQUOT, "Disk quota exceeded"))
    assert not is_disk_full(OSError(errno.ENOENT, "No such file or directory"))
    # What safetensors raised when a real trainer's checkpoint filled a tmpfs mid-write.
    full = SafetensorError("Error while serializing: I/O error: No space left on device "
                           "(os error 28)")
    assert is_disk_full(full)
    assert not is_disk_full(SafetensorError("Error while serializing: (os error 2)"))
    assert not is_disk_full(ValueError("bad"))
    err = as_disk_full(full, tmp_path)
    assert isinstance(err, DiskFull) and "disk full" in str(err)
