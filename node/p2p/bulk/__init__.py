"""The bulk plane: one TLS port beside libp2p for checkpoint shards and announced gossip
bodies, authenticated by the node's identity both ways (plane.py says how)."""

from .client import BulkClient, parse_endpoint
from .conn import BulkConn, RxStats
from .errors import BulkBusy, BulkError, BulkUnavailable
from .plane import BulkPlane, listen_address
from .pool import IdlePool
from .server import BulkServer

__all__ = ["BulkBusy", "BulkClient", "BulkConn", "BulkError", "BulkPlane",
           "BulkServer", "BulkUnavailable", "IdlePool", "RxStats", "listen_address",
           "parse_endpoint"]
