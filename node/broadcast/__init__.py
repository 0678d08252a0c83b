"""Checkpoint broadcast: signed manifests, a verified shard store, a shard server and a
parallel downloader that picks sources by measured throughput and penalises bad ones.

Transport-independent: the server and downloader speak a small framed protocol over any
byte stream (`transport.py`: libp2p streams in the node, TCP or in-memory in tests).
"""
