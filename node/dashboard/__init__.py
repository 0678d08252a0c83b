"""The dashboard page served by the admin endpoint at `/` and `/dashboard`.

Plain HTML + JS in one file (no build step, no network): it polls `/status` of the node
that served it and draws the reward curve and the tables.
"""

from __future__ import annotations

from pathlib import Path

PAGE = Path(__file__).with_name("index.html")


def page() -> bytes:
    return PAGE.read_bytes()
