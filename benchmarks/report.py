"""Write a benchmark's figures into BENCHMARKS.md, one section per benchmark, with its command."""

from __future__ import annotations

import platform
import re
from datetime import UTC, datetime
from pathlib import Path

BENCHMARKS_MD = Path(__file__).resolve().parent.parent / "BENCHMARKS.md"
_HEADER = "# Benchmarks\n\nEvery section is written by the command it names; rerun it to refresh the figures.\n"


def write_section(title: str, command: str, body: str) -> None:
    text = BENCHMARKS_MD.read_text() if BENCHMARKS_MD.exists() else _HEADER
    stamp = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    section = (
        f"## {title}\n\n`{command}` — {stamp}, {platform.machine()} ({_cores()} cores), Python {platform.python_version()}, "
        f"{load_average()} when written\n\n{body.strip()}\n"
    )
    pattern = re.compile(rf"^## {re.escape(title)}\n.*?(?=^## |\Z)", re.DOTALL | re.MULTILINE)
    if pattern.search(text):
        text = pattern.sub(lambda _m: section + "\n", text)
    else:
        text = text.rstrip() + "\n\n" + section
    BENCHMARKS_MD.write_text(text.rstrip() + "\n")


def load_average() -> str:
    """The machine's load average (1, 5, 15 min): timings of a shared machine mean little without it."""
    import os

    one, five, fifteen = os.getloadavg()
    return f"load average {one:.2f} / {five:.2f} / {fifteen:.2f}"


def _cores() -> int:
    import os

    return os.cpu_count() or 1
