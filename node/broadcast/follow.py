"""Which trainer a follower (inference peer, relay) adopts checkpoints from.

A node adopts checkpoints only from trainers it follows. With `node.follow` set, those.
Without it, the node makes ONE explicit choice, from its bootstrap peers: it asks each of
them whom it follows (FOLLOWS_PROTOCOL: a trainer names itself, a relay or an inference
peer the trainers it follows) and follows a trainer only when every bootstrap peer answered
and those that name a trainer name the same one (at once when all of them name it; after
`DECIDE_AFTER_S` when some answered that they follow nobody yet). When they name different
trainers, or a bootstrap peer stays silent (no answer at all), it follows none and says so
in one line naming who named which trainer and who is silent, asking the operator for
`--follow`; it keeps asking meanwhile. The operator picked the bootstrap peers, so the
choice is anchored in the operator's own configuration, never in whichever key gossips
first, and one bad entry in the list cannot win, not even while the others are silent
(with the real trainer down, an attacker's "follow me" is not enough). The choice is
logged, written to `<data_dir>/follow.json` and kept across restarts; it never changes
silently (only a configured `--follow` replaces it, with a log line). A trainer follows
nobody unless configured (no chooser).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
from pathlib import Path

from ...protocol.codec import pack, unpack
from ...protocol.errors import ProtocolError
from ...protocol.ids import FOLLOWS_PROTOCOL
from ..p2p import Transport

log = logging.getLogger(__name__)

FOLLOW_FILE = "follow.json"
DECIDE_AFTER_S = 30.0
"""Without an answer from every bootstrap peer, decide on the answers so far after this."""
RETRY_S = (1.0, 30.0)
"""Asking the bootstrap peers again while undecided: the first and the longest wait."""
MAX_NAMED = 16
"""Trainers one FOLLOWS_PROTOCOL answer may name."""
MAX_ANSWER = 4096
PEER_ID = re.compile(r"^[A-Za-z0-9]{1,128}$")  # as a policy directory name (store.py)


def bootstrap_peer_ids(bootstrap: list[str]) -> list[str]:
    """The peer IDs in `/p2p/<id>` bootstrap multiaddrs."""
    out = []
    for addr in bootstrap:
        _, sep, pid = addr.rpartition("/p2p/")
        if sep and pid and "/" not in pid:
            out.append(pid)
    return out


def encode_follows(trainers: list[str]) -> bytes:
    """A FOLLOWS_PROTOCOL answer: msgpack array of at most MAX_NAMED peer id strings."""
    return pack(sorted(trainers)[:MAX_NAMED])


def decode_follows(data: bytes) -> list[str]:
    """The trainers a FOLLOWS_PROTOCOL answer names; ValueError for anything else."""
    try:
        value = unpack(data, max_size=MAX_ANSWER)
    except ProtocolError as e:
        raise ValueError(f"undecodable answer: {e}") from None
    if (not isinstance(value, list) or len(value) > MAX_NAMED
            or not all(isinstance(p, str) and PEER_ID.match(p) for p in value)):
        raise ValueError("not a list of at most 16 peer ids")
    return value


class TrainerChoice:
    def __init__(self, data_dir: Path, configured: list[str], announcers: list[str]):
        self.path = Path(data_dir) / FOLLOW_FILE
        self.announcers = set(announcers)
        self.answers: dict[str, set[str]] = {}  # bootstrap peer -> trainers it follows
        self.responded: set[str] = set()  # bootstrap peers that answered (even "nobody")
        self.problem: str | None = None  # why no choice was made (said once), for /status
        saved = self._load()
        self.chosen: str | None = None
        if configured:
            self.chosen = configured[0]
            if saved and saved not in configured:
                log.warning("following trainer %s as configured (--follow); the earlier "
                            "choice %s is replaced", configured[0], saved)
            if saved != configured[0]:
                self._save(configured[0], "configured")
        elif saved:
            self.chosen = saved
            log.info("following trainer %s (chosen earlier, kept in %s; pass --follow to "
                     "choose another)", saved, self.path)
        elif self.announcers:
            log.info("no --follow given: following the trainer that bootstrap peers %s "
                     "agree on", ", ".join(sorted(self.announcers)))
        else:
            log.warning("no --follow and no --bootstrap: this node follows no trainer")

    @property
    def deciding(self) -> bool:
        """No choice yet, and bootstrap peers to ask."""
        return self.chosen is None and bool(self.announcers)

    def answered(self, peer: str, trainers: list[str]) -> None:
        """Bootstrap peer `peer` follows `trainers` (an empty answer is no answer)."""
        if peer in self.announcers:
            self.responded.add(peer)
            if trainers:
                self.answers[peer] = set(trainers)
            else:
                self.answers.pop(peer, None)

    def decide(self, final: bool = False) -> str | None:
        """Choose if the answers name exactly one trainer and every bootstrap peer named it
        (or `final`, the wait is over, and every bootstrap peer answered: some follow
        nobody yet). A silent bootstrap peer is never outvoted: after the wait, one line
        says who named what and who is silent. Returns the choice (None: none yet)."""
        if self.chosen is not None:
            return self.chosen
        named: dict[str, list[str]] = {}
        for peer, trainers in sorted(self.answers.items()):
            for t in trainers:
                named.setdefault(t, []).append(peer)
        silent = sorted(self.announcers - self.responded)
        if len(named) > 1:
            self._say("bootstrap peers disagree on the trainer to follow", named, silent)
            return None
        if not named or not (final or set(self.answers) == self.announcers):
            return None
        if silent:
            self._say("cannot choose a trainer to follow yet: not every bootstrap peer "
                      "answered", named, silent)
            return None
        (trainer, by), = named.items()
        self.chosen, self.problem = trainer, None
        self._save(trainer, f"named by bootstrap peers {', '.join(by)}")
        how = "itself" if by == [trainer] else "the trainer it follows" if len(by) == 1 \
            else "the trainer they follow"
        log.info("following trainer %s (bootstrap peer%s %s named %s); kept in %s across "
                 "restarts; pass --follow to choose another", trainer,
                 "s" if len(by) > 1 else "", ", ".join(p[-8:] for p in by), how, self.path)
        return trainer

    def _say(self, why: str, named: dict[str, list[str]], silent: list[str]) -> None:
        """The one line (logged when it changes, kept for /status) of an undecided choice."""
        parts = [f"{t} (named by {', '.join(p[-8:] for p in by)})"
                 for t, by in sorted(named.items())]
        if silent:
            parts.append(f"silent: {', '.join(p[-8:] for p in silent)}")
        line = (f"{why}: {'; '.join(parts)}. Following none (asking again): pass --follow "
                "<trainer peer id> to choose")
        if line != self.problem:
            self.problem = line
            log.warning("%s", line)

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


async def ask_bootstrap_peers(choice: TrainerChoice, node: Transport, timeout_s: float) -> str | None:
    """Ask `choice`'s bootstrap peers whom they follow (FOLLOWS_PROTOCOL over `node`), again
    and again with a growing wait, until a choice is made; returns it (None: nothing to
    ask)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + DECIDE_AFTER_S
    wait = RETRY_S[0]

    async def ask(peer: str) -> None:
        try:
            data = await node.request(peer, FOLLOWS_PROTOCOL, b"", timeout=timeout_s)
            choice.answered(peer, decode_follows(data))
        except Exception as e:  # noqa: BLE001 - unreachable or no answer yet: asked again
            log.debug("asking bootstrap peer %s whom it follows failed: %r", peer[-8:], e)

    while choice.deciding:
        await asyncio.gather(*(ask(peer) for peer in sorted(choice.announcers)))
        if choice.decide(final=loop.time() >= deadline) is not None:
            break
        left = deadline - loop.time()
        # a retry backoff, not a poll: the answers are asked for again, nothing signals them
        await asyncio.sleep(min(wait, left) if left > 0.05 else wait)
        wait = min(2 * wait, RETRY_S[1])
    return choice.chosen


def trainer_choice(cfg) -> TrainerChoice:
    """The choice of a follower role from its config (node.follow, node.bootstrap)."""
    return TrainerChoice(cfg.data_dir, list(cfg.node.follow),
                         bootstrap_peer_ids(list(cfg.node.bootstrap)))
