"""Read a `wan.py --sections swarm` run's node logs (issue #27): who closed each direct
connection and why, and how steadily each follower completed versions.

    python benchmarks/swarm_logs.py WORKDIR/swarm10 RUN.json [--all]

- closes: every direct connection between peers (`--all`: relays and trainer too) that
  closed, both sides' lines paired (relay.py's ConnectionLog, DEBUG: `closed by us (why)` or
  how the reads and writes ended), attributed in this order: the run's end; a churn leaver's
  exit (its log ends within 8 s); the partition (the two sides in different halves, from
  its start to 10 s after the heal); our code (`closed by us`, noise_io's write bound);
  py-libp2p's hole punch closing the connection it had just made (`[ADDCONN_FAIL] ...
  Cancelled` in a side's swarm log: `cancelled_add_conn`); else UNEXPLAINED with both
  sides' read/write endings, followed by both sides' py-libp2p
  lines naming the other peer from LIB_BEFORE_S before the close to LIB_AFTER_S after it
  (in the logs only when the run raised them: `--node-set 'node.library_log_levels=
  {"libp2p.relay.circuit_v2.dcutr": "DEBUG", "libp2p.network.swarm": "DEBUG"}'`). Needs the
  JSON of a wan.py that records `nat_of`, the churn's `left_nodes` and the partition's
  `at`/`healed_at`/`sides`.
- followers: per boot peer, versions completed per minute in the WINDOW_S after its first
  (before the partition), the trainer's rate then; the versions each peer on the trainer's
  side completed during the partition; and the versions that waited behind a
  kept download (follower.py: the last 'vN waits' before the kept one completed) and how
  many of them completed.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import re
from collections import Counter
from pathlib import Path

WINDOW_S = 100.0
CLOSE = re.compile(r"^(\S+ \S+) DEBUG\s+\S+relay: connection to (\S+) (opened|closed)"
                   r"(?: after (\S+) s)?: (direct \S+|relayed), (\w+)(?:; (.*))?$")
NOISE_BOUND = "Noise write unfinished"
LIB_BEFORE_S, LIB_AFTER_S = 5.0, 1.0  # py-libp2p lines shown around an unexplained close
LIB_LINE = re.compile(r"^\S+ \S+ \w+\s+libp2p\.")


def cancelled_add_conn(logs: dict[str, list[str]], ids: dict[str, str], a: str, b: str,
                       t: float) -> bool:
    """py-libp2p's own close (swarm logger at DEBUG): DCUtR's `_perform_hole_punch` cancels
    its dial tasks once a direct connection verifies, and the task that made that very
    connection was still in `add_conn`'s notify (pubsub's notifee): add_conn's cleanup logs
    `[ADDCONN_FAIL] ... Cancelled` and closes the connection it had just registered."""
    for x, y in ((a, b), (b, a)):
        for ln in library_lines(logs.get(x, []), ids.get(y, "?"), t):
            if "[ADDCONN_FAIL]" in ln and "Cancelled" in ln:
                return True
    return False


def library_lines(lines: list[str], other_id: str, t: float) -> list[str]:
    """A node's py-libp2p lines that name `other_id`, around a close at `t`."""
    out = []
    for ln in lines:
        if LIB_LINE.match(ln) and other_id in ln:
            s = _ts(ln)
            if t - LIB_BEFORE_S <= s <= t + LIB_AFTER_S:
                out.append(ln)
            elif s > t + LIB_AFTER_S:
                break
    return out


def _ts(line: str) -> float:
    return dt.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S.%f").replace(
        tzinfo=dt.UTC).timestamp()


def _logs(work: Path) -> dict[str, list[str]]:
    out = {}
    for d in sorted(work.iterdir()):
        f = d / "node.log"
        if f.exists():
            out[d.name] = [ln for ln in f.read_text(errors="replace").splitlines()
                           if re.match(r"\d{4}-", ln)]
    return out


def closes(work: Path, run: dict, everyone: bool) -> Counter:
    logs = _logs(work)
    names = {}
    for name, lines in logs.items():
        for ln in lines[:400]:
            for m in re.finditer(r"peer id (12D3\w+)", ln):
                names[m.group(1)] = name
    ids = {name: pid for pid, name in names.items()}
    last = {n: _ts(lines[-1]) for n, lines in logs.items()}
    stops = [_ts(ln) for ln in logs["trainer"] if " swarm_node: stopp" in ln]
    end = min([last["trainer"], *stops]) - 3
    left = {n: how for c in run.get("churn", []) for n, how in c.get("left_nodes", {}).items()}
    part, nat = run.get("partition") or {}, run.get("nat_of", {})
    sides = part.get("sides", {})

    def side(n):
        return sides.get(n, "a" if n in ("trainer", "relay1") else "b")

    rows = []
    for a, lines in logs.items():
        for ln in lines:
            m = CLOSE.match(ln)
            if m and m.group(3) == "closed" and m.group(5).startswith("direct"):
                b = names.get(m.group(2), m.group(2)[-8:])
                if everyone or (a.startswith("p") and b.startswith("p")):
                    rows.append((_ts(ln), a, b, m.group(4), m.group(7) or ""))
    rows.sort()
    seen: list[tuple[frozenset, float]] = []
    tally: Counter = Counter()
    for t, a, b, age, why in rows:
        if any(p == frozenset((a, b)) and abs(s - t) < 6 for p, s in seen):
            continue
        seen.append((frozenset((a, b)), t))
        whys = [why] + [w for s, x, y, _, w in rows if x == b and y == a and abs(s - t) < 6]
        gone = [x for x in (a, b) if x in left and abs(last[x] - t) < 8]
        ours = [w for w in whys if w.startswith("closed by us")]
        if t >= end:
            cause = "run end"
        elif gone:
            cause = f"churn: {gone[0]} left ({left[gone[0]]})"
        elif "at" in part and part["at"] - 1 <= t <= part["healed_at"] + 10 and side(a) != side(b):
            cause = "partition: " + ("liveness" if any("liveness" in w for w in whys)
                                     else "noise_io write bound" if any(NOISE_BOUND in w for w in whys)
                                     else whys[0].split("; ", 1)[-1][:80])
        elif ours:
            cause = "ours: " + ours[0].split("(", 1)[1].split(")")[0]
        elif cancelled_add_conn(logs, ids, a, b, t):
            cause = "py-libp2p: hole punch cancelled its own dial in add_conn"
        elif any(NOISE_BOUND in w for w in whys):
            cause = "ours: noise_io write bound"
        else:
            cause = "UNEXPLAINED: " + " | ".join(w.split("; ", 1)[-1] for w in whys)
        pair = "/".join(sorted((nat.get(a, a), nat.get(b, b))))
        if cause != "run end":
            print(f"  {dt.datetime.fromtimestamp(t, dt.UTC):%H:%M:%S} {a}-{b} "
                  f"({pair}, {age} s old): {cause}")
        if cause.startswith("UNEXPLAINED"):
            for x, y in ((a, b), (b, a)):
                for ln in library_lines(logs.get(x, []), ids.get(y, "?"), t):
                    print(f"    {x}: {ln[11:]}")
        tally[(cause.split(":")[0] + (": " + cause.split(": ", 1)[1][:40] if ":" in cause else ""),
               "cone/cone" if pair == "cone/cone" else "other")] += 1
    return tally


def partition_rates(logs: dict[str, list[str]], pubs: list[float], part: dict) -> None:
    """Versions each peer on the trainer's side completed during the partition (the trainer
    publishes fastest then: half b's rollouts stop). Its start from the JSON, else the
    60 s of the trainer's log with the most publishes."""
    span = part.get("seconds", 60.0)
    at = part.get("at") or max(pubs, key=lambda t: sum(1 for u in pubs if t <= u < t + span))
    sides = part.get("sides", {})
    got = {}
    for name, lines in logs.items():
        if name.startswith("p") and sides.get(name, "a") == "a":
            got[name] = sum(1 for ln in lines if "progress: policy" in ln and ": complete," in ln
                            and at <= _ts(ln) < at + span)
    got = {n: k for n, k in got.items() if k > 2}  # no sides known: half b completes ~none
    slow = min(got, key=got.get)
    print(f"during the partition ({span:.0f} s, trainer {sum(1 for u in pubs if at <= u < at + span)}"
          f" versions), versions completed on its side: "
          + ", ".join(f"{n} {k}" for n, k in sorted(got.items())) + f"; slowest {slow} {got[slow]}")


def followers(work: Path, part: dict) -> None:
    logs = _logs(work)
    t0 = min(_ts(lines[0]) for lines in logs.values())
    pubs = [_ts(ln) for ln in logs["trainer"] if "publisher: published policy" in ln]
    rates, waited = {}, {}
    for name, lines in logs.items():
        if not name.startswith("p"):
            continue
        done, started, waiting, comp = set(), [], None, []
        for ln in lines:
            m = re.search(r" v(\d+) waits: v(\d+) is kept", ln)
            if m:
                waiting = int(m.group(1))
                continue
            m = re.search(r"progress: policy \S+ v(\d+): complete", ln)
            if m:
                v = int(m.group(1))
                done.add(v)
                comp.append(_ts(ln))
                if waiting is not None and waiting > v:
                    started.append(waiting)
                waiting = None
        waited[name] = (sum(v in done for v in started), len(started))
        if comp and _ts(lines[0]) - t0 < 30:  # boot peers (churn newcomers start later)
            rates[name] = (comp[0], sum(1 for t in comp if t <= comp[0] + WINDOW_S) * 60 / WINDOW_S)
    lo = min(f for f, _ in rates.values())
    trainer = sum(1 for t in pubs if lo <= t <= lo + WINDOW_S) * 60 / WINDOW_S
    slow = min(rates, key=lambda n: rates[n][1])
    print(f"versions completed per minute in the {WINDOW_S:.0f} s after each boot peer's first "
          f"(trainer {trainer:.1f}/min): "
          + ", ".join(f"{n} {r:.1f}" for n, (_, r) in sorted(rates.items()))
          + f"; slowest {slow} {rates[slow][1]:.1f}")
    partition_rates(logs, pubs, part)
    ok, n = (sum(v[i] for v in waited.values()) for i in (0, 1))
    print(f"versions that waited behind a kept download, completed: {ok}/{n} ("
          + ", ".join(f"{k} {a}/{b}" for k, (a, b) in sorted(waited.items())) + ")")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("work", type=Path, help="the run's swarm<N> folder of node logs")
    ap.add_argument("json", type=Path, help="the run's --json")
    ap.add_argument("--all", action="store_true", help="relays' and trainer's closes too")
    args = ap.parse_args()
    run = json.loads(args.json.read_text())["swarm"]
    print("direct connections closed (both sides paired):")
    for (cause, pair), k in sorted(closes(args.work, run, args.all).items()):
        print(f"  {k} x {pair}: {cause}")
    followers(args.work, run.get("partition") or {})


if __name__ == "__main__":
    main()
