"""The protocol IDs and topics in NODE_SPEC.md are the code's (protocol/ids.py), and only
protocol/ids.py spells a protocol ID."""

from __future__ import annotations

import re
from pathlib import Path

from swarm_node.protocol import ids

ROOT = Path(__file__).resolve().parents[2]
SPEC = ROOT / "NODE_SPEC.md"
PROTOCOL_ID = re.compile(r"/swarm-node/[a-z-]+/\d+\.\d+\.\d+")
ROW = re.compile(r"^\|\s*`([^`]+)`\s*\|\s*`([^`]+)`\s*\|")


def spec_tables() -> tuple[dict[str, str], dict[str, str]]:
    """(constant -> protocol ID, topic kind -> topic) from the spec's "Protocol IDs" section."""
    lines = SPEC.read_text().splitlines()
    start = next(i for i, line in enumerate(lines)
                 if line.startswith("#") and "Protocol IDs and topics" in line)
    protocols, topics = {}, {}
    for line in lines[start + 1:]:
        if line.startswith("#"):
            break
        m = ROW.match(line)
        if m is None:
            continue
        key, value = m.groups()
        (protocols if key.endswith("_PROTOCOL") else topics)[key] = value
    return protocols, topics


def test_stream_protocols_match_spec():
    protocols, _ = spec_tables()
    code = {name: getattr(ids, name) for name in dir(ids) if name.endswith("_PROTOCOL")}
    assert protocols == code
    assert set(ids.STREAM_PROTOCOLS) == set(code.values())


def test_topics_match_spec():
    _, topics = spec_tables()
    assert tuple(topics) == ids.TOPIC_KINDS
    for kind, template in topics.items():
        assert ids.topic("<swarm_id>", kind) == template


def test_spec_names_no_other_protocol_id():
    assert set(PROTOCOL_ID.findall(SPEC.read_text())) == set(ids.STREAM_PROTOCOLS)


def test_only_ids_module_spells_protocol_ids():
    offenders = []
    for folder in ("protocol", "node", "verifier", "cli"):
        for path in (ROOT / folder).rglob("*.py"):
            if path != ROOT / "protocol" / "ids.py" and PROTOCOL_ID.search(path.read_text()):
                offenders.append(str(path.relative_to(ROOT)))
    assert offenders == []
