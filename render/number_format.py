"""How the plan page and its SVGs write numbers: one place, so the table, tooltips and charts agree."""

from __future__ import annotations

import math


def px(value: float) -> str:
    """An SVG coordinate to 0.01 px: exact enough to check, short enough for 100k ops."""
    text = f"{value:.2f}".rstrip("0").rstrip(".")
    return "0" if text == "-0" else text


def ms_text(value: float) -> str:
    """`1,234.5`: thousands separated, at most 3 decimals, no trailing zeros."""
    return f"{value:,.3f}".rstrip("0").rstrip(".")


def speed_text(speed: float) -> str:
    """`0.8` for 0.80, `1` for 1.0."""
    return f"{speed:.2f}".rstrip("0").rstrip(".")


def gib_text(value: float) -> str:
    return f"{value:,.1f}"


def memory_text(used_gib: float, capacity_gib: float | None) -> str:
    """`35.2 / 80 GiB` when the GPU's capacity is known, else `35.2 GiB`."""
    if capacity_gib is None or not math.isfinite(capacity_gib) or capacity_gib <= 0:
        return f"{gib_text(used_gib)} GiB"
    return f"{gib_text(used_gib)} / {capacity_gib:g} GiB"


def memory_share(used_gib: float, capacity_gib: float | None) -> float | None:
    """Used share of the GPU's memory in [0, 1], or None when the capacity is unknown."""
    if capacity_gib is None or not math.isfinite(capacity_gib) or capacity_gib <= 0 or not math.isfinite(used_gib):
        return None
    return min(max(used_gib / capacity_gib, 0.0), 1.0)


def group_text(tp: int, cp: int) -> str:
    """A stage's GPU group: "TP 4", or "TP 4 × CP 2" with context parallelism."""
    return f"TP {int(tp)}" + (f" × CP {int(cp)}" if cp > 1 else "")
