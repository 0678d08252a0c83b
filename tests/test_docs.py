"""The documents' cross-references resolve: every headline row of benchmarks/RESULTS.md links
to a section that exists, every NODE_SPEC section the code or the docs cite exists, and every
relative link between the documents (a file, and a heading in it) exists.

Each check is a function over text, tested once on the real files and once on a broken copy,
so a check that could never fail is caught too.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from benchmarks.results import HEADLINE_END, HEADLINE_START, anchor

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "RESULTS.md"
SPEC = ROOT / "NODE_SPEC.md"
CODE_DIRS = ("node", "protocol", "verifier", "cli", "tests", "benchmarks")
DOCS = ("README.md", "ARCHITECTURE.md", "NODE_SPEC.md", "benchmarks/RESULTS.md",
        "benchmarks/CALIBRATION.md", *sorted(str(p.relative_to(ROOT))
                                             for p in (ROOT / "docs").glob("*.md")))

SECTION = re.compile(r"<!-- begin (.+?) -->\n(.*?)<!-- end \1 -->", re.DOTALL)
LINK = re.compile(r"\]\((#[^)\s]+)\)")
# "NODE_SPEC 3.3", "NODE_SPEC.md §5.2", "NODE_SPEC 3, 7.2", "NODE_SPEC 3.3, 3.4",
# "NODE_SPEC.md 5.1 and 5.2", optionally followed by a quoted name ("Bulk plane")
_NUM = r"(?:§ ?)?\d+[a-z]?(?:\.\d+)*\b"
SPEC_REF = re.compile(
    r"NODE_SPEC(?:\.md)?(?:\]\([^)]*\))?[ ,:]*"
    rf"(?P<nums>{_NUM}(?:(?:, ?| and )(?!\d+ ){_NUM})*)?"
    r"(?:,? \"(?P<name>[^\"\n]+)\")?")
SPEC_HEADING = re.compile(r"^#{2,4} (\d+[a-z]?(?:\.\d+)*)\.? ", re.MULTILINE)
FILE_LINK = re.compile(r"\]\(([^)\s#]+\.md)(#[^)\s]*)?\)")
HEADING = re.compile(r"^#{1,6} (.+?)\s*$", re.MULTILINE)


def results_problems(text: str) -> list[str]:
    """Broken headline links and section markers of a RESULTS.md text."""
    problems = []
    anchors = {}
    for name, body in SECTION.findall(text):
        if name == "headline":
            continue
        if not body.startswith(f"## {name}\n"):
            problems.append(f"section {name!r}: its first line is not '## {name}'")
        anchors[anchor(name)] = name
    if HEADLINE_START not in text or HEADLINE_END not in text:
        return problems + ["no headline table markers"]
    rows = text.split(HEADLINE_START, 1)[1].split(HEADLINE_END, 1)[0].strip().splitlines()
    for row in rows[2:]:
        links = LINK.findall(row.rsplit("|", 2)[-2])
        if not links:
            problems.append(f"headline row without a section link: {row[:60]!r}")
        problems += [f"headline row {row[:60]!r}: no section {link}" for link in links
                     if link not in anchors]
    return problems


def spec_sections(spec: str) -> set[str]:
    return set(SPEC_HEADING.findall(spec))


def spec_ref_problems(source: str, spec: str, where: str = "") -> list[str]:
    """NODE_SPEC references in `source` that name no section (or no text) of `spec`."""
    sections, lowered = spec_sections(spec), spec.lower()
    problems = []
    for m in SPEC_REF.finditer(source):
        for num in re.findall(r"\d+[a-z]?(?:\.\d+)*", m.group("nums") or ""):
            if num not in sections:
                problems.append(f"{where}: {m.group(0)!r}: no section {num}")
        name = m.group("name")
        if name and name.lower() not in lowered:
            problems.append(f"{where}: {m.group(0)!r}: {name!r} is not in NODE_SPEC.md")
    return problems


def link_problems(text: str, here: Path, read=Path.read_text) -> list[str]:
    """Relative links `[..](path.md#heading)` in `text` (a file in folder `here`) whose file
    or heading does not exist."""
    problems = []
    for target, frag in FILE_LINK.findall(text):
        if "://" in target:
            continue
        path = (here / target).resolve()
        if not path.is_file():
            problems.append(f"{target}: no such file")
        elif frag and frag not in {anchor(h) for h in HEADING.findall(read(path))}:
            problems.append(f"{target}{frag}: no such heading")
    return problems


def _sources() -> list[Path]:
    files = [p for d in CODE_DIRS for p in (ROOT / d).rglob("*.py")
             if p != Path(__file__).resolve()]  # this file's broken examples are on purpose
    return files + [ROOT / d for d in DOCS if (ROOT / d).exists()]


def test_results_headline_links_resolve():
    assert results_problems(RESULTS.read_text()) == []


def test_node_spec_references_resolve():
    spec = SPEC.read_text()
    assert {"1.4", "3.3", "5.2", "6a.2", "7.1"} <= spec_sections(spec)
    problems = []
    for path in _sources():
        problems += spec_ref_problems(path.read_text(), spec, str(path.relative_to(ROOT)))
    assert problems == []


def test_links_between_documents_resolve():
    problems = []
    for doc in DOCS:
        path = ROOT / doc
        problems += [f"{doc}: {p}" for p in link_problems(path.read_text(), path.parent)]
    assert problems == []


def test_a_broken_document_link_is_found():
    text = (ROOT / "ARCHITECTURE.md").read_text()
    assert link_problems(text, ROOT) == []
    moved = text.replace("(docs/wan-lab.md)", "(docs/no-such-file.md)", 1)
    assert link_problems(moved, ROOT) == ["docs/no-such-file.md: no such file"]
    renamed = "[x](ARCHITECTURE.md#no-such-heading)"
    assert link_problems(renamed, ROOT) == ["ARCHITECTURE.md#no-such-heading: no such heading"]


def test_a_broken_headline_link_is_found():
    text = RESULTS.read_text()
    first = SECTION.search(text.split(HEADLINE_END, 1)[1]).group(1)
    broken = text.replace(f"]({anchor(first)})", "](#no-such-section)", 1)
    assert broken != text
    assert any("no section #no-such-section" in p for p in results_problems(broken))
    renamed = text.replace(f"## {first}\n", "## renamed\n", 1)
    assert any("is not '## " in p for p in results_problems(renamed))


@pytest.mark.parametrize(("ref", "bad"), [
    ("(NODE_SPEC 3.3)", False),
    ("(NODE_SPEC.md §5.2 \"Batch rules\")", False),
    ("(NODE_SPEC 3, 7.2)", False),
    ("(NODE_SPEC 3, \"Bulk plane\")", False),
    ("(NODE_SPEC.md, \"Trainer groups\")", False),
    ("(NODE_SPEC 3.99)", True),
    ("(NODE_SPEC 3, 7.9)", True),
    ("(NODE_SPEC §4 \"Sampler output\")", True),
])
def test_a_broken_spec_reference_is_found(ref, bad):
    assert bool(spec_ref_problems(ref, SPEC.read_text())) == bad
