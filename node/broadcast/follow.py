"""Which trainer a follower (inference peer, relay) adopts checkpoints from.

A node adopts checkpoints only from trainers it follows. With `node.follow` set, those.
Without it, the node makes ONE explicit choice: the trainer its bootstrap peer announces
(the bootstrap peer's own manifest if it is a trainer, or the policy of its first
`shard_advert` if it is a relay or another follower). The operator picked that bootstrap
peer, so the choice is anchored in the operator's own configuration, never in whichever key
gossips first. The choice is logged, written to `<data_dir>/follow.json` and kept across
restarts; it never changes silently (only a configured `--follow` replaces it, with a log
line). A trainer follows nobody unless configured (no chooser).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)

FOLLOW_FILE = "follow.json"


def bootstrap_peer_ids(bootstrap: list[str]) -> list[str]:
    """The peer IDs in `/p2p/<id>` bootstrap multiaddrs."""
    out = []
    for addr in bootstrap:
        _, sep, pid = addr.rpartition("/p2p/")
        if sep and pid and "/" not in pid:
            out.append(pid)
    return out


class TrainerChoice:
    def __init__(self, data_dir: Path, configured: list[str], announcers: list[str]):
        self.path = Path(data_dir) / FOLLOW_FILE
        self.announcers = set(announcers)
        saved = self._load()
        self.chosen: str | None = None
        if configured:
            self.chosen = configured[0]
            if saved and saved not in configured:
                log.info("following trainer %s as configured (--follow); the earlier "
                         "choice %s is replaced", configured[0], saved)
            if saved != configured[0]:
                self._save(configured[0], "configured")
        elif saved:
            self.chosen = saved
            log.info("following trainer %s (chosen earlier, kept in %s; pass --follow to "
                     "choose another)", saved, self.path)
        elif self.announcers:
            log.info("no --follow given: following the trainer that bootstrap peer %s "
                     "announces", ", ".join(sorted(self.announcers)))
        else:
            log.warning("no --follow and no --bootstrap: this node follows no trainer")

    def offer(self, announcer: str, policy_id: str) -> bool:
        """`announcer` (a signed manifest's or advert's sender) names `policy_id`. True if
        this made the choice (only once, only from a bootstrap peer)."""
        if self.chosen is not None or announcer not in self.announcers:
            return False
        self.chosen = policy_id
        self._save(policy_id, f"announced by bootstrap peer {announcer}")
        how = "its own policy" if announcer == policy_id else f"the policy of {announcer}"
        log.info("following trainer %s (%s, announced by the bootstrap peer); kept in %s "
                 "across restarts; pass --follow to choose another", policy_id, how,
                 self.path)
        return True

    def _load(self) -> str | None:
        try:
            value = json.loads(self.path.read_text()).get("trainer")
        except (OSError, ValueError, AttributeError):
            return None
        return value if isinstance(value, str) and 0 < len(value) <= 128 else None

    def _save(self, trainer: str, why: str) -> None:
        tmp = self.path.with_name(FOLLOW_FILE + ".tmp")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps({"trainer": trainer, "why": why}))
            os.replace(tmp, self.path)
        except OSError as e:  # the choice still holds for this run; logged, not fatal
            log.warning("could not save the followed trainer to %s: %s", self.path, e)


def trainer_choice(cfg) -> TrainerChoice:
    """The choice of a follower role from its config (node.follow, node.bootstrap)."""
    return TrainerChoice(cfg.data_dir, list(cfg.node.follow),
                         bootstrap_peer_ids(list(cfg.node.bootstrap)))
