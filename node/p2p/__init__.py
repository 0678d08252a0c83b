"""Peer-to-peer layer: a py-libp2p host (trio, in its own thread) behind an asyncio API.

`P2PNode` is the only thing other packages use. Nothing outside this package imports trio.
"""

from .errors import (
    BootstrapError,
    DialError,
    NotRunning,
    P2PError,
    PublishError,
    RequestError,
    StreamError,
)

__all__ = [
    "BootstrapError",
    "DialError",
    "NotRunning",
    "P2PError",
    "P2PNode",
    "PublishError",
    "RequestError",
    "StreamError",
]


def __getattr__(name):
    # Lazy: importing the package must not import libp2p/trio (keeps `--help` fast).
    if name == "P2PNode":
        from .host import P2PNode  # noqa: PLC0415

        return P2PNode
    raise AttributeError(name)
