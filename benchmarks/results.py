"""Writes a benchmark's figures into its own section of benchmarks/RESULTS.md.

Each benchmark owns one section, delimited by HTML comments, and replaces only that
section, so benchmarks can be rerun independently. Every section records the command, the
machine, the date and the figures.
"""

from __future__ import annotations

import fcntl
import os
import platform
import shlex
import sys
from datetime import UTC, datetime
from pathlib import Path

RESULTS = Path(__file__).with_name("RESULTS.md")
HEADER = "# Benchmark results\n\nEach section is rewritten by the script named in it.\n"


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


def record(section: str, body: str, command: str | None = None) -> None:
    """Replace section `section` of RESULTS.md with `body` (markdown) plus provenance."""
    command = command or "python " + " ".join(shlex.quote(a) for a in sys.argv)
    now = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    start, end = f"<!-- begin {section} -->", f"<!-- end {section} -->"
    block = (f"{start}\n## {section}\n\n- command: `{command}`\n- machine: {machine()}\n"
             f"- date: {now}\n\n{body.strip()}\n{end}")
    RESULTS.touch(exist_ok=True)
    with open(RESULTS, "r+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        text = f.read() or HEADER
        if start in text and end in text:
            before, rest = text.split(start, 1)
            after = rest.split(end, 1)[1]
            text = before + block + after
        else:
            text = text.rstrip() + "\n\n" + block + "\n"
        f.seek(0)
        f.truncate()
        f.write(text)
    print(f"recorded section '{section}' in {RESULTS}")


def table(headers: list[str], rows: list[list[object]]) -> str:
    """A markdown table."""
    def fmt(v: object) -> str:
        return f"{v:.4g}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)
