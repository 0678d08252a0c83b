"""How the trainer integration tests pace a trainer that peers feed.

Stepping on each verified peer batch (`peer_batches_per_step = 1`) makes the trainer and
its peers run flat out: every step publishes a version, every version lets each peer sample
its next rounds at once, and the pair burns both cores while the test waits for a count or
a few seconds of a condition. `PACE` steps on what arrived every `peer_wait_s` instead
(peer_batches_per_step far above what arrives): a version every few seconds, still several
per test and more than any check here needs. tests/integration/test_trainer_steering.py
paces its trainer the same way (commit f8b62c8: 3.4x less CPU).
"""

from __future__ import annotations

PACE = {"peer_batches_per_step": 1000, "peer_wait_s": 3.0}
