"""Which tasks a node works on in a round: derived from (swarm id, peer ID, round).

Task i of (peer, round) is a pure function of (swarm_id, peer_id, round, i, mix), so a node
cannot pick easy problems and any verifier can recompute the assignment:
    h = BLAKE2b-256("swarm-node/task-draw/v1" | swarm_id | peer_id | round | i)
    u = h[0:8] / 2^64 picks the dataset from the mix (weights normalised, names sorted)
    seed = h[8:16] as u64 >> 32  (a 32-bit generator seed)
    index = h[16:24] as u64 mod 1_000_000
    params = the generator params configured for that dataset (tasks.params), else {}
"""

from __future__ import annotations

import bisect
import hashlib
import struct

from ...protocol.messages import TaskRef
from ..errors import NodeError
from .rg import INDEX_SPACE, rg_names
from .toy import TOY_FAMILIES

_DOMAIN = b"swarm-node/task-draw/v1"
MAX_TASKS_PER_ROUND = 256


def check_dataset(name: str) -> None:
    if name.startswith("toy/"):
        if name not in TOY_FAMILIES:
            raise NodeError(f"unknown toy task family {name!r} (known: {sorted(TOY_FAMILIES)})")
    elif name.startswith("rg/"):
        if name[3:] not in rg_names():
            raise NodeError(f"unknown reasoning-gym dataset {name!r}")
    else:
        raise NodeError(f"task dataset {name!r} must start with toy/ or rg/")


class TaskSource:
    def __init__(self, mix: dict[str, float], swarm_id: str,
                 max_per_round: int = MAX_TASKS_PER_ROUND, params: dict | None = None):
        if not mix:
            raise NodeError("task mix is empty")
        self.params = {name: dict(p) for name, p in (params or {}).items()}
        for name in self.params:
            if name not in mix or not name.startswith("rg/"):
                raise NodeError(f"tasks.params names {name!r}, which is not an rg/ dataset of "
                                f"the task mix")
        for name, weight in mix.items():
            check_dataset(name)
            if not weight >= 0:
                raise NodeError(f"task mix weight of {name!r} is {weight}; must be >= 0")
        total = sum(mix.values())
        if total <= 0:
            raise NodeError("task mix weights sum to 0")
        self.names = sorted(n for n in mix if mix[n] > 0)
        acc, self._cum = 0.0, []
        for name in self.names:
            acc += mix[name] / total
            self._cum.append(acc)
        self.swarm_id = swarm_id
        self.max_per_round = max_per_round

    def ref_at(self, peer_id: str, round: int, i: int) -> TaskRef:
        key = b"\x00".join([_DOMAIN, self.swarm_id.encode(), peer_id.encode(),
                            str(int(round)).encode(), str(int(i)).encode()])
        h = hashlib.blake2b(key, digest_size=32).digest()
        u = struct.unpack("<Q", h[0:8])[0] / 2**64
        k = min(bisect.bisect_right(self._cum, u), len(self.names) - 1)
        seed = struct.unpack("<Q", h[8:16])[0] >> 32
        index = struct.unpack("<Q", h[16:24])[0] % INDEX_SPACE
        name = self.names[k]
        return TaskRef(dataset=name, params=self.params.get(name, {}), seed=seed, index=index)

    @classmethod
    def of(cls, tasks_section, swarm_id: str) -> TaskSource:
        """The task source of a node config's `tasks` section (mix and generator params)."""
        return cls(tasks_section.mix, swarm_id, params=tasks_section.params)

    def draw(self, peer_id: str, round: int, n: int) -> list[TaskRef]:
        if not 0 <= n <= self.max_per_round:
            raise NodeError(f"cannot draw {n} tasks per round (max {self.max_per_round})")
        return [self.ref_at(peer_id, round, i) for i in range(n)]

    def assigned(self, peer_id: str, round: int, ref: TaskRef, n: int | None = None) -> bool:
        """Whether `ref` is among the first `n` (default: max_per_round) tasks of (peer, round)."""
        limit = self.max_per_round if n is None else min(n, self.max_per_round)
        return any(self.ref_at(peer_id, round, i) == ref for i in range(limit))
