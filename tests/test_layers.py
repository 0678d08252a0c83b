"""Every module has a place in the layers contract (.importlinter).

lint-imports checks imports only between the layers it is given: a new top-level module
under node/ that no layer names is checked by nothing (it could import the CLI and be
imported by the wire). So every module and package directly under the four installed
folders must be a layer, or sit inside one (protocol/, verifier/ and cli/ are layers whole).
"""

from __future__ import annotations

import configparser
import pkgutil
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("node", "protocol", "verifier", "cli")  # as setup.py installs them
NAMESPACE = "swarm_node"


def layer_modules(importlinter: Path) -> set[str]:
    """Every module the layers contract names (a layer line may hold several, split by
    `|` or `:`; an optional layer is written in parentheses)."""
    cfg = configparser.ConfigParser()
    cfg.read(importlinter)
    out = set()
    for section in cfg.sections():
        if cfg[section].get("type") != "layers":
            continue
        for line in cfg[section]["layers"].split("\n"):
            out.update(name.strip(" ()") for name in re.split(r"[|:]", line) if name.strip())
    return out


def unlisted(root: Path, layers: set[str]) -> list[str]:
    """The modules directly under each folder that no layer covers (itself or a parent)."""
    missing = []
    for folder in FOLDERS:
        for info in pkgutil.iter_modules([str(root / folder)]):
            name = f"{NAMESPACE}.{folder}.{info.name}"
            parts = name.split(".")
            if not any(".".join(parts[:i]) in layers for i in range(2, len(parts) + 1)):
                missing.append(name)
    return sorted(missing)


def test_every_module_is_in_a_layer():
    missing = unlisted(ROOT, layer_modules(ROOT / ".importlinter"))
    assert not missing, (f"{missing}: in no layer of .importlinter's layers contract; add "
                         "each where it belongs (ARCHITECTURE.md, Layers)")


def test_a_new_unlisted_module_is_found(tmp_path):
    for folder in FOLDERS:
        (tmp_path / folder).mkdir()
    (tmp_path / "node" / "listed.py").write_text("")
    (tmp_path / "node" / "newcomer.py").write_text("")
    (tmp_path / "node" / "pkg").mkdir()
    (tmp_path / "node" / "pkg" / "__init__.py").write_text("")
    (tmp_path / "verifier" / "checks.py").write_text("")
    (tmp_path / ".importlinter").write_text(
        "[importlinter:contract:layers]\ntype = layers\nlayers =\n"
        "    swarm_node.cli\n    swarm_node.node.listed | (swarm_node.node.other)\n"
        "    swarm_node.verifier\n")
    layers = layer_modules(tmp_path / ".importlinter")
    assert {"swarm_node.node.listed", "swarm_node.node.other"} <= layers
    assert unlisted(tmp_path, layers) == ["swarm_node.node.newcomer", "swarm_node.node.pkg"]
