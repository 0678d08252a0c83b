"""Config tree: TOML, CLI overrides, error messages, --dry-run."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
from pydantic import BaseModel
from swarm_node.cli.main import app
from swarm_node.node.config import Config, build_config, dump_toml, load_config
from swarm_node.node.errors import ConfigError, NodeError
from swarm_node.protocol.limits import DEFAULT_MAX_BYTES
from typer.testing import CliRunner

NODE_TOML = """
[node]
role = "trainer"
swarm_id = "lab-1"
data_dir = "/srv/swarm"
bootstrap = ["/ip4/10.0.0.1/tcp/4001/p2p/12D3KooWExample"]

[sampler]
completions_per_task = 4
temperature = 0.7

[tasks]
mix = { "toy/digit_successor" = 2.0, "rg/basic_arithmetic" = 1.0 }

[limits]
max_message_bytes = { rollout_batch = 1048576 }
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "node.toml"
    path.write_text(text)
    return path


def sections():
    return [(name, info.annotation) for name, info in Config.model_fields.items()]


def test_defaults_are_valid_and_documented():
    cfg = Config()
    assert cfg.node.role == "inference"
    for name, section in sections():
        assert issubclass(section, BaseModel)
        for field, info in section.model_fields.items():
            assert info.description, f"{name}.{field} has no docstring"


def test_toml_load(tmp_path):
    cfg = load_config(write(tmp_path, NODE_TOML))
    assert cfg.node.role == "trainer"
    assert cfg.node.swarm_id == "lab-1"
    assert cfg.data_dir == Path("/srv/swarm")
    assert cfg.key_path == Path("/srv/swarm/node_key.pem")
    assert cfg.sampler.completions_per_task == 4 and cfg.sampler.temperature == 0.7
    assert cfg.tasks.mix == {"toy/digit_successor": 2.0, "rg/basic_arithmetic": 1.0}
    limits = cfg.limits.to_limits()
    assert limits.max_for("rollout_batch") == 1 << 20
    assert limits.max_for("hello") == DEFAULT_MAX_BYTES["hello"]
    assert cfg.trainer == Config().trainer  # untouched sections keep their defaults


def test_cli_overrides_win_and_none_means_unset(tmp_path):
    cfg = load_config(write(tmp_path, NODE_TOML), {
        "node.role": "relay", "node.swarm_id": None, "admin.port": 9100,
        "identity.key_path": str(tmp_path / "k.pem"),
    })
    assert cfg.node.role == "relay"
    assert cfg.node.swarm_id == "lab-1"
    assert cfg.admin.port == 9100
    assert cfg.key_path == tmp_path / "k.pem"


def test_data_dir_expands_user(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    assert Config().data_dir == tmp_path / ".swarm-node"
    assert Config().key_path == tmp_path / ".swarm-node" / "node_key.pem"


@pytest.mark.parametrize("text,key,hint", [
    ("[node]\nswarmid = 'x'\n", "node.swarmid", "did you mean `swarm_id`"),
    ("[nodes]\nrole = 'x'\n", "nodes", "did you mean `node`"),
    ("[sampler]\nzzz = 1\n", "sampler.zzz", "expected one of:"),
    ("[trainer]\nlearning_rate = 0.1\n[trainer_extra]\n", "trainer_extra", ""),
])
def test_unknown_key_is_named(tmp_path, text, key, hint):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as e:
        load_config(path)
    msg = str(e.value)
    assert f"unknown key `{key}`" in msg and str(path) in msg and hint in msg


@pytest.mark.parametrize("text,key,value,expected", [
    ('[node]\nrole = "trainr"\n', "node.role", "'trainr'", "'inference', 'trainer'"),
    ("[sampler]\ntemperature = -1\n", "sampler.temperature", "-1", "greater than or equal to 0"),
    ('[node]\nswarm_id = "a b"\n', "node.swarm_id", "'a b'", "should match pattern"),
    ("[admin]\nport = 70000\n", "admin.port", "70000", "less than or equal to 65535"),
    ('[node]\nlisten = "x"\n', "node.listen", "'x'", "valid list"),
    ("[sampler]\ncompletions_per_task = 1.5\n", "sampler.completions_per_task", "1.5",
     "valid integer"),
])
def test_bad_value_names_key_value_and_expectation(tmp_path, text, key, value, expected):
    with pytest.raises(ConfigError) as e:
        load_config(write(tmp_path, text))
    msg = str(e.value)
    assert f"`{key}` = {value}" in msg and expected in msg


def test_all_errors_reported_at_once(tmp_path):
    with pytest.raises(ConfigError) as e:
        load_config(write(tmp_path, "[node]\nrole = 1\nnope = 2\n[admin]\nport = -1\n"))
    assert str(e.value).count("\n  ") == 3


def test_override_errors_say_command_line(tmp_path):
    with pytest.raises(ConfigError) as e:
        load_config(write(tmp_path, NODE_TOML), {"node.role": "boss"})
    assert "command line: `node.role` = 'boss'" in str(e.value)
    with pytest.raises(ConfigError, match="must be a table"):
        load_config(write(tmp_path, NODE_TOML), {"node.role.sub": 1})


def test_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "absent.toml")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(write(tmp_path, "[node\nrole="))
    assert issubclass(ConfigError, NodeError)


def test_to_toml_round_trips(tmp_path):
    cfg = load_config(write(tmp_path, NODE_TOML), {
        "model.name": 'we"ird\\name é', "identity.key_path": str(tmp_path / "k.pem")})
    text = cfg.to_toml()
    assert build_config(tomllib.loads(text)) == cfg
    assert build_config(tomllib.loads(Config().to_toml())) == Config()


def test_dump_toml_leaves_out_unset():
    text = dump_toml({"identity": {"key_path": None}, "x": {"m": {}, "l": [1, "a"]}})
    assert "# key_path = (unset)" in text
    assert tomllib.loads(text) == {"identity": {}, "x": {"m": {}, "l": [1, "a"]}}


def test_dry_run_prints_resolved_config(tmp_path):
    path = write(tmp_path, NODE_TOML)
    boot = "/ip4/127.0.0.1/tcp/4001/p2p/12D3KooWNgpKH2Luu1kDmhJkc6dRcL7Q5n3mfKxpFDzk9oARbA2S"
    result = CliRunner().invoke(app, [
        "join", "--config", str(path), "--role", "relay", "--swarm", "other",
        "--bootstrap", boot, "--admin-port", "9101",
        "--log-json", "--dry-run"])
    assert result.exit_code == 0, result.output
    printed = tomllib.loads(result.output)
    cfg = build_config(printed)
    assert cfg.node.role == "relay" and cfg.node.swarm_id == "other"
    assert cfg.node.bootstrap == [boot]
    assert cfg.admin.port == 9101 and cfg.node.log_json is True
    assert cfg.sampler.temperature == 0.7  # from the file
    assert cfg.data_dir == Path("/srv/swarm")


def test_dry_run_bad_flag_is_clear_error(tmp_path):
    result = CliRunner().invoke(app, ["join", "--role", "boss", "--dry-run"])
    assert result.exit_code == 1  # a configuration mistake (README: exit codes); 2 is usage
    assert "command line: `node.role` = 'boss'" in result.output
    assert "Traceback" not in result.output


@pytest.mark.parametrize("item,key,value", [
    ("model.dtype=bfloat16", "model.dtype", "bfloat16"),
    ("sampler.max_batch=8", "sampler.max_batch", 8),
    ("sampler.temperature=0.7", "sampler.temperature", 0.7),
    ("trainer.sample_locally=false", "trainer.sample_locally", False),
    ('node.listen=["/ip4/127.0.0.1/tcp/0"]', "node.listen", ["/ip4/127.0.0.1/tcp/0"]),
    ('tasks.mix={"toy/digit_copy"=1.0}', "tasks.mix", {"toy/digit_copy": 1.0}),
    ("--model.device=cpu", "model.device", "cpu"),
])
def test_set_overrides_parse_toml_values(item, key, value):
    from swarm_node.node.config import parse_set

    assert parse_set([item]) == {key: value}
    cfg = load_config(None, parse_set([item]))
    section, leaf = key.split(".")
    assert getattr(getattr(cfg, section), leaf) == value


@pytest.mark.parametrize("item,expect", [
    ("model.dtype=bf16", "`model.dtype` = 'bf16'"),
    ("sampler.max_bach=4", "did you mean `max_batch`"),
    ("modle.dtype=float32", "unknown key `modle`"),
    ("sampler.max_batch=0", "`sampler.max_batch` = 0"),
])
def test_set_overrides_are_validated_like_toml(item, expect):
    from swarm_node.node.config import parse_set

    with pytest.raises(ConfigError) as e:
        load_config(None, parse_set([item]))
    assert expect in str(e.value) and "command line" in str(e.value)
    assert "\n" not in str(e.value)  # one error: one line


@pytest.mark.parametrize("item", ["model.dtype", "=3", "model..dtype=x"])
def test_set_override_syntax_errors(item):
    from swarm_node.node.config import parse_set

    with pytest.raises(ConfigError, match="--set"):
        parse_set([item])


def test_admin_port_is_fixed_by_default():
    from swarm_node.node.config import DEFAULT_ADMIN_PORT

    assert Config().admin.port == DEFAULT_ADMIN_PORT != 0


@pytest.mark.parametrize("section, key, says", [
    ("broadcast", "tcp_listen", "did you mean `bulk.listen`"),
    ("broadcast", "tcp_auth_timeout_s", "did you mean `bulk.handshake_timeout_s`"),
    ("p2p", "payload_tcp_listen", "did you mean `bulk.listen`"),
    ("p2p", "payload_tcp_conns_per_peer", "did you mean `p2p.payload_pulls_per_peer`"),
    ("p2p", "payload_token_ttl_s", "there are no tokens"),
])
def test_the_old_side_plane_keys_name_the_bulk_plane(section, key, says):
    with pytest.raises(ConfigError, match=f"unknown key `{section}.{key}`.*{says}"):
        build_config({section: {key: "off" if "listen" in key else 1}})


@pytest.mark.parametrize("bulk, message", [
    ({"listen": "4002"}, '`bulk.listen` = .*"host:port"'),
    ({"advertise": "example.org:0"}, "`bulk.advertise` = "),
    ({"known_reserve": 256}, "known_reserve must be below"),
])
def test_bulk_settings_are_checked(bulk, message):
    with pytest.raises(ConfigError, match=message):
        build_config({"bulk": bulk})
    assert build_config({"bulk": {"listen": "[::1]:0", "advertise": "h.example:4102"}})


def test_a_loaded_config_is_read_only_and_changed_only_by_copy(tmp_path):
    """Nothing mutates configuration after start: fields, lists and tables all refuse;
    `with_overrides` is a new validated Config that keeps what was set explicitly."""
    path = tmp_path / "node.toml"
    path.write_text(NODE_TOML)
    cfg = load_config(path, {"trainer.micro_batch_size": 8})
    with pytest.raises(ConfigError, match="read-only.*`trainer.micro_batch_size`"):
        cfg.trainer.micro_batch_size = 4
    with pytest.raises(ConfigError, match="read-only"):
        cfg.node = cfg.node
    with pytest.raises(TypeError, match="read-only"):
        cfg.node.bootstrap.append("/ip4/10.0.0.2/tcp/4001")
    with pytest.raises(TypeError, match="read-only"):
        cfg.tasks.mix["toy/digit_successor"] = 9.0
    with pytest.raises(TypeError, match="read-only"):
        cfg.limits.max_message_bytes.update(rollout_batch=1)
    assert cfg == load_config(path, {"trainer.micro_batch_size": 8})
    new = cfg.with_overrides({"sampler.temperature": 0.5})
    assert (new.sampler.temperature, cfg.sampler.temperature) == (0.5, 0.7)
    assert new.sampler.model_fields_set == {"completions_per_task", "temperature"}
    assert new.trainer.micro_batch_size == 8 and new.tasks.mix == cfg.tasks.mix
    with pytest.raises(ConfigError, match="sampler.temperature"):
        cfg.with_overrides({"sampler.temperature": -1})


@pytest.mark.parametrize("key, value, expected", [
    ("queue_grace", "-1", "greater than or equal to 0"),
    ("queue_grace", "65", "less than or equal to 64"),
    ("queue_grace", "1.5", "a valid integer"),
    ("alarm_forgive_s", "-1.0", "greater than or equal to 0"),
    ("alarm_forgive_s", "inf", "a finite number"),
    ("alarm_forgive_s", "nan", "a finite number"),
])
def test_queue_grace_and_alarm_forgiveness_are_checked(tmp_path, key, value, expected):
    """Issue 30: the verification queue's grace and the alarm forgiveness interval are
    settings; a bad value is one line naming the key, the value and what is expected."""
    with pytest.raises(ConfigError) as e:
        load_config(write(tmp_path, f"[verifier]\n{key} = {value}\n"))
    msg = str(e.value)
    assert "\n" not in msg and f"`verifier.{key}` = {value}: Input should be {expected}" in msg



def test_queue_grace_and_alarm_forgiveness_reach_the_verifier(tmp_path):
    """Defaults (2 versions, a day) and configured values reach what uses them: the
    retention (rules.retention), the trainer's checks and the reputation."""
    from swarm_node.verifier.checks import CheckSettings
    from swarm_node.verifier.reputation import ALARM_FORGIVE_S, Reputation
    from swarm_node.verifier.rules import retention

    cfg = load_config(write(tmp_path, NODE_TOML))
    assert (cfg.verifier.queue_grace, cfg.verifier.alarm_forgive_s) == (2, 86_400.0)
    assert CheckSettings().queue_grace == 2 and ALARM_FORGIVE_S == 86_400.0
    cfg = load_config(write(tmp_path, "[verifier]\nqueue_grace = 0\nalarm_forgive_s = 60.0\n"),
                      {"trainer.max_staleness": 3})
    assert retention(cfg, 1) == 4
    assert Reputation.from_config(cfg.verifier, None).alarm_forgive_s == 60.0
