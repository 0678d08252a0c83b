"""Writes a benchmark's figures into benchmarks/RESULTS.md.

RESULTS.md opens with one table of headline figures, then holds one section per benchmark,
delimited by HTML comments. A rerun replaces its own section (only the newest run is kept;
git keeps the older ones) and rewrites its own rows of the headline table, so benchmarks can
be rerun independently and the first screen always shows the current figures. Every
section records the command, the machine, the date and the figures.
"""

from __future__ import annotations

import fcntl
import os
import platform
import re
import shlex
import sys
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

RESULTS = Path(__file__).with_name("RESULTS.md")
HEADER = ("# Benchmark results\n\nOne section per benchmark, each holding its newest run; "
          "a rerun replaces its section and its rows of the headline table "
          "(benchmarks/results.py).\n")
HEADLINE_START, HEADLINE_END = "<!-- begin headline -->", "<!-- end headline -->"
HEADLINE_COLUMNS = ["figure", "goal", "current", "baseline", "date", "load", "section"]
HEADLINE_TABLE = ("## Headline figures\n\n" + HEADLINE_START + "\n| "
                  + " | ".join(HEADLINE_COLUMNS) + " |\n|" + "---|" * len(HEADLINE_COLUMNS)
                  + "\n" + HEADLINE_END)
# a dated copy of a section ("gossip (session 6)", "broadcast (quiet rerun)") is what this
# module exists to prevent: a rerun replaces the section of what it measures
DATED_COPY = re.compile(r"\bsession\s*\d+|\brerun\b", re.IGNORECASE)


@dataclass(frozen=True)
class Headline:
    """One row of the headline table; `figure` names the row (a rerun replaces it)."""

    figure: str
    goal: str
    current: str
    baseline: str = "-"
    load: str = ""  # default: the 1-minute load average when recorded


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError):
        mem = 0.0
    gpu = ""
    try:
        import torch

        if torch.cuda.is_available():
            gpu = ", GPU " + torch.cuda.get_device_name(0)
    except ImportError:
        pass
    return f"{os.cpu_count()} cores ({cpu}), {mem:.0f} GiB RAM{gpu}, Python {platform.python_version()}"


def anchor(section: str) -> str:
    """The link target GitHub gives the heading `## section`."""
    return "#" + re.sub(r"[^\w\- ]", "", section.strip().lower()).replace(" ", "-")


def load_now() -> str:
    return f"{os.getloadavg()[0]:.1f}"


def record(section: str, body: str, command: str | None = None,
           headline: tuple[Headline, ...] | list[Headline] = (),
           path: Path = RESULTS) -> None:
    """Replace section `section` of RESULTS.md with `body` (markdown) plus provenance, and
    its rows of the headline table with `headline`."""
    if DATED_COPY.search(section):
        raise ValueError(f"section {section!r} names a run, not a benchmark: a rerun replaces "
                         "its section (git keeps the old one)")
    command = command or "python " + " ".join(shlex.quote(a) for a in sys.argv)
    now = datetime.now(UTC)
    start, end = f"<!-- begin {section} -->", f"<!-- end {section} -->"
    block = (f"{start}\n## {section}\n\n- command: `{command}`\n- machine: {machine()}\n"
             f"- date: {now:%Y-%m-%d %H:%M} UTC, load (1 min) {load_now()}\n\n"
             f"{body.strip()}\n{end}")
    path.touch(exist_ok=True)
    with open(path, "r+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        text = replace_section(f.read() or HEADER, start, end, block)
        for h in headline:
            text = replace_headline(text, h, section, f"{now:%Y-%m-%d}")
        f.seek(0)
        f.truncate()
        f.write(text)
    print(f"recorded section '{section}' in {path}")


def replace_section(text: str, start: str, end: str, block: str) -> str:
    if start in text and end in text:
        before, rest = text.split(start, 1)
        return before + block + rest.split(end, 1)[1]
    return text.rstrip() + "\n\n" + block + "\n"


def replace_headline(text: str, h: Headline, section: str, date: str) -> str:
    """Rewrite the headline row named `h.figure` (or add it at the end of the table)."""
    if HEADLINE_START not in text:
        head, sep, rest = text.partition("\n<!-- begin ")
        text = head.rstrip() + "\n\n" + HEADLINE_TABLE + "\n" + (sep + rest if sep else "")
    before, rest = text.split(HEADLINE_START, 1)
    rows, after = rest.split(HEADLINE_END, 1)
    cells = [h.figure, h.goal, h.current, h.baseline, date, h.load or load_now(),
             f"[{section}]({anchor(section)})"]
    row = "| " + " | ".join(c.replace("|", "\\|").replace("\n", " ") for c in cells) + " |"
    lines = rows.strip("\n").splitlines()
    key = cells[0].replace("|", "\\|")
    for i, line in enumerate(lines):
        if _first_cell(line) == key:
            lines[i] = row
            break
    else:
        lines.append(row)
    return before + HEADLINE_START + "\n" + "\n".join(lines) + "\n" + HEADLINE_END + after


def _first_cell(line: str) -> str:
    m = re.match(r"^\|\s*((?:[^|\\]|\\.)*?)\s*\|", line)
    return m.group(1) if m else ""


def table(headers: list[str], rows: list[list[object]]) -> str:
    """A markdown table."""
    def fmt(v: object) -> str:
        return f"{v:.4g}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)
