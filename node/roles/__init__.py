"""The roles a node can play. One process runs one role (`swarm-node join --role ...`)."""

from __future__ import annotations


def role_class(role: str) -> type:
    """The class of `role`, its module imported: for a model role torch and the model's code,
    seconds of CPU, which the runner spends in a thread while its host starts. Only the
    chosen role's module is imported: a relay never loads torch or a sampler."""
    if role == "inference":
        from .inference import InferenceRole  # noqa: PLC0415

        return InferenceRole
    if role == "trainer":
        from .trainer import TrainerRole  # noqa: PLC0415

        return TrainerRole
    if role == "relay":
        from .relay import RelayRole  # noqa: PLC0415

        return RelayRole
    raise ValueError(f"unknown role {role!r}")


def make_role(cfg, identity, p2p, state):
    return role_class(cfg.node.role)(cfg, identity, p2p, state)
