"""What an operator sees (issue 29): the join line a trainer prints, a full disk, the
dashboard and `swarm-node status` in each stuck state, and counters against what the node
did. Real `swarm-node join` processes on 127.0.0.1 (tiny model), pages in headless Chromium.

One trainer (module fixture) serves every test. The disk test runs one inference peer on a
small tmpfs it fills and frees (root needed to mount; skipped with one reason otherwise).
`SWARM_DASHBOARD_DIR=<dir>` keeps the screenshots (the README's come from here).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from rich.text import Text

from tests.launch import start_join

from .test_operator import Node, get, status, taken_admin_port, trainer_config, wait_for

BIN = Path(sys.executable).parent / "swarm-node"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


# headless Chromium -------------------------------------------------------------------------


def dashboard(port: int, tmp_path: Path, shot: str | None = None) -> str:
    """The dashboard's DOM after its script rendered /status (and a screenshot, kept under
    SWARM_DASHBOARD_DIR when that is set), from one Chromium run: a launch costs 1-3 s."""
    if CHROMIUM is None:
        pytest.skip("chromium is not installed (apt-get install -y chromium)")
    url = f"http://127.0.0.1:{port}/dashboard"
    flags = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
             f"--user-data-dir={tmp_path / 'chromium'}", "--virtual-time-budget=6000",
             "--window-size=1100,1500", "--dump-dom"]
    path = None
    if shot is not None:
        keep = os.environ.get("SWARM_DASHBOARD_DIR")
        path = Path(keep) / shot if keep else tmp_path / shot
        flags.append(f"--screenshot={path}")
    dom = subprocess.run([*flags, url], capture_output=True, text=True, timeout=120,
                         check=False).stdout
    assert 'data-ready="1"' in dom, dom[:3000]
    if path is not None:
        assert path.stat().st_size > 10_000
    return dom


def banners(dom: str) -> list[str]:
    box = re.search(r'id="alerts"[^>]*data-codes="([^"]*)"', dom)
    return box.group(1).split() if box and box.group(1) else []


def element_text(dom: str, element_id: str) -> str:
    m = re.search(rf'id="{element_id}"[^>]*>([^<]*)<', dom)
    assert m, f"no #{element_id} in the page"
    return m.group(1)


# processes -----------------------------------------------------------------------------------


class Peer:
    """`swarm-node join` started from a command line (the trainer's join line plus this
    machine's own flags), with its log and admin port; forked from a warm interpreter
    (tests/launch.py). The restart on a full disk is a real exec."""

    def __init__(self, root: Path, argv: list[str]):
        self.root, self.argv = root, argv
        self.log = root / "node.log"
        self.data = Path(argv[argv.index("--data-dir") + 1])
        self.proc: subprocess.Popen | None = None

    @property
    def admin_port(self) -> int | None:
        """The port it took (--admin-port 0): from its node.json, once written."""
        return taken_admin_port(self.data, self.proc)

    def start(self) -> Peer:
        self.root.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "HOME": str(self.root), "OMP_NUM_THREADS": "1",
               "PYTHONUNBUFFERED": "1"}
        # forked warm (tests/launch.py): ~9 s of CPU importing torch saved per start
        self.proc = start_join(BIN, self.argv[1:], env, self.log)
        return self

    def status(self) -> dict:
        port = self.admin_port
        return status(port) if port else {}

    def text(self) -> str:
        return self.log.read_text()

    def wait(self, pred, what: str, timeout: float = 180):
        return wait_for(pred, timeout, what, self.proc, self.log)

    def stop(self) -> int:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(signal.SIGINT)
        try:
            return self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            pytest.fail(f"{self.argv[2:4]} did not stop within 60 s of Ctrl-C")


def peer_argv(line: str, root: Path, model: Path, *extra: str) -> list[str]:
    """The pasted join line, plus what differs per machine: data dir, ports, model files."""
    return [*shlex.split(line), "--data-dir", str(root / "data"), "--listen",
            "/ip4/127.0.0.1/tcp/0", "--admin-port", "0", "--model", str(model),
            *extra]


# the module trainer's step interval: no test needs versions faster (the fastest asks for
# two more versions, or three mirrored, while it watches a peer)
PACE_S = 3.0


@pytest.fixture(scope="module")
def swarm(tmp_path_factory, tiny_model_dir):
    """A trainer that keeps training (local sampling) and verifying its peers' batches as
    they arrive, a step every PACE_S seconds on what arrived (paced by each peer batch, the
    trainer and the test's inference peer ran flat out, in lockstep)."""
    root = tmp_path_factory.mktemp("views-trainer")
    node = Node(root, trainer_config(root, tiny_model_dir, peer_batches_per_step=1000,
                                     peer_wait_s=PACE_S)).start()
    try:
        node.wait_joined()
        yield node
    finally:
        node.stop()


def _trainer_row(doc: dict, trainer_id: str) -> dict | None:
    """The trainer's row of `doc`'s swarm view once it holds a version advertised by the
    trainer that is at least the version this node runs (None before)."""
    row = next((r for r in (doc.get("swarm") or {}).get("peers") or []
                if r["peer"] == trainer_id), None)
    if row is None or row["version"] is None or row["version"] < doc["policy_version"]:
        return None
    return row


def _advertised_and_held(doc: dict, trainer_id: str) -> dict | None:
    """`doc` once its swarm view has the trainer's row (`_trainer_row`) and a version of the
    trainer's that is complete here and advertised by at least one holder (None before)."""
    if _trainer_row(doc, trainer_id) is None:
        return None
    if not any(v["policy_id"] == trainer_id and v["here"] == "complete" and v["holders"] >= 1
               for v in doc["swarm"]["versions"]):
        return None
    return doc


def join_line(trainer: Node) -> str:
    m = re.search(r"others join with: (swarm-node join .*?--follow \S+)", trainer.log.read_text())
    assert m, trainer.log.read_text()[-2000:]
    return m.group(1)


def logged_sum(text: str, pattern: str) -> int:
    return sum(int(n) for n in re.findall(pattern, text))


# the join line, a full disk, history across restarts --------------------------------------


def fill(path: Path) -> None:
    """Write zeros to `path` until the filesystem has no byte left."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        for block in (2**20, 4096, 1):
            try:
                while True:
                    os.write(fd, b"\0" * block)
            except OSError:
                pass
    finally:
        os.close(fd)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_join_line_full_disk_and_history(swarm, tiny_model_dir, small_disk, tmp_path):
    line = join_line(swarm)
    trainer_id = swarm.status()["peer_id"]
    # the printed line is complete: swarm id, bootstrap address and the trainer to follow
    assert f"--swarm {swarm.cfg['node']['swarm_id']} " in line and f"--follow {trainer_id}" in line
    assert re.search(r"--bootstrap /ip4/127\.0\.0\.1/tcp/\d+/p2p/" + trainer_id, line)
    # version_wait_s: a peer whose rounds of its version are used up waits this long for the
    # next version before looking again (and then meets the full disk); 30 s by default
    argv = peer_argv(line, small_disk, tiny_model_dir, "--set", "node.min_free_disk_mib=8",
                     "--set", "sampler.version_wait_s=3")
    peer = Peer(tmp_path / "peer", argv).start()
    try:
        # pasted as printed, it follows the trainer and its rollouts are accepted
        peer.wait(lambda: peer.status().get("contribution", {}).get("accepted", 0) > 0,
                  "rollouts accepted by the trainer")
        before = peer.status()
        text = peer.text()
        after = peer.status()
        for key, pattern in (("accepted", r"verified my round \d+: (\d+) accepted"),
                             ("sent", r"published round \d+: (\d+) completions")):
            # counters against the node's own log lines (read between two reads of /status)
            assert before["contribution"][key] <= logged_sum(text, pattern) \
                <= after["contribution"][key], key
        mine = swarm.status()["accepted_by_peer"][after["peer_id"]]
        assert mine["accepted"] >= after["contribution"]["accepted"]  # verdicts lag
        trainer_share = after["contribution"]["trainers"][0]
        assert trainer_share["trainer"] == trainer_id and 0 < trainer_share["share"] <= 1
        assert after["policy_id"] == trainer_id  # not "policy -" beside a checkpoint
        # the swarm as the peer knows it: its trainer, connected directly, and the versions
        # it advertised, the newest held here too. A row's version is the newest one the
        # peer heard the trainer advertise (ARCHITECTURE `swarm`), not the one it
        # downloaded: a peer that fetched a version whose first advert it missed (it joined
        # after it) hears it at the trainer's next re-advert (`readvertise_s`, 10 s), so
        # the row may lag the peer's first accepted rollout (a whole-suite run failed so)
        # the same lag holds for a version's holders: a version held here counts its
        # holders from the adverts heard (a whole-suite run failed reading them from `after`)
        view = peer.wait(lambda: _advertised_and_held(peer.status(), trainer_id),
                         "the trainer's advertised version in the peer's swarm view", 60)
        row = _trainer_row(view, trainer_id)
        assert row["role"] == "trainer" and row["connection"] == "direct", row
        # a /status of now, not `after`: the wait above may have outlasted every version
        # `after` lists (the store prunes old ones), leaving none of them to check on disk
        _downloads_match_disk(peer.status(), small_disk / "data" / "broadcast" / trainer_id)
        # the trainer counts what it uploaded: to this peer, at least what it downloaded
        # (a download superseded by a newer version is served but not recorded)
        wait_for(lambda: swarm.status()["served"]["bytes"] >= after["counters"][
            "bytes_downloaded"], 60, "the trainer's served bytes")
        assert swarm.status()["served"]["peers"] >= 1
        assert after["alerts"] == [] and f"--follow {trainer_id}" in after["join_command"]
        dom = dashboard(peer.admin_port, tmp_path, "dashboard-inference.png")
        assert banners(dom) == [] and int(element_text(dom, "c-accepted")) > 0
        assert re.search(r'id="swarm-peers" data-rows="[1-9]', dom)
        assert 'data-role="inference"' in dom

        # the disk fills: sampling pauses with one line, the dashboard says so and how
        fill(small_disk / "filler")
        peer.wait(lambda: "disk_paused:sampling_disk" in _codes(peer.status()),
                  "sampling paused in /status")
        sent = peer.status()["rollouts_sent"]
        dom = dashboard(peer.admin_port, tmp_path, "dashboard-disk-full.png")
        assert "disk_paused:sampling_disk" in banners(dom)
        assert "free space on the disk holding" in dom
        version = swarm.status()["policy_version"]
        wait_for(lambda: swarm.status()["policy_version"] >= version + 2, 120,
                 "two more trainer versions while the peer is paused")
        assert peer.text().count("disk full: sampling paused") == 1
        assert peer.status()["rollouts_sent"] == sent  # nothing sampled meanwhile

        # space returns: it resumes by itself
        (small_disk / "filler").unlink()
        peer.wait(lambda: "disk space back: sampling resumed" in peer.text(), "resumed")
        peer.wait(lambda: peer.status()["rollouts_sent"] > sent, "sampling again")

        # a restart keeps the dashboard's history (curves, counts), saved at the stop, and
        # starts from the newest verified version on disk (not the base model, v0)
        held = peer.status()["policy_version"]
        assert peer.stop() == 0 and held > 0
        saved = json.loads((small_disk / "data" / "history.json").read_text())
        peer.start()
        peer.wait(lambda: "history restored" in peer.text(), "history restored")
        ready = peer.wait(lambda: re.findall(r"inference peer ready: .*policy version (\d+)",
                                             peer.text())[1:], "ready after the restart")
        assert int(ready[0]) >= held
        doc = peer.wait(lambda: peer.status() or None, "/status after the restart")
        assert len(doc["steps"]) >= len(saved["steps"]) >= 2
        assert doc["rollouts_sent"] >= saved["rollouts_sent"] > 0
        assert doc["contribution"]["accepted"] >= saved["own_verdicts"]["accepted"] > 0

        # full again: Ctrl-C still stops it at once (a write waiting for space gives up)
        peer.wait(lambda: peer.status().get("phase") == "running", "running again")
        fill(small_disk / "filler")
        # whichever write meets the full disk first waits for space: a sample, or the
        # download of the version it needs (the restarted peer may hold sampling until that
        # version is here: its rounds of an older one would be stale)
        peer.wait(lambda: any(c.startswith("disk_paused:") for c in _codes(peer.status())),
                  "paused again")
        assert peer.stop() == 0 and peer.text().rstrip().endswith("stopped")

        # a restart on the full disk: one line, no traceback
        fill(small_disk / "filler")
        restart = subprocess.run([str(BIN), *argv[1:]], capture_output=True, text=True,
                                 env={**os.environ, "HOME": str(tmp_path / "peer")},
                                 timeout=120, check=False)
        lines = [ln for ln in restart.stderr.splitlines() if ln.strip()]
        assert restart.returncode == 1 and len(lines) == 1, restart.stderr
        assert "the disk is full" in lines[0] and str(small_disk / "data") in lines[0]
    finally:
        peer.stop()


def _gauges(text: str, family: str) -> dict[str, float]:
    """{label value: value} of one metric family in a /metrics text."""
    return {m.group(1): float(m.group(2)) for m in re.finditer(
        rf'^{family}{{\w+="([^"]*)"}} (\S+)$', text, re.MULTILINE)}


def _codes(doc: dict) -> list[str]:
    return [a["code"] for a in doc.get("alerts") or []]


def _relay_row_and_holders(view: dict, relay_id: str, trainer_id: str) -> bool:
    """The trainer's swarm view names the relay's newest version, and a version of its own
    held complete there has a holder."""
    return (any(r["peer"] == relay_id and r.get("version") is not None for r in view["peers"])
            and any(v["policy_id"] == trainer_id and v["here"] == "complete"
                    and v["holders"] >= 1 for v in view["versions"]))


def _downloads_match_disk(doc: dict, store: Path) -> None:
    """Each recorded download is one verified version; its bytes are the checkpoint's size
    on disk (for the versions the store still keeps)."""
    downloads = doc["downloads"]
    assert downloads and doc["counters"]["checkpoints_downloaded"] == len(downloads)
    assert doc["counters"]["bytes_downloaded"] == sum(d["bytes"] for d in downloads)
    checked = 0
    for d in downloads:
        ckpt = store / f"{d['version']:012d}" / "checkpoint"
        on_disk = _size_on_disk(ckpt)
        # the node runs on and its store prunes old versions (rmtree, a file at a time): a
        # short count is a prune under way when the directory is gone moments later
        deadline = time.monotonic() + 10
        while on_disk is not None and on_disk != d["bytes"] and time.monotonic() < deadline:
            time.sleep(0.1)
            on_disk = _size_on_disk(ckpt)
        if on_disk is not None:
            assert d["bytes"] == on_disk, d
            checked += 1
    assert checked >= 1


def _size_on_disk(ckpt: Path) -> int | None:
    """Bytes of the files under `ckpt`; None when it is not there (or vanished mid-walk)."""
    try:
        size = sum(f.stat().st_size for f in ckpt.rglob("*") if f.is_file())
    except FileNotFoundError:
        return None
    return size if ckpt.is_dir() else None


# banned, the trainer's own view ---------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_banned_peer_is_told_and_the_trainer_counts_it(swarm, tiny_model_dir, tmp_path):
    argv = peer_argv(join_line(swarm), tmp_path, tiny_model_dir, "--set",
                     "node.dishonest=tamper_tokens")
    cheater = Peer(tmp_path / "cheater", argv).start()
    try:
        cheater.wait(lambda: "banned" in _codes(cheater.status()), "the ban in /status")
        doc = cheater.status()
        ban = next(a for a in doc["alerts"] if a["code"] == "banned")
        assert ban["level"] == "error" and ban["fix"]
        dom = dashboard(cheater.admin_port, tmp_path, "dashboard-banned.png")
        assert banners(dom)[0] == "banned"
        cli = subprocess.run([str(BIN), "status", "--port", str(cheater.admin_port)],
                             capture_output=True, text=True, timeout=60, check=False,
                             env={**os.environ, "COLUMNS": "200", "NO_COLOR": "1"})
        assert cli.returncode == 0 and "NEEDS ATTENTION" in cli.stdout
        assert "Banned by trainer" in cli.stdout

        trainer = swarm.status()
        me = doc["peer_id"]
        assert me in trainer["banned"] and trainer["accepted_by_peer"][me]["accepted"] == 0
        row = next(r for r in trainer["swarm"]["peers"] if r["peer"] == me)  # the swarm view
        assert row["role"] == "inference" and row["accepted"] == 0 and row["rejected"] > 0
        assert trainer["contribution"]["role"] == "trainer"
        assert all(p["peer"] != me for p in trainer["contribution"]["top_peers"])
        dom = dashboard(swarm.admin_port, tmp_path, "dashboard-trainer.png")
        assert 'data-role="trainer"' in dom and "banned" in dom.split('id="peers"')[1]
        assert f"--follow {trainer['peer_id']}" in element_text(dom, "join")
        assert int(dom.split('id="loss-chart"')[1].split('data-points="')[1].split('"')[0]) >= 1
        # the step in progress: what it waits for, the groups gathered, the pace and ETA
        step = trainer["extra"]["step"]
        assert step["next_version"] == trainer["policy_version"] + 1 and step["pace_s"] > 0
        assert step["groups"]["need_local"] == 4 and step["doing"]
        assert re.search(r'id="step-box"[^>]*data-phase="\w+"', dom)
        assert "groups gathered for the step" in dom and "a version every" in dom
        cli = subprocess.run([str(BIN), "status", "--port", str(swarm.admin_port)],
                             capture_output=True, text=True, timeout=60, check=False,
                             env={**os.environ, "COLUMNS": "250", "NO_COLOR": "1"})
        assert cli.returncode == 0 and "training step" in cli.stdout, cli.stdout
    finally:
        cheater.stop()


# refused settings: no stale rounds sent ----------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_peer_that_refuses_the_policy_sends_no_stale_rounds(swarm, tiny_model_dir, tmp_path):
    """An explicit setting that differs from the swarm's: the trainer's policy is refused.
    Once the trainer is more than trainer.max_staleness versions past what the peer holds,
    its rounds would be rejected as stale (and counted against it): it holds them instead,
    says so once, and shows the refusal as a banner."""
    lag = 1  # the peer's own staleness bound: the module trainer is far past v0 + 1
    wait_for(lambda: swarm.status()["policy_version"] > lag + 1, 120, "the trainer past v2")
    # version_wait_s, how long a peer waits for the trainer's announcement before sampling
    # what it has, far beyond this test: the refusal that holds sampling ends that wait (the
    # gate wakes the round loop once the refused version is more than `lag` ahead; with 2 s,
    # a whole-suite run's peer ran out of its wait before it heard the trainer and sent v0)
    argv = peer_argv(join_line(swarm), tmp_path, tiny_model_dir, "--set",
                     "sampler.temperature=0.7", "--set", "sampler.version_wait_s=3600",
                     "--set", f"trainer.max_staleness={lag}")
    peer = Peer(tmp_path / "refusing", argv).start()
    try:
        peer.wait(lambda: "sampling held: the trainer's" in peer.text(), "sampling held")
        assert "settings_refused" in _codes(peer.status())
        version = swarm.status()["policy_version"]
        # five paced trainer versions (>= 15 s; each one refused here, none wakes the held
        # peer into a round) later: still nothing sent
        wait_for(lambda: swarm.status()["policy_version"] >= version + 5, 120,
                 "five more trainer versions while the peer holds")
        doc = peer.status()
        assert doc["rollouts_sent"] == 0 and not doc["verdicts_about_me"].get("rejected")
        assert doc["peer_id"] not in swarm.status()["accepted_by_peer"]
        assert peer.text().count("sampling held") == 1
        assert "published round" not in peer.text()
        # the dashboard leads with the refusal, naming the setting and the fix
        dom = dashboard(peer.admin_port, tmp_path, "dashboard-refused.png")
        assert banners(dom)[0] == "settings_refused"
        assert "sampler.temperature = 0.7 here" in dom and "remove the differing" in dom
        assert peer.text().count("refusing the policy of trainer") == 1
    finally:
        peer.stop()


# relays: counters, and a relay with nothing to follow -----------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_relay_counters_and_a_relay_with_nothing_to_follow(swarm, tmp_path):
    line = join_line(swarm).replace("--role inference", "--role relay")
    relay = Peer(tmp_path / "relay", [*shlex.split(line), "--data-dir",
                                      str(tmp_path / "relay" / "data"), "--listen",
                                      "/ip4/127.0.0.1/tcp/0", "--admin-port",
                                      "0"]).start()
    lonely = Peer(tmp_path / "lonely", ["swarm-node", "join", "--role", "relay",
                                        "--data-dir", str(tmp_path / "lonely" / "data"),
                                        "--listen", "/ip4/127.0.0.1/tcp/0",
                                        "--admin-port", "0"]).start()
    try:
        lonely.wait(lambda: "nothing_to_follow" in _codes(lonely.status()),
                    "the nothing-to-follow banner", timeout=120)
        dom = dashboard(lonely.admin_port, tmp_path, "dashboard-nothing-to-follow.png")
        assert banners(dom) == ["nothing_to_follow"] and "--follow" in dom

        trainer_id = swarm.status()["peer_id"]
        relay.wait(lambda: relay.status().get("counters", {}).get("versions_mirrored", 0) >= 3,
                   "three versions mirrored")
        before = relay.status()
        text = relay.text()
        after = relay.status()
        mirrored = len(re.findall(r"mirrored policy \S+ v\d+", text))
        assert before["counters"]["versions_mirrored"] <= mirrored \
            <= after["counters"]["versions_mirrored"]
        assert before["counters"]["checkpoints_downloaded"] <= mirrored \
            <= after["counters"]["checkpoints_downloaded"]
        _downloads_match_disk(after, tmp_path / "relay" / "data" / "broadcast" / trainer_id)
        assert after["policy_id"] == trainer_id
        c = after["contribution"]
        assert c["role"] == "relay" and c["versions_mirrored"] >= 3
        assert c["bytes_downloaded"] == after["counters"]["bytes_downloaded"]
        # others may bootstrap through the relay with its own complete line
        assert f"--follow {trainer_id}" in after["join_command"]
        dom = dashboard(relay.admin_port, tmp_path, "dashboard-relay.png")
        assert 'data-role="relay"' in dom and banners(dom) == []
        assert int(element_text(dom, "c-mirrored")) >= 3
        assert any(v["here"] == "complete" for v in after["swarm"]["versions"])
        # what the first download loaded was frozen too (before: 144,562 objects tracked,
        # 121,230 frozen; after: ~1k tracked, 265k frozen)
        heap = _gauges(get(relay.admin_port, "/metrics").decode(), "swarm_node_gc_objects")
        assert heap["tracked"] < heap["frozen"] / 2, heap
        # the trainer knows the relay holds its versions (it ignored adverts of its own
        # policy: "versions known" showed 0 peers advertising what it published)
        # (one /status where both hold: a version's holders count the adverts heard, which
        # lag like the row does; a /status read after the wait could still miss them)
        relay_id = after["peer_id"]
        wait_for(lambda: _relay_row_and_holders(swarm.status()["swarm"], relay_id, trainer_id),
                 120, "the trainer's swarm view: the relay's newest version, held",
                 swarm.proc, swarm.log)

        # restarted, it serves what it stored at once (not counted as mirrored again)
        held = relay.status()["policy_version"]
        assert relay.stop() == 0
        mark = len(relay.text())
        relay.start()
        found = relay.wait(lambda: re.search(r"serving the stored policy \S+ v(\d+)",
                                             relay.text()[mark:]), "the stored version")
        assert int(found.group(1)) >= held
        assert "mirrored policy" not in relay.text()[mark:][:found.start()]
    finally:
        relay.stop()
        lonely.stop()


# every banner in Chromium (states a test swarm cannot reach yet: the host's reachability) --


async def test_every_stuck_state_is_a_banner_in_chromium(tmp_path):
    from swarm_node.node.admin import AdminServer
    from swarm_node.node.diskspace import DiskWatch
    from swarm_node.node.metrics import NodeState

    state = NodeState("12D3KooWInferencePeer0000000000", "inference", "my-swarm")
    state.phase = "running"
    state.own_verdicts.add("12D3KooWTrainer000000000000000000", False, "banned", 0,
                           "reputation -12.0")
    state.own_verdicts.add("12D3KooWTrainer000000000000000000", False, "config_task_mix", 16)
    state.extra["settings"] = {"refused": "refusing the policy of trainer 00000000: its "
                                          "swarm settings differ: sampler.temperature"}
    state.extra["follow"] = {"trainer": None, "seen": False, "problem": "no trainer to follow"}
    watch = DiskWatch("checkpoint downloads", tmp_path)
    watch.hit(OSError(28, "No space left on device"))
    state.extra["disk"] = watch.status()
    state.extra["reachability"] = {"status": "unreachable", "detail": "no peer could dial "
                                   "/ip4/203.0.113.7/tcp/4001", "fix": "open TCP 4001"}
    state.set_problem("custom", "Something else", "detail", "what to do")
    state.extra["starting"] = {"doing": "loading the model", "elapsed_s": 12.0, "eta_s": 20.0,
                               "last_s": 32.0}
    trainer = "12D3KooWTrainer000000000000000000"
    state.extra["swarm"] = {"versions": [{"policy_id": trainer, "version": 7, "holders": 1,
                                          "here": ""}],
                            "holders": {trainer: {"policy_id": trainer, "version": 7,
                                                  "complete": True}}}
    state.checkpoint_progress = {"version": 8, "shards_done": 3, "shards_total": 10,
                                 "bytes_done": 30 * 2**20, "bytes_total": 100 * 2**20,
                                 "complete": False, "rate_bytes_s": 2 * 2**20, "eta_s": 35.0}
    expected = ["banned", "settings_refused", "nothing_to_follow", "disk_paused:disk",
                "unreachable", "custom"]
    async with AdminServer(state, port=0) as server:
        dom = await asyncio.to_thread(dashboard, server.port, tmp_path, "dashboard-banners.png")
        assert banners(dom) == expected  # errors first, each once
        for text in ("open TCP 4001", "no peer could dial", "sampler.temperature",
                     "what to do", "reputation -12.0"):
            assert text in dom, text
        # a download in flight: a progress bar, its rate and the time left
        assert element_text(dom, "download-now") == ("v8: 3/10 shards, 30.0 MiB of 100.0 MiB, "
                                                     "2.0 MiB/s, ETA 35 s")
        assert 'style="width: 30%;"' in dom.split('id="download-bar"')[1][:80]
        # a model load at start: the time so far and the ETA from the last run
        assert "loading the model: 12 s so far, ETA 20 s (took 32 s last time)" in dom
        # the swarm as it knows it: the trainer (it sends verdicts) holding v7
        assert re.search(r'id="swarm-peers" data-rows="1"', dom)
        assert re.search(r"<td[^>]*>trainer</td><td[^>]*>v7</td>", dom)
        state.extra.clear()
        state.own_verdicts.banned_by.clear()
        state.clear_problem("custom")
        dom = await asyncio.to_thread(dashboard, server.port, tmp_path)
        # a configuration difference the trainer rejects for, once nothing else is wrong
        assert banners(dom) == ["settings_differ"]



async def test_honest_rejects_are_not_shown_as_cheating(tmp_path):
    """A fresh honest peer's rounds rejected as stale (walkthrough: 32 of its first 512, the
    trainer 4+ versions ahead by the time it verified them) are amber and explained; a
    proof mismatch is red."""
    from swarm_node.node.admin import AdminServer, render_tables
    from swarm_node.node.metrics import NodeState
    from swarm_node.verifier.reasons import HONEST_MISTAKES

    assert "stale_policy" in HONEST_MISTAKES and "proof_index_mismatch" not in HONEST_MISTAKES
    honest, strict = "12D3KooWTrainerHonest00000000000", "12D3KooWTrainerStrict00000000000"
    state = NodeState("12D3KooWInferencePeer0000000000", "inference", "my-swarm")
    state.phase = "running"
    state.own_verdicts.add(honest, True, "accepted", 480)
    state.own_verdicts.add(honest, False, "stale_policy", 32)
    state.own_verdicts.add(strict, False, "proof_index_mismatch", 5)
    async with AdminServer(state, port=0) as server:
        doc = await asyncio.to_thread(status, server.port)
        assert doc["reasons"]["stale_policy"]["held_against"] is False
        assert doc["reasons"]["proof_index_mismatch"]["held_against"] is True
        held = {t["trainer"]: t["rejected_held_against"]
                for t in doc["contribution"]["trainers"]}
        assert held == {honest: 0, strict: 5}
        dom = await asyncio.to_thread(dashboard, server.port, tmp_path)
    cells = re.findall(r'<td class="n (\w*)">(\d+)</td>', dom.split('id="contribution"')[1]
                       .split("</table>")[0])
    assert ("warn", "32") in cells and ("bad", "5") in cells, cells
    notes = dom.split('id="verdict-notes"')[1].split("</div></div>")[0]
    assert "stale_policy" in notes and "not held against the sender" in notes
    assert "proof_index_mismatch" in notes
    printed = "\n".join(str(t) for t in render_tables(doc) if isinstance(t, str | Text))
    assert "stale_policy: policy version older" in printed
    assert "not held against the sender" in printed
