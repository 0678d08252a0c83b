"""The swarm-node wire: message schemas, codecs, signed envelopes, protocol IDs and limits.

Nothing here imports torch, transformers or libp2p, so decoding stays cheap and `--help` fast.
"""

PROTOCOL_VERSION = 1
