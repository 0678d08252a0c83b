"""The installed software version (the protocol version is `protocol.PROTOCOL_VERSION`)."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version


def software_version() -> str:
    try:
        return version("swarm-node")
    except PackageNotFoundError:
        return "unknown"
