"""The roles a node can play. One process runs one role (`swarm-node join --role ...`)."""

from __future__ import annotations


def make_role(cfg, identity, p2p, state):
    # Only the chosen role's module is imported: a relay never loads torch or a sampler.
    role = cfg.node.role
    if role == "inference":
        from .inference import InferenceRole  # noqa: PLC0415

        return InferenceRole(cfg, identity, p2p, state)
    if role == "trainer":
        from .trainer import TrainerRole  # noqa: PLC0415

        return TrainerRole(cfg, identity, p2p, state)
    if role == "relay":
        from .relay import RelayRole  # noqa: PLC0415

        return RelayRole(cfg, identity, p2p, state)
    raise ValueError(f"unknown role {role!r}")
