"""Decides whether a rollout is honest: activation-hash proofs, rollout checks, reputation."""
