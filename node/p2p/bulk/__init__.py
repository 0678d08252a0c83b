"""The bulk plane: one TLS port beside libp2p for checkpoint shards and announced gossip
bodies, authenticated by the node's identity both ways (plane.py says how)."""

from .client import BulkClient, parse_endpoint
from .conn import RX_STATS, BulkConn
from .errors import BulkBusy, BulkError, BulkUnavailable
from .plane import BulkPlane, listen_address
from .pool import IdlePool
from .server import BulkServer

__all__ = ["RX_STATS", "BulkBusy", "BulkClient", "BulkConn", "BulkError", "BulkPlane",
           "BulkServer", "BulkUnavailable", "IdlePool", "listen_address", "parse_endpoint"]
