"""The `swarm-node` console script, run as a real subprocess."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from swarm_node.node.identity import Identity

BIN = Path(sys.executable).parent / "swarm-node"
HEAVY = ("torch", "transformers", "libp2p", "trio", "vllm", "numpy", "safetensors")


def run(*args: str, home: Path, check: bool = False) -> subprocess.CompletedProcess:
    env = {**os.environ, "HOME": str(home), "NO_COLOR": "1"}
    proc = subprocess.run([str(BIN), *args], capture_output=True, text=True, env=env,
                          timeout=120, check=False)
    if check and proc.returncode != 0:
        raise AssertionError(f"{args} exited {proc.returncode}: {proc.stderr}")
    return proc


def test_console_script_installed():
    assert BIN.exists(), f"{BIN} missing: is the project installed (pip install -e .)?"


def test_keygen_then_id(tmp_path):
    data = tmp_path / "node"
    out = run("keygen", "--data-dir", str(data), home=tmp_path, check=True).stdout.split()
    key = data / "node_key.pem"
    assert out[0] == "wrote" and Path(out[1]) == key
    peer_id = out[-1]
    assert peer_id.startswith("12D3KooW")
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    assert Identity.load(key).peer_id == peer_id
    assert run("id", "--data-dir", str(data), home=tmp_path, check=True).stdout.strip() \
        == peer_id

    again = run("keygen", "--data-dir", str(data), home=tmp_path)
    assert again.returncode == 1 and "already exists" in again.stderr and "--force" in again.stderr
    assert run("id", "--data-dir", str(data), home=tmp_path).stdout.strip() == peer_id

    forced = run("keygen", "--data-dir", str(data), "--force", home=tmp_path, check=True)
    assert forced.stdout.split()[-1] != peer_id


def test_keygen_explicit_key_path_and_default_home(tmp_path):
    key = tmp_path / "keys" / "a.pem"
    peer_id = run("keygen", "--key", str(key), home=tmp_path, check=True).stdout.split()[-1]
    assert run("id", "--key", str(key), home=tmp_path, check=True).stdout.strip() == peer_id
    # Without flags the data dir is ~/.swarm-node.
    default = run("keygen", home=tmp_path, check=True).stdout.split()[-1]
    assert (tmp_path / ".swarm-node" / "node_key.pem").exists()
    assert run("id", home=tmp_path, check=True).stdout.strip() == default


def test_id_errors_are_clear(tmp_path):
    missing = run("id", "--data-dir", str(tmp_path / "none"), home=tmp_path)
    assert missing.returncode != 0
    assert "keygen" in missing.stderr and "Traceback" not in missing.stderr

    key = tmp_path / "loose.pem"
    Identity.generate().save(key)
    key.chmod(0o644)
    loose = run("id", "--key", str(key), home=tmp_path)
    assert loose.returncode != 0 and str(key) in loose.stderr and "chmod 600" in loose.stderr
    assert "Traceback" not in loose.stderr

    bad = tmp_path / "bad.pem"
    bad.write_text("not a key")
    bad.chmod(0o600)
    corrupt = run("id", "--key", str(bad), home=tmp_path)
    assert corrupt.returncode != 0 and str(bad) in corrupt.stderr
    assert "Traceback" not in corrupt.stderr


def test_join_dry_run(tmp_path):
    cfg_file = tmp_path / "node.toml"
    cfg_file.write_text('[node]\nrole = "trainer"\n[sampler]\ntemperature = 0.5\n')
    proc = run("join", "--config", str(cfg_file), "--swarm", "cli-test", "--listen",
               "/ip4/127.0.0.1/tcp/0", "--data-dir", str(tmp_path / "d"), "--dry-run",
               home=tmp_path, check=True)
    resolved = tomllib.loads(proc.stdout)
    assert resolved["node"]["role"] == "trainer"
    assert resolved["node"]["swarm_id"] == "cli-test"
    assert resolved["node"]["listen"] == ["/ip4/127.0.0.1/tcp/0"]
    assert resolved["node"]["data_dir"] == str(tmp_path / "d")
    assert resolved["sampler"]["temperature"] == 0.5
    assert not (tmp_path / "d").exists()  # a dry run touches nothing


def test_join_bad_config_is_clear(tmp_path):
    cfg_file = tmp_path / "node.toml"
    cfg_file.write_text("[node]\nrol = 'trainer'\n")
    proc = run("join", "--config", str(cfg_file), "--dry-run", home=tmp_path)
    assert proc.returncode == 1  # a mistake (README: exit codes); 2 is a bad command line
    assert "unknown key `node.rol`" in proc.stderr and "did you mean `role`" in proc.stderr
    assert "Traceback" not in proc.stderr


PROBE = """
import json, sys
sys.argv = ["swarm-node", *{args!r}]
from swarm_node.cli.main import main
try:
    main()
except SystemExit:
    pass
print("HEAVY=" + json.dumps(sorted(m for m in {heavy!r} if m in sys.modules)))
"""


@pytest.mark.parametrize("args", [["--help"], ["join", "--help"], ["status", "--help"],
                                  ["demo", "--help"], ["join", "--dry-run"]])
def test_help_imports_nothing_heavy(tmp_path, args):
    code = PROBE.format(args=args, heavy=HEAVY)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, "HOME": str(tmp_path)}, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    assert "Usage" in proc.stdout or "[node]" in proc.stdout
    loaded = json.loads(proc.stdout.rsplit("HEAVY=", 1)[1])
    assert loaded == [], f"`swarm-node {' '.join(args)}` imported {loaded}"


def test_help_lists_commands(tmp_path):
    out = run("--help", home=tmp_path, check=True).stdout
    for command in ("keygen", "id", "join", "demo", "status"):
        assert command in out


def test_keygen_unwritable_is_clear(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    proc = run("keygen", "--key", str(blocker / "key.pem"), home=tmp_path)
    assert proc.returncode == 1
    assert "cannot write key file" in proc.stderr and "Traceback" not in proc.stderr


def test_version(tmp_path):
    from swarm_node.protocol import PROTOCOL_VERSION

    proc = run("--version", home=tmp_path, check=True)
    assert proc.stdout.startswith("swarm-node ") and f"(protocol {PROTOCOL_VERSION})" in proc.stdout


@pytest.mark.slow  # two processes that import torch and transformers (~40 s on a busy machine)
def test_doctor_reports_hardware_fit_and_problems(tmp_path, tiny_model_dir):
    proc = run("doctor", "--model", str(tiny_model_dir), home=tmp_path)
    out = proc.stdout
    assert "cpu:" in out and "RAM" in out and "torch " in out
    assert "parameters (estimated from" in out and ") on cpu (" in out
    assert "sampling batch <=" in out and "recommended on cpu: model" in out
    assert "float32" in out and "bfloat16" in out and "<- configured" in out
    assert sys.platform != "linux" or "network: TCP congestion control " in out
    bad = run("doctor", "--model", str(tiny_model_dir), "--set", "model.device=cuda",
              home=tmp_path)
    assert bad.returncode == 1 and "problem: model.device = 'cuda'" in bad.stdout


def test_set_flag_reaches_the_resolved_config(tmp_path):
    proc = run("join", "--dry-run", "--data-dir", str(tmp_path / "d"), "--set",
               "model.dtype=bfloat16", "--set", "sampler.max_batch=8", home=tmp_path,
               check=True)
    resolved = tomllib.loads(proc.stdout)
    assert resolved["model"]["dtype"] == "bfloat16"
    assert resolved["sampler"]["max_batch"] == 8
    assert "# config ok" in proc.stdout


def test_dry_run_names_a_taken_port_a_taken_admin_port_and_a_locked_data_dir(tmp_path):
    import socket
    import textwrap

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        data = ["--data-dir", str(tmp_path / "d")]
        proc = run("join", "--dry-run", *data, "--listen", f"/ip4/127.0.0.1/tcp/{port}",
                   home=tmp_path)
        assert proc.returncode == 1 and f"/ip4/127.0.0.1/tcp/{port}" in proc.stderr
        assert "in use" in proc.stderr and "# config ok" not in proc.stdout
        proc = run("join", "--dry-run", *data, "--listen", "/ip4/127.0.0.1/tcp/0",
                   "--admin-port", str(port), home=tmp_path)
        assert proc.returncode == 1 and f"admin port 127.0.0.1:{port} is taken" in proc.stderr
    assert not (tmp_path / "d").exists()  # nothing created

    # a data dir held by another process (the lock a running node holds)
    (tmp_path / "d").mkdir()
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, time
        from filelock import FileLock
        lock = FileLock({str(tmp_path / 'd' / 'node.lock')!r}, timeout=0)
        lock.acquire()
        open({str(tmp_path / 'd' / 'node.pid')!r}, "w").write("4242\\n")
        print("held", flush=True)
        sys.stdin.read()
        """)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        proc = run("join", "--dry-run", "--data-dir", str(tmp_path / "d"), "--listen",
                   "/ip4/127.0.0.1/tcp/0", "--admin-port", "0", home=tmp_path)
        assert proc.returncode == 1 and "in use by another swarm-node (pid 4242)" in proc.stderr
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
    ok = run("join", "--dry-run", "--data-dir", str(tmp_path / "d"), "--listen",
             "/ip4/127.0.0.1/tcp/0", "--admin-port", "0", home=tmp_path)
    assert ok.returncode == 0 and "# config ok" in ok.stdout  # released: free again


def test_dry_run_names_a_taken_bulk_plane_port(tmp_path):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        data = ["--data-dir", str(tmp_path / "d"), "--admin-port", "0"]
        # "auto": the port after --listen's is taken; the node would run without its bulk
        # plane, and the dry run says so (the libp2p port itself is free)
        proc = run("join", "--dry-run", *data, "--listen", f"/ip4/127.0.0.1/tcp/{port - 1}",
                   home=tmp_path)
        if proc.returncode == 1 and f"tcp/{port - 1}" in proc.stderr:
            pytest.skip(f"port {port - 1} is taken by something else here")
        assert proc.returncode == 0 and "# config ok" in proc.stdout, proc.stderr
        assert f"# warning: the bulk-plane port 127.0.0.1:{port} (the libp2p port + 1) is " \
            "taken" in proc.stdout
        # an explicit bulk.listen that is taken fails, as the real join would
        proc = run("join", "--dry-run", *data, "--listen", "/ip4/127.0.0.1/tcp/0", "--set",
                   f'bulk.listen="127.0.0.1:{port}"', home=tmp_path)
        assert proc.returncode == 1 and f"bulk.listen '127.0.0.1:{port}'" in proc.stderr
    ok = run("join", "--dry-run", *data, "--listen", f"/ip4/127.0.0.1/tcp/{port - 1}",
             home=tmp_path)
    assert ok.returncode == 0 and "bulk-plane port" not in ok.stdout  # freed: no warning


def test_example_config_passes_dry_run_with_its_placeholders_marked(tmp_path):
    example = Path(__file__).parents[1] / "node.example.toml"
    text = example.read_text()
    # every placeholder is a commented-out line that says what to put there
    for line in text.splitlines():
        if "<" in line.split("#", 1)[0]:
            pytest.fail(f"an active line holds a placeholder: {line}")
    assert "REPLACE" in text and "bootstrap" not in tomllib.loads(text)["node"]
    # the ports may be taken by something else on a shared machine: the rest must pass
    proc = run("join", "--config", str(example), "--dry-run", "--data-dir",
               str(tmp_path / "d"), "--listen", "/ip4/127.0.0.1/tcp/0", "--admin-port", "0",
               home=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "# config ok" in proc.stdout


def test_unknown_role_exits_1_with_one_line(tmp_path):
    proc = run("join", "--role", "miner", "--dry-run", home=tmp_path)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 1 and len(lines) == 1 and "node.role" in lines[0]
    usage = run("join", "--no-such-flag", home=tmp_path)
    assert usage.returncode == 2  # the command line itself: the parser's usage error


def test_every_option_has_help_text():
    import typer
    from swarm_node.cli.main import app

    missing = []

    def walk(cmd, path):
        for param in cmd.params:
            if not getattr(param, "help", None):
                missing.append(f"{path} {param.opts[0] if param.opts else param.name}")
        for name, sub in getattr(cmd, "commands", {}).items():
            walk(sub, f"{path} {name}")

    walk(typer.main.get_command(app), "swarm-node")
    assert missing == []


def test_group_keygen_writes_a_private_key_once(tmp_path):
    key = tmp_path / "group.key"
    proc = run("group", "keygen", str(key), home=tmp_path, check=True)
    assert "wrote" in proc.stdout and stat.S_IMODE(key.stat().st_mode) == 0o600
    assert len(bytes.fromhex(key.read_text().strip())) == 32  # what read_group_key takes
    again = run("group", "keygen", str(key), home=tmp_path)
    assert again.returncode == 1 and "already exists" in again.stderr


def test_doctor_reads_no_weights_and_estimates_parameters_exactly(tmp_path, tiny_model_dir):
    from swarm_node.node.doctor import gpu_possible, torch_build

    # torch (1.6 s of 2.2 s quiet, 5.7 s at load 10) only where it could find a GPU
    no_gpu = not gpu_possible(torch_build())
    heavy = ("transformers", "safetensors", "libp2p", *(("torch",) if no_gpu else ()))
    code = PROBE.format(args=["doctor", "--model", str(tiny_model_dir)], heavy=heavy)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, "HOME": str(tmp_path)}, timeout=120, check=False)
    assert "recommended on cpu: model" in proc.stdout and "dtype float32" in proc.stdout
    assert "estimated from" in proc.stdout and "Writing model shards" not in proc.stderr
    assert json.loads(proc.stdout.rsplit("HEAVY=", 1)[1]) == []  # no weights, no transformers
    import torch  # what torch itself says of its build, read here without importing it

    assert f"torch {torch.__version__}, CUDA build: {torch.version.cuda or 'none'}" \
        in proc.stdout

    from swarm_node.node.config import load_config
    from swarm_node.node.doctor import model_plan
    from swarm_node.node.models import load_model

    model, _ = load_model(str(tiny_model_dir))
    exact = sum(p.numel() for p in model.parameters())
    for name in (str(tiny_model_dir), "builtin:tiny"):  # its config.json; the definition
        assert model_plan(load_config(None, {"model.name": name}))["params"] == exact, name


def test_doctor_names_the_tcp_congestion_control_and_tips_where_it_is_not_bbr(tmp_path):
    from swarm_node.node.doctor import selectable, tcp_congestion, tcp_lines

    proc = tmp_path / "ipv4"
    proc.mkdir()
    assert tcp_congestion(proc) is None and tcp_lines(None) == []  # not Linux: no line
    (proc / "tcp_congestion_control").write_text("cubic\n")
    (proc / "tcp_available_congestion_control").write_text("reno cubic\n")
    found = tcp_congestion(proc)
    # the node may choose bbr for its own connections: no tip
    assert tcp_lines(found, "bbr", chosen=True) == [
        ("network: TCP congestion control cubic (loaded: reno cubic); this node's "
        "connections: bbr (p2p.tcp_congestion)")]
    # it may not: the kernel's cubic, said, and how to switch
    lines = tcp_lines(found, "bbr", chosen=False)
    assert lines[0].endswith("this node's connections: cubic (the kernel's); bbr not "
                             "available to this node")
    assert len(lines) == 2 and "net.ipv4.tcp_congestion_control=bbr" in lines[1]
    assert len(tcp_lines(found, "", chosen=False)) == 2  # p2p.tcp_congestion = "": the same
    (proc / "tcp_congestion_control").write_text("bbr\n")
    assert tcp_lines(tcp_congestion(proc), "bbr", chosen=True) == [
        ("network: TCP congestion control bbr (loaded: reno cubic); this node's "
        "connections: bbr (the kernel's)")]
    assert not selectable("nosuchcc") and not selectable("")
    if sys.platform == "linux":  # this kernel's own answer reaches the report
        current = Path("/proc/sys/net/ipv4/tcp_congestion_control").read_text().strip()
        assert tcp_congestion()[0] == current and selectable(current)


def test_doctor_recommends_per_device():
    from swarm_node.node.doctor import KNOWN_MODELS, plan_from_config, recommend

    gib = 2**30
    assert "model builtin:smollm2-135m, dtype float32" in recommend("cpu", 16 * gib, 1024,
                                                                     "inference", False, None)
    assert "Qwen/Qwen2.5-7B-Instruct, dtype bfloat16" in recommend(
        "cuda:0", 75 * gib, 2048, "inference", True, None)
    # a full AdamW fine-tune of 7.6B parameters needs ~12 bytes each: not in 80% of 75 GiB
    big = recommend("cuda:0", 75 * gib, 2048, "trainer", True, None)
    assert "Qwen/Qwen2.5-3B-Instruct, dtype bfloat16" in big and "micro_batch_size=" in big
    small = recommend("cuda:0", 6 * gib, 2048, "trainer", False,
                      plan_from_config(KNOWN_MODELS["Qwen/Qwen2.5-0.5B-Instruct"]))
    assert "dtype float16" in small and "for the configured model" in small
    assert "nothing" in recommend("cuda:0", gib // 8, 2048, "trainer", True, None)
    # the table's estimates match the published sizes (SmolLM2 134.5M, Qwen2.5-7B 7.62B)
    assert round(plan_from_config(KNOWN_MODELS["builtin:smollm2-135m"])["params"] / 1e6, 1) \
        == 134.5
    assert round(plan_from_config(KNOWN_MODELS["Qwen/Qwen2.5-7B-Instruct"])["params"] / 1e9,
                 2) == 7.62


@pytest.mark.slow  # a process that loads torch and the tiny model
def test_doctor_load_prints_progress_with_an_eta_from_the_last_load(tmp_path, tiny_model_dir):
    args = ("doctor", "--load", "--model", str(tiny_model_dir), "--set",
            f"node.data_dir={tmp_path / 'data'}")
    (tmp_path / "data").mkdir()
    first = run(*args, home=tmp_path, check=True)
    assert "doctor: loading the weights of" in first.stderr, first.stderr
    assert "first time: no ETA" in first.stderr
    assert "counted after loading the weights" in first.stdout
    # the second load in this process (the printing path is the one the first run proved):
    # the ETA comes from the duration the first process recorded in the data dir
    from swarm_node.cli.main import app
    from typer.testing import CliRunner

    second = CliRunner().invoke(app, list(args), env={"NO_COLOR": "1", "HOME": str(tmp_path)})
    assert second.exit_code == 0, second.output
    assert "last time" in second.output and "first time" not in second.output, second.output


def test_a_builtin_model_named_without_its_prefix_gets_a_did_you_mean(tmp_path):
    from swarm_node.node.errors import NodeError
    from swarm_node.node.models import load_model

    with pytest.raises(NodeError, match="did you mean 'builtin:tiny'"):
        load_model("tiny")
    proc = run("join", "--dry-run", "--model", "tiny", "--data-dir", str(tmp_path / "d"),
               home=tmp_path)
    assert "Traceback" not in proc.stderr


@pytest.mark.skipif(sys.platform == "darwin", reason="macOS may have mps: torch is asked")
def test_doctor_asks_torch_only_where_a_gpu_is_possible():
    from swarm_node.node.doctor import GPU_DEVICE_NODES, gpu_possible

    assert not gpu_possible({"__version__": "2.13.0+cpu", "cuda": None, "hip": None})
    assert gpu_possible({})  # an unreadable build: torch is asked
    nodes = any(Path("/").glob(p.lstrip("/")) for p in GPU_DEVICE_NODES)
    assert gpu_possible({"__version__": "2.13.0", "cuda": "12.8"}) == nodes


def test_ctrl_c_before_the_node_started_says_so(tmp_path, monkeypatch):
    """Ctrl-C in the first second (still importing, before the node's own handler): one
    line and code 130, not a silent exit."""
    from swarm_node.cli.main import app
    from swarm_node.node import runner
    from typer.testing import CliRunner

    def interrupted(cfg, new_model=False):
        raise KeyboardInterrupt

    monkeypatch.setattr(runner, "run_node", interrupted)
    result = CliRunner().invoke(app, ["join", "--data-dir", str(tmp_path / "d")],
                                env={"NO_COLOR": "1", "HOME": str(tmp_path)})
    assert result.exit_code == 130
    assert "interrupted before the node started" in result.output
