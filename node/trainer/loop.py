"""A trainer with its own in-process sampler: the local half of a SAPO round.

Used by the learning test and the benchmarks; a round's sampling itself is
`node/sampler/rounds.py`.
"""

from __future__ import annotations


def sync_sampler(sampler, trainer) -> None:
    """Give an in-process sampler the trainer's current weights and version."""
    if sampler.version != trainer.version:
        sampler.load_weights(trainer.state_dict(), trainer.version)
