"""What the dashboard and `swarm-node status` show besides the raw numbers, computed once
from the `/status` document: the stuck states (`alerts`), each naming its fix, and what this
node contributes (`contribution`), per role.

Both are pure functions of the document, so the page, the CLI and the tests read the same
thing. The admin endpoint adds them to `/status`; the CLI computes them itself when it talks
to a node that did not.
"""

from __future__ import annotations

from typing import Any

from ...verifier.reasons import HONEST_MISTAKES, REASONS

ERROR, WARNING = "error", "warning"
MIB = 2**20


def alerts(doc: dict[str, Any]) -> list[dict[str, str]]:
    """Every stuck state of the node in `doc`, most severe first: {code, level, title,
    detail, fix}. Empty when nothing is wrong."""
    extra = _dict(doc.get("extra"))
    out: list[dict[str, str]] = []
    p2p = _dict(doc.get("p2p"))
    if p2p and p2p.get("alive") is False:
        out.append(_alert("host_failed", ERROR, "The libp2p host stopped",
                          str(p2p.get("failure") or ""),
                          "the node exits so that a supervisor restarts it; see its log"))
    mine = _dict(doc.get("verdicts_about_me"))
    for trainer, ban in _dict(mine.get("banned_by")).items():
        out.append(_alert(
            "banned", ERROR, f"Banned by trainer {_short(trainer)}",
            str(_dict(ban).get("detail") or "the trainer's reputation of this node fell "
                                            "below its ban threshold"),
            "the rejection reasons below say why; run the unmodified software with the "
            "swarm's model and settings. Its rollouts are dropped until the ban expires"))
    refused = _dict(extra.get("settings")).get("refused")
    if refused:
        out.append(_alert(
            "settings_refused", ERROR, "Policy refused: the trainer's swarm settings differ",
            str(refused), "remove the differing settings from this node's config and flags "
            "(it then adopts the swarm's), or follow another trainer (--follow)"))
    config_rejects = {r: n for r, n in _dict(mine.get("rejected")).items()
                      if str(r).startswith("config_") and isinstance(n, int) and n}
    if config_rejects and not refused:
        out.append(_alert(
            "settings_differ", WARNING, "The trainer rejects this node's rollouts for "
            "configuration differences",
            ", ".join(f"{n} {r}" for r, n in sorted(config_rejects.items())),
            "use the swarm's settings (model, task mix, sampling): remove local overrides so "
            "this node adopts the trainer's; these rejections are never penalised"))
    follow = _dict(extra.get("follow"))
    if follow and not follow.get("seen"):
        out.append(_alert(
            "nothing_to_follow", WARNING,
            "No trainer to follow" if not follow.get("trainer")
            else f"Nothing received from the followed trainer {_short(follow['trainer'])}",
            str(follow.get("problem") or ""),
            "join with the complete line the trainer prints ('others join with: ...'): "
            "--swarm, --bootstrap and --follow"))
    for key, watch in extra.items():
        watch = _dict(watch)
        if watch.get("paused") is True and "path" in watch:
            name = str(watch.get("name") or key)
            need = watch.get("min_free_bytes")
            keep = f" (node.min_free_disk_mib = {need // MIB} must stay free)" \
                if isinstance(need, int) else ""
            out.append(_alert(
                f"disk_paused:{key}", WARNING, f"Paused: disk full ({name})",
                str(watch.get("detail") or ""),
                f"free space on the disk holding {watch.get('path')}{keep}; it resumes by "
                "itself, nothing is lost"))
    reach = _reachability(doc)
    if reach is not None and "unreachable" in reach[0].lower():
        out.append(_alert("unreachable", WARNING, "Unreachable: other peers cannot dial "
                          "this node", reach[1], reach[2] or "open the listen port (TCP) "
                          "in the firewall/NAT, or let the node use a relay"))
    for code, problem in _dict(doc.get("problems")).items():
        problem = _dict(problem)
        out.append(_alert(str(code), str(problem.get("level") or WARNING),
                          str(problem.get("title") or code), str(problem.get("detail") or ""),
                          str(problem.get("fix") or "")))
    out.sort(key=lambda a: a["level"] != ERROR)
    return out


def contribution(doc: dict[str, Any]) -> dict[str, Any]:
    """What this node gives the swarm, by role (numbers only; the views word them)."""
    role = doc.get("role")
    counters = _dict(doc.get("counters"))
    if role == "trainer":
        by_peer = _dict(doc.get("accepted_by_peer"))
        total = sum(_int(_dict(c).get("accepted")) for c in by_peer.values())
        top = sorted(((p, _int(_dict(c).get("accepted"))) for p, c in by_peer.items()),
                     key=lambda kv: -kv[1])
        return {"role": "trainer", "versions": _int(doc.get("policy_version")),
                "accepted_from_peers": total,
                "peers_contributing": sum(1 for _, n in top if n > 0),
                "top_peers": [{"peer": p, "accepted": n,
                               "share": round(n / total, 4) if total else 0.0}
                              for p, n in top[:10] if n > 0],
                "train_steps": _int(counters.get("train_steps")),
                "tokens_trained": _int(counters.get("tokens_trained")),
                "bytes_served": _int(_dict(doc.get("served")).get("bytes")),
                "peers_served": _int(_dict(doc.get("served")).get("peers"))}
    if role == "relay":
        served = _dict(doc.get("served"))
        return {"role": "relay", "versions_mirrored": _int(counters.get("versions_mirrored")),
                "bytes_downloaded": _int(counters.get("bytes_downloaded")),
                "bytes_served": _int(served.get("bytes")),
                "peers_served": _int(served.get("peers")),
                "policy_version": _int(doc.get("policy_version"))}
    mine = _dict(doc.get("verdicts_about_me"))
    trainers = []
    for trainer, rec in _dict(mine.get("by_trainer")).items():
        rec = _dict(rec)
        theirs = _int(rec.get("trainer_accepted"))
        trainers.append({"trainer": trainer, "accepted": _int(rec.get("accepted")),
                         "rejected": _int(rec.get("rejected")),
                         "trainer_accepted": theirs,
                         "share": round(_int(rec.get("accepted")) / theirs, 4)
                         if theirs else None})
    for t in trainers:  # rejects that count against this node (not an honest mistake)
        reasons = _dict(_dict(_dict(mine.get("by_trainer")).get(t["trainer"])).get("reasons"))
        t["rejected_held_against"] = sum(_int(n) for r, n in reasons.items()
                                         if r not in HONEST_MISTAKES)
    hour = _dict(mine.get("per_hour"))
    return {"role": "inference", "sent": _int(doc.get("rollouts_sent")),
            "accepted": _int(mine.get("accepted")),
            "rejected": sum(_int(n) for n in _dict(mine.get("rejected")).values()),
            "per_hour": hour.get("rate"), "trainers": trainers}


def reason_notes(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """What each reject reason in `doc` means, and whether it counts against the peer
    (`held_against`: evidence of cheating) or is an honest mistake (a stale policy, a
    setting, a duplicate: never penalised). The views show a reason's code with it, so an
    honest node's `stale_policy` is not read as cheating."""
    mine = _dict(doc.get("verdicts_about_me"))
    seen = set(_dict(mine.get("rejected"))) | set(_dict(doc.get("rollouts_rejected")))
    for rec in [*_dict(mine.get("by_trainer")).values(),
                *_dict(doc.get("accepted_by_peer")).values()]:
        seen |= set(_dict(_dict(rec).get("reasons")))
    return {str(r): {"text": REASONS.get(str(r), ""), "held_against": r not in HONEST_MISTAKES}
            for r in sorted(seen, key=str)}


def swarm(doc: dict[str, Any], max_peers: int = 64) -> dict[str, Any]:
    """The swarm as this node knows it, from what it already learned: its connections
    (direct or through a relay), the checkpoint adverts of the policies it follows
    (`extra.swarm`: who holds which version), the rollouts it verified (a trainer: accepted
    and rejected per peer) and the verdicts about it (the trainers that judged it).
    `peers`: one row per peer, newest-known first: role (`trainer`: it publishes a policy
    or sends verdicts; `inference`: it sent rollouts; else the role it named in its
    peer-exchange Hello (`p2p.peer_roles`); `follower`: it holds a followed policy's
    checkpoint, a relay or an inference peer; `?`: connected, nothing more known),
    the version it holds, its connection, how it is reachable (`reach`: public,
    hole-punched, relayed, unreachable or ?, with the evidence in `reach_why`; from the host's
    `p2p.peer_reach`: this node's connections and dial-back probes, and the relay addresses
    the peer announces), and on a trainer its counts. `versions`: each
    version known, with the number of peers advertising it and whether it is here."""
    extra = _dict(doc.get("extra"))
    known = _dict(extra.get("swarm"))
    holders = _dict(known.get("holders"))
    conns = _dict(_dict(doc.get("p2p")).get("connections"))
    relayed = set(conns.get("relayed_peers") or [])
    reach = _dict(_dict(doc.get("p2p")).get("peer_reach"))
    announced = _dict(_dict(doc.get("p2p")).get("peer_roles"))
    connected = set(doc.get("peers") or [])
    by_peer = _dict(doc.get("accepted_by_peer"))
    trainers = set(_dict(_dict(doc.get("verdicts_about_me")).get("by_trainer")))
    trainers |= {str(_dict(v).get("policy_id")) for v in known.get("versions") or []}
    if doc.get("policy_id") and doc.get("role") != "trainer":
        trainers.add(str(doc["policy_id"]))
    me = doc.get("peer_id")
    rows = []
    for peer in sorted((connected | set(holders) | set(by_peer) | trainers | set(reach))
                       - {me, "None"}):
        held = _dict(holders.get(peer))
        counts = _dict(by_peer.get(peer))
        said = announced.get(peer)
        role = ("trainer" if peer in trainers else "inference" if counts
                else said if said in ("trainer", "inference", "relay")
                else "follower" if held else "?")
        row = {"peer": peer, "role": role,
               "version": held.get("version") if held else None,
               "complete": held.get("complete") if held else None,
               "connection": ("relayed" if peer in relayed else "direct")
               if peer in connected else "not connected"}
        kind = reach.get(peer)
        if isinstance(kind, list) and len(kind) == 2:
            row["reach"], row["reach_why"] = str(kind[0]), str(kind[1])
        else:
            row["reach"], row["reach_why"] = "?", "not known from here"
        if counts:
            row["accepted"] = _int(counts.get("accepted"))
            row["rejected"] = _int(counts.get("rejected"))
        rows.append(row)
    rows.sort(key=lambda r: (r["connection"] == "not connected", -(r["version"] or -1)))
    return {"peers": rows[:max_peers], "peers_known": len(rows),
            "versions": [v for v in known.get("versions") or [] if isinstance(v, dict)]}


def _reachability(doc: dict[str, Any]) -> tuple[str, str, str] | None:
    """(status, detail, fix) from wherever the host reports it, or None when it does not."""
    extra = _dict(doc.get("extra"))
    for value in (doc.get("reachability"), _dict(doc.get("p2p")).get("reachability"),
                  extra.get("reachability")):
        if isinstance(value, str) and value:
            return value, "", ""
        if isinstance(value, dict) and value:
            status = next((str(value[k]) for k in ("status", "state", "verdict", "kind")
                           if value.get(k)), "")
            detail = next((str(value[k]) for k in ("detail", "reason", "message")
                           if value.get(k)), "")
            fix = next((str(value[k]) for k in ("fix", "hint", "advice") if value.get(k)), "")
            return status, detail, fix
    return None


def _alert(code: str, level: str, title: str, detail: str, fix: str) -> dict[str, str]:
    return {"code": code, "level": level, "title": title, "detail": detail, "fix": fix}


def _dict(value) -> dict:
    return value if isinstance(value, dict) else {}


def _int(value) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _short(peer: str) -> str:
    return f"...{peer[-8:]}" if len(peer) > 16 else peer
