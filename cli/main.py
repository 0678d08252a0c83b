"""`swarm-node`: a thin typer layer over `swarm_node.node`.

Heavy modules (torch, transformers, libp2p, vllm) are imported inside the commands, so
`swarm-node --help` answers fast.

Exit codes (README "Operating a node"): 0 success; 1 a mistake or failure, said in one line
(a bad config value or key, a failed check, a node that cannot start or stops on an error);
2 a command line the parser rejects (an unknown flag or command, a missing argument); 130
interrupted (a second Ctrl-C).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import typer

from ..node.errors import NodeError
from ..node.version import software_version
from ..protocol import PROTOCOL_VERSION

app = typer.Typer(
    name="swarm-node",
    help="Decentralized, verified RL post-training of language models.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

ConfigOpt = typer.Option(None, "--config", "-c", help="TOML config file.", exists=False)
DataDirOpt = typer.Option(None, "--data-dir", help="Data directory (key, buffers, checkpoints).")
KeyWriteOpt = typer.Option(None, "--key", help="Key file to write.")
KeyReadOpt = typer.Option(None, "--key", help="Key file to read.")
BootstrapOpt = typer.Option(None, "--bootstrap", "-b",
                            help="Multiaddr of a peer to join through (repeatable).")
ListenOpt = typer.Option(None, "--listen", help="Multiaddr to listen on.")
FollowOpt = typer.Option(None, "--follow", help="Peer ID of a trainer to follow.")
WorkdirOpt = typer.Option(None, "--workdir", help="Where the demo keeps files.")
ModelDirArg = typer.Argument(..., help="Folder to write the model and tokenizer to.")
EXIT_ERROR = 1  # a mistake or a failure, said in one line (click's usage errors are 2)


def _fail(message: str, code: int = EXIT_ERROR, json_line: bool = False) -> None:
    message = _one_line(message)
    if json_line:  # `--log-json`: the last line is a JSON object like every other
        typer.echo(json.dumps({"ts": round(time.time(), 3), "level": "ERROR",
                               "logger": "swarm_node", "msg": message}), err=True)
    else:
        typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    raise typer.Exit(code)


def _one_line(message: str) -> str:
    """An error of several lines (a heading, `- item` lines, a hint: a bootstrap failure)
    as the one line an operator or a supervisor's log gets: items joined by '; '."""
    out, after_item = "", False
    for raw in message.splitlines():
        line = raw.strip()
        if not line:
            continue
        item = line.startswith("- ")
        if out:
            joint = ". " if after_item and not out.endswith(".") else " "
            out += "; " if item and after_item else joint
        out += line.removeprefix("- ")
        after_item = item
    return out


def _load(config: Path | None, overrides: dict[str, Any], sets: list[str] | None = None):
    from ..node.config import load_config, parse_set

    try:
        # --set items first, so a dedicated flag (--model, --role, ...) wins over them
        return load_config(config, {**parse_set(sets or []), **overrides})
    except NodeError as e:
        _fail(str(e))


def _version(value: bool) -> None:
    if value:
        typer.echo(f"swarm-node {software_version()} (protocol {PROTOCOL_VERSION})")
        raise typer.Exit()


@app.callback()
def _root(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                       help="Print the software and protocol version.")):
    """Decentralized, verified RL post-training of language models."""


SetOpt = typer.Option(None, "--set", "-s", metavar="KEY=VALUE",
                      help="Override any config key, e.g. --set model.dtype=bfloat16 "
                           "(repeatable; validated like the TOML file).")


@app.command()
def keygen(
    config: Path | None = ConfigOpt,
    data_dir: Path | None = DataDirOpt,
    key: Path | None = KeyWriteOpt,
    force: bool = typer.Option(False, "--force", help="Overwrite an existing key."),
) -> None:
    """Create the node's Ed25519 key (PEM, mode 0600) and print its peer ID."""
    from ..node.identity import Identity

    cfg = _load(config, {"node.data_dir": data_dir, "identity.key_path": key})
    path = cfg.key_path
    if path.exists() and not force:
        _fail(f"{path} already exists (use --force to replace it; the peer ID would change)")
    ident = Identity.generate()
    try:
        ident.save(path)
    except NodeError as e:
        _fail(str(e), 1)
    typer.echo(f"wrote {path}")
    typer.echo(ident.peer_id)


@app.command("id")
def show_id(
    config: Path | None = ConfigOpt,
    data_dir: Path | None = DataDirOpt,
    key: Path | None = KeyReadOpt,
) -> None:
    """Print this node's libp2p peer ID."""
    from ..node.identity import Identity

    cfg = _load(config, {"node.data_dir": data_dir, "identity.key_path": key})
    try:
        typer.echo(Identity.load(cfg.key_path).peer_id)
    except NodeError as e:
        _fail(str(e))


@app.command()
def join(
    role: str | None = typer.Option(None, "--role", "-r",
                                       help="inference | trainer | relay"),
    config: Path | None = ConfigOpt,
    data_dir: Path | None = DataDirOpt,
    bootstrap: list[str] | None = BootstrapOpt,
    listen: list[str] | None = ListenOpt,
    swarm: str | None = typer.Option(None, "--swarm",
                                     help="Swarm id (the trainer's join line names it)."),
    follow: list[str] | None = FollowOpt,
    model: str | None = typer.Option(None, "--model",
                                     help="HF model id, local dir, or builtin:smollm2-135m."),
    admin_port: int | None = typer.Option(
        None, "--admin-port", help="Port of the admin endpoint (dashboard, /status, "
        "/metrics) on 127.0.0.1; 0 picks a free one (default 4010)."),
    log_json: bool | None = typer.Option(
        None, "--log-json/--log-text", help="Log one JSON object per line (for a log "
        "collector) or plain text lines (default)."),
    sets: list[str] | None = SetOpt,
    new_model: bool = typer.Option(False, "--new-model",
                                   help="The data dir holds another model's checkpoints: "
                                        "move them aside and start this model afresh."),
    dry_run: bool = typer.Option(False, "--dry-run",
                                 help="Run every start-up check (addresses, peer ids, tasks, "
                                      "device, model, checkpoints, free ports, the data-dir "
                                      "lock) without starting or changing anything; print "
                                      "the resolved config and exit."),
    procs: int | None = typer.Option(
        None, "--procs", help="Trainer: N ranks of this trainer (torchrun); rank 0 is the node."),
) -> None:
    """Join a swarm (or start one) in the given role."""
    overrides = {
        "node.role": role, "node.data_dir": str(data_dir) if data_dir else None,
        "node.bootstrap": bootstrap or None, "node.listen": listen or None,
        "node.swarm_id": swarm, "node.follow": follow or None, "model.name": model,
        "admin.port": admin_port, "node.log_json": log_json, "trainer.procs": procs,
    }
    cfg = _load(config, overrides, sets)

    as_json = cfg.node.log_json
    if dry_run:
        from ..node.preflight import check_config, check_data_dir, check_ports

        try:
            notes = check_config(cfg, new_model=new_model)
            check_data_dir(cfg)
            notes += check_ports(cfg)
        except NodeError as e:
            _fail(str(e), 1, as_json)
        typer.echo(cfg.to_toml())
        for note in notes:
            typer.echo(f"# {note}")
        typer.echo("# config ok")
        return
    try:
        _start(cfg, new_model, as_json)
    except KeyboardInterrupt:  # before the node's own handler is in place (its imports)
        _fail("interrupted before the node started; nothing was started or changed", 130,
              as_json)


def _start(cfg, new_model: bool, as_json: bool) -> None:
    try:
        from ..node.runner import run_node
    except ImportError as e:
        _fail(f"this build cannot run a node yet: {e}", 1, as_json)
    if cfg.node.role == "trainer" and cfg.trainer.procs > 1:  # re-executes under torchrun
        from ..node.trainer.distributed import launch

        launch(cfg, cfg.trainer.procs, cfg.data_dir / "trainer" / "ranks" / "config.toml")
    try:
        run_node(cfg, new_model=new_model)
    except NodeError as e:
        _fail(str(e), 1, as_json)


@app.command()
def doctor(
    config: Path | None = ConfigOpt,
    model: str | None = typer.Option(None, "--model", help="HF model id or local dir."),
    sets: list[str] | None = SetOpt,
    load: bool = typer.Option(False, "--load",
                              help="Also load the model's weights (slow; builds a builtin "
                                   "model on first use) and count its parameters exactly; "
                                   "prints progress with an ETA from the last --load."),
) -> None:
    """Print the hardware, what fits on each device (model, dtype, batch sizes), any problem.

    Answers in seconds from the model's config.json alone; --load is the full check."""
    from ..node.doctor import doctor_report

    cfg = _load(config, {"model.name": model}, sets)
    try:
        lines, problems = doctor_report(cfg, load=load,
                                        say=lambda line: typer.echo(line, err=True))
    except NodeError as e:
        _fail(str(e))
    for line in lines:
        typer.echo(line)
    for p in problems:
        typer.secho(f"problem: {p}", fg=typer.colors.YELLOW)
    typer.echo("no problems found" if not problems else f"{len(problems)} problem(s)")
    raise typer.Exit(1 if problems else 0)


@app.command()
def demo(
    rounds: int = typer.Option(0, "--rounds", help="Training steps (0: the demo's default)."),
    inference_peers: int = typer.Option(2, "--inference-peers", help="Honest inference peers."),
    workdir: Path | None = WorkdirOpt,
    model: str = typer.Option("tiny", "--model",
                              help="tiny (fast) or smollm2 (SmolLM2-135M-Instruct on "
                                   "arithmetic; slow on a CPU; held-out accuracy at the end)."),
    cheater: bool = typer.Option(True, "--cheater/--no-cheater",
                                 help="Run the dishonest peer (off: an honest learning swarm)."),
    time_limit_s: float = typer.Option(0.0, "--time-limit-s",
                                       help="Stop training after this long (0: the default)."),
) -> None:
    """Run a complete local swarm on loopback (the built-in tiny model by default)."""
    try:
        from ..node.demo import run_demo
    except ImportError as e:
        _fail(f"this build cannot run the demo yet: {e}", 1)
    try:
        code = run_demo(rounds=rounds, inference_peers=inference_peers, workdir=workdir,
                        model=model, cheater=cheater, time_limit_s=time_limit_s or None)
    except NodeError as e:
        _fail(str(e), 1)
    raise typer.Exit(code or 0)


@app.command()
def status(
    config: Path | None = ConfigOpt,
    data_dir: Path | None = DataDirOpt,
    port: int | None = typer.Option(None, "--port", help="Admin port (default: from data dir)."),
    as_json: bool = typer.Option(False, "--json", help="Print the raw JSON."),
) -> None:
    """Show the local node's status (peers, policy version, rollouts, reward)."""
    cfg = _load(config, {"node.data_dir": str(data_dir) if data_dir else None})
    try:
        from ..node.admin import print_status
    except ImportError as e:
        _fail(f"this build has no status endpoint yet: {e}", 1)
    try:
        print_status(cfg, port=port, as_json=as_json)
    except NodeError as e:
        _fail(str(e), 1)


@app.command("make-tiny-model")
def make_tiny_model(
    directory: Path = ModelDirArg,
    seed: int = typer.Option(0, "--seed", help="Seed of the random initial weights."),
) -> None:
    """Build the built-in tiny model (Qwen2 architecture, local tokenizer) into DIRECTORY."""
    from ..node.models import build_tiny_model

    try:
        build_tiny_model(directory, seed=seed)
    except NodeError as e:
        _fail(str(e), 1)
    typer.echo(f"wrote tiny model to {directory}")


model_app = typer.Typer(help="Builtin models.", no_args_is_help=True)
app.add_typer(model_app, name="model")


@model_app.command("prepare")
def model_prepare(
    name: str = typer.Argument(..., help="Builtin model: smollm2-135m or tiny."),
    config: Path | None = ConfigOpt,
) -> None:
    """Build or convert a builtin model into the model cache (once) and print its folder."""
    from ..node.models import ensure_builtin

    cfg = _load(config, {})
    try:
        path = ensure_builtin(name if name.startswith("builtin:") else f"builtin:{name}",
                              cfg.model.cache_dir)
    except NodeError as e:
        _fail(str(e), 1)
    typer.echo(str(path))


group_app = typer.Typer(help="Trainer groups (several trainers averaging one model).",
                        no_args_is_help=True)
app.add_typer(group_app, name="group")


@group_app.command("keygen")
def group_keygen(
    path: Path = typer.Argument(Path("group.key"),
                                help="Key file to write (mode 0600); copy it into every "
                                     "member's data dir."),
) -> None:
    """Create a trainer group's shared key (README "Scaling a trainer out")."""
    from ..node.trainer.group_key import write_group_key

    try:
        write_group_key(path)
    except FileExistsError:
        _fail(f"{path} already exists (a group keeps its key; delete the file to make a new "
              "one, then copy it to every member again)")
    except OSError as e:
        _fail(f"cannot write group key {path}: {e.strerror or e}")
    typer.echo(f"wrote {path} (mode 0600): copy it into each member's data dir as group.key")


def main() -> None:
    try:
        app()
    except KeyboardInterrupt:  # Ctrl-C while a command still imports or reads its config
        typer.secho("interrupted (Ctrl-C); nothing was started", fg=typer.colors.RED,
                    err=True)
        sys.exit(130)


if __name__ == "__main__":
    main()
