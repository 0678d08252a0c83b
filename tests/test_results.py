"""benchmarks/results.py: a rerun replaces its section and its headline rows; nothing is
appended as a dated copy."""

from __future__ import annotations

import pytest

from benchmarks.results import Headline, anchor, record

TEXT = """# Benchmark results

intro

## Headline figures

<!-- begin headline -->
| figure | goal | current | baseline | date | load | section |
|---|---|---|---|---|---|---|
| gossip: p95 vs hivemind | <= 0.3x | 0.25x | hivemind 620 ms | 2026-12-01 | 2.9 | [gossip](#gossip) |
| broadcast: 4 clients | <= 0.25x | 0.16x | shardcast 16 s | 2026-12-01 | 1.2 | [broadcast](#broadcast) |
<!-- end headline -->

<!-- begin gossip -->
## gossip

old gossip run
<!-- end gossip -->

<!-- begin broadcast -->
## broadcast

broadcast run
<!-- end broadcast -->
"""


def test_rerun_replaces_section_and_its_headline_row(tmp_path):
    path = tmp_path / "RESULTS.md"
    path.write_text(TEXT)
    record("gossip", "new gossip run", command="python benchmarks/gossip.py", path=path,
           headline=[Headline("gossip: p95 vs hivemind", "<= 0.3x", "0.21x | quiet",
                              "hivemind 700 ms", load="0.4"),
                     Headline("gossip: CPU per hop", "<= 1/3", "5 ms")])
    text = path.read_text()
    assert "old gossip run" not in text and text.count("new gossip run") == 1
    assert text.count("<!-- begin gossip -->") == 1
    assert "broadcast run" in text and text.index("## gossip") < text.index("## broadcast")
    rows = text.split("<!-- begin headline -->")[1].split("<!-- end headline -->")[0]
    rows = rows.strip().splitlines()[2:]
    assert len(rows) == 3  # one replaced in place, one added, the broadcast row untouched
    assert rows[0].startswith("| gossip: p95 vs hivemind | <= 0.3x | 0.21x \\| quiet | "
                              "hivemind 700 ms | ")
    assert rows[0].endswith("| 0.4 | [gossip](#gossip) |")
    assert rows[1].startswith("| broadcast: 4 clients | <= 0.25x | 0.16x |")
    assert rows[2].startswith("| gossip: CPU per hop | <= 1/3 | 5 ms | - |")


def test_new_file_gets_header_table_and_section(tmp_path):
    path = tmp_path / "RESULTS.md"
    record("trainer throughput (CPU, tiny model)", "figures", command="x", path=path,
           headline=[Headline("trainer: tokens/s", "-", "9129")])
    text = path.read_text()
    assert text.index("<!-- begin headline -->") < text.index("## trainer throughput")
    assert "[trainer throughput (CPU, tiny model)](#trainer-throughput-cpu-tiny-model)" in text


@pytest.mark.parametrize("name", ["gossip (session 6)", "broadcast (quiet rerun, end of s8)"])
def test_dated_copies_are_refused(tmp_path, name):
    path = tmp_path / "RESULTS.md"
    path.write_text(TEXT)
    with pytest.raises(ValueError, match="names a run"):
        record(name, "figures", command="x", path=path)
    assert path.read_text() == TEXT


def test_anchor_is_githubs_heading_slug():
    assert anchor("learning: prompt styles (SmolLM2 base rates)") == \
        "#learning-prompt-styles-smollm2-base-rates"
    assert anchor("gossip-load2") == "#gossip-load2"
